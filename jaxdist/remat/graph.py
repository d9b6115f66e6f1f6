"""The operator graph the remat selector decides on, and what one choice of saved operators costs.

An :class:`OperatorGraph` lists the forward operators of one block (bytes per
device if saved, seconds to recompute, inputs, whether the backward pass reads
them, decision unit); :func:`evaluate` gives the bytes and recompute time of
saving a set of units; :class:`Selection` is a solver's answer.  The solvers
(:mod:`jaxdist.remat.select`, :mod:`jaxdist.remat.lagrangian`) build on this
module and return their answers through :func:`make_selection`.
"""

from __future__ import annotations

import time as _time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from jaxdist.config import ConfigError


class InfeasibleBudget(ConfigError):
    """No set of saved operators fits the budget; ``smallest`` is the least budget that works (bytes)."""

    def __init__(self, message: str, smallest: float):
        super().__init__(message)
        self.smallest = smallest


@dataclass(eq=False)
class OperatorGraph:
    """Forward operators of one block, in topological order (inputs before users).

    ``bytes[i]``: bytes per device that saving operator i's output holds;
    ``time[i]``: seconds (per device) to recompute it from its inputs;
    ``inputs[i]``: indices of the operators whose outputs it reads (block
    inputs are not operators: always available); ``needed[i]``: the backward
    pass reads its output; ``unit[i]``: decision unit, -1 if it can never be saved.
    """

    bytes: np.ndarray
    time: np.ndarray
    inputs: tuple[tuple[int, ...], ...]
    needed: np.ndarray
    unit: np.ndarray

    def __post_init__(self):
        self.bytes = np.asarray(self.bytes, dtype=np.float64)
        self.time = np.asarray(self.time, dtype=np.float64)
        self.needed = np.asarray(self.needed, dtype=bool)
        self.unit = np.asarray(self.unit, dtype=np.int64)
        self.inputs = tuple(tuple(int(j) for j in ins) for ins in self.inputs)
        n = len(self.bytes)
        assert len(self.time) == len(self.inputs) == len(self.needed) == len(self.unit) == n
        assert all(j < i for i, ins in enumerate(self.inputs) for j in ins), "operators must be in topological order"
        assert (self.bytes >= 0).all() and (self.time >= 0).all()
        units = sorted(set(self.unit[self.unit >= 0].tolist()))
        assert units == list(range(len(units))), "units must be numbered 0..U-1"
        consumers: list[list[int]] = [[] for _ in range(n)]
        for i, ins in enumerate(self.inputs):
            for j in set(ins):
                consumers[j].append(i)
        self.consumers = tuple(tuple(c) for c in consumers)

    @property
    def n(self) -> int:
        """Number of operators."""
        return len(self.bytes)

    @property
    def n_units(self) -> int:
        """Number of decision units."""
        return int(self.unit.max()) + 1 if (self.unit >= 0).any() else 0

    def members(self, unit: int) -> np.ndarray:
        """Operator indices of one decision unit."""
        return np.flatnonzero(self.unit == unit)


@dataclass(frozen=True)
class Evaluation:
    """Bytes (per device) and recompute time (seconds) of one choice of saved units."""

    bytes: float
    time: float
    saved: np.ndarray  # bool [n]: saved and used by the backward pass
    recomputed: np.ndarray  # bool [n]


@dataclass(frozen=True)
class Selection:
    """The chosen units and their cost; ``lower_bound`` is a proven bound on the optimal time (s)."""

    saved_units: frozenset[int]
    bytes: float
    time: float
    budget: float
    method: str
    lower_bound: float
    solve_seconds: float

    @property
    def gap(self) -> float:
        """Relative distance to the proven lower bound (0 when exact)."""
        return 0.0 if self.time <= self.lower_bound else (self.time - self.lower_bound) / max(self.time, 1e-300)


def _saved_nodes(graph: OperatorGraph, saved_units: Iterable[int]) -> np.ndarray:
    chosen = np.zeros(graph.n_units + 1, dtype=bool)  # last slot: unit -1
    for u in saved_units:
        chosen[u] = True
    return chosen[graph.unit]


def evaluate(graph: OperatorGraph, saved_units: Iterable[int]) -> Evaluation:
    """Cost of saving ``saved_units``: bytes of the saved values the backward pass uses, and recompute time.

    A value is required if the backward pass reads it or a recomputed operator
    does; a required value is recomputed unless saved.
    """
    s = _saved_nodes(graph, saved_units)
    required = graph.needed.copy()
    recomputed = np.zeros(graph.n, dtype=bool)
    for i in range(graph.n - 1, -1, -1):  # users come after their inputs
        if not required[i]:
            required[i] = any(recomputed[j] for j in graph.consumers[i])
        if required[i] and not s[i]:
            recomputed[i] = True
    saved = required & s
    return Evaluation(float(graph.bytes[saved].sum()), float(graph.time[recomputed].sum()), saved, recomputed)


def check_budget(graph: OperatorGraph, budget: float) -> None:
    """Raise :class:`InfeasibleBudget` for a negative budget (bytes): even saving nothing needs 0."""
    if budget < 0:
        raise InfeasibleBudget(
            f"a budget of {budget:.0f} bytes cannot be met: the smallest feasible budget is 0 bytes (save nothing).",
            0.0,
        )


def make_selection(
    graph: OperatorGraph, units: Iterable[int], budget: float, method: str, bound: float, t0: float
) -> Selection:
    """The :class:`Selection` saving ``units`` (those nothing uses dropped), found by ``method`` since
    ``t0`` (``time.perf_counter()`` seconds), with lower bound ``bound`` (seconds, capped at its time)."""
    ev = evaluate(graph, units)
    units = frozenset(u for u in units if ev.saved[graph.members(u)].any())  # drop units nothing uses
    return Selection(units, ev.bytes, ev.time, float(budget), method, min(bound, ev.time), _time.perf_counter() - t0)

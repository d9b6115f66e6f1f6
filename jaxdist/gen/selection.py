"""Each round's nodes of a generation cluster under a compute budget.

**Nodes each round** (:func:`select_nodes`). Each node reports its pending
tasks by type; a type costs ``task_compute`` units of the rated budget per task
(device-seconds, FLOPs: any unit, the budget's) and is worth ``task_work``
(default 1: tasks). Choosing the nodes that process next is a 0/1 knapsack:
maximise ``sum importance * work`` with ``sum compute <= budget``.
:func:`knapsack` tries every subset of up to 14 candidate nodes (exact);
beyond, it solves it by dynamic programming over integer costs: exact when the
costs are whole numbers (budget up to ``2**16`` units), otherwise on costs
rounded up to ``budget / resolution`` (so the true budget is never exceeded),
followed by a greedy fill; the LP relaxation's value is returned as
an upper bound, so every answer carries its optimality gap. Whole multiples
of a unit count as whole numbers (:func:`cost_unit` finds it from the task
types' costs: 2.5, 0.4 and 0.05 are 50, 8 and 1 times 0.05).
``method="auto"`` then asks :func:`scipy.optimize.milp` (exact) within a time
limit when that answer is not proven optimal, and keeps the better;
``"milp"`` asks it alone.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from jaxdist.errors import ConfigError

EXACT_UNITS = 2**16  # whole-number costs with a budget up to this are solved exactly


@dataclass(frozen=True)
class NodeWork:
    """A node's pending tasks this round (type -> count) and its importance in the job (>= 0)."""

    node: str
    pending: Mapping[str, int]
    importance: float = 1.0

    @staticmethod
    def from_tasks(node: str, task_types: Iterable[str], importance: float = 1.0) -> NodeWork:
        """From the list of the pending tasks' types."""
        return NodeWork(node, dict(Counter(task_types)), importance)


@dataclass(frozen=True)
class Selection:
    """The nodes that process next, the compute they need of the budget, the value, its upper bound, time taken."""

    nodes: tuple[str, ...]
    compute: float
    budget: float
    value: float
    bound: float
    exact: bool
    too_large: tuple[str, ...]  # nodes whose pending work alone exceeds the budget: split it
    seconds: float

    @property
    def gap(self) -> float:
        """Upper bound on the shortfall from the optimum, as a share of it (0 when exact)."""
        return 0.0 if self.exact or self.bound <= 0 else max(0.0, 1 - self.value / self.bound)


def lp_bound(values: np.ndarray, costs: np.ndarray, budget: float) -> float:
    """The LP relaxation's optimum (Dantzig): an upper bound on any selection's value."""
    v, w = np.asarray(values, float), np.asarray(costs, float)
    free = w <= 0
    vv, ww = v[~free & (w <= budget)], w[~free & (w <= budget)]
    order = np.argsort(-vv / ww, kind="stable")
    cum = np.cumsum(ww[order])
    full = np.searchsorted(cum, budget, side="right")
    total = v[free].sum() + vv[order[:full]].sum()
    if full < len(order):
        total += vv[order[full]] * (budget - (cum[full - 1] if full else 0.0)) / ww[order[full]]
    return float(total)


def cost_unit(costs: Iterable[float]) -> float | None:
    """The largest unit all ``costs`` are whole multiples of (as fractions of denominator up to 10**6), or None."""
    fr = []
    for c in costs:
        f = Fraction(c).limit_denominator(10**6)
        if abs(float(f) - c) > 4 * math.ulp(c):  # not a short fraction (a float's rounding aside)
            return None
        if f:
            fr.append(f)
    if not fr:
        return None
    den = math.lcm(*(f.denominator for f in fr))
    return math.gcd(*(f.numerator * (den // f.denominator) for f in fr)) / den


def knapsack(
    values: np.ndarray,
    costs: np.ndarray,
    budget: float,
    unit: float | None = None,
    resolution: int = 2**16,
    enumerate_up_to: int = 14,
) -> tuple[np.ndarray, bool]:
    """A 0/1 selection (bool mask) with ``fsum(costs[mask]) <= budget`` and high ``values[mask].sum()``, and
    whether it is proven optimal. Up to ``enumerate_up_to`` candidate items every subset is tried (exact);
    beyond, dynamic programming over integer costs (see the module docstring): exact when the costs are whole
    multiples of ``unit`` (default: whole numbers) and the budget is at most ``2**16`` of them."""
    v, w = np.asarray(values, float), np.asarray(costs, float)
    assert v.shape == w.shape and np.all(v >= 0) and np.all(w >= 0) and budget >= 0
    mask = (w <= 0) & (v > 0)  # free work is always taken
    idx = np.flatnonzero((w > 0) & (w <= budget) & (v > 0))
    if math.fsum(w[idx]) <= budget:
        mask[idx] = True
        return mask, True
    if len(idx) <= enumerate_up_to:  # at most 2**14 subsets: exact in about a millisecond
        subsets = (np.arange(2 ** len(idx))[:, None] >> np.arange(len(idx))) & 1
        fits = np.flatnonzero(subsets @ w[idx] <= budget)
        best = fits[np.argmax(subsets[fits] @ v[idx])]
        mask[idx] = subsets[best].astype(bool)
        dropped = _repair_and_fill(mask, v, w, budget)  # the matrix sum may round differently from fsum
        return mask, not dropped
    step = unit or 1.0
    integral = bool(np.all(np.abs(w[idx] / step - np.round(w[idx] / step)) <= 1e-9 * w[idx] / step))
    integral = integral and math.floor(budget / step + 1e-9) <= EXACT_UNITS
    if integral:
        wu, cap = np.round(w[idx] / step).astype(np.int64), int(math.floor(budget / step + 1e-9))
    else:
        unit = budget / resolution
        wu = np.ceil(w[idx] / unit * (1 + 1e-12)).astype(np.int64)  # rounded up: never over the budget
        cap = resolution
    cap = int(min(cap, wu.sum()))
    dp = np.zeros(cap + 1)
    take = np.zeros((len(idx), cap + 1), bool)
    for i, (wi, vi) in enumerate(zip(wu, v[idx])):
        if wi > cap:
            continue
        cand = dp[: cap + 1 - wi] + vi
        better = cand > dp[wi:]
        take[i, wi:] = better
        dp[wi:] = np.where(better, cand, dp[wi:])
    j = cap
    for i in range(len(idx) - 1, -1, -1):
        if take[i, j]:
            mask[idx[i]] = True
            j -= wu[i]
    dropped = _repair_and_fill(mask, v, w, budget)
    exact = (integral and not dropped) or v[mask].sum() >= lp_bound(v, w, budget) * (1 - 1e-12)
    return mask, bool(exact)


def _repair_and_fill(mask: np.ndarray, v: np.ndarray, w: np.ndarray, budget: float) -> bool:
    """Drop the least valuable items while over budget (float rounding), then add any that still fit; whether
    any was dropped."""
    dropped = False
    while math.fsum(w[mask]) > budget:
        dropped = True
        sel = np.flatnonzero(mask & (w > 0))
        mask[sel[np.argmin(v[sel] / w[sel])]] = False
    for i in np.argsort(-v / np.maximum(w, 1e-300), kind="stable"):
        if not mask[i] and v[i] > 0 and math.fsum([*w[mask], w[i]]) <= budget:
            mask[i] = True
    return dropped


def exhaustive_knapsack(values: np.ndarray, costs: np.ndarray, budget: float) -> float:
    """The brute-force optimum (every subset; for up to about 20 items): the reference of :func:`knapsack`."""
    v, w = np.asarray(values, float), np.asarray(costs, float)
    subsets = (np.arange(2 ** len(v))[:, None] >> np.arange(len(v))) & 1
    fits = subsets @ w <= budget
    return float((subsets @ v)[fits].max())


def _milp(values: np.ndarray, costs: np.ndarray, budget: float, time_limit_s: float) -> tuple[np.ndarray, bool]:
    from scipy.optimize import Bounds, LinearConstraint, milp  # scipy (~0.3 s to import) only for the MILP

    v, w = np.asarray(values, float), np.asarray(costs, float)
    res = milp(
        -v,
        constraints=LinearConstraint(w[None, :], -np.inf, budget),
        integrality=np.ones(len(v)),
        bounds=Bounds(0, 1),
        options={"mip_rel_gap": 0.0, "time_limit": time_limit_s, "disp": False},
    )
    mask = (res.x > 0.5) if res.x is not None else np.zeros(len(v), bool)
    _repair_and_fill(mask, v, w, budget)
    return mask, bool(res.status == 0)


def node_demand(
    nodes: Sequence[NodeWork], task_compute: Mapping[str, float], task_work: Mapping[str, float] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per node: the compute its pending tasks need (budget units) and their importance-weighted work."""
    need, value = np.zeros(len(nodes)), np.zeros(len(nodes))
    for i, nw in enumerate(nodes):
        if not nw.importance >= 0:
            raise ConfigError(f"node '{nw.node}' has importance {nw.importance}: give a number of at least 0.")
        for t, count in nw.pending.items():
            if t not in task_compute:
                raise ConfigError(f"task type '{t}' of node '{nw.node}' has no compute cost: add it to task_compute.")
            need[i] += count * task_compute[t]
            value[i] += count * (1.0 if task_work is None else task_work.get(t, 1.0))
        value[i] *= nw.importance
    return need, value


def select_nodes(
    nodes: Sequence[NodeWork],
    task_compute: Mapping[str, float],
    budget: float,
    task_work: Mapping[str, float] | None = None,
    method: str = "dp",
    max_seconds: float = 0.5,
) -> Selection:
    """The nodes to process their pending tasks this round: compute <= ``budget``, importance-weighted work highest.

    ``method``: ``"dp"`` (:func:`knapsack`: milliseconds, its gap bounded; exact
    on up to 14 nodes and when the task costs are whole multiples of a unit
    and the budget at most 2**16 of them),
    ``"milp"`` (exact unless it runs past ``max_seconds``), or ``"auto"``: dp,
    then milp within what is left of ``max_seconds`` when dp is not proven
    optimal, the better of the two. A node should report the tasks it can do in
    one round: one whose work alone exceeds the budget is never selected (it is
    named in ``too_large``).
    """
    t0 = time.perf_counter()
    if not budget >= 0 or math.isinf(budget):
        raise ConfigError(f"the compute budget {budget} must be a finite number of at least 0.")
    if any(not c >= 0 for c in task_compute.values()):
        raise ConfigError("a task type has a negative compute cost: give costs of at least 0.")
    if method not in ("auto", "dp", "milp"):
        raise ConfigError(f"node selection method '{method}' is unknown: use auto, dp or milp.")
    need, value = node_demand(nodes, task_compute, task_work)
    if method == "milp":
        mask, exact = _milp(value, need, budget, max_seconds)
    else:
        mask, exact = knapsack(value, need, budget, cost_unit(task_compute.values()))
        left = max_seconds - (time.perf_counter() - t0)
        if method == "auto" and not exact and left > 0.01:
            mask2, exact = _milp(value, need, budget, left)
            if value[mask2].sum() > value[mask].sum():
                mask = mask2
    assert math.fsum(need[mask]) <= budget
    return Selection(
        tuple(nodes[i].node for i in np.flatnonzero(mask)),
        math.fsum(need[mask]),
        float(budget),
        float(value[mask].sum()),
        lp_bound(value, need, budget),
        exact,
        tuple(nodes[i].node for i in np.flatnonzero(need > budget)),
        time.perf_counter() - t0,
    )


def format_selection(sel: Selection) -> str:
    """One line: the selected nodes, the budget used, the value and its gap bound."""
    names = ", ".join(sel.nodes[:12]) + (f" and {len(sel.nodes) - 12} more" if len(sel.nodes) > 12 else "")
    used = sel.compute / sel.budget if sel.budget else 0.0
    opt = "optimal" if sel.exact else f"within {100 * sel.gap:.2f}% of optimal"
    late = f"; too large for the budget alone: {', '.join(sel.too_large)}" if sel.too_large else ""
    return (
        f"{len(sel.nodes)} nodes selected ({names or 'none'}): compute {sel.compute:.4g} of {sel.budget:.4g} "
        f"({100 * used:.1f}%), value {sel.value:.4g}, {opt}, {1e3 * sel.seconds:.1f} ms{late}"
    )

"""What a job asks Slurm for: how many nodes, how many GPUs on each, and which nodes (pure).

A *shape* is ``n`` training nodes (plus ``standbys``) with ``k`` free GPUs each
(a mesh needs the same number on every node).  :func:`choose_shape` tries every
shape the free GPUs allow and keeps, in this order of importance:

1. the lowest ``cost`` (the planner's predicted step time of the best plan on
   ``n`` x ``k`` devices, whose tensor, expert, context and pipeline groups
   stay inside a node; or any other figure the caller prefers);
2. the placement that leaves the remaining free GPUs most usable by the next
   job -- its :func:`leftover` score: first the largest block a next job of
   equal GPUs per node could still get (:func:`largest_block`, the rule the
   planner's cluster view applies), then the number of nodes left wholly
   free, then the free GPUs in all;
3. the fewer GPUs.

For one shape, :func:`place` picks the nodes: every set of ``n`` plus up to
``standbys`` nodes (as many as are left) with ``k`` free GPUs is scored by :func:`leftover` when there are at most
:data:`EXACT_PLACEMENTS` of them, else the nodes with the fewest free GPUs
that fit go first (best fit: partly used nodes fill up, whole ones stay whole).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from jaxdist.config import ConfigError

EXACT_PLACEMENTS = 5000  # node sets scored one by one; beyond, best fit


def largest_block(free: Mapping[str, int]) -> int:
    """The most GPUs a job with the same number on every node can get: max over k of k x (nodes with >= k free)."""
    counts = sorted((f for f in free.values() if f > 0), reverse=True)
    return max((k * (i + 1) for i, k in enumerate(counts)), default=0)


def leftover(free: Mapping[str, int], totals: Mapping[str, int]) -> tuple[int, int, int]:
    """How usable free GPUs are for the next job: (largest block, nodes wholly free, free GPUs); higher is better."""
    whole = sum(1 for n, f in free.items() if f > 0 and f == totals.get(n, f))
    return largest_block(free), whole, sum(free.values())


def _after(free: Mapping[str, int], nodes: tuple[str, ...], k: int) -> dict[str, int]:
    taken = set(nodes)
    return {n: f - k if n in taken else f for n, f in free.items()}


def place(free: Mapping[str, int], totals: Mapping[str, int], count: int, k: int) -> tuple[str, ...] | None:
    """The ``count`` nodes (in ``free``'s order) that get ``k`` GPUs each, leaving the best :func:`leftover`;
    None when fewer than ``count`` nodes have ``k`` free."""
    fit = [n for n, f in free.items() if f >= k]
    if len(fit) < count:
        return None
    if math.comb(len(fit), count) > EXACT_PLACEMENTS:
        best_fit = sorted(fit, key=lambda n: (free[n], fit.index(n)))[:count]
        return tuple(n for n in fit if n in best_fit)
    best = max(
        itertools.combinations(fit, count),
        key=lambda nodes: (leftover(_after(free, nodes, k), totals), [-fit.index(n) for n in nodes]),
    )
    return tuple(best)


@dataclass(frozen=True)
class Shape:
    """A request: ``nodes`` (``training`` of them train, the rest are standbys) with ``gpus_per_node`` GPUs each;
    ``cost`` (e.g. predicted seconds per step) and the :func:`leftover` score of the GPUs it leaves free."""

    training: int
    gpus_per_node: int
    nodes: tuple[str, ...]
    cost: float
    leftover: tuple[int, int, int]

    @property
    def devices(self) -> int:
        """GPUs that train."""
        return self.training * self.gpus_per_node

    def key(self) -> tuple:
        """The order of :func:`choose_shape` (smaller is better)."""
        return (self.cost, tuple(-x for x in self.leftover), self.devices)

    def describe(self) -> str:
        """e.g. ``2 nodes x 8 GPUs on n2,n4 (+1 standby: n1)``."""
        s = f"{self.training} node{'s' if self.training != 1 else ''} x {self.gpus_per_node} GPUs on "
        s += ",".join(self.nodes[: self.training])
        extra = self.nodes[self.training :]
        if extra:
            s += f" (+{len(extra)} standby{'s' if len(extra) != 1 else ''}: {','.join(extra)})"
        return s


@dataclass(frozen=True)
class ShapeChoice:
    """The chosen shape and every shape tried (best first)."""

    best: Shape
    tried: tuple[Shape, ...]

    def table(self, n: int = 8, cost_name: str = "step s") -> str:
        """The best ``n`` shapes: nodes x GPUs, where, cost, and the leftover score."""
        head = f"{'#':>2}  {'shape':<10} {'nodes':<24} {cost_name:>10}  left: block / whole nodes / free"
        lines = [head, "-" * len(head)]
        for i, s in enumerate(self.tried[:n], 1):
            shape = f"{s.training}x{s.gpus_per_node}"
            lines.append(
                f"{i:>2}  {shape:<10} {','.join(s.nodes):<24} {s.cost:>10.4g}  "
                f"{s.leftover[0]} / {s.leftover[1]} / {s.leftover[2]}"
            )
        return "\n".join(lines)


def choose_shape(
    free: Mapping[str, int],
    totals: Mapping[str, int],
    cost: Callable[[int, int], float | None],
    standbys: int = 0,
    max_nodes: int = 0,
    min_nodes: int = 1,
) -> ShapeChoice:
    """The best shape over the free GPUs (see the module docstring).

    ``free``/``totals``: node -> free / all GPUs (in Slurm's node order).  ``cost(n, k)``: the figure to
    minimise for ``n`` training nodes of ``k`` GPUs, None when that shape cannot run the job.  Up to
    ``standbys`` more nodes with ``k`` free GPUs each come with every shape, as many as are left (a standby
    never keeps a shape from running); ``n`` is at least ``min_nodes`` and at most ``max_nodes`` (0: no limit).
    Raises ConfigError when no shape can.
    """
    tried = []
    for k in range(1, max(free.values(), default=0) + 1):
        fit = sum(1 for f in free.values() if f >= k)
        for n in range(max(1, min_nodes), min(fit, max_nodes or fit) + 1):
            c = cost(n, k)
            if c is None:
                continue
            nodes = place(free, totals, n + min(standbys, fit - n), k)  # standbys only where nodes are left
            assert nodes is not None
            tried.append(Shape(n, k, nodes, float(c), leftover(_after(free, nodes, k), totals)))
    if not tried:
        raise ConfigError(
            f"no free GPUs fit the job ({sum(free.values())} free: "
            f"{', '.join(f'{n}:{f}' for n, f in free.items())}; at least {min_nodes} training node(s) asked for): "
            "wait for GPUs to free up, lower controller.min_nodes, or change the model, batch or mesh."
        )
    tried.sort(key=Shape.key)
    return ShapeChoice(tried[0], tuple(tried))

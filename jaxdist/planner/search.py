"""Search over evaluation points: find the cheapest strategy without evaluating them all.

The objective of a strategy is its predicted step time if it fits in memory;
a strategy that does not fit ranks after every one that does, by its memory
(so that, when nothing fits, the search still converges on the plan that
needs the least memory and can report how much that is).

:func:`search` starts from a small set of points (the canonical meshes:
all-data, all-fsdp, tensor inside a node with data or fsdp across, ... with
the most memory-saving remat choice and the smallest valid microbatch count;
a start point that does not fit gets more microbatches until it does),
then repeatedly evaluates the neighbours (``candidates.neighbours``, plus
mesh moves with the nearest valid microbatch counts) of the best ``beam``
points until the best has not improved for ``patience`` rounds or ``budget``
evaluations are spent.  :func:`exhaustive` evaluates every
candidate: the reference the search is tested against.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from jaxdist.config import MESH_AXES
from jaxdist.planner.candidates import (
    REMAT_CHOICES,
    RematChoice,
    Strategy,
    candidates,
    neighbours,
    valid,
    with_pipeline,
)
from jaxdist.planner.computation import ComputationView
from jaxdist.planner.cost import Estimate


def objective(e: Estimate) -> tuple:
    """Sort key: fitting plans by step time, then the others by memory per device."""
    return (0, e.step_time, e.memory.total) if e.fits else (1, e.memory.total, e.step_time)


@dataclass(frozen=True)
class SearchResult:
    """What a search found: every evaluated estimate (best first) and how many points it took."""

    ranked: tuple[Estimate, ...]
    evaluations: int
    rounds: int

    @property
    def best(self) -> Estimate:
        """The minimum-cost estimate."""
        return self.ranked[0]


def exhaustive(evaluate: Callable[[Strategy], Estimate], points: Iterable[Strategy]) -> SearchResult:
    """Evaluate every strategy in ``points``; the reference optimum."""
    found = sorted((evaluate(s) for s in points), key=objective)
    if not found:
        raise ValueError("no candidate strategy to evaluate")
    return SearchResult(tuple(found), len(found), 1)


def _fix_microbatches(s: Strategy, batch_size: int, max_microbatches: int) -> list[Strategy]:
    ways = s.data * s.fsdp * s.expert
    ok = [
        m
        for m in range(1, min(batch_size, max_microbatches) + 1)
        if batch_size % m == 0 and (batch_size // m) % ways == 0
    ]
    if not ok:
        return []
    below = [m for m in ok if m <= s.microbatches]
    above = [m for m in ok if m >= s.microbatches]
    picks = {below[-1] if below else ok[0], above[0] if above else ok[-1]}
    return [replace(s, microbatches=m) for m in sorted(picks)]


def start_points(
    view: ComputationView,
    nodes: int,
    per_node: int,
    batch_size: int,
    remat: Sequence[RematChoice] = REMAT_CHOICES,
    axes: Sequence[str] = MESH_AXES,
    max_microbatches: int = 64,
    n_random: int = 0,
    seed: int = 0,
    starts_remat_last: bool = True,
) -> list[Strategy]:
    """A small, varied first set of evaluation points (all valid): canonical meshes with the last (most
    memory-saving) remat choice, the smallest valid microbatch count, and ``n_random`` random candidates."""
    n = nodes * per_node
    meshes = []
    for t in sorted({1, 2, 4, 8, per_node} & set(range(1, per_node + 1))):
        if per_node % t:
            continue
        rest = n // t  # a multiple of nodes: t divides per_node
        meshes += [dict(data=rest, tensor=t), dict(fsdp=rest, tensor=t), dict(data=nodes, fsdp=rest // nodes, tensor=t)]
    points: list[Strategy] = []
    for mesh in meshes:
        if any(a not in axes and s > 1 for a, s in mesh.items()):
            continue
        for r in remat[-1:] if starts_remat_last else remat:
            base = Strategy(**mesh, microbatches=1, remat=r.name)
            for fixed in _fix_microbatches(base, batch_size, max_microbatches):
                if valid(fixed, view, nodes, per_node, batch_size, max_microbatches):
                    points.append(fixed)
    pool = list(candidates(view, n, nodes, per_node, batch_size, remat, axes, max_microbatches)) if n_random else []
    rng = random.Random(seed)
    points += rng.sample(pool, min(n_random, len(pool)))
    return list(dict.fromkeys(points))


def search(
    evaluate: Callable[[Strategy], Estimate],
    view: ComputationView,
    nodes: int,
    per_node: int,
    batch_size: int,
    remat: Sequence[RematChoice] = REMAT_CHOICES,
    axes: Sequence[str] = MESH_AXES,
    max_microbatches: int = 64,
    budget: int = 2000,
    beam: int = 2,
    patience: int = 2,
    seed: int = 0,
    repair: int = 1,
) -> SearchResult:
    """Local search over evaluation points; returns every point it evaluated, best first.

    ``budget`` caps the evaluations, ``beam`` is how many of the best points
    are expanded each round, ``patience`` how many rounds without a better
    best it tolerates before stopping.
    """
    seen: dict[Strategy, Estimate] = {}

    def run(points: Iterable[Strategy]) -> None:
        for s in points:
            if len(seen) >= budget:
                return
            if s not in seen:
                seen[s] = evaluate(s)

    starts = start_points(view, nodes, per_node, batch_size, remat, axes, max_microbatches, seed=seed)
    if not starts:  # e.g. axes without data and fsdp, where no canonical mesh applies: random candidates
        starts = start_points(view, nodes, per_node, batch_size, remat, axes, max_microbatches, n_random=8, seed=seed)
    run(starts)
    if not seen:
        raise ValueError("no valid strategy for this model, batch and cluster")

    def until_it_fits(s: Strategy) -> None:
        """More microbatches (fewer activations in flight) for a point that does not fit, until it does."""
        m = s.microbatches
        while s in seen and not seen[s].fits and len(seen) < budget:
            bigger = [
                c
                for c in _fix_microbatches(replace(s, microbatches=2 * m), batch_size, max_microbatches)
                if c.microbatches > m and valid(c, view, nodes, per_node, batch_size, max_microbatches)
            ]
            if not bigger:
                break
            s, m = bigger[0], bigger[0].microbatches
            run([s])

    for s in starts:
        until_it_fits(s)
    best = min(seen.values(), key=objective)
    expanded: set[Strategy] = set()
    stale = rounds = 0
    while stale < patience and len(seen) < budget:
        rounds += 1
        frontier = [e.strategy for e in sorted(seen.values(), key=objective) if e.strategy not in expanded][:beam]
        if not frontier:
            break
        for s in frontier:
            expanded.add(s)
            moves = list(neighbours(s, view, nodes, per_node, batch_size, remat, axes, max_microbatches))
            # A mesh move that breaks the microbatch divisibility gets the nearest valid microbatch counts.
            for c in _mesh_moves(s, view, axes):
                moves += [
                    f
                    for f in _fix_microbatches(c, batch_size, max_microbatches)
                    if valid(f, view, nodes, per_node, batch_size, max_microbatches)
                ]
            run(moves)
            # a faster move that runs out of memory may fit with more microbatches: repair the nearest to fitting
            over = sorted(
                (seen[c] for c in moves if c in seen and not seen[c].fits and seen[c].step_time < seen[s].step_time),
                key=lambda e: e.memory.total,
            )
            for e in over[:repair]:
                until_it_fits(e.strategy)
        new_best = min(seen.values(), key=objective)
        if objective(new_best) < objective(best):
            best, stale = new_best, 0
        else:
            stale += 1
    return SearchResult(tuple(sorted(seen.values(), key=objective)), len(seen), rounds)


def _mesh_moves(s: Strategy, view: ComputationView, axes: Sequence[str]) -> list[Strategy]:
    out = []
    sizes = s.mesh
    for src in axes:
        for dst in axes:
            if src == dst or sizes[src] == 1:
                continue
            q = min(p for p in range(2, sizes[src] + 1) if sizes[src] % p == 0)
            new = dict(sizes)
            new[src] //= q
            new[dst] *= q
            out.extend(with_pipeline(s, view, **new))
    return out

"""Lagrangian relaxation of the remat selection, solved by minimum cuts.

For a price ``lam`` (seconds per byte), minimising ``time + lam * bytes``
without a budget is a minimum-weight closure problem: binary variables "value
i is required" and "value i is recomputed", implications "recomputing i
requires its inputs", "the backward pass requires the needed values", and
"an unsaveable value, if required, is recomputed".  Picard's reduction solves
it exactly with one minimum cut (``scipy.sparse.csgraph.maximum_flow``).
Bisection on ``lam`` finds the cheapest solution within the budget on the
lower convex hull of (bytes, time), and a greedy pass fills the budget left.
For every ``lam``, ``time(S) + lam * (bytes(S) - budget)`` of the cut solution
is a lower bound on the optimum.

This is the fallback of :func:`jaxdist.remat.select.select_approximate` (when
the MILP's node limit is reached) and the source of a proven lower bound; on
knapsack-like instances its own solutions can be ~20% above the optimum.
"""

from __future__ import annotations

import itertools
import math
import time as _time

import numpy as np

from jaxdist.remat.graph import OperatorGraph, Selection, check_budget, evaluate, make_selection

_CAPACITY = 10**9  # finite capacities are scaled to sum to at most this (int32 max flow)
_INFINITE = 2**31 - 1


def _closure_cut(graph: OperatorGraph, lam: float) -> frozenset[int]:
    """Units saved by the exact minimiser of time + lam * bytes (no budget), via one minimum cut.

    Binary variables z[i] (value i required) and y[i] (recomputed), cost
    lam*bytes[i]*z[i] + (time[i] - lam*bytes[i])*y[i], implications
    needed[i] => z[i], y[i] => z[i], y[j] => z[i] for each input i of j, and
    z[i] => y[i] for unsaveable i: a minimum-weight closure (Picard), whose
    source side in a minimum cut is the set of variables equal to 1.  Units
    are coupled only afterwards: a unit is saved if any of its operators is.
    """
    import scipy.sparse as sp  # scipy (~0.4 s to import) only when train.remat=auto selects: a default run never does
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    n = graph.n
    wz = lam * graph.bytes
    wy = graph.time - lam * graph.bytes
    scale = _CAPACITY / max(np.abs(wz).sum() + np.abs(wy).sum(), 1e-300)
    src, snk = 2 * n, 2 * n + 1
    rows: list[int] = []
    cols: list[int] = []
    caps: list[int] = []

    def edge(u, v, cap):
        if cap > 0:
            rows.append(u), cols.append(v), caps.append(cap)

    for v, w in itertools.chain(enumerate(wz), ((n + i, w) for i, w in enumerate(wy))):
        c = int(round(abs(w) * scale))
        edge(v, snk, c) if w > 0 else edge(src, v, c)
    for i in range(n):
        edge(n + i, i, _INFINITE)
        if graph.needed[i]:
            edge(src, i, _INFINITE)
        if graph.unit[i] < 0:
            edge(i, n + i, _INFINITE)
        for j in graph.inputs[i]:
            edge(n + i, j, _INFINITE)
    cap = sp.csr_array((np.asarray(caps, dtype=np.int32), (rows, cols)), shape=(2 * n + 2, 2 * n + 2))
    cap.sum_duplicates()
    flow = maximum_flow(cap, src, snk).flow
    residual = (cap - flow).tocsr()
    residual.data = (residual.data > 0).astype(np.int8)
    residual.eliminate_zeros()
    reach = breadth_first_order(residual, src, directed=True, return_predecessors=False)
    one = np.zeros(2 * n + 2, dtype=bool)
    one[reach] = True
    saved = one[:n] & ~one[n : 2 * n] & (graph.unit >= 0)
    return frozenset(int(u) for u in np.unique(graph.unit[saved]))


def _greedy_fill(graph: OperatorGraph, units: set[int], budget: float, candidates: int = 16) -> set[int]:
    """Add units, most time saved per byte first (among the ``candidates`` most promising), while they fit."""
    units = set(units)
    current = evaluate(graph, units)
    while True:
        pool = {int(u) for u in graph.unit[current.recomputed] if u >= 0} - units
        score = {u: graph.time[graph.members(u)].sum() / max(graph.bytes[graph.members(u)].sum(), 1.0) for u in pool}
        best, best_ratio = None, 0.0
        for u in sorted(pool, key=score.get, reverse=True)[:candidates]:
            ev = evaluate(graph, units | {u})
            gain = current.time - ev.time
            if gain > 0 and ev.bytes <= budget and gain / max(ev.bytes - current.bytes, 1e-9) > best_ratio:
                best, best_ratio, best_ev = u, gain / max(ev.bytes - current.bytes, 1e-9), ev
        if best is None:
            return units
        units.add(best)
        current = best_ev


def select_lagrangian(graph: OperatorGraph, budget: float, iterations: int = 40) -> Selection:
    """Lagrangian relaxation: minimum cuts at prices found by bisection, then a greedy fill of the budget left.

    The result is the cut solution at the smallest price that fits the
    budget (a point of the lower convex hull of (bytes, time)), with units
    added greedily while they fit.  ``lower_bound`` is the best Lagrangian
    bound ``time(S) + lam * (bytes(S) - budget)`` seen.
    """
    t0 = _time.perf_counter()
    check_budget(graph, budget)
    positive = graph.bytes[graph.bytes > 0]
    if positive.size == 0:  # saving is free: save every unit
        return make_selection(graph, range(graph.n_units), budget, "lagrangian", -math.inf, t0)
    lo, hi = 0.0, 2.0 * max(graph.time.sum(), 1e-300) / positive.min()  # at hi nothing is worth saving
    sol_lo = _closure_cut(graph, lo)
    ev_lo = evaluate(graph, sol_lo)
    if ev_lo.bytes <= budget:
        return make_selection(graph, sol_lo, budget, "lagrangian", ev_lo.time + lo * (ev_lo.bytes - budget), t0)
    sol_hi = _closure_cut(graph, hi)
    ev_hi = evaluate(graph, sol_hi)
    bound = ev_hi.time + hi * (ev_hi.bytes - budget)
    for _ in range(iterations):
        if hi - lo <= 1e-9 * hi or ev_hi.bytes >= ev_lo.bytes:
            break
        mid = math.sqrt(lo * hi) if lo > 0 else hi * 1e-9
        sol = _closure_cut(graph, mid)
        ev = evaluate(graph, sol)
        bound = max(bound, ev.time + mid * (ev.bytes - budget))
        if ev.bytes <= budget:
            hi, sol_hi, ev_hi = mid, sol, ev
        else:
            lo, sol_lo, ev_lo = mid, sol, ev
    return make_selection(graph, _greedy_fill(graph, set(sol_hi), budget), budget, "lagrangian", bound, t0)

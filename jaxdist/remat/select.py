"""Choosing what to save: recompute time against saved bytes, solved on an operator graph.

The backward pass of a block needs some forward values (``needed``).  Each one
is either *saved* (its bytes stay in memory from the forward to the backward
pass) or *recomputed* in the backward pass, which needs its inputs: saved or
recomputed in turn.  Block inputs are always at hand.  Given a budget of saved
bytes per block, find the set of operators to save with the least recompute
time:

    minimise  sum(time[i] for i recomputed)
    s.t.      sum(bytes[i] for i saved and used) <= budget

Operators that share a ``unit`` are saved or recomputed together (a
``jax.checkpoint`` policy sees an operator's primitive, input shapes and
parameters, so two operators that agree on those are indistinguishable to it);
``unit == -1`` marks an operator no policy can save.

The graph, :func:`~jaxdist.remat.graph.evaluate` and :class:`~jaxdist.remat.graph.Selection`
live in :mod:`jaxdist.remat.graph`.  Solvers, all pure functions of (graph, budget):

* :func:`select_exact`: a mixed-integer program (``scipy.optimize.milp``,
  HiGHS): one binary per unit, continuous "recomputed" and "saved-and-used"
  indicators that the constraints force to 0/1.  Exact.
* :func:`select_brute_force`: every subset of units (up to ~22 units); the
  reference for tests.
* :func:`jaxdist.remat.lagrangian.select_lagrangian`: Lagrangian relaxation.  For a price ``lam``
  (seconds per byte), minimising ``time + lam * bytes`` without a budget is a
  minimum-weight closure problem (which values are required, which of those
  are recomputed; recomputing implies the inputs are required), solved exactly
  by one minimum cut.  Bisection on ``lam`` finds the cheapest solution within
  the budget on the lower convex hull of (bytes, time); a greedy pass then
  spends the budget left over on the units that save the most time per byte.
  ``time(S) + lam * (bytes(S) - budget)`` for the minimum-cut solution ``S`` at
  any ``lam`` is a lower bound on the optimum, so each result carries a proven
  bound (``Selection.lower_bound``).  A few hundred milliseconds for 500
  operators, but on knapsack-like instances up to ~20% above the optimum:
  a fallback, not the default.
* :func:`select_approximate`: the MILP stopped at a proven relative gap of
  0.5% (deterministic: a node limit, no time limit), falling back on the
  Lagrangian solution if the node limit comes first.
* :func:`select`: exact up to ``EXACT_MAX_UNITS`` decision units, the
  approximation above.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time as _time

import numpy as np

# evaluate is re-exported: benchmarks/remat.py imports it from here.
from jaxdist.remat.graph import OperatorGraph, Selection, check_budget, evaluate, make_selection  # noqa: F401
from jaxdist.remat.lagrangian import select_lagrangian

# Up to this many decision units, select() solves the MILP exactly (a safety node limit aside);
# above, select_approximate.
EXACT_MAX_UNITS = 200
EXACT_NODE_LIMIT = 20000
# Above it: stop at this proven relative gap to the optimum, or after this many branch-and-bound nodes.
APPROX_REL_GAP = 0.005
APPROX_NODE_LIMIT = 2000
# Brute force enumerates 2**units subsets; beyond this it is refused.
BRUTE_FORCE_MAX_UNITS = 22
# The MILP's tie-break: this weight on the saved bytes (a share of the budget, so at most TIE in all) beside the
# recompute time (in units of the shortest operator's time, so each recomputed operator costs at least 1).  Ties
# within TIE of the shortest operator's time go to fewer bytes; HiGHS ignores cost terms much smaller (1e-9 is
# lost in its tolerances).  Under a time cap, the same weight on the time breaks ties between equal bytes.  The
# term is below HiGHS's absolute gap (1e-6), so a solve that stops at its gap before telling two ties apart may
# return either; select(..., slack > 0) (train.remat_slack > 0) minimises bytes in a second solve.
TIE = 1e-7


# --------------------------------------------------------------------------- exact


@contextlib.contextmanager
def _quiet_stdout():
    # HiGHS prints a debug line ("HighsMipSolverData::...") to the C-level stdout on some solves.
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # no real stdout (e.g. captured): nothing to silence
        yield
        return
    sys.stdout.flush()
    saved, null = os.dup(fd), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(null)


def select_exact(
    graph: OperatorGraph,
    budget: float,
    *,
    time_cap: float | None = None,
    rel_gap: float = 1e-9,
    node_limit: int | None = None,
) -> Selection:
    """The optimal selection, from a mixed-integer program (scipy.optimize.milp / HiGHS).

    Variables: g[u] binary (unit u saved), r[i] in [0, 1] (operator i
    recomputed), m[i] in [0, 1] (operator i saved and used; only for units of
    several operators, a one-operator unit never saves an unused value at the
    optimum).  With s[i] = g[unit[i]] (0 if unsaveable):  r[i] + s[i] >=
    needed[i];  r[i] + s[i] >= r[j] for each user j of i;  m[i] >= s[i] +
    needed[i] - 1 and m[i] >= s[i] + r[j] - 1;  bytes <= budget.  r and m need
    not be integer: for binary g their least feasible values are 0 or 1.

    Minimises recompute time (ties, within :data:`TIE` of the shortest operator's time: fewer bytes).  With ``time_cap``
    (seconds) it instead minimises bytes subject to time <= time_cap (ties:
    less time).  The lower bound is HiGHS's dual bound, proven to its tolerances (about 1e-6 relative).
    ``rel_gap`` and ``node_limit`` stop HiGHS early (deterministically: no time limit, so that
    every process of a job chooses the same plan).
    """
    import scipy.sparse as sp  # scipy (~0.4 s to import) only when train.remat=auto selects: a default run never does
    from scipy.optimize import Bounds, LinearConstraint, milp

    t0 = _time.perf_counter()
    check_budget(graph, budget)
    n, U = graph.n, graph.n_units
    if U == 0:
        return make_selection(graph, (), budget, "exact (MILP)", -math.inf, t0)
    G, R, M = 0, U, U + n  # variable offsets
    nv = U + 2 * n
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(entries, lb, ub):
        for c, v in entries:
            rows.append(len(lo)), cols.append(c), vals.append(v)
        lo.append(lb), hi.append(ub)

    def s_term(i, coef):
        return [(G + graph.unit[i], coef)] if graph.unit[i] >= 0 else []

    sizes = np.bincount(graph.unit[graph.unit >= 0], minlength=U)
    shared = (graph.unit >= 0) & (sizes[np.maximum(graph.unit, 0)] > 1)
    for i in range(n):
        if graph.needed[i]:
            add([(R + i, 1.0)] + s_term(i, 1.0), 1.0, np.inf)
            if shared[i]:
                add([(M + i, 1.0)] + s_term(i, -1.0), 0.0, np.inf)
        for j in graph.consumers[i]:
            add([(R + i, 1.0), (R + j, -1.0)] + s_term(i, 1.0), 0.0, np.inf)
            if shared[i]:
                add([(M + i, 1.0), (R + j, -1.0)] + s_term(i, -1.0), -1.0, np.inf)
    # Rows and objective scaled to O(1) and up: HiGHS's tolerances are absolute.
    bscale = max(float(budget), float(graph.bytes.max()), 1.0)
    positive_t = graph.time[graph.time > 0]
    tscale = positive_t.min() if positive_t.size else 1.0
    byte_coef = np.zeros(nv)
    byte_coef[M : M + n] = np.where(shared, graph.bytes, 0.0) / bscale
    for u in np.flatnonzero(sizes == 1):
        byte_coef[G + u] = graph.bytes[graph.unit == u].sum() / bscale
    time_coef = np.zeros(nv)
    time_coef[R : R + n] = graph.time / tscale
    add([(k, v) for k, v in enumerate(byte_coef) if v], -np.inf, float(budget) / bscale)
    if time_cap is None:
        c = time_coef + TIE * byte_coef
    else:
        add([(k, v) for k, v in enumerate(time_coef) if v], -np.inf, float(time_cap) / tscale * (1 + 1e-9))
        c = byte_coef + TIE * time_coef / max(time_coef.sum(), 1.0)
    A = sp.csr_array((vals, (rows, cols)), shape=(len(lo), nv))
    upper = np.ones(nv)
    upper[M : M + n][~shared] = 0.0
    integrality = np.zeros(nv)
    integrality[G : G + U] = 1
    options = {"mip_rel_gap": rel_gap, "disp": False}
    if node_limit is not None:
        options["node_limit"] = node_limit
    with _quiet_stdout():
        res = milp(
            c,
            integrality=integrality,
            bounds=Bounds(np.zeros(nv), upper),
            constraints=LinearConstraint(A, lo, hi),
            options=options,
        )
    if res.x is None:
        raise RuntimeError(f"MILP solver failed: {res.message}")
    units = [u for u in range(U) if res.x[G + u] > 0.5]
    exact = res.status == 0
    bound = getattr(res, "mip_dual_bound", None)
    # The dual bound is on time + the tie term (at most TIE): less that, a bound on the time alone.
    bound = -math.inf if bound is None or time_cap is not None else (bound - TIE) * tscale
    return make_selection(graph, units, budget, "exact (MILP)" if exact else "MILP (limit reached)", bound, t0)


def select_brute_force(graph: OperatorGraph, budget: float) -> Selection:
    """The optimal selection by trying every subset of units (vectorised over subsets); for <= 22 units."""
    t0 = _time.perf_counter()
    check_budget(graph, budget)
    U = graph.n_units
    if U > BRUTE_FORCE_MAX_UNITS:
        raise ValueError(f"brute force over {U} units would try 2**{U} subsets; use select_exact")
    masks = np.arange(2**U, dtype=np.int64)
    n = graph.n
    required = [None] * n
    recomputed = [None] * n
    total_t = np.zeros(masks.shape)
    total_b = np.zeros(masks.shape)
    for i in range(n - 1, -1, -1):
        req = np.full(masks.shape, bool(graph.needed[i]))
        for j in graph.consumers[i]:
            req |= recomputed[j]
        s = ((masks >> graph.unit[i]) & 1).astype(bool) if graph.unit[i] >= 0 else np.zeros(masks.shape, bool)
        required[i], recomputed[i] = req, req & ~s
        total_t += graph.time[i] * recomputed[i]
        total_b += graph.bytes[i] * (req & s)
    ok = total_b <= budget
    # least time, then least bytes
    order = np.lexsort((total_b[ok], total_t[ok]))
    best = int(masks[ok][order[0]])
    units = [u for u in range(U) if best >> u & 1]
    return make_selection(graph, units, budget, "brute force", float(total_t[ok][order[0]]), t0)


def select_approximate(
    graph: OperatorGraph, budget: float, rel_gap: float = APPROX_REL_GAP, node_limit: int = APPROX_NODE_LIMIT
) -> Selection:
    """Within ``rel_gap`` of the optimum: the MILP stopped at that proven relative gap.

    Deterministic (a node limit, not a time limit), so every process of a
    job chooses the same plan.  If HiGHS reaches ``node_limit``
    branch-and-bound nodes first, the better of its best solution and
    :func:`select_lagrangian`'s is returned, with the better lower bound
    (``Selection.gap`` then says how far from optimal it may be).  On
    generated graphs of 500 operators the root node usually suffices
    (0.01-0.2 s).
    """
    t0 = _time.perf_counter()
    try:
        res = select_exact(graph, budget, rel_gap=rel_gap, node_limit=node_limit)
    except RuntimeError:  # no solution at all within the node limit
        res = None
    if res is not None and res.method == "exact (MILP)":
        return dataclasses.replace(res, method=f"MILP to {rel_gap:.1%} gap", solve_seconds=_time.perf_counter() - t0)
    lag = select_lagrangian(graph, budget)
    best = lag if res is None or (lag.time, lag.bytes) < (res.time, res.bytes) else res
    bound = max(lag.lower_bound, res.lower_bound if res is not None else -math.inf)
    return dataclasses.replace(
        best,
        method=f"{best.method} (MILP node limit)",
        lower_bound=min(bound, best.time),
        solve_seconds=_time.perf_counter() - t0,
    )


def select(
    graph: OperatorGraph,
    budget: float,
    exact_max_units: int = EXACT_MAX_UNITS,
    slack: float = 0.0,
    best: Selection | None = None,
) -> Selection:
    """Least recompute time within ``budget`` bytes: exact up to ``exact_max_units`` units, else :func:`select_approximate`.

    With ``slack`` (seconds) > 0, a second solve returns a selection with
    (within 2%) the fewest bytes among those within ``slack`` of that least
    time (``best``: that least-time selection, if already solved).  Both
    solves are deterministic (node limits, no time limits).
    """
    large = graph.n_units > exact_max_units
    if best is None:
        best = select_approximate(graph, budget) if large else select_exact(graph, budget, node_limit=EXACT_NODE_LIMIT)
    if slack <= 0:
        return best
    t0 = _time.perf_counter()
    try:  # bytes within 2% of the least: minimising bytes under a time cap is the harder direction
        lean = select_exact(graph, budget, time_cap=best.time + slack, rel_gap=0.02, node_limit=200)
    except RuntimeError:
        return best
    if lean.bytes > best.bytes or lean.time > best.time + slack * (1 + 1e-9):
        return best
    return dataclasses.replace(
        lean,
        method=f"{best.method}, then least bytes within {slack:.3g} s",
        lower_bound=best.lower_bound,
        solve_seconds=best.solve_seconds + _time.perf_counter() - t0,
    )


# --------------------------------------------------------------------------- generated graphs


def random_graph(n: int, kind: str = "branching", seed: int = 0, needed_fraction: float = 0.5) -> OperatorGraph:
    """A generated operator graph for tests and benchmarks.

    ``kind="chain"``: operator i reads operator i-1.  ``"branching"``: each
    operator reads one to three earlier operators, mostly recent ones (a
    transformer-like mix of long chains, fan-out and residual joins).  Bytes
    are log-uniform over 1 KiB..16 MiB, times log-uniform over 1 us..10 ms
    (independent, so the time-per-byte ratios vary widely); about
    ``needed_fraction`` of the operators are read by the backward pass.
    """
    rng = np.random.default_rng(seed)
    nbytes = np.exp(rng.uniform(np.log(2**10), np.log(2**24), n)).round()
    times = np.exp(rng.uniform(np.log(1e-6), np.log(1e-2), n))
    needed = rng.random(n) < needed_fraction
    inputs: list[tuple[int, ...]] = []
    for i in range(n):
        if i == 0:
            inputs.append(())
        elif kind == "chain":
            inputs.append((i - 1,))
        elif kind == "branching":
            k = int(rng.integers(1, 4))
            back = np.minimum(rng.geometric(0.35, size=k), i)
            inputs.append(tuple(sorted({i - int(b) for b in back})))
        else:
            raise ValueError(f"unknown graph kind '{kind}': use chain or branching")
    return OperatorGraph(nbytes, times, tuple(inputs), needed, np.arange(n))

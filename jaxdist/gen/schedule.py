"""Scheduling decisions of a generation cluster: streams and nodes per model, and each round's nodes under a budget.

**Streams and nodes per model** (:func:`plan_streams`). A job chains models
(a generator, a scorer, a deduplicator); one *item* of its output needs
``requests_per_item`` requests of each model (:class:`Stage`, from the job's
run log by :func:`stages_from_log`). With a node of model ``m`` at ``s``
streams finishing ``R_m(s) = s / L_m(s)`` requests/s (:mod:`jaxdist.gen.profile`),
the chain delivers ``min_m n_m R_m(s_m) / k_m`` items/s. The plan maximises it
over streams ``s_m`` (among ``streams``, with ``L_m(s_m)`` within the model's
latency target) and node counts ``n_m >= 1`` with ``sum n_m <= nodes``; among
equal throughputs it takes the fewest nodes (the rest are spare), then the
lowest latencies. A node's rate does not depend on how many nodes there are,
so the problem separates and is solved exactly at any size: the best rate per
model, then nodes one at a time to the current bottleneck (optimal for a
maximin of increasing terms), then per model the lowest-latency streams that
keep up with the optimum on its nodes. :func:`exhaustive_plan` is the
brute-force reference.

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

import itertools
import math
import time
from collections import Counter, defaultdict
from fractions import Fraction
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.gen.profile import ModelProfile
from jaxdist.gen.runlog import RunRecord

TIE = 1e-9  # relative: throughputs this close count as equal
EXACT_UNITS = 2**16  # whole-number costs with a budget up to this are solved exactly


# ---------------------------------------------------------------- streams and nodes per model


@dataclass(frozen=True)
class Stage:
    """One model of the chain: requests per item of chain output, their mean size (tokens), latency target (s)."""

    model: str
    requests_per_item: float
    tokens_in: float
    tokens_out: float
    latency_target_s: float


def stages_from_log(
    records: Iterable[RunRecord], chain: Sequence[str], latency_targets_s: Mapping[str, float]
) -> list[Stage]:
    """The stages of a job from its run log: requests per item relative to ``chain[0]``, mean tokens per request."""
    by: dict[str, list[RunRecord]] = defaultdict(list)
    for r in records:
        by[r.model].append(r)
    for m in chain:
        if not by[m]:
            raise ConfigError(f"the job's run log has no request of model '{m}': log the job running its chain.")
        if m not in latency_targets_s or not latency_targets_s[m] > 0:
            raise ConfigError(f"model '{m}' has no positive latency target: give one in seconds.")
    base = len(by[chain[0]])
    return [
        Stage(
            m,
            len(by[m]) / base,
            float(np.mean([r.tokens_in for r in by[m]])),
            float(np.mean([r.tokens_out for r in by[m]])),
            float(latency_targets_s[m]),
        )
        for m in chain
    ]


@dataclass(frozen=True)
class StageChoice:
    """A model's streams per node and node count, what they give, and why."""

    model: str
    streams: int
    nodes: int
    requests_s: float  # per node
    latency_s: float
    items_s: float  # the stage's capacity in chain items/s
    meets_target: bool
    why_streams: str
    why_nodes: str


@dataclass(frozen=True)
class StreamPlan:
    """Streams and nodes per model; ``items_s`` is the chain's throughput (items/s), ``spare`` the unused nodes."""

    choices: tuple[StageChoice, ...]
    items_s: float
    pool: int
    spare: int

    @property
    def streams(self) -> dict[str, int]:
        return {c.model: c.streams for c in self.choices}

    @property
    def nodes(self) -> dict[str, int]:
        return {c.model: c.nodes for c in self.choices}


def _rates(profiles: Mapping[str, ModelProfile], stages: Sequence[Stage], streams: Sequence[int]):
    """Per stage: items/s per node and latency (s) at each candidate stream count (arrays over ``streams``)."""
    s = np.asarray(streams, float)
    out = []
    for st in stages:
        if st.model not in profiles:
            raise ConfigError(f"model '{st.model}' has no profile: run jaxdist gen profile on its logs first.")
        if not st.requests_per_item > 0:
            raise ConfigError(f"model '{st.model}' has {st.requests_per_item} requests per item: give a positive one.")
        p = profiles[st.model]
        lat = p.serial_latency_s(st.tokens_in, st.tokens_out) * (1 + p.contention * (s - 1))
        out.append((s / lat / st.requests_per_item, lat))
    return out


def plan_streams(
    profiles: Mapping[str, ModelProfile],
    stages: Sequence[Stage],
    nodes: int,
    streams: Sequence[int] = tuple(range(1, 17)),
    check_latency: bool = True,
) -> StreamPlan:
    """The streams per node and nodes per model that maximise the chain's throughput (see the module docstring).

    ``check_latency=False`` ignores the latency targets (choices over them are
    marked); :func:`plan_fixed_streams` uses it. ConfigError when the pool has
    fewer nodes than models or a model cannot meet its target at any stream count.
    """
    streams = sorted(set(int(s) for s in streams))
    if not streams or streams[0] < 1:
        raise ConfigError(f"stream counts {streams} must be whole numbers of at least 1: give e.g. 1..16.")
    if nodes < len(stages):
        raise ConfigError(f"a pool of {nodes} nodes cannot hold {len(stages)} models: give at least one node each.")
    rates = _rates(profiles, stages, streams)
    feasible = []
    for st, (u, lat) in zip(stages, rates):
        ok = lat <= st.latency_target_s if check_latency else np.ones(len(streams), bool)
        if not ok.any():
            raise ConfigError(
                f"model '{st.model}' takes {lat[0]:.3g} s per request even at 1 stream, over its "
                f"{st.latency_target_s:.3g} s target: raise the target or shorten its requests."
            )
        feasible.append(ok)
    best = np.array([u[ok].max() for (u, _), ok in zip(rates, feasible)])
    n = np.ones(len(stages), int)  # one node each, then each further node to the bottleneck
    for _ in range(nodes - len(stages)):
        n[np.argmin(n * best)] += 1
    top = float(np.min(n * best))
    need = top * (1 - TIE)
    for i in range(len(n)):  # the fewest nodes that keep up with the optimum
        while n[i] > 1 and (n[i] - 1) * best[i] >= need:
            n[i] -= 1
    assert n.sum() <= nodes and np.all(n * best >= need)
    caps = n * best
    choices = []
    for i, (st, (u, lat), ok) in enumerate(zip(stages, rates, feasible)):
        keep = ok & (n[i] * u >= need)
        j = int(np.flatnonzero(keep)[np.argmin(lat[keep])])
        j_best = int(np.flatnonzero(ok)[np.argmax(u[ok])])
        s = streams[j]
        target = f"{st.latency_target_s:.3g} s"
        if j != j_best:
            on = f"{n[i]} node{'s' if n[i] > 1 else ''}"
            slower = f"{lat[j_best]:.3g} s with {streams[j_best]}"
            why_s = f"{s}: on {on} as fast as the chain needs, at {lat[j]:.3g} s, not {slower}"
        elif j + 1 < len(streams) and not ok[j + 1]:
            why_s = f"{s}: the most within its {target} target ({streams[j + 1]} would take {lat[j + 1]:.3g} s)"
        elif j + 1 < len(streams):
            why_s = f"{s}: its throughput peak (more streams lower it)"
        else:
            why_s = f"{s}: the most allowed (latency {lat[j]:.3g} s of {target})"
        if not lat[j] <= st.latency_target_s:
            why_s += "; over its latency target"
        if caps[i] <= top * (1 + TIE):
            why_n = f"{n[i]}: the bottleneck, {caps[i]:.4g} items/s"
        else:
            why_n = f"{n[i]}: the fewest that keep up with {top:.4g} items/s (capacity {caps[i]:.4g})"
        rps = float(u[j] * st.requests_per_item)
        choices.append(
            StageChoice(
                st.model, s, int(n[i]), rps, float(lat[j]), float(n[i] * u[j]), bool(lat[j] <= st.latency_target_s),
                why_s, why_n,
            )
        )  # fmt: skip
    return StreamPlan(tuple(choices), top, nodes, int(nodes - n.sum()))


def plan_fixed_streams(
    profiles: Mapping[str, ModelProfile], stages: Sequence[Stage], nodes: int, streams: int
) -> StreamPlan:
    """The best node counts when every model runs ``streams`` streams (latency targets not enforced, but marked)."""
    return plan_streams(profiles, stages, nodes, [streams], check_latency=False)


def stage_importance(plan: StreamPlan) -> dict[str, float]:
    """Importance of a model's nodes for :func:`select_nodes`: the chain's throughput over the stage's capacity
    (1 for the bottleneck, less for stages with room to spare)."""
    return {c.model: plan.items_s / c.items_s for c in plan.choices}


def format_plan(plan: StreamPlan, stages: Sequence[Stage]) -> str:
    """The plan as a table, with the reason for each model's streams and nodes."""
    target = {st.model: st for st in stages}
    rows = [("model", "req/item", "streams", "nodes", "req/s/node", "latency s", "target s", "items/s", "why")]
    for c in plan.choices:
        st = target[c.model]
        rows.append(
            (
                c.model, f"{st.requests_per_item:.3g}", str(c.streams), str(c.nodes), f"{c.requests_s:.4g}",
                f"{c.latency_s:.3g}", f"{st.latency_target_s:.3g}", f"{c.items_s:.4g}",
                f"streams {c.why_streams}; nodes {c.why_nodes}",
            )
        )  # fmt: skip
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(x.ljust(w[i]) if i in (0, 8) else x.rjust(w[i]) for i, x in enumerate(r)) for r in rows]
    lines.insert(1, "  ".join("-" * x for x in w))
    spare = f"; {plan.spare} spare (more would not raise it)" if plan.spare else ""
    lines.append(f"chain: {plan.items_s:.4g} items/s on {plan.pool - plan.spare} of {plan.pool} nodes{spare}")
    return "\n".join(lines)


def exhaustive_plan(
    profiles: Mapping[str, ModelProfile], stages: Sequence[Stage], nodes: int, streams: Sequence[int]
) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """The brute-force reference of :func:`plan_streams`: (items/s, streams, nodes) over every combination."""
    streams = sorted(set(streams))
    rates = _rates(profiles, stages, streams)
    m, k = len(stages), len(streams)
    sj = np.array(list(itertools.product(range(k), repeat=m)))  # stream index per stage
    nn = np.array([c for c in itertools.product(range(1, nodes + 1), repeat=m) if sum(c) <= nodes])
    u = np.stack([rates[i][0][sj[:, i]] for i in range(m)], 1)  # (S, m)
    lat = np.stack([rates[i][1][sj[:, i]] for i in range(m)], 1)
    ok = np.all(lat <= np.array([st.latency_target_s for st in stages]), 1)
    thr = np.min(nn[None, :, :] * u[:, None, :], -1)  # (S, N)
    thr[~ok] = -1
    top = thr.max()
    cand = np.argwhere(thr >= top * (1 - TIE))
    total_n = nn[cand[:, 1]].sum(1)
    cand = cand[total_n == total_n.min()]
    order = np.lexsort((sj[cand[:, 0]].sum(1), lat[cand[:, 0]].sum(1)))
    a, b = cand[order[0]]
    return float(top), tuple(streams[j] for j in sj[a]), tuple(int(x) for x in nn[b])


# ---------------------------------------------------------------- nodes each round


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

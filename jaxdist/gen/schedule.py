"""Scheduling decisions of a generation cluster: streams and nodes per model of a chain.

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

Each round's nodes under a compute budget: :mod:`jaxdist.gen.selection`.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.gen.profile import ModelProfile
from jaxdist.gen.runlog import RunRecord

TIE = 1e-9  # relative: throughputs this close count as equal


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
        lat = p.latency_s(s, st.tokens_in, st.tokens_out)
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
    for st, (_u, lat) in zip(stages, rates):
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

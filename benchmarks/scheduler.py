"""The generation cluster's scheduling decisions against known truths and brute force (no devices, seconds).

Five tables:

1. profile accuracy: synthetic run logs from known latency/throughput curves
   (2% log-normal noise, 1,000 requests per stream count at 1, 2, 4, 8
   streams), the worst and median relative error of each fitted parameter over
   20 seeds, for models whose streams add to the per-request and per-token
   parts apart and for the first profiles' one-contention-factor family;
2. strategy: :func:`plan_streams` against :func:`exhaustive_plan` on random
   small chains, and, on a three-model chain, its throughput against every
   fixed "same streams for every model" choice (each with its best node counts);
3. node selection: :func:`knapsack` against brute force on 1,000 random small
   instances (whole-number and real costs): the optimality gap, as used (small
   instances are enumerated) and with the dynamic programme forced;
4. decision time with 100 nodes and 10,000 pending tasks (dp and milp);
5. budget use over a 1,000-round simulation with a growing backlog.

    python benchmarks/scheduler.py
"""

from __future__ import annotations

import math
import time

import numpy as np

from jaxdist.gen.profile import ModelProfile, fit_profile, synthetic_records
from jaxdist.gen.schedule import (
    Stage,
    exhaustive_plan,
    format_plan,
    plan_fixed_streams,
    plan_streams,
)
from jaxdist.gen.selection import (
    NodeWork,
    knapsack,
    node_demand,
    select_nodes,
)


def table(rows: list[tuple]) -> str:
    rows = [tuple(str(x) for x in r) for r in rows]
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([fmt(rows[0]), "  ".join("-" * x for x in w), *map(fmt, rows[1:])])


MEAN_IN, MEAN_OUT = (1 + 512) / 2, (1 + 256) / 2  # the means of synthetic_records' uniform token counts
TRUE = {  # (a, p, b, a', p', b'): s per request, per prompt token, per output token; what each extra stream adds
    "generator": ModelProfile("generator", 0, 0.05, 5e-4, 0.010, 0.004, 1e-4, 0.0012, MEAN_IN, MEAN_OUT),
    "sampler": ModelProfile("sampler", 0, 0.003, 2e-5, 3e-4, 0.0, 2e-6, 2e-5, MEAN_IN, MEAN_OUT),
    # the first profiles' family: each stream adds c of the serial latency (a' = c a, p' = c p, b' = c b)
    "scorer": ModelProfile.with_contention("scorer", 0.10, 2e-4, 0.002, 0.50, MEAN_IN, MEAN_OUT),
    "large": ModelProfile.with_contention("large", 0.20, 1e-3, 0.030, 0.04, MEAN_IN, MEAN_OUT),
}


def profile_accuracy(seeds: int = 20) -> str:
    names = [
        "request_s", "input_token_s", "output_token_s", "stream_output_token_s", "serial_tokens_s",
        "limit_tokens_s", "saturation_streams",
    ]  # fmt: skip
    short = {"request_s": "a", "input_token_s": "p", "output_token_s": "b", "stream_output_token_s": "b'",
             "serial_tokens_s": "r1", "limit_tokens_s": "limit", "saturation_streams": "s_sat"}  # fmt: skip
    rows = [("model", "true a, p, b / a', p', b' (ms)", *[f"{short[n]} worst / median" for n in names],
             "+stream D", "a' and p' (share of D)")]  # fmt: skip
    for model, truth in TRUE.items():
        fits = [fit_profile(model, synthetic_records(truth, seed=s)) for s in range(seeds)]
        errs = np.array([[abs(getattr(pr, n) / getattr(truth, n) - 1) for n in names] for pr in fits])
        d = truth.extra_stream_s()
        d_err = np.array([abs(pr.extra_stream_s() / d - 1) for pr in fits])
        parts = np.array([max(abs(pr.stream_request_s - truth.stream_request_s),
                              abs(pr.stream_input_token_s - truth.stream_input_token_s) * MEAN_IN) / d
                          for pr in fits])  # fmt: skip
        ms = lambda *xs: ", ".join(f"{1e3 * x:.3g}" for x in xs)  # noqa: E731
        rows.append((
            model,
            f"{ms(truth.request_s, truth.input_token_s, truth.output_token_s)} / "
            f"{ms(truth.stream_request_s, truth.stream_input_token_s, truth.stream_output_token_s)}",
            *[f"{100 * e.max():.1f}% / {100 * np.median(e):.1f}%" for e in errs.T],
            f"{100 * d_err.max():.1f}% / {100 * np.median(d_err):.1f}%",
            f"{100 * parts.max():.1f}% / {100 * np.median(parts):.1f}%",
        ))  # fmt: skip
    return table(rows)


def profile(name, a, p, b, c) -> ModelProfile:
    return ModelProfile.with_contention(name, a, p, b, c)


def random_profile(rng, name) -> ModelProfile:
    a, p, b = rng.uniform(0.01, 0.2), rng.uniform(0, 1e-3), rng.uniform(1e-3, 0.03)
    extra = rng.uniform(0, 1.5, 3) * (rng.uniform(0, 1, 3) > 0.2)  # what a stream adds, each part apart
    return ModelProfile(name, 0, a, p, b, *(extra * (a, p, b)), 100.0, 100.0)


def strategy(instances: int = 500) -> str:
    rng = np.random.default_rng(0)
    same = worst = 0
    for _ in range(instances):
        m = int(rng.integers(1, 4))
        profiles, stages = {}, []
        for i in range(m):
            pr = random_profile(rng, f"m{i}")
            tin, tout = float(rng.integers(1, 500)), float(rng.integers(1, 300))
            target = pr.serial_latency_s(tin, tout) * rng.uniform(1, 4)
            profiles[pr.model] = pr
            stages.append(Stage(pr.model, float(rng.choice([0.5, 1, 2, 4])), tin, tout, target))
        streams = sorted({1, *rng.choice(np.arange(1, 9), int(rng.integers(1, 6)), replace=False).tolist()})
        nodes = int(rng.integers(m, 9))
        plan = plan_streams(profiles, stages, nodes, streams)
        top, s_ref, n_ref = exhaustive_plan(profiles, stages, nodes, streams)
        same += tuple(plan.streams.values()) == s_ref and tuple(plan.nodes.values()) == n_ref
        worst = max(worst, abs(plan.items_s / top - 1))
    out = [f"vs brute force: {same} of {instances} random chains (1-3 models, <= 8 nodes, streams of 1..8) "
           f"the same streams and nodes; largest throughput difference {worst:.1e}"]  # fmt: skip
    profiles = {m: TRUE[m] for m in ("generator", "scorer", "large")}
    stages = [
        Stage("generator", 1, 200, 256, 6.0),  # writes an answer
        Stage("scorer", 4, 450, 1, 0.6),  # scores four candidates of it
        Stage("large", 0.25, 600, 64, 8.0),  # rewrites one answer in four
    ]
    plan = plan_streams(profiles, stages, 24, range(1, 65))
    out.append("\nthe chain on 24 nodes, streams of 1..64:\n" + format_plan(plan, stages))
    rows = [("streams", "items/s", "vs plan", "nodes (generator, scorer, large)", "latency targets")]
    rows.append(("plan " + "/".join(map(str, plan.streams.values())), f"{plan.items_s:.4g}", "1.000",
                 str(tuple(plan.nodes.values())), "met"))  # fmt: skip
    for s in (1, 2, 4, 8, 16, 32, 64):
        f = plan_fixed_streams(profiles, stages, 24, s)
        over = [c.model for c in f.choices if not c.meets_target]
        rows.append((f"all {s}", f"{f.items_s:.4g}", f"{f.items_s / plan.items_s:.3f}", str(tuple(f.nodes.values())),
                     "met" if not over else "over: " + ", ".join(over)))  # fmt: skip
    out.append("\nagainst every fixed stream count (best nodes for it):\n" + table(rows))
    return "\n".join(out)


def brute_force(values, costs, budget):
    n = values.shape[1]
    subsets = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1).astype(float)
    fits = np.einsum("sn,in->is", subsets, costs) <= budget[:, None]
    return np.where(fits, np.einsum("sn,in->is", subsets, values), -1).max(1)


def selection_gap(instances: int = 1000) -> str:
    rows = [("solver", "costs", "instances", "items", "optimal", "proven exact", "mean gap", "max gap", "over budget")]
    for solver, kind, enumerate_up_to in [("default", "whole", 14), ("default", "real", 14), ("dp only", "whole", 0),
                                          ("dp only", "real", 0)]:  # fmt: skip
        rng = np.random.default_rng(7)
        gaps, exact_n, over = [], 0, 0
        for n in range(3, 13):
            k = instances // 10
            values = rng.uniform(0, 10, (k, n))
            costs = rng.integers(1, 60, (k, n)).astype(float) if kind == "whole" else rng.uniform(0.1, 60, (k, n))
            budget = np.floor(costs.sum(1) * rng.uniform(0.2, 0.8, k))
            for v, w, b, opt in zip(values, costs, budget, brute_force(values, costs, budget)):
                mask, exact = knapsack(v, w, b, enumerate_up_to=enumerate_up_to)
                exact_n += exact
                over += math.fsum(w[mask]) > b
                gaps.append(max(0.0, 1 - v[mask].sum() / opt) if opt > 0 else 0.0)
        g = np.array(gaps)
        rows.append((solver, kind, len(g), "3-12", f"{np.mean(g <= 1e-12):.1%}", f"{exact_n / len(g):.1%}",
                     f"{100 * g.mean():.4f}%", f"{100 * g.max():.3f}%", over))  # fmt: skip
    return table(rows)


TYPES = {"gen-long": 3.1, "gen-short": 0.77, "score": 0.13, "dedup": 0.011}


def large_instance(rng) -> tuple[list[NodeWork], float]:
    names = list(TYPES)
    tasks = rng.choice(names, 10_000, p=[0.1, 0.3, 0.4, 0.2])
    owner = rng.integers(0, 100, 10_000)
    nodes = [NodeWork.from_tasks(f"n{i}", tasks[owner == i].tolist(), rng.uniform(0.1, 5)) for i in range(100)]
    return nodes, 0.4 * sum(TYPES[t] for t in tasks)


def decision_time(rounds: int = 20) -> str:
    rng = np.random.default_rng(11)
    methods = ("auto", "dp", "milp")
    times: dict[str, list[float]] = {m: [] for m in methods}
    gaps: dict[str, list[float]] = {m: [] for m in methods}
    bounds: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(rounds):
        nodes, budget = large_instance(rng)
        sel = {m: select_nodes(nodes, TYPES, budget, method=m, max_seconds=0.9) for m in methods}
        opt = max(s.value for s in sel.values())
        for m, s in sel.items():
            assert s.compute <= budget
            times[m].append(s.seconds)
            gaps[m].append(1 - s.value / opt)
            bounds[m].append(s.gap)
    rows = [("method", "instances", "median ms", "max ms", "gap to the best (max)", "reported gap bound (max)")]
    for m in methods:
        rows.append((m, rounds, f"{1e3 * np.median(times[m]):.1f}", f"{1e3 * max(times[m]):.1f}",
                     f"{100 * max(gaps[m]):.4f}%", f"{100 * max(bounds[m]):.4f}%"))  # fmt: skip
    return "100 nodes, 10,000 pending tasks of 4 types, budget 40% of their compute:\n" + table(rows)


def budget_simulation(rounds: int = 1000) -> str:
    rng = np.random.default_rng(4)
    types = {"gen": 2.5, "score": 0.4, "dedup": 0.05}
    per_round = {"gen": 2, "score": 4, "dedup": 8}
    names = list(types)
    pending = [dict.fromkeys(names, 0) for _ in range(20)]
    importance = rng.uniform(0.2, 3.0, 20)
    budget, used, value, greedy_value, over = 15.0, [], 0.0, 0.0, 0
    for _ in range(rounds):
        for p in pending:
            for t in names:
                p[t] += int(rng.poisson(0.3 if t == "gen" else 1.0))
        offers = [{t: min(p[t], per_round[t]) for t in names} for p in pending]
        nodes = [NodeWork(f"n{i}", o, importance[i]) for i, o in enumerate(offers)]
        sel = select_nodes(nodes, types, budget)
        over += sel.compute > budget
        used.append(sel.compute / budget)
        value += sel.value
        need, val = node_demand(nodes, types)  # the baseline: most important nodes first while they fit
        left = budget
        for i in np.argsort(-importance):
            if need[i] <= left:
                left -= need[i]
                greedy_value += val[i]
        for name in sel.nodes:
            i = int(name[1:])
            pending[i] = {t: pending[i][t] - offers[i][t] for t in names}
    u = np.array(used)
    rows = [
        ("rounds", "budget", "rounds over budget", "mean use", "min use", "max use", "value vs most-important-first")
    ]
    rows.append((rounds, budget, over, f"{u.mean():.1%}", f"{u.min():.1%}", f"{u.max():.1%}",
                 f"{value / greedy_value:.3f}x"))  # fmt: skip
    return "20 nodes, ~24 compute units of work arriving per round, offers capped at 7 units a node:\n" + table(rows)


def main() -> None:
    for title, fn in [
        ("1. profile accuracy (synthetic logs, 20 seeds)", profile_accuracy),
        ("2. streams and nodes per model", strategy),
        ("3. node selection vs brute force", selection_gap),
        ("4. decision time", decision_time),
        ("5. budget over a 1,000-round simulation", budget_simulation),
    ]:
        t0 = time.perf_counter()
        text = fn()
        print(f"## {title} ({time.perf_counter() - t0:.1f} s)\n{text}\n")


if __name__ == "__main__":
    main()

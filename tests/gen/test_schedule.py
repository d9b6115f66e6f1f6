"""Scheduling decisions against brute force: streams and nodes per model, nodes under a compute budget."""

import math
import time

import numpy as np
import pytest

from jaxdist.errors import ConfigError
from jaxdist.gen.profile import ModelProfile
from jaxdist.gen.runlog import RunRecord
from jaxdist.gen.schedule import (
    Stage,
    exhaustive_plan,
    format_plan,
    plan_fixed_streams,
    plan_streams,
    stage_importance,
    stages_from_log,
)
from jaxdist.gen.selection import (
    NodeWork,
    cost_unit,
    exhaustive_knapsack,
    format_selection,
    knapsack,
    lp_bound,
    node_demand,
    select_nodes,
)


def one_sentence(msg: str) -> None:
    assert msg.endswith(".") and ". " not in msg and "\n" not in msg, msg


def profile(model, a, p, b, c):
    return ModelProfile.with_contention(model, a, p, b, c)


def random_profile(rng, name):
    """Serial costs, then what a stream adds to each: the per-request, per-prompt-token and per-output-token parts
    scale apart (some streams cost nothing extra, some more than a serial request)."""
    a, p, b = rng.uniform(0.01, 0.2), rng.uniform(0, 1e-3), rng.uniform(1e-3, 0.03)
    extra = rng.uniform(0, 1.5, 3) * (rng.uniform(0, 1, 3) > 0.2)
    return ModelProfile(name, 100, a, p, b, *(extra * (a, p, b)), 100.0, 100.0)


def random_instance(rng):
    m = int(rng.integers(1, 4))
    profiles, stages = {}, []
    for i in range(m):
        name = f"m{i}"
        profiles[name] = random_profile(rng, name)
        st = Stage(
            name, float(rng.choice([0.5, 1, 2, 4])), float(rng.integers(1, 500)), float(rng.integers(1, 300)), 1.0
        )
        serial = profiles[name].serial_latency_s(st.tokens_in, st.tokens_out)
        stages.append(Stage(st.model, st.requests_per_item, st.tokens_in, st.tokens_out, serial * rng.uniform(1, 4)))
    streams = sorted(rng.choice(np.arange(1, 9), int(rng.integers(1, 6)), replace=False).tolist())
    return profiles, stages, int(rng.integers(m, 8)), streams


def test_plan_equals_brute_force_on_small_instances():
    rng = np.random.default_rng(0)
    for _ in range(300):
        profiles, stages, nodes, streams = random_instance(rng)
        if 1 not in streams:
            streams = [1, *streams]  # so that every model can meet its target
        plan = plan_streams(profiles, stages, nodes, streams)
        top, s_ref, n_ref = exhaustive_plan(profiles, stages, nodes, streams)
        assert plan.items_s == pytest.approx(top, rel=1e-12)
        assert tuple(plan.streams.values()) == s_ref and tuple(plan.nodes.values()) == n_ref
        assert sum(plan.nodes.values()) + plan.spare == nodes
        assert all(c.meets_target for c in plan.choices)
        for s in streams:  # at least every fixed "same streams for every model" choice that meets the targets
            fixed = plan_fixed_streams(profiles, stages, nodes, s)
            if all(c.meets_target for c in fixed.choices):
                assert plan.items_s >= fixed.items_s * (1 - 1e-12)


def test_plan_table_reasons_and_importance():
    profiles = {"gen": profile("gen", 0.05, 5e-4, 0.01, 0.15), "score": profile("score", 0.02, 2e-4, 0.002, 0.5)}
    stages = [Stage("gen", 1, 100, 200, 4.0), Stage("score", 4, 300, 1, 0.2)]
    plan = plan_streams(profiles, stages, 10, range(1, 33))
    gen, score = plan.choices
    # gen: 2.1 s (1 + 0.15 (s - 1)) <= 4 s -> 7 streams, 7 / 3.99 s = 1.754 items/s per node;
    # score: 0.082 s (1 + 0.5 (s - 1)) <= 0.2 s -> 3 streams, 3 / 0.164 s / 4 = 4.573 items/s per node;
    # 10 nodes: min(1.754 n, 4.573 (10 - n)) is largest at n = 7
    assert gen.streams == 7 and "within its 4 s target (8 would take 4.3 s)" in gen.why_streams
    assert score.streams == 3 and plan.nodes == {"gen": 7, "score": 3} and plan.spare == 0
    assert plan.items_s == pytest.approx(7 * 7 / 3.99)
    assert plan.items_s == pytest.approx(min(c.items_s for c in plan.choices))
    assert stage_importance(plan) == {"gen": 1.0, "score": pytest.approx(plan.items_s / score.items_s)}
    table = format_plan(plan, stages)
    assert "chain:" in table and "bottleneck" in table and table.count("\n") == 4


def test_plan_bad_input_is_one_sentence():
    profiles = {"gen": profile("gen", 0.05, 5e-4, 0.01, 0.15)}
    for stages, nodes, says in [
        ([Stage("gen", 1, 100, 200, 1.0)], 4, "even at 1 stream"),
        ([Stage("gen", 1, 100, 200, 9.0), Stage("gen", 1, 1, 1, 9.0)], 1, "cannot hold 2 models"),
        ([Stage("other", 1, 100, 200, 9.0)], 4, "no profile"),
    ]:
        with pytest.raises(ConfigError) as e:
            plan_streams(profiles, stages, nodes)
        assert says in str(e.value)
        one_sentence(str(e.value))


def test_stages_from_a_job_log():
    recs = [RunRecord("gen", 4, 0, 1, 10, 100)] * 3 + [RunRecord("score", 8, 0, 1, 110, 1)] * 12
    stages = stages_from_log(recs, ["gen", "score"], {"gen": 5.0, "score": 0.5})
    assert stages == [Stage("gen", 1.0, 10.0, 100.0, 5.0), Stage("score", 4.0, 110.0, 1.0, 0.5)]
    with pytest.raises(ConfigError) as e:
        stages_from_log(recs, ["gen", "dedup"], {"gen": 5.0, "dedup": 1.0})
    one_sentence(str(e.value))


def brute_force(values, costs, budget):
    """Vectorised over instances of one size: every subset's value and cost."""
    n = values.shape[1]
    subsets = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1).astype(float)
    fits = np.einsum("sn,in->is", subsets, costs) <= budget[:, None]
    return np.where(fits, np.einsum("sn,in->is", subsets, values), -1).max(1)


@pytest.mark.parametrize("integral", [True, False])
@pytest.mark.parametrize("enumerate_up_to", [14, 0])  # as used (small instances enumerated), dynamic programme forced
def test_knapsack_against_brute_force_on_1000_instances(integral, enumerate_up_to):
    rng = np.random.default_rng(1 if integral else 2)
    gaps, exacts = [], []
    for n in range(1, 11):
        k = 100
        values = rng.uniform(0, 10, (k, n)) * (rng.uniform(0, 1, (k, n)) > 0.1)  # some nodes with no work
        costs = rng.integers(0, 40, (k, n)).astype(float) if integral else rng.uniform(0, 40, (k, n))
        budget = np.floor(costs.sum(1) * rng.uniform(0.1, 0.9, k))
        best = brute_force(values, costs, budget)
        for v, w, b, opt in zip(values, costs, budget, best):
            mask, exact = knapsack(v, w, b, enumerate_up_to=enumerate_up_to)
            assert math.fsum(w[mask]) <= b
            got = v[mask].sum()
            assert got <= opt + 1e-9 and opt <= lp_bound(v, w, b) + 1e-9
            if exact:
                assert got == pytest.approx(opt, rel=1e-12, abs=1e-12)
            gaps.append(1 - got / opt if opt > 0 else 0.0)
            exacts.append(exact)
    gaps = np.array(gaps)
    if integral or enumerate_up_to:  # exact: equal to brute force on every instance
        assert all(exacts) and gaps.max() <= 1e-12
    else:  # costs rounded up to 1/65536 of the budget: an optimum that fills the budget to that is missed
        assert np.mean(gaps <= 0.01) >= 0.995 and gaps.mean() <= 1e-3


def test_cost_unit():
    assert cost_unit([2.5, 0.4, 0.05]) == pytest.approx(0.05)
    assert cost_unit([3, 6, 0]) == 3.0 and cost_unit([0.1 + 0.2, 0.2]) == pytest.approx(0.1)
    assert cost_unit([math.pi, 1.0]) is None and cost_unit([0.0]) is None


def test_select_nodes_milp_and_dp_agree_and_bad_input_is_one_sentence():
    rng = np.random.default_rng(3)
    nodes = [
        NodeWork(f"n{i}", {"gen": int(rng.integers(0, 5)), "score": int(rng.integers(0, 9))}, rng.uniform(0.5, 2))
        for i in range(12)
    ]
    cost = {"gen": 3.7, "score": 0.9}
    dp, milp = select_nodes(nodes, cost, 25.0), select_nodes(nodes, cost, 25.0, method="milp")
    w, v = node_demand(nodes, cost)
    assert dp.value == pytest.approx(exhaustive_knapsack(v, w, 25.0)) == pytest.approx(milp.value)
    assert dp.compute <= 25.0 and "of 25" in format_selection(dp)
    for args, says in [((nodes, {"gen": 1.0}, 5.0), "'score'"), ((nodes, cost, -1.0), "budget")]:
        with pytest.raises(ConfigError) as e:
            select_nodes(*args)
        assert says in str(e.value)
        one_sentence(str(e.value))


def test_budget_never_exceeded_in_a_1000_round_simulation():
    rng = np.random.default_rng(4)
    types = {"gen": 2.5, "score": 0.4, "dedup": 0.05}
    names = list(types)
    pending = [dict.fromkeys(names, 0) for _ in range(20)]
    importance = rng.uniform(0.2, 3.0, 20)
    per_round = {"gen": 2, "score": 4, "dedup": 8}  # what a node can do in one round (7 units at most)
    budget, used = 15.0, []  # below the ~24 units of work arriving per round: a backlog builds
    for _ in range(1000):
        for p in pending:  # new work arrives
            for t in names:
                p[t] += int(rng.poisson(0.3 if t == "gen" else 1.0))
        offers = [{t: min(p[t], per_round[t]) for t in names} for p in pending]
        sel = select_nodes([NodeWork(f"n{i}", o, importance[i]) for i, o in enumerate(offers)], types, budget)
        assert sel.compute <= budget and sel.value <= sel.bound * (1 + 1e-9) and sel.exact  # 0.05 units
        used.append(sel.compute / budget)
        for name in sel.nodes:  # the selected nodes process what they offered
            i = int(name[1:])
            pending[i] = {t: pending[i][t] - offers[i][t] for t in names}
    assert np.mean(used) > 0.9  # and the budget is used, not left idle


def test_100_nodes_and_10000_tasks_decided_under_1_s():
    rng = np.random.default_rng(5)
    types = {"gen-long": 3.1, "gen-short": 0.77, "score": 0.13, "dedup": 0.011}
    names = list(types)
    tasks = rng.choice(names, 10_000, p=[0.1, 0.3, 0.4, 0.2])
    owner = rng.integers(0, 100, 10_000)
    nodes = [NodeWork.from_tasks(f"n{i}", tasks[owner == i].tolist(), rng.uniform(0.1, 5)) for i in range(100)]
    total = sum(types[t] for t in tasks)
    t0 = time.process_time()  # CPU time: the machine is shared (wall time was 0.39 s at load 15 on 2 cores)
    sel = select_nodes(nodes, types, 0.4 * total)
    took = time.process_time() - t0
    # measured 0.03 s of CPU at load 15: over 30x headroom under the 1 s a scheduling round may take
    assert took < 1.0 and sel.compute <= 0.4 * total and sel.gap <= 0.01

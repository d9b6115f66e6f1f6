"""Workers and streams per stage of a job: from gen.workers / gen.task_size, or planned from the models' profiles."""

import itertools

import numpy as np
import pytest

import jaxdist.gen.job_plan as job_plan_module
from jaxdist.config import ConfigError
from jaxdist.gen.config import load_gen_config
from jaxdist.gen.job_plan import format_job_plan, job_plan, place_workers, plan_job
from jaxdist.gen.profile import ModelProfile, save_profiles
from jaxdist.gen.runlog import RunLogWriter, RunRecord
from jaxdist.gen.schedule import exhaustive_plan, plan_fixed_streams

from .test_schedule import random_instance


def one_sentence(msg: str) -> None:
    assert msg.endswith(".") and ". " not in msg and "\n" not in msg, msg


BASE = ["deliver_to=127.0.0.1:5601", "run=x"]


def test_streams_per_task_of_one_stage_from_its_profile(tmp_path):
    """gen.task_size=0: the samples per task (parallel streams) from the model's profile, the most throughput
    within gen.latency_target_s, and why; every worker on the one stage."""
    save_profiles(tmp_path / "p.json", {"m:f": ModelProfile.with_contention("m:f", 0.05, 0.0, 0.01, 0.2, 10, 10)})
    (tmp_path / "s.txt").write_text("x" * 10 + "\n")
    base = [*BASE, f"samples={tmp_path / 's.txt'}", "function=m:f", "task_size=0", "workers=3"]
    with pytest.raises(ConfigError, match="0 with gen.profile set"):
        load_gen_config(None, base)
    # latency(s) = (0.05 + 0.01 * 10) * (1 + 0.2 (s - 1)) <= target: 12 streams for 0.5 s, 62 for 2 s
    plans = [
        job_plan(load_gen_config(None, [*base, f"profile={tmp_path / 'p.json'}", f"latency_target_s={t}"]), ["x" * 10])
        for t in (0.5, 2.0)
    ]
    (tight, _), (loose, _) = plans
    assert tight.streams == (12,) and loose.streams == (62,) and "target" in tight.streams_why[0]
    assert tight.nodes == (3,) and tight.spare == 0
    other = load_gen_config(None, [*base, f"profile={tmp_path / 'p.json'}", "function=n:g"])
    with pytest.raises(ConfigError, match="no profile of 'n:g'") as e:
        job_plan(other, ["x"])
    one_sentence(str(e.value))


def test_workers_per_stage_are_the_brute_force_optimum(monkeypatch):
    """On random small chains the workers per stage and streams equal the brute-force optimum's (streams planned
    among 1..8 here, or fixed by gen.task_size); without profiles every stage gets gen.workers."""
    monkeypatch.setattr(job_plan_module, "MAX_STREAMS", 8)
    rng = np.random.default_rng(6)
    for _ in range(100):
        profiles, stages, nodes, streams = random_instance(rng)
        plan = plan_job(profiles, stages, nodes, 0, 1)
        top, s_ref, n_ref = exhaustive_plan(profiles, stages, nodes, range(1, 9))
        assert plan.streams == s_ref and plan.nodes == n_ref and plan.items_s == pytest.approx(top, rel=1e-12)
        s = int(rng.choice(streams))
        fixed = plan_job(profiles, stages, nodes, s, 1)
        n_fix = tuple(plan_fixed_streams(profiles, stages, nodes, s).nodes.values())
        brute = max(  # the best node counts for s streams everywhere, latency targets aside
            (c for c in itertools.product(range(1, nodes + 1), repeat=len(stages)) if sum(c) <= nodes),
            key=lambda c: (min(n * r for n, r in zip(c, rates(profiles, stages, s))), -sum(c)),
        )
        assert fixed.streams == (s,) * len(stages) and fixed.nodes == n_fix == brute
        assert sum(plan.nodes) + plan.spare == nodes
    none = plan_job(None, stages, 0, 5, 2)
    assert none.streams == (5,) * len(stages) and none.nodes == (2,) * len(stages) and none.spare == 0


def rates(profiles, stages, s):
    """Items/s of one node of each stage at s streams."""
    return [s / profiles[st.model].latency_s(s, st.tokens_in, st.tokens_out) / st.requests_per_item for st in stages]


def test_a_chain_plan_from_profiles_and_an_earlier_runs_log(tmp_path):
    gen, score = "m:gen", "m:score"
    save_profiles(
        tmp_path / "p.json",
        {
            gen: ModelProfile.with_contention(gen, 0.05, 0.0, 0.0, 0.25, 10, 10),
            score: ModelProfile.with_contention(score, 0.04, 0.0, 0.0, 0.5, 10, 10),
        },
    )
    (tmp_path / "s.txt").write_text("a\nb\n")
    RunLogWriter(tmp_path / "runlog.w0.jsonl", gen).write(
        [RunRecord(gen, 4, 0.0, 1.0, 8, 8)] * 4 + [RunRecord(score, 2, 0.0, 1.0, 5, 5)] * 8
    )
    args = [*BASE, f"samples={tmp_path / 's.txt'}", f"stages={gen},{score}", f"profile={tmp_path / 'p.json'}"]
    args += ["task_size=0", "latency_target_s=0.09", f"job_logs={tmp_path / 'runlog.*.jsonl'}"]
    # gen: 4 streams, 45.7 items/s a node; score, 2 requests per item: 3 nodes at 2 streams keep up with it
    plan, stages = job_plan(load_gen_config(None, [*args, "nodes=4"]), ["a", "b"])
    assert [st.requests_per_item for st in stages] == [1.0, 2.0]
    assert plan.streams == (4, 2) and plan.nodes == (1, 3) and plan.items_s == pytest.approx(4 / 0.0875)
    assert "the bottleneck" in plan.nodes_why[0] and "keep up" in plan.nodes_why[1]
    # 7 nodes: 2 generators (91.4 items/s), 5 scorers at 3 streams (93.75) keep up with them
    plan, stages = job_plan(load_gen_config(None, [*args, "nodes=7"]), ["a", "b"])
    assert plan.streams == (4, 3) and plan.nodes == (2, 5) and plan.spare == 0
    text = format_job_plan(plan, stages)
    assert "stage 1 m:score: 2 requests per item" in text and "91.43 items/s planned on 7 of 7 nodes" in text
    # fixed streams: the nodes still planned; without a job log one request per item each
    plan, _ = job_plan(load_gen_config(None, [*args[:-3], "task_size=3", "workers=2"]), ["a", "b"])
    assert plan.streams == (3, 3) and plan.pool == 4 and plan.streams_why == ("gen.task_size",) * 2
    for bad, says in [
        (["nodes=1"], "cannot serve 2 stages"),
        ([f"stages={gen},{gen}"], "one model twice"),
        ([f"job_logs={tmp_path / 'none.jsonl'}"], "cannot be read"),
    ]:
        with pytest.raises(ConfigError, match=says) as e:
            job_plan(load_gen_config(None, [*args, *bad]), ["a", "b"])
        one_sentence(str(e.value))
    with pytest.raises(ConfigError, match="gen.profile") as e:
        load_gen_config(None, [*BASE, "samples=x", "nodes=3"])
    one_sentence(str(e.value))


def test_place_workers():
    assert place_workers([2]) == [("w0", 0, None), ("w1", 0, None)]
    assert place_workers([1, 3]) == [("s0w0", 0, None), ("s1w0", 1, None), ("s1w1", 1, None), ("s1w2", 1, None)]
    assert place_workers([2], ["a", "b"]) == [("a-w0", 0, "a"), ("b-w0", 0, "b")]  # the names of before
    assert place_workers([1, 3], ["a", "b"]) == [
        ("s0a-w0", 0, "a"), ("s1b-w0", 1, "b"), ("s1a-w0", 1, "a"), ("s1b-w1", 1, "b"),
    ]  # fmt: skip

"""A chain of cooperating models in the running job: stages fed forward, nodes selected each round under a budget."""

import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxdist.config import ConfigError
from jaxdist.gen.chain import Chain
from jaxdist.gen.config import load_gen_config
from jaxdist.gen.delivery import Ledger, Receiver
from jaxdist.gen.profile import ModelProfile, save_profiles
from jaxdist.gen.rounds import NodeReport, decide_round
from jaxdist.gen.runlog import RunLogWriter, RunRecord, read_run_logs
from jaxdist.gen.status import format_status
from jaxdist.gen.tasks import sample_digest

from . import genfns
from .test_delivery import make_run

REPO = Path(__file__).resolve().parents[2]


def test_round_decision_against_brute_force():
    """Importance = 1 + downstream nodes waiting; the selection is the best subset within the budget left."""
    streams, cps = [4, 9, 2], [1.0, 0.5, 2.0]
    cost = [s * c for s, c in zip(streams, cps)]  # 4, 4.5, 4
    reports = [NodeReport(f"n{i}", st, idle) for i, (st, idle) in enumerate([(0, 1), (0, 1), (1, 1), (1, 0), (2, 1)])]
    pending = [3, 1, 0]  # stage 2 has nothing: its idle node waits on stage 1 (and so on stage 0)
    d = decide_round(reports, pending, streams, cps, running_compute=2.0, budget=11.0)
    assert d.importance == (2.0, 2.0, 1.0)
    # candidates: n0, n1 (stage 0: value 2*4, cost 4), n2 (stage 1: value 2*9, cost 4.5); room 9
    best = max(
        sum(v for _, v, _ in c)
        for r in range(4)
        for c in itertools.combinations([("n0", 8, 4), ("n1", 8, 4), ("n2", 18, 4.5)], r)
        if sum(w for _, _, w in c) <= 9
    )
    assert d.selection.value == best == 26 and "n2" in d.selected and len(d.selected) == 2
    assert d.used == 2.0 + 8.5 <= 11.0 and cost == [4, 4.5, 4]
    # one pending task of stage 1 for its one idle node; nothing for a budget already spent
    assert decide_round(reports, pending, streams, cps, running_compute=11.0, budget=11.0).selected == ()
    unlimited = decide_round(reports, pending, streams, cps, running_compute=50.0, budget=0.0)
    assert sorted(unlimited.selected) == ["n0", "n1", "n2"]


def test_chain_cuts_the_next_stage_in_task_order_and_a_restart_recognises_it(tmp_path):
    samples = [f"s{i}" for i in range(5)]
    ch = Chain("job", samples, [2, 3], tmp_path, 60.0)
    assert [len(t.samples) for t in ch.boards[0].tasks] == [2, 2, 1] and ch.boards[1].tasks == []
    b0 = ch.boards[0]
    for i in (1, 0):  # out of order: nothing goes forward until task 0 is finished
        b0.take("w")
        b0.finish(i, "w", {"outcome": "passed", "outputs": [x + "!" for x in b0.tasks[i].samples]})
        ch.refresh()
        assert len(ch.boards[1].tasks) == (0 if i == 1 else 1)
    assert ch.boards[1].tasks[0].samples == ["s0!", "s1!", "s2!"] and not ch.done
    b0.take("w")
    b0.finish(2, "w", {"outcome": "refused", "reason": "x"})  # no outputs: the rest is cut once stage 0 is closed
    ch.refresh()
    assert [t.samples for t in ch.boards[1].tasks] == [["s0!", "s1!", "s2!"], ["s3!"]]
    t = ch.boards[1].tasks[1]
    assert t.key == f"job:s1:{sample_digest(['s3!'])}:3:1"
    ch.boards[1].take("w")
    ch.boards[1].finish(1, "w", {"outcome": "delivered"})
    again = Chain("job", samples, [2, 3], tmp_path, 60.0)  # a restarted job: the same tasks, finished ones known
    assert [x.key for x in again.boards[1].tasks] == [x.key for x in ch.boards[1].tasks]
    assert again.pending() == [0, 1] and sorted(again.boards[1].finished) == [1]


def test_chain_config_is_checked_in_one_sentence():
    base = ["samples=x", "deliver_to=127.0.0.1:1", "run=r", "stages=tests.gen.genfns:variants,tests.gen.genfns:score"]
    assert load_gen_config(None, base).functions == ["tests.gen.genfns:variants", "tests.gen.genfns:score"]
    for bad, says in [("stage_compute=1", "one positive number per stage"), ("compute_budget=-1", "at least 0")]:
        with pytest.raises(ConfigError, match=says) as e:
            load_gen_config(None, [*base, bad])
        assert str(e.value).count(". ") == 0


def _max_concurrent_compute(records, compute_of):
    """The most compute of the tasks running at any instant, from the workers' run logs (one record per sample)."""
    tasks = {(r.worker, r.start, r.end): compute_of(r) * r.streams for r in records}
    events = sorted([(s, c) for (_, s, _), c in tasks.items()] + [(e, -c) for (_, _, e), c in tasks.items()])
    now = peak = 0.0
    for _, c in sorted(events, key=lambda x: (x[0], x[1])):  # an end before a start at the same instant
        now += c
        peak = max(peak, now)
    return peak


def test_a_chain_runs_with_streams_and_workers_from_profiles_and_nodes_selected_within_the_budget(tmp_path):
    fa, fb = "tests.gen.genfns:variants", "tests.gen.genfns:score"
    profiles = {  # the profiles of the two stages: their known cost curves
        f: ModelProfile.with_contention(f, a, 0.0, 0.0, c, 10.0, 10.0)
        for f, (a, c) in [(fa, genfns.VARIANTS_COST), (fb, genfns.SCORE_COST)]
    }
    save_profiles(tmp_path / "prof.json", profiles)
    # an earlier run's log: two scorer requests per sample (variants makes two of each)
    RunLogWriter(tmp_path / "runlog.earlier.jsonl", "x").write(
        [RunRecord(fa, 4, 0.0, 1.0, 8, 8)] * 8 + [RunRecord(fb, 3, 0.0, 1.0, 10, 10)] * 16
    )
    # the plan for a 0.09 s target on 4 nodes: the generator at 4 streams makes 4 / 0.0875 s = 45.7 items/s on
    # 1 node; the scorer needs 2 requests per item: 3 nodes at 2 streams (2 / 0.06 s / 2 = 16.7 items/s each)
    # keep up with it, 2 nodes at 3 streams (18.75 each) would not
    samples = [f"sample {i}" for i in range(16)]
    (tmp_path / "p.txt").write_text("\n".join(samples))
    run = make_run(tmp_path)
    rec = Receiver(run)
    t = threading.Thread(target=rec.serve, args=(time.monotonic() + 120,), daemon=True)
    t.start()
    budget, cps = 9.0, [1.0, 1.5]
    args = [f"samples={tmp_path / 'p.txt'}", "task_size=0", f"profile={tmp_path / 'prof.json'}"]
    args += ["latency_target_s=0.09", f"stages={fa},{fb}", "workers=2", f"compute_budget={budget}"]
    args += [f"job_logs={tmp_path / 'runlog.*.jsonl'}", "stage_compute=1,1.5", f"deliver_to={rec.address}"]
    args += [f"run={run}", f"state_dir={tmp_path / 'st'}"]
    env = {k: v for k, v in os.environ.items() if k != "JAXDIST_JOB_TOKEN"}
    env.update(PYTHONPATH=str(REPO))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "jaxdist.cli", "gen", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        rec.stop()
        t.join(timeout=5)
        rec.close()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    status = json.loads((tmp_path / "st" / "status.json").read_text())
    assert status["streams"] == [4, 2] and status["nodes"] == [1, 3], (status["streams_why"], status["nodes_why"])
    assert sorted(status["workers"]) == ["s0w0", "s1w0", "s1w1", "s1w2"]  # the processes started per stage
    assert status["planned_items_s"] == pytest.approx(4 / 0.0875)
    # the reference chain: 16 samples in tasks of 4 -> 32 variants in task order -> 16 tasks of 2
    variants = [f"{s} /{v}" for s in samples for v in ("a", "b")]
    parts = [variants[i : i + 2] for i in range(0, 32, 2)]
    want = {f"gen:s1:{sample_digest(p)}:2:{j}" for j, p in enumerate(parts)}
    assert set(Ledger(run / "gen" / "ledger.jsonl").by_key) == want
    assert [c["delivered"] for c in status["stages_counts"]] == [0, 16] and status["stages_counts"][0]["tasks"] == 4
    # the budget: never exceeded by the tasks that really ran at once (the workers' own logs), and used
    records = read_run_logs(sorted((tmp_path / "st").glob("runlog.*.jsonl"))).records
    assert {r.worker for r in records if r.model == fa} == {"s0w0"}
    assert {r.worker for r in records if r.model == fb} <= {"s1w0", "s1w1", "s1w2"}
    peak = _max_concurrent_compute(records, lambda r: cps[0] if r.model == fa else cps[1])
    assert 4.5 < peak <= budget and status["compute_max"] <= budget, (peak, status["compute_max"])
    text = format_status({**status, "run": {}})
    assert "stage 1 tests.gen.genfns:score: 3 workers (" in text and "2 samples per task" in text
    assert f"of {budget:g}" in text and "last round" in text and "selected s" in text
    assert "plan: 45.71 items/s on 4 of 4 nodes" in text
    assert math.isclose(status["compute_budget"], budget)

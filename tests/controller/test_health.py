"""The health detector (jaxdist/controller/health.py): pure decisions on efficiency records, and its view."""

from __future__ import annotations

import json
import random

import pytest

from jaxdist.cli import main
from jaxdist.controller.health import (
    HealthHistory,
    LoopPosition,
    Period,
    Thresholds,
    assess,
    name_probe,
    round_summary,
    stuck_ranks,
)
from jaxdist.controller.health_view import format_table, last_probe, node_table, read_health
from jaxdist.train.efficiency import LoopClock

STEPS = 10


def period(rank, index=0, *, step_s=0.1, data=0.001, dispatch=0.01, ckpt=0.0, gen=0, rng=None, noise=0.0):
    """A rank's record of STEPS steps in lockstep: blocked is what the step leaves after its own parts."""
    j = (lambda: 1 + rng.gauss(0, noise)) if rng else (lambda: 1.0)
    d, c, k = data * j(), dispatch * j(), ckpt * j()
    train = step_s * j()
    blocked = max(train - d - c, 0.0)
    first = index * STEPS + 1
    return Period(
        gen, rank, f"n{rank}", index, first, first + STEPS - 1, 0.0, 8 * STEPS, train * STEPS,
        data_wait_s=d * STEPS, dispatch_s=c * STEPS, blocked_s=blocked * STEPS, checkpoint_s=k * STEPS,
    )  # fmt: skip


def history(n=8, **kw):
    return [round_summary([period(r, i, **kw) for r in range(4)]) for i in range(n)]


def test_a_rank_waiting_for_data_is_named_and_nothing_else():
    ps = [period(r, 8) for r in range(4)]
    ps[2] = period(2, 8, data=0.03, step_s=0.13)  # 30% of a step: its input pipeline
    found = assess(8, ps, history())
    assert [(f.kind, f.rank, f.node) for f in found] == [("data", 2, "n2")]
    assert found[0].value == pytest.approx(0.03) and found[0].reference == pytest.approx(0.001)


def test_a_rank_slow_to_dispatch_is_named_compute():
    ps = [period(r, 8) for r in range(4)]
    ps[1] = period(1, 8, dispatch=0.02)  # +10% of a step in its host's part of the step
    assert [(f.kind, f.rank) for f in assess(8, ps, history())] == [("compute", 1)]


def test_a_change_below_min_share_names_no_rank():
    ps = [period(r, 8) for r in range(4)]
    ps[1] = period(1, 8, dispatch=0.017)  # 7 ms more: under 8% of a 0.1 s step
    assert assess(8, ps, history()) == []


def test_a_busy_hosts_uneven_share_of_the_cores_names_no_rank():
    """The CI round that named rank 0 (stop 49): on CPU the dispatch holds the device's compute, so one rank's
    smaller share of a loaded host's cores shows as 17% more dispatch -- over min_share of the step and many
    MADs of the two others, but under min_ratio.  Half again as slow (1.5x) is named."""
    ps = [period(0, 8, step_s=0.1, dispatch=0.059), period(1, 8, dispatch=0.0504), period(2, 8, dispatch=0.0505)]
    assert assess(8, ps, history()) == []
    ps[0] = period(0, 8, step_s=0.1, dispatch=0.076)
    assert [(f.kind, f.rank) for f in assess(8, ps, history())] == [("compute", 0)]
    assert [(f.kind, f.rank) for f in assess(8, ps, history(), Thresholds(min_ratio=1.6))] == []


def test_a_slower_device_step_is_a_job_wide_slowdown():
    ps = [period(r, 8, step_s=0.2) for r in range(4)]  # every rank blocked longer: device or link
    found = assess(8, ps, history())
    assert [(f.kind, f.rank) for f in found] == [("slowdown", None)]
    assert found[0].value == pytest.approx(0.2) and found[0].reference == pytest.approx(0.1)
    # the same extra time in every host's dispatch: the cluster's hosts, not the devices
    ps = [period(r, 8, step_s=0.2, dispatch=0.11) for r in range(4)]
    assert [(f.kind, f.rank) for f in assess(8, ps, history())] == [("compute", None)]


def test_a_checkpoint_stall_is_named():
    ps = [period(r, 8, step_s=0.1, ckpt=0.2) for r in range(4)]  # saves block every rank's loop
    ps = [Period(**{**p.to_dict(), "train_s": p.train_s + p.checkpoint_s}) for p in ps]
    assert [(f.kind, f.rank) for f in assess(8, ps, history())] == [("checkpoint", None)]
    ps = [period(r, 8) for r in range(4)]
    ps[3] = period(3, 8, ckpt=0.03)  # one rank's saves 30% of a step (its disk)
    assert [(f.kind, f.rank) for f in assess(8, ps, history())] == [("checkpoint", 3)]
    ps[3] = period(3, 8, ckpt=0.02)  # 20%: the primary host may write more than the others
    assert assess(8, ps, history()) == []


def test_a_job_change_within_min_change_or_its_noise_is_normal():
    ps = [period(r, 8, step_s=0.12) for r in range(4)]  # +20%: under health_min_change (25%)
    assert assess(8, ps, history()) == []
    ps = [period(r, 8, step_s=0.14) for r in range(4)]  # +40%: more than min_change ...
    assert [f.kind for f in assess(8, ps, history())] == ["slowdown"]  # ... against a steady history
    noisy = [round_summary([period(r, i, step_s=s) for r in range(4)]) for i, s in enumerate(NOISY)]
    assert assess(8, ps, noisy) == []  # ... but within 5 scaled MADs of a history that noisy


NOISY = [0.08, 0.12, 0.09, 0.13, 0.1, 0.07, 0.11, 0.1]


def test_two_ranks_name_no_rank_and_a_short_history_says_nothing():
    ps = [period(0, 2), period(1, 2, data=0.05)]
    assert assess(2, ps, history(2)) == []
    ps = [period(r, 2, step_s=0.5) for r in range(4)]
    assert assess(2, ps, history(2)) == []  # 2 rounds of history: under min_history


def test_no_false_alarm_in_a_thousand_noisy_fault_free_rounds():
    """10% noise on every part of every rank (a loaded host): the defaults never fire."""
    rng = random.Random(0)
    h = HealthHistory(0, 8)
    found = []
    for i in range(1000):
        for r in range(8):
            assert h.add(period(r, i, rng=rng, noise=0.1))
        for _, _, f, _ in h.complete_rounds():
            found += f
    assert found == [] and h.rounds_done == 1000


def test_injected_slow_ranks_are_flagged_in_the_first_round():
    """10-30% of a step added to one rank's data wait or dispatch, under 10% noise: flagged at once, named."""
    rng = random.Random(2)
    hits = 0
    for _trial in range(40):
        h = HealthHistory(0, 4)
        for i in range(6):
            for r in range(4):
                h.add(period(r, i, rng=rng, noise=0.1))
        list(h.complete_rounds())
        bad, extra, part = rng.randrange(4), rng.uniform(0.01, 0.03), rng.choice(["data", "dispatch"])
        for r in range(4):
            kw = {part: {"data": 0.001, "dispatch": 0.01}[part] + (extra if r == bad else 0.0)}
            h.add(period(r, 6, step_s=0.1 + extra, rng=rng, noise=0.1, **kw))
        (_, _, found, _), *_ = list(h.complete_rounds())
        kind = {"data": "data", "dispatch": "compute"}[part]
        hits += [(f.kind, f.rank) for f in found] == [(kind, bad)]
    assert hits >= 38  # at least 95% named right


def test_rounds_complete_in_order_once_and_slow_rounds_stay_out_of_the_history():
    h = HealthHistory(gen=1, ranks=3)
    assert not h.add(period(0, 0, gen=0))  # another generation's
    assert h.add(period(0, 0, gen=1)) and not h.add(period(0, 0, gen=1))  # a resent one
    assert not h.add(period(0, 2, gen=1))  # out of order
    assert list(h.complete_rounds()) == []  # ranks 1 and 2 have not reported
    for i in range(5):
        for r in range(3):
            h.add(period(r, i, gen=1))
    rounds = list(h.complete_rounds())
    assert [r for r, *_ in rounds] == [0, 1, 2, 3, 4] and h.rounds_done == 5
    assert len(h.job_history) == 4  # round 0 is warm-up: recorded, not judged, not history
    alarms = []
    for i, step_s in enumerate([0.3, 0.1, 0.3, 0.3, 0.3, 0.1, 0.3, 0.3], start=5):
        for r in range(3):
            h.add(period(r, i, gen=1, step_s=step_s))
        ((_, _, found, raised),) = list(h.complete_rounds())
        assert [f.kind for f in found] == (["slowdown"] if step_s > 0.1 else [])
        alarms += [(i, f.kind) for f in raised]
    # an alarm once a spell has lasted 2 rounds, once per spell; slow rounds stay out of the history
    assert alarms == [(8, "slowdown"), (12, "slowdown")] and len(h.job_history) == 6
    assert h.typical_step_s() == pytest.approx(0.1)


def pos(rank, phase, age, dispatched=50):
    return LoopPosition(rank, f"n{rank}", phase, dispatched, age)


def test_a_stuck_rank_is_named_after_three_step_times_and_the_heartbeat_timeout_whatever_the_window():
    step, hb = 0.1, 1.0  # limit 3 x 0.1 + 1.0 = 1.3 s, with a metrics window of 1 step or of 100 (log_every)
    stuck = [pos(0, "blocked", 5.0), pos(1, "data", 5.0, 49), pos(2, "blocked", 5.0)]
    for window in (None, 0.1, 10.0):
        assert stuck_ranks(1.25, stuck, step, hb, window) is None  # not yet
        ranks, why = stuck_ranks(1.35, stuck, step, hb, window)
        assert ranks == [1] and "rank 1 on n1 (data for 5.0 s)" in why
    # a rank that only just entered its phase is not stuck; nor one in a save (long saves are legitimate)
    assert stuck_ranks(1.7, [pos(0, "blocked", 5), pos(1, "callbacks", 1.2), pos(2, "blocked", 5)], step, hb) is None
    assert stuck_ranks(9.0, [pos(0, "blocked", 9), pos(1, "checkpoint", 9), pos(2, "blocked", 9)], step, hb) is None
    # every host busy with its own work: nobody waits for anybody
    assert stuck_ranks(9.0, [pos(r, "eval", 9) for r in range(3)], step, hb) is None


def test_a_group_blocked_inside_the_device_program_is_stuck_only_after_ten_windows():
    allb = [pos(r, "blocked", 30.0) for r in range(4)]
    step, window = 0.02, 0.2  # a window of 10 steps: a flush legitimately waits that long for the device
    assert stuck_ranks(2.5, allb, step, 1.0, window) is None  # 3 steps + hb, 1 window + hb passed: not yet
    ranks, why = stuck_ranks(3.1, allb, step, 1.0, window)  # 10 windows + hb
    assert ranks == [0, 1, 2, 3] and "inside the device program" in why and "no host can tell" in why
    # the time since the last step also counts a save before the wait: only the ranks' own wait is judged
    # (a fault-free run's first save left the last step 4.2 s old while every rank had waited 0.5 s)
    just_waiting = [pos(r, "blocked", 0.5) for r in range(4)]
    assert stuck_ranks(30.0, just_waiting, step, 1.0, window) is None
    ranks, why = stuck_ranks(30.0, [pos(r, "blocked", 3.2 + r) for r in range(4)], step, 1.0, window)
    assert ranks == [0, 1, 2, 3] and "waited for 3.2 s" in why


def test_a_rank_long_in_dispatch_waits_for_its_device_and_is_not_named():
    """Measured in a real job (test_health_jobs): at a hang inside rank 0's device program, rank 1's host sat in
    "dispatch" (its device queue full) for longer than the stuck limit while rank 0 waited at the flush. Naming
    rank 1 would restart the wrong node's process; the group is judged as a whole, later."""
    waits = [pos(0, "blocked", 30.0, 30), pos(1, "dispatch", 30.0, 25)]
    assert stuck_ranks(2.6, waits, 0.05, 1.5, 0.5) is None
    ranks, why = stuck_ranks(6.6, waits, 0.05, 1.5, 0.5)
    assert ranks == [0, 1] and "no host can tell" in why
    # a rank stuck in its data wait is still named while another waits in dispatch
    held = [pos(0, "dispatch", 30.0, 30), pos(1, "data", 30.0, 25)]
    assert stuck_ranks(2.6, held, 0.05, 1.5, 0.5)[0] == [1]


def test_loop_clock_books_each_part_and_starts_the_next_period(monkeypatch):
    t = [100.0]
    monkeypatch.setattr("jaxdist.train.efficiency.time.perf_counter", lambda: t[0])
    clock = LoopClock(samples_per_step=4, first_step=11)
    for step in range(11, 14):
        clock.enter("data")
        t[0] += 0.5
        clock.enter("dispatch")
        t[0] += 0.25
        clock.enter("callbacks", step)
        t[0] += 0.125
    clock.enter("blocked")
    t[0] += 2.0
    clock.add_window(3, 4.625)
    clock.enter("checkpoint")
    t[0] += 1.0  # still saving when the period is taken: counted up to now
    rec = clock.take_period(13)
    assert (rec["first_step"], rec["last_step"], rec["samples"], rec["train_s"]) == (11, 13, 12, 4.625)
    assert (rec["data_wait_s"], rec["dispatch_s"], rec["blocked_s"], rec["checkpoint_s"]) == (1.5, 0.75, 2.0, 1.0)
    assert rec["callbacks_s"] == 0.375 and clock.dispatched == 13 and clock.phase == "checkpoint"
    t[0] += 1.0
    nxt = clock.take_period(14)
    assert nxt["first_step"] == 14 and nxt["checkpoint_s"] == 1.0 and nxt["data_wait_s"] == 0.0


def write_health(run, periods, rounds):
    d = run / "controller"
    d.mkdir(parents=True)
    lines = [json.dumps({"record": "period", **p.to_dict()}) for p in periods]
    lines += [json.dumps({"record": "round", **r}) for r in rounds] + ['{"record": "per']  # a torn last line
    (d / "health.jsonl").write_text("\n".join(lines))
    (d / "events.jsonl").write_text(json.dumps({"event": "probe", "slow_nodes": ["n2"]}) + "\n")


def test_status_prints_a_table_per_node_and_writes_a_heat_map(tmp_path, capsys):
    periods = [period(r, i, data=0.03 if (r == 2 and i == 3) else 0.001) for i in range(4) for r in range(4)]
    finding = {"kind": "data", "rank": 2, "round": 3, "why": "rank 2 on n2 spends 0.030 s per step in data wait"}
    write_health(tmp_path, periods, [{"gen": 0, "round": 3, "step_s": 0.1, "findings": [finding]}])
    got, rounds = read_health(tmp_path)
    assert got == periods and len(rounds) == 1
    rows = node_table(got, rounds, {"slow_nodes": ["n2"]})
    assert [(r["rank"], r["flags"], r["probe"]) for r in rows] == [
        (0, "-", "ok"), (1, "-", "ok"), (2, "data@3", "slow links"), (3, "-", "ok")
    ]  # fmt: skip
    assert rows[0]["samples_per_s"] == pytest.approx(80.0) and rows[0]["step_s"] == pytest.approx(0.1)
    assert "data@3" in format_table(rows)
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "round 3: data: rank 2 on n2" in out
    png = tmp_path / "controller" / "health.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_status_of_a_run_without_records_is_one_sentence(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "health.jsonl does not exist" in err and err.count("\n") == 1


def test_health_settings_out_of_range_are_refused(capsys):
    assert main(["config", "controller.health_z=0"]) == 2
    assert "health_z > 0" in capsys.readouterr().err


def test_thresholds_follow_the_config_defaults():
    from jaxdist.config import load_config

    c = load_config(None, []).controller
    assert Thresholds(c.health_z, c.health_min_change, c.health_min_share, c.health_min_ratio) == Thresholds()


def _probe_record(compute, pair_s, seed=0):
    """A device probe's record: nodes n0..n3, ``pair_s(a, b)`` seconds per pair, a little noise."""
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(len(compute))]
    pairs = [[a, b, pair_s(a, b) * (1 + 0.05 * rng.random()), 1e9] for i, a in enumerate(nodes) for b in nodes[i + 1 :]]
    return {"nodes": nodes, "compute_s": dict(zip(nodes, compute)), "pairs": pairs}


def test_a_probe_names_a_slow_node_a_slow_link_or_a_node_whose_network_is_slow():
    base = lambda a, b: 0.002  # noqa: E731
    # compute stands out: the node, even though its pairs are slower too (its sends are late)
    v = name_probe(_probe_record([0.01, 0.01, 0.03, 0.0101], lambda a, b: 0.004 if "n2" in (a, b) else 0.002))
    assert (v["kind"], v["node"], v["link"]) == ("compute", "n2", None) and v["words"]["n2"] == "slow compute"
    # one pair stands out, neither end's compute does: that link
    v = name_probe(_probe_record([0.01] * 4, lambda a, b: 0.006 if (a, b) == ("n0", "n3") else 0.002))
    assert (v["kind"], v["node"], v["link"]) == ("link", None, ["n0", "n3"])
    assert v["words"] == {"n0": "slow link to n3", "n1": "ok", "n2": "ok", "n3": "slow link to n0"}
    # every pair of n1 is slow (three of six): n1's network
    v = name_probe(_probe_record([0.01] * 4, lambda a, b: 0.006 if "n1" in (a, b) else 0.002))
    assert (v["kind"], v["node"]) == ("link", "n1") and v["words"]["n1"] == "slow network"
    # noise within 5 % and a pair 30 % slower (below PROBE_MIN_EXCESS): nothing
    for seed in range(50):
        v = name_probe(_probe_record([0.01, 0.0102, 0.0099, 0.0101], base, seed))
        assert v["kind"] is None, v
    v = name_probe(_probe_record([0.01] * 4, lambda a, b: 0.0026 if (a, b) == ("n0", "n1") else 0.002))
    assert v["kind"] is None
    # a probe of benchmarks/health.py's job (ms): one delayed link and a noisy pair sharing a node with it
    ms = {
        ("n3", "n0"): 527.7,
        ("n1", "n2"): 1.5,
        ("n3", "n2"): 2.1,
        ("n1", "n0"): 4.8,
        ("n3", "n1"): 2.4,
        ("n2", "n0"): 1.8,
    }
    rec = {
        "compute_s": {"n3": 1.9e-3, "n1": 1.3e-3, "n2": 1.9e-3, "n0": 1.6e-3},
        "pairs": [[a, b, t / 1e3] for (a, b), t in ms.items()],
    }
    v = name_probe(rec)
    assert (v["kind"], v["node"], v["link"]) == ("link", None, ["n3", "n0"]) and "also above the others: n1-n0" in v[
        "why"
    ]


def test_status_shows_the_device_probes_word_per_node(tmp_path, capsys):
    periods = [period(r, i) for i in range(3) for r in range(4)]
    write_health(tmp_path, periods, [])
    v = name_probe(_probe_record([0.01] * 4, lambda a, b: 0.006 if (a, b) == ("n1", "n2") else 0.002))
    event = {"event": "device_probe", "step": 30, "probe_s": 1.5, "finding": v.pop("kind"), **v}
    (tmp_path / "controller" / "events.jsonl").write_text(json.dumps(event) + "\n")
    rows = node_table(*read_health(tmp_path), last_probe(tmp_path))
    assert [r["probe"] for r in rows] == ["ok", "slow link to n2", "slow link to n1", "ok"]
    assert main(["status", str(tmp_path)]) == 0
    assert "device probe at step 30 (1.50 s): n1-n2 takes" in capsys.readouterr().out


def test_the_controller_asks_every_member_once_records_the_verdict_and_evicts_only_when_told(tmp_path):
    from types import SimpleNamespace

    from jaxdist.controller.health_actions import HealthActions
    from jaxdist.controller.state import EventLog, JobState

    class Fake(HealthActions):
        def __init__(self, evict):
            self.state = JobState("j", phase="running", generation=3, members={0: "n0", 1: "n1", 2: "n2", 3: "n3"})
            self.cc = SimpleNamespace(health_z=5.0, evict_slow=evict)
            self.dir, self.events, self.sent, self.acted = tmp_path, EventLog(tmp_path / f"ev{evict}.jsonl"), [], []
            self.endpoint = SimpleNamespace(send=lambda ident, msg: self.sent.append((ident, msg)))

        def _member_worker(self, r):
            return SimpleNamespace(identity=f"w:n{r}:{100 + r}")

        def _ban(self, node, why):
            self.acted.append(("ban", node))

        def _fail(self, failures, now):
            self.acted.append(("fail", [(f.kind, f.node, f.rank) for f in failures]))

    record = _probe_record([0.01, 0.01, 0.01, 0.01], lambda a, b: 0.006 if "n2" in (a, b) else 0.002)
    for evict in (False, True):
        c = Fake(evict)
        c._probe_devices("slow")
        c._probe_devices("slow again")  # one probe at a time
        assert [i for i, _ in c.sent] == [f"w:n{r}:{100 + r}" for r in range(4)]
        assert {m["id"] for _, m in c.sent} == {1} and c.sent[0][1]["nodes"] == ["n0", "n1", "n2", "n3"]
        c._on_device_probe({"id": 1, "step": 9, "seconds": 1.2, "ring_s": 0.01, "allreduce_s": 0.02, **record})
        c._on_device_probe({"id": 1, **record})  # resent with the next heartbeat: once
        (e,) = [e for e in c.events.events if e["event"] == "device_probe"]
        assert (e["finding"], e["node"], e["step"], len(e["pairs"])) == ("link", "n2", 9, 6)
        assert c.acted == ([("ban", "n2"), ("fail", [("evicted", "n2", 2)])] if evict else [])
        (line,) = [json.loads(x) for x in (tmp_path / "health.jsonl").read_text().splitlines()][-1:]
        assert line["record"] == "probe" and line["words"]["n2"] == "slow network"


def test_the_partly_slow_first_rounds_of_a_spell_stay_out_of_the_history():
    # Normal rounds 0.10 +- 0.01 s (history MAD 0.01: abnormal beyond ~0.174 s), then a spell whose first rounds
    # are only partly slow (within 5 MADs, beyond min_change): joining the history, they hid the spell (0.2 s).
    h = HealthHistory(gen=0, ranks=4)
    steps = [0.1, 0.09, 0.11, 0.1, 0.09, 0.11, 0.1, 0.11, 0.09, 0.16, 0.165, 0.17, 0.2, 0.2, 0.2]
    found_at = []
    for i, s in enumerate(steps):
        for r in range(4):
            h.add(period(r, i, step_s=s))
        ((_, _, found, _),) = list(h.complete_rounds())
        found_at += [i for f in found if f.kind == "slowdown"]
    assert found_at == [12, 13, 14]
    assert max(x["step_s"] for x in h.job_history) == pytest.approx(0.11)


def test_a_probe_names_a_far_slower_link_over_a_noisy_compute_test():
    # a probe of benchmarks/health.py's job (ms): one node's compute test 2x the others' on the busy host (a
    # millisecond more), the delayed link 250x the other pairs (half a second more): the link explains the step
    ms = {
        ("n0", "n2"): 1.9,
        ("n3", "n1"): 2.0,
        ("n0", "n1"): 1.5,
        ("n3", "n2"): 2.0,
        ("n0", "n3"): 522.3,
        ("n1", "n2"): 2.4,
    }
    rec = {"compute_s": {"n0": 0.9e-3, "n3": 2.06e-3, "n1": 0.8e-3, "n2": 1.9e-3}}
    rec["pairs"] = [[a, b, t / 1e3] for (a, b), t in ms.items()]
    v = name_probe(rec)
    assert (v["kind"], v["node"], v["link"]) == ("link", None, ["n0", "n3"])
    rec["compute_s"]["n3"] = 0.6  # a compute test 600 ms slower: the node
    assert (name_probe(rec)["kind"], name_probe(rec)["node"]) == ("compute", "n3")


def test_median_mad_of_others_equals_each_median_mad_without_the_value():
    """The O(N log N) leave-one-out median and MAD give exactly (bit for bit) what a median of the N - 1 others
    gives, for odd and even counts, ties, and a few ranks."""
    from jaxdist.controller.health import median_mad, median_mad_of_others

    rng = random.Random(5)
    for n in (2, 3, 4, 5, 8, 9, 33, 64):
        for ties in (False, True):
            values = [round(rng.uniform(0, 1), 1 if ties else 6) for _ in range(n)]
            want = [median_mad(values[:i] + values[i + 1 :]) for i in range(n)]
            assert median_mad_of_others(values) == want, (n, values)

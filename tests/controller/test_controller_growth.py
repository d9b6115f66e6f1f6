"""How the controller's work per heartbeat and per judgment (``tick``) grows with the node count, counted.

The controller runs in this process (no agents): N nodes register and check their links, each with a warm
worker; generation 0 starts on all of them and every member reports training.  Counted, not timed: the
entries that walks over the controller's whole worker tables visit (every worker, the per-node and the
per-rank index) while it handles one round of heartbeats and judges the job ``TICKS`` times.  At N = 32, 64
and 128 the count per node must stay flat; the lookups it replaced (every worker walked for each node or
rank, each tick) made it grow with N: 1,397, 2,773 and 5,525 per node (now 0: lookups go through the indexes).
"""

from __future__ import annotations

import os
import time

import pytest

from jaxdist.config import load_config
from jaxdist.controller.controller import Controller
from jaxdist.controller.local import write_cpu_cluster

TICKS = 20


class CountingDict(dict):
    """A dict that counts the entries every full walk over it visits (values, items, keys, iteration)."""

    visited = 0

    def values(self):
        CountingDict.visited += len(self)
        return super().values()

    def items(self):
        CountingDict.visited += len(self)
        return super().items()

    def __iter__(self):
        CountingDict.visited += len(self)
        return super().__iter__()


def _node_hb(name: str, pid: int) -> dict:
    return {
        "t": "node_hb",
        "node": name,
        "host": "127.0.0.1",
        "checks": {"ok": True, "disk": "ok", "devices": 1},
        "probe": "127.0.0.1:1",
        "free_port": 2,
        "procs": [{"pid": pid, "role": "spare", "gen": -1, "rank": -1, "rc": None}],
        "welcomed": True,
    }


def _hb(name: str, pid: int, state: str, gen: int = -1, rank: int = -1, step: int = 0) -> dict:
    return {"t": "hb", "node": name, "pid": pid, "state": state, "gen": gen, "rank": rank, "step": step}


def running_controller(tmp_path, n: int, counting: bool = False) -> tuple[Controller, dict[str, int]]:
    """A controller in this process whose generation 0 runs on ``n`` nodes (each member reported a step);
    the pid of each node's worker.  ``counting``: its worker tables count the entries their walks visit."""
    cluster = write_cpu_cluster(tmp_path / f"c{n}.toml", n, 1)
    cfg = load_config(
        None,
        [
            "model=tiny",
            f"mesh.cluster={cluster}",
            f"train.batch_size={n}",
            "train.seq_len=32",
            f"train.runs_dir={tmp_path / f'runs{n}'}",
            "controller.worker_command={python} -c pass",
            "controller.start_grace=0",
        ],
    )
    ctl = Controller(cfg, [])
    if counting:
        ctl.workers = CountingDict()
        ctl.node_workers = CountingDict()
        ctl.rank_workers = CountingDict()
    names = [f"n{i:04d}" for i in range(n)]
    pid = {name: 1000 + i for i, name in enumerate(names)}
    for name in names:
        ctl.handle(f"n:{name}", _node_hb(name, pid[name]))
        ctl.handle(f"n:{name}", {"t": "probe_result", "node": name, "rtt": {name: 0.001}})
        ctl.handle(f"w:{name}:{pid[name]}", _hb(name, pid[name], "warm"))
    ctl.tick(time.monotonic())  # starts generation 0 on every node
    s = ctl.state
    assert s.generation == 0 and len(s.members) == n, ctl.state
    CountingDict.visited = 0
    for r, name in s.members.items():  # one round of heartbeats: every node, every member training
        ctl.handle(f"n:{name}", _node_hb(name, pid[name]))
        ctl.handle(f"w:{name}:{pid[name]}", _hb(name, pid[name], "training", 0, r, 1))
    assert s.phase == "running"
    return ctl, pid


def close(ctl: Controller) -> None:
    ctl.endpoint.close()
    ctl.run_lock.release()


def visits_per_node(tmp_path, n: int) -> float:
    ctl, _ = running_controller(tmp_path, n, counting=True)
    try:
        now = time.monotonic()
        for i in range(TICKS):  # a judgment each (a tick judges the running job every heartbeat interval)
            ctl.tick(now + i * ctl.cc.heartbeat_interval)
        return CountingDict.visited / n
    finally:
        close(ctl)


@pytest.mark.skipif(os.name != "posix", reason="the controller's run lock and sockets are POSIX")
def test_the_controllers_lookups_grow_linearly_with_the_nodes(tmp_path):
    counts = {n: visits_per_node(tmp_path, n) for n in (32, 64, 128)}
    # flat per node (a few visits per node and tick); a scan of every worker per node or rank would give
    # ~N x TICKS per node: 4x more at 128 than at 32
    assert counts[128] <= 1.2 * counts[32] + 1, counts
    assert counts[128] < 128 * TICKS / 4, counts


class CountingList(list):
    """A list that counts ``len()`` calls (the per-rank checks of a walk over the ranks' period lists)."""

    checks = 0

    def __len__(self):
        CountingList.checks += 1
        return super().__len__()


def period_checks_per_period(n: int, monkeypatch, rounds: int = 12) -> tuple[float, float]:
    """The health history of ``n`` ranks, asked for complete rounds after every period, as the controller does
    (and judging every round after the warm-up): per period received, the per-rank checks of whether a round is
    complete, and the reads of a period's part (``Period.per_step``: what judging a rank against the others
    reads)."""
    from jaxdist.controller.health import HealthHistory, Period

    reads = [0]
    per_step = Period.per_step

    def counted(self, part):
        reads[0] += 1
        return per_step(self, part)

    monkeypatch.setattr(Period, "per_step", counted)
    h = HealthHistory(0, n)
    h.periods = CountingDict()
    CountingDict.visited = CountingList.checks = 0
    done = 0
    for i in range(rounds):
        for r in range(n):
            h.periods.setdefault(r, CountingList())
            assert h.add(Period(0, r, f"n{r}", i, 10 * i + 1, 10 * i + 10, 0.0, 80, 1.0 + r / n, blocked_s=0.9))
            done += len(list(h.complete_rounds()))
    assert done == rounds
    return (CountingDict.visited + CountingList.checks) / (n * rounds), reads[0] / (n * rounds)


def test_the_health_rounds_cost_a_constant_per_period_at_any_rank_count(monkeypatch):
    """Per period received, at 32, 128 and 512 ranks over 12 rounds.  Before: each period walked every rank's
    list (``all(len(v) > done ...)``), 49, 181 and 709 checks; judging each rank against the median of the
    others read every other rank's parts, 98, 362 and 1,418 reads (N^2 a round).  Now 2 checks and 12.3 reads
    at every count."""
    counts = {n: period_checks_per_period(n, monkeypatch) for n in (32, 128, 512)}
    checks, reads = ({n: c[k] for n, c in counts.items()} for k in (0, 1))
    assert checks[512] <= 1.2 * checks[32] + 1 and checks[512] < 8, counts
    assert reads[512] <= 1.2 * reads[32] + 1 and reads[512] < 16, counts


def test_the_event_log_keeps_a_bounded_tail_in_memory_and_every_event_on_disk(tmp_path):
    from jaxdist.controller.state import EVENTS_KEPT, EventLog, read_events

    log = EventLog(tmp_path / "events.jsonl")
    for i in range(EVENTS_KEPT + 5):
        log.add("tick", i=i)
    assert [e["i"] for e in log.events] == list(range(5, EVENTS_KEPT + 5))
    assert [e["i"] for e in read_events(tmp_path / "events.jsonl")] == list(range(EVENTS_KEPT + 5))


@pytest.mark.skipif(os.name != "posix", reason="the controller's run lock and sockets are POSIX")
def test_a_running_job_is_judged_every_heartbeat_interval_and_at_once_after_an_exit(tmp_path):
    """Each judgment of a running job walks every member (O(nodes)): at 1,024 nodes, one every tick (0.05 s) was
    half the controller's time.  Now one per heartbeat interval while nothing happens (a silence is measured to
    a heartbeat interval anyway), and the next tick after a member's exit report."""
    ctl, pid = running_controller(tmp_path, 8)
    judged = [0]
    check = ctl._check_generation

    def counted(now):
        judged[0] += 1
        return check(now)

    ctl._check_generation = counted
    try:
        now, tick = time.monotonic(), 0.05
        for i in range(20):  # 1 s of ticks, nothing happening (and no member silent for heartbeat_timeout yet)
            ctl.tick(now + i * tick)
        assert ctl.state.phase == "running"
        assert 1 / ctl.cc.heartbeat_interval - 1 <= judged[0] <= 1 / ctl.cc.heartbeat_interval + 1, judged  # not 20
        name = ctl.state.members[3]
        ctl.handle(f"n:{name}", {**_node_hb(name, pid[name]), "procs": [{"pid": pid[name], "rc": -9}]})
        ctl.tick(now + 20 * tick)  # the very next tick, though the last judgment was under an interval ago
        assert ctl.state.phase == "recovering" and ctl.state.current.end.startswith("failed"), ctl.state
    finally:
        close(ctl)


@pytest.mark.skipif(os.name != "posix", reason="the controller's run lock and sockets are POSIX")
def test_the_efficiency_records_a_heartbeat_resends_are_not_read_again(tmp_path, monkeypatch):
    """A heartbeat carries each record for a few beats: the copies the controller has are skipped unread."""
    from jaxdist.controller.health import Period

    ctl, pid = running_controller(tmp_path, 2)
    reads = [0]
    from_dict = Period.from_dict.__func__

    def counted(cls, d):
        reads[0] += 1
        return from_dict(cls, d)

    monkeypatch.setattr(Period, "from_dict", classmethod(counted))
    try:
        name = ctl.state.members[0]
        records = [Period(0, 0, name, i, 10 * i + 1, 10 * i + 10, time.time(), 10, 1.0).to_dict() for i in range(4)]
        for _ in range(5):  # the same four records on five heartbeats
            ctl.handle(f"w:{name}:{pid[name]}", {**_hb(name, pid[name], "training", 0, 0, 2), "periods": records})
        assert reads[0] == 4 and len(ctl.health.periods[0]) == 4
    finally:
        close(ctl)


def test_the_controllers_load_meter_reports_rate_busy_share_and_percentiles(monkeypatch):
    """state.json's ``controller_load``: 1,000 messages in a 10 s window, each handled in 10 us but one in 5 ms,
    each read 2 ms after it was signed, 9 s of the 10 spent waiting for messages."""
    from jaxdist.controller import state as st

    clock = {"mono": 100.0, "wall": 1e9}
    monkeypatch.setattr(st.time, "monotonic", lambda: clock["mono"])
    monkeypatch.setattr(st.time, "time", lambda: clock["wall"])
    meter = st.LoadMeter()
    for i in range(1000):
        meter.message(5e-3 if i == 500 else 10e-6, clock["wall"] - 2e-3)
    assert meter.snapshot(waited_s=1.0) == {}  # under WINDOW_S: nothing yet
    clock["mono"] += 10.0
    got = meter.snapshot(waited_s=9.0)
    assert got["messages_per_s"] == 100.0 and got["busy"] == 0.1
    assert got["handle_us_p50"] == 10.0 and got["handle_us_p99"] == 10.0  # one slow message in 1,000 is not p99
    assert got["lag_ms_p50"] == got["lag_ms_p99"] == 2.0
    for _ in range(50):
        meter.message(5e-3, clock["wall"] - 0.5)
    clock["mono"] += 10.0
    late = meter.snapshot(waited_s=9.0 + 1.0)
    assert late["handle_us_p99"] == 5000.0 and late["lag_ms_p99"] == 500.0 and late["busy"] == 0.9

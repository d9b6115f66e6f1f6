"""The controller's pure decisions against brute force and hand-worked cases."""

from __future__ import annotations

import itertools
import math

import pytest

from jaxdist.config import load_config
from jaxdist.controller.policy import (
    PROBE_PEERS,
    TERM_GRACE_S,
    Failure,
    WorkerView,
    choose_group_size,
    disconnect_grace,
    find_failures,
    group_size_error,
    grown_plan,
    lineage,
    lost_steps,
    plan_replacement,
    probe_peers,
    process_failure_verdict,
    slow_nodes,
    valid_group_sizes,
)

TIMEOUTS = dict(heartbeat_timeout=1.5, progress_timeout=30.0, start_timeout=100.0)


def _brute_valid(fsdp: int, tensor: int, batch: int, per_node: int, n: int) -> bool:
    """Plain statement of the rule: data fills the devices; the batch splits over data*fsdp;
    tensor stays inside a node; data*fsdp splits over the nodes."""
    devices = n * per_node
    if devices % (fsdp * tensor):
        return False
    data = devices // (fsdp * tensor)
    return batch % (data * fsdp) == 0 and per_node % tensor == 0 and (data * fsdp) % n == 0


@pytest.mark.parametrize(
    "fsdp,tensor,batch,per_node",
    [(1, 1, 16, 2), (2, 1, 16, 2), (1, 2, 16, 2), (2, 2, 24, 4), (1, 4, 12, 2), (4, 1, 16, 2)],
)
def test_valid_group_sizes_match_brute_force(fsdp, tensor, batch, per_node):
    cfg = load_config(
        None,
        ["model=tiny", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}", f"train.batch_size={batch}", "train.seq_len=32"],
    )
    got = valid_group_sizes(cfg, per_node, 8)
    want = [n for n in range(1, 9) if _brute_valid(fsdp, tensor, batch, per_node, n)]
    assert got == want


def test_group_size_error_says_why():
    cfg = load_config(None, ["model=tiny", "train.batch_size=16", "train.seq_len=32"])
    assert group_size_error(cfg, 4, 2) is None
    assert "not divisible by the data axes data*fsdp=6" in group_size_error(cfg, 3, 2)
    cfg = load_config(None, ["model=tiny", "mesh.tensor=4", "train.batch_size=16", "train.seq_len=32"])
    assert "does not fit in a node of 2 devices" in group_size_error(cfg, 2, 2)


def test_choose_group_size_is_the_largest_valid_count_in_range():
    valid = [1, 2, 4, 8]
    for ready, lo, hi in itertools.product(range(0, 10), range(1, 5), range(1, 9)):
        if hi < lo:
            continue
        got = choose_group_size(ready, lo, hi, valid)
        fits = [n for n in valid if lo <= n <= min(ready, hi)]
        assert got == (max(fits) if fits else None), (ready, lo, hi)
    assert choose_group_size(3, 2, 4, valid) == 2  # 3 ready, 3 does not fit: start with 2, the third is a standby
    assert choose_group_size(3, 3, 4, valid) is None  # and with min_nodes=3: wait for the 4th


def _w(rank, hb, **kw):
    return WorkerView(rank, f"n{rank}", hb, **kw)


def test_find_failures_blames_exits_and_silence():
    ws = [
        _w(0, 10.0, step=5, state="training"),
        _w(1, 8.0, step=5),
        _w(2, 10.0, exit_code=-9, exited_at=9.0),
        _w(3, 10.0, exit_code=0),
    ]
    got = find_failures(10.0, ws, started_at=0.0, progress_at=9.0, **TIMEOUTS)
    assert [(f.kind, f.node, f.rank) for f in got] == [("silent", "n1", 1), ("exit", "n2", 2)]
    assert "killed by signal 9" in got[1].detail and "no heartbeat for 2.0 s" in got[0].detail
    assert (
        "exit code 3"
        in find_failures(1.0, [_w(0, 1.0, exit_code=3)], started_at=0, progress_at=None, **TIMEOUTS)[0].detail
    )
    # exactly at the timeout: still alive
    assert find_failures(11.5, [_w(0, 10.0)], started_at=0.0, progress_at=11.0, **TIMEOUTS) == []


def test_an_exit_by_sigterm_is_a_failure_only_after_the_grace():
    """scancel or a preemption signals the workers and the controller together: a worker's SIGTERM exit that
    reaches the controller first is not blamed until TERM_GRACE_S later (by then the controller has stopped)."""
    term = [_w(0, 10.0, exit_code=-15, exited_at=10.0)]
    assert find_failures(10.0 + TERM_GRACE_S - 0.1, term, started_at=0.0, progress_at=9.0, **TIMEOUTS) == []
    got = find_failures(10.0 + TERM_GRACE_S, term, started_at=0.0, progress_at=9.0, **TIMEOUTS)
    assert [(f.kind, f.rank) for f in got] == [("exit", 0)] and "killed by signal 15" in got[0].detail
    kill = [_w(0, 10.0, exit_code=-9, exited_at=10.0)]  # any other signal is blamed at once
    assert [f.kind for f in find_failures(10.0, kill, started_at=0.0, progress_at=9.0, **TIMEOUTS)] == ["exit"]


def test_an_abort_after_a_peer_died_is_its_consequence_not_a_second_failure():
    """JAX's distributed service aborts every process (SIGABRT, "another task died") within milliseconds of losing
    one -- here the coordinator, rank 0, killed; rank 2's abort may be reported first or in the same batch. Only
    the cause is blamed; an abort alone is blamed once the disconnect grace passed without a cause."""
    kw = dict(started_at=0.0, progress_at=9.0, **TIMEOUTS)
    killed, aborted = _w(0, 10.0, exit_code=-9, exited_at=10.0), _w(2, 10.0, exit_code=-6, exited_at=10.0)
    for ws in ([killed, aborted], [aborted, killed]):
        got = find_failures(10.0, ws, **kw)
        assert [(f.kind, f.rank) for f in got] == [("exit", 0)], got
    assert find_failures(10.1, [_w(1, 10.0), aborted], **kw) == []  # the cause may still be reported
    got = find_failures(10.3, [_w(1, 10.0), aborted], **kw)  # none came: the abort was the failure
    assert [(f.kind, f.rank) for f in got] == [("exit", 2)] and "killed by signal 6" in got[0].detail
    # the cause is a lost connection (a node gone): the abort waits with it, and is never blamed
    lost = _w(0, 9.9, connected=False, disconnected_at=9.95)
    assert find_failures(10.1, [lost, aborted], **kw) == []
    assert [(f.kind, f.rank) for f in find_failures(10.3, [lost, aborted], **kw)] == [("silent", 0)]
    # aborts only: every one is blamed, as before
    both = [aborted, _w(3, 10.0, exit_code=-6, exited_at=10.0)]
    assert [f.rank for f in find_failures(10.5, both, **kw)] == [2, 3]


def test_connections_dropped_in_bulk_wait_a_heartbeat_timeout_before_they_count():
    """A stall of the controller's host (or the network) drops many connections at once and ZeroMQ reconnects
    them after it: from MASS_DROP_MIN members and MASS_DROP_SHARE of the group, a dropped connection waits
    heartbeat_timeout, not one heartbeat interval. Exits, old drops and a single drop do not count."""
    interval, timeout = 0.25, 1.5
    group = [_w(r, 10.0) for r in range(100)]
    assert disconnect_grace(10.0, group, interval, timeout) == interval
    few = [_w(r, 10.0, connected=False, disconnected_at=9.9) if r < 4 else w for r, w in enumerate(group)]
    assert disconnect_grace(10.0, few, interval, timeout) == interval  # 4 of 100: below 5 %
    bulk = [_w(r, 10.0, connected=False, disconnected_at=9.9) if r < 5 else w for r, w in enumerate(group)]
    assert disconnect_grace(10.0, bulk, interval, timeout) == timeout  # 5 of 100
    assert disconnect_grace(11.39, bulk, interval, timeout) == timeout
    assert disconnect_grace(11.41, bulk, interval, timeout) == interval  # dropped longer ago than the timeout
    exited = [
        _w(r, 10.0, exit_code=-9, exited_at=9.9, disconnected_at=9.9) if r < 5 else w for r, w in enumerate(group)
    ]
    assert disconnect_grace(10.0, exited, interval, timeout) == interval  # exits are not drops of live processes
    small = [_w(0, 10.0, connected=False, disconnected_at=9.9), *[_w(r, 10.0) for r in range(1, 5)]]
    assert disconnect_grace(10.0, small, interval, timeout) == interval  # 1 of 5: MASS_DROP_MIN is 4
    # with the longer grace, find_failures waits: none failed at 0.5 s after the drop, all 5 at the timeout
    kw = dict(started_at=0.0, progress_at=9.9, heartbeat_timeout=timeout, progress_timeout=30.0, start_timeout=99.0)
    assert find_failures(10.4, bulk, disconnect_grace=disconnect_grace(10.4, bulk, interval, timeout), **kw) == []
    late = find_failures(11.45, bulk, disconnect_grace=interval, **kw)
    assert [f.rank for f in late] == [0, 1, 2, 3, 4]


def test_find_failures_tells_a_busy_process_from_a_stopped_one():
    kw = dict(started_at=0.0, progress_at=99.0, heartbeat_grace=15.0, **TIMEOUTS)
    # heartbeats 5 s late, but the connection still answers ZeroMQ heartbeats: busy (GIL held), not failed
    assert find_failures(100.0, [_w(0, 95.0, state="training", connected=True)], **kw) == []
    assert [f.kind for f in find_failures(100.0, [_w(0, 84.0, state="training", connected=True)], **kw)] == ["silent"]
    # the same lateness without a connection to vouch for it: failed after heartbeat_timeout
    assert [f.kind for f in find_failures(100.0, [_w(0, 98.0, state="training")], **kw)] == ["silent"]
    # starting (importing, compiling): the grace applies
    assert find_failures(100.0, [_w(0, 90.0, state="restoring")], **kw) == []
    # the connection dropped (a stopped process): failed once the node had time to report an exit
    stopped = _w(0, 99.5, state="training", connected=False, disconnected_at=99.9)
    assert find_failures(100.0, [stopped], **kw) == []
    got = find_failures(100.3, [stopped], **kw)
    assert [f.kind for f in got] == ["silent"] and "stopped answering heartbeats" in got[0].detail
    # done: silence and exit codes no longer matter
    assert find_failures(200.0, [_w(0, 10.0, state="done"), _w(1, 10.0, state="done", exit_code=-9)], **kw) == []


def test_find_failures_group_stall_and_start_timeout_blame_no_node():
    ws = [_w(0, 50.0, step=7), _w(1, 50.0, step=7)]
    assert find_failures(50.0, ws, started_at=0.0, progress_at=19.0, **TIMEOUTS) == [
        Failure("stalled", None, None, "no step progress for 31 s")
    ]
    assert find_failures(50.0, ws, started_at=0.0, progress_at=21.0, **TIMEOUTS) == []
    assert [f.kind for f in find_failures(150.0, [_w(0, 150.0)], started_at=49.0, progress_at=None, **TIMEOUTS)] == [
        "start_timeout"
    ]
    # one finished, the other not yet: the job is ending, nothing failed
    assert find_failures(99.0, [_w(0, 99.0, exit_code=0), _w(1, 99.0)], started_at=0, progress_at=1.0, **TIMEOUTS) == []


def test_plan_replacement():
    members = {0: "a", 1: "b", 2: "c", 3: "d"}
    # the standby takes the failed rank; the others keep theirs
    assert plan_replacement(members, {"a"}, ["s1", "s2"], set()) == {0: "s1", 1: "b", 2: "c", 3: "d"}
    assert plan_replacement(members, {"b", "d"}, ["s1", "s2"], set()) == {0: "a", 1: "s1", 2: "c", 3: "s2"}
    # banned candidates are skipped; with no standby left the failed node takes its rank back
    assert plan_replacement(members, {"c"}, ["s1"], {"s1"}) == {0: "a", 1: "b", 2: "c", 3: "d"}
    # ... unless it is banned too
    assert plan_replacement(members, {"c"}, ["s1"], {"s1", "c"}) is None
    # a group failure without blame restarts the same nodes
    assert plan_replacement(members, set(), ["s1"], set()) == members
    # a member is never doubled
    assert plan_replacement(members, {"a"}, ["b", "s1"], set()) == {0: "s1", 1: "b", 2: "c", 3: "d"}


def test_grown_plan_takes_standbys_up_to_the_largest_valid_group():
    plan = {0: "a", 1: "b"}
    # sizes 1, 2, 4 fit (batch 16 on 2-device nodes): 3 standbys -> 4 ranks, the new ones after the old
    assert grown_plan(plan, ["a", "s1", "s2", "s3"], 1, 8, [1, 2, 4]) == {0: "a", 1: "b", 2: "s1", 3: "s2"}
    assert grown_plan(plan, ["s1"], 1, 8, [1, 2, 4]) == plan  # 3 does not fit: no growth
    assert grown_plan(plan, ["s1", "s2"], 1, 3, [1, 2, 3, 4]) == {0: "a", 1: "b", 2: "s1"}  # max_nodes=3
    assert grown_plan(plan, [], 1, 8, [1, 2, 4]) == plan


def test_slow_nodes_finds_the_node_in_every_slow_pair():
    nodes = ["a", "b", "c", "d"]
    rtt = {(x, y): 0.001 for x in nodes for y in nodes}
    assert slow_nodes(rtt) == []
    for x in nodes:
        rtt[(x, "c")] = rtt[("c", x)] = 0.05
    assert slow_nodes(rtt) == ["c"]
    assert slow_nodes({("a", "b"): 1.0, ("b", "a"): 1.0}) == []  # two nodes: cannot tell which


def test_probe_peers_are_linear_in_the_node_count_and_still_find_the_slow_node():
    """Each node pings itself and the PROBE_PEERS nodes before it (cyclically): N x (PROBE_PEERS + 1) pings, not
    N^2, every node in 2 x PROBE_PEERS pairs -- and over that ring slow_nodes still names a slow node alone."""
    assert probe_peers(["a", "b", "c"], "a") == ["a", "c", "b"]  # small: everyone, itself first
    assert probe_peers(["a"], "a") == ["a"] and probe_peers(["a"], "z") == ["z"]
    names = [f"n{i:03d}" for i in range(300)]
    assert probe_peers(names, "n100") == ["n100", *[f"n{i:03d}" for i in range(99, 99 - PROBE_PEERS, -1)]]
    assert probe_peers(names, "n001", 3) == ["n001", "n000", "n299", "n298"]
    for n in (16, 64, 256):
        ring = names[:n]
        pairs = [(a, b) for a in ring for b in probe_peers(ring, a)]
        assert len(pairs) == n * (PROBE_PEERS + 1)
        pinged = {b: sum(1 for a, x in pairs if x == b and a != b) for b in ring}
        assert set(pinged.values()) == {PROBE_PEERS}  # every node is checked by the same number of others
        rtt = {(a, b): (0.05 if "n007" in (a, b) else 0.001) for a, b in pairs if a != b}
        assert slow_nodes(rtt) == ["n007"]


def test_lineage_is_each_batch_once_exactly_when_resumes_are_consistent():
    # uninterrupted
    assert lineage([(0, 20)], 20) == list(range(20))
    # failed at step 9 with step 8 committed, resumed from 8; then failed at 15, resumed from 15
    assert lineage([(0, 9), (8, 15), (15, 20)], 20) == list(range(20))
    # resuming from an older checkpoint recomputes, still each batch once in the final lineage
    assert lineage([(0, 9), (5, 20)], 20) == list(range(20))
    # a group that resumed beyond what was ever trained would skip batches: the gap shows
    got = lineage([(0, 9), (11, 20)], 20)
    assert sorted(set(range(20)) - set(got)) == [9, 10]
    assert lost_steps(9, 8) == 1 and lost_steps(8, 8) == 0 and math.isclose(lost_steps(3, 5), 0)


def test_a_rank_that_crashes_on_one_healthy_node_moves_once_before_any_ban():
    """Issue 35 item 6: four rank-0 crashes on node a (max_process_failures=4) banned a healthy node. Now the
    rank moves once; a node failing from two ranks is banned; a rank failing on two nodes stops the job."""
    log = [(0, "a")] * 3
    assert process_failure_verdict(log, 4).action == "stay"  # crashed_rank=same_node keeps it on a
    assert process_failure_verdict(log + [(0, "a")], 4).action == "move"  # the 4th: move rank 0, a not banned
    moved = log + [(0, "a"), (0, "e")]  # it fails on e as well: the rank, not the node
    v = process_failure_verdict(moved, 4)
    assert v.action == "give_up" and "rank 0" in v.why and "4 on a, 1 on e" in v.why
    # a node failing from ranks 0 and 2: the node's fault
    v = process_failure_verdict([(0, "a"), (0, "a"), (2, "a"), (2, "a")], 4)
    assert v.action == "ban" and "ranks [0, 2]" in v.why
    # moved off a, then rank 1 lands on a and fails there: a fails from two ranks
    assert process_failure_verdict(log + [(0, "a"), (1, "a")], 4).action == "ban"
    # no other node to take it: it came back to a; stops after 2 x limit rather than looping
    assert process_failure_verdict([(0, "a")] * 7, 4).action == "move"
    assert process_failure_verdict([(0, "a")] * 8, 4).action == "give_up"
    # failures spread over ranks and nodes below the limit: nothing
    assert process_failure_verdict([(0, "a"), (1, "b"), (2, "c"), (3, "d")], 4).action == "stay"


def test_a_ban_cools_down_doubling_with_each_ban_and_zero_is_for_good():
    from jaxdist.controller.policy import ban_ends, bans_over

    assert [ban_ends(100.0, 30.0, k) for k in (1, 2, 3)] == [130.0, 160.0, 220.0]
    assert ban_ends(100.0, 0.0, 1) is None
    until = {"a": 130.0, "b": 160.0}
    assert bans_over(["a", "b", "c"], until, 129.9) == []
    assert bans_over(["a", "b", "c"], until, 130.0) == ["a"]  # "c" has no end: banned for good
    assert bans_over(["b", "a", "c"], until, 1e9) == ["b", "a"]


def test_a_smaller_group_keeps_every_old_ranks_local_files_when_it_can():
    """Old rank r's local-tier files are on its node and rank r+1's: of 4 nodes with c lost, the group of 2
    is b and d (a and b, the first two, hold nothing of rank 2's). Against brute force on random rings."""
    import itertools
    import random

    from jaxdist.controller.policy import _ring_cover, covering_group

    members = dict(enumerate("abcd"))
    assert covering_group(members, ["a", "b", "d"], 2) == ["b", "d"]
    assert covering_group(members, ["a", "b", "d", "e"], 3) == ["a", "b", "d"]  # covered, filled in order
    assert covering_group(members, ["a", "d", "e"], 2) == ["a", "d"]  # b and c gone: nothing covers rank 1

    def smallest(allowed):
        spots = [i for i, a in enumerate(allowed) if a]
        for k in range(len(spots) + 1):
            for pick in itertools.combinations(spots, k):
                if all(i in pick or (i + 1) % len(allowed) in pick for i in range(len(allowed))):
                    return k
        return None

    rng = random.Random(1)
    for _ in range(2000):
        allowed = [rng.random() < 0.8 for _ in range(rng.randint(2, 9))]
        cover, best = _ring_cover(allowed), smallest(allowed)
        assert (cover is None) == (best is None), allowed
        if cover is not None:
            assert len(cover) == best and all(allowed[i] for i in cover)
            assert all(i in cover or (i + 1) % len(allowed) in cover for i in range(len(allowed)))


def test_group_size_problem_says_which_counts_cannot_train_and_why():
    """The one sentence a job start gets when no node count in [min_nodes, max_nodes] fits: the counts, the reason
    of the largest one (the brute-force rule above: 3 nodes of 2 devices give data=6, which does not divide 16)."""
    from jaxdist.controller.policy import group_size_problem

    cfg = load_config(None, ["model=tiny", "train.batch_size=16", "train.seq_len=32"])
    valid = valid_group_sizes(cfg, 2, 8)
    assert valid == [n for n in range(1, 9) if _brute_valid(1, 1, 16, 2, n)] == [1, 2, 4, 8]
    assert group_size_problem(cfg, 2, 8, 2, valid) is None
    assert group_size_problem(cfg, 8, 8, 2, valid) is None  # exactly min_nodes fits
    assert group_size_problem(cfg, 5, 4, 2, [1, 2, 4]) == (
        "controller.min_nodes=5 asks for more than the 4 nodes the job may use (mesh.cluster=cpu-8, or "
        "controller.max_nodes): lower controller.min_nodes."
    )
    msg = group_size_problem(cfg, 3, 3, 2, [1, 2])  # min = max = 3 does not fit: the reason for 3 nodes
    assert msg.startswith("no node count from controller.min_nodes=3 to 3 fits the mesh and batch (")
    assert "not divisible by the data axes data*fsdp=6" in msg
    assert msg.endswith("): change the mesh, the batch or the node counts.")


def test_group_size_error_names_the_node_local_axes_and_valid_sizes_stop_at_upto():
    cfg = load_config(None, ["model=tiny", "mesh.tensor=4", "train.batch_size=16", "train.seq_len=32"])
    # context is 1: named only when it takes part
    assert group_size_error(cfg, 2, 2) == "tensor*expert*pipeline = 4 does not fit in a node of 2 devices"
    cfg = load_config(None, ["model=tiny", "train.batch_size=16", "train.seq_len=32"])
    assert valid_group_sizes(cfg, 2, 3) == [1, 2]  # 4 fits too, but past upto


def test_find_failures_at_the_exact_limits_and_who_is_blamed():
    """Each limit is a strict 'more than': exactly at it nothing has failed yet; a dropped connection blames its
    own node and rank; a finished worker does not hide a crashed one."""
    kw = dict(started_at=0.0, progress_at=99.0, **TIMEOUTS)
    stopped = _w(3, 99.5, state="training", connected=False, disconnected_at=99.75)
    assert find_failures(100.0, [stopped], **kw) == []  # exactly disconnect_grace (0.25 s) after
    got = find_failures(100.5, [stopped], **kw)
    assert [(f.kind, f.node, f.rank) for f in got] == [("silent", "n3", 3)]
    # no first step: exactly start_timeout (100 s) after the start is not yet a failure
    assert find_failures(149.0, [_w(0, 149.0)], started_at=49.0, progress_at=None, **TIMEOUTS) == []
    got = find_failures(150.0, [_w(0, 150.0)], started_at=49.0, progress_at=None, **TIMEOUTS)
    assert got == [Failure("start_timeout", None, None, "no first step 101 s after the start")]
    # no progress for exactly progress_timeout (30 s): not yet stalled
    assert find_failures(50.0, [_w(0, 50.0)], started_at=0.0, progress_at=20.0, **TIMEOUTS) == []
    # rank 0 done, rank 1 killed: the crash is still a failure
    got = find_failures(10.0, [_w(0, 10.0, state="done"), _w(1, 10.0, exit_code=-9)], **kw)
    assert [(f.kind, f.node, f.rank) for f in got] == [("exit", "n1", 1)]


def test_grown_plan_never_shrinks_or_fails_when_no_larger_group_fits():
    plan = {0: "a", 1: "b", 2: "c"}
    # max_nodes=3 with sizes 1, 2, 4: the largest fit (2) is below the plan's 3: the plan stays as it is
    assert grown_plan(plan, ["d", "e"], 1, 3, [1, 2, 4]) == plan
    # min_nodes=4 cannot be met by the ready nodes: no group size at all, the plan stays
    assert grown_plan({0: "a", 1: "b"}, [], 4, 4, [4]) == {0: "a", 1: "b"}


def test_slow_nodes_at_the_factor_and_with_three_nodes():
    """A node is slow when its median round trip is MORE than factor (default 3) x the median node's; three nodes
    are enough to tell which; a node is judged from every pair it is in, first or second."""
    nodes = "abcde"

    def ring(slow_t, slow_first):
        rtt = {}
        for x, y in itertools.combinations(nodes, 2):
            t = slow_t if "e" in (x, y) else 1.0
            rtt[(y, x) if slow_first and y == "e" else (x, y)] = t
        return rtt

    for first in (False, True):
        assert slow_nodes(ring(3.5, first)) == ["e"]  # 3.5 x the median (1.0)
        assert slow_nodes(ring(3.0, first)) == []  # exactly 3 x: not more
    three = {("a", "b"): 1.0, ("a", "c"): 10.0, ("b", "c"): 10.0}  # medians 5.5, 5.5, 10
    assert slow_nodes(three, factor=1.5) == ["c"]


def test_a_ban_shorter_than_a_second_still_ends():
    from jaxdist.controller.policy import ban_ends

    assert ban_ends(100.0, 0.5, 1) == 100.5 and ban_ends(100.0, 0.5, 3) == 102.0


def test_lineage_last_generation_runs_to_the_final_step():
    """The last generation contributes up to ``final_step`` (the job's end), whatever its last report said."""
    assert lineage([(0, 4), (3, 6)], 9) == list(range(9))
    assert lineage([(0, 5)], 8) == list(range(8))


def test_process_failure_verdict_judges_the_latest_failure_and_says_why():
    # the latest failure is rank 1 on b (limit 1): rank 1 moves, named with its node
    v = process_failure_verdict([(0, "a"), (2, "c"), (1, "b")], 1)
    assert v.action == "move" and v.why == "rank 1 failed 1 times on b: it moves to another node once"
    # exactly limit (2) failures of rank 0 on two nodes: it fails wherever it runs
    v = process_failure_verdict([(0, "a"), (0, "b")], 2)
    assert v.action == "give_up" and "rank 0 failed 2 times on healthy nodes (1 on a, 1 on b)" in v.why
    assert "wherever it runs" in v.why and v.why.endswith("(see the worker logs)")
    # 2 x limit failures on its only node: the job stops, saying where to look
    v = process_failure_verdict([(0, "a")] * 4, 2)
    assert v.action == "give_up"
    assert v.why == "the process of rank 0 failed 4 times on a and no other node could take it (see the worker logs)"


def test_a_group_of_two_shrinks_onto_the_node_that_holds_both_ranks_files():
    """Two old ranks on a and b: each node holds both ranks' local files (its own and its neighbour's replica), so a
    group of one keeps b, a survivor, rather than the first usable node c."""
    from jaxdist.controller.policy import covering_group

    assert covering_group({0: "a", 1: "b"}, ["c", "b"], 1) == ["b"]

"""The node agent's relay of its workers' heartbeats (jaxdist.controller.relay), and the controller's side."""

from __future__ import annotations

import os
import time

import pytest
import zmq

from jaxdist.controller.messages import message_problem
from jaxdist.controller.relay import DIRECT_EVERY, TRUST_BEATS, RelayClient, RelayServer, goes_direct, merge


def _hb(beat: int, step: int, periods=(), pid: int = 7, node: str = "n0") -> dict:
    hb = {"t": "hb", "node": node, "pid": pid, "state": "training", "gen": 0, "rank": 0, "step": step}
    return {**hb, "beat": beat, "sent": time.time(), "periods": [{"index": i, "gen": 0} for i in periods]}


def test_merge_keeps_the_newer_heartbeat_and_every_efficiency_record_of_both():
    old, new = _hb(3, 10, periods=(0, 1)), _hb(4, 11, periods=(1, 2))
    for a, b in ((old, new), (new, old)):  # in either order of arrival
        m = merge(a, b)
        assert m["beat"] == 4 and m["step"] == 11
        assert [p["index"] for p in m["periods"]] == [0, 1, 2]
    assert merge(None, new) is new


def test_a_worker_goes_directly_first_every_nth_beat_and_when_its_agent_stops_acking():
    interval = 0.25
    assert goes_direct(1, None, interval)  # the first: the controller learns its connection
    assert goes_direct(2, None, interval)  # no ack yet
    assert not goes_direct(2, 0.1, interval)
    assert not goes_direct(DIRECT_EVERY, TRUST_BEATS * interval, interval)
    assert goes_direct(DIRECT_EVERY + 1, 0.1, interval)
    assert goes_direct(5, TRUST_BEATS * interval + 0.01, interval)  # the agent stalled: directly again
    direct = sum(goes_direct(b, 0.1, interval) for b in range(1, 401))
    assert direct == 400 // DIRECT_EVERY


@pytest.mark.skipif(os.name != "posix", reason="ipc:// sockets are POSIX")
def test_heartbeats_cross_the_relay_with_their_age_and_are_acked():
    ctx = zmq.Context()
    server = RelayServer(ctx)
    client = RelayClient(ctx, server.address, "w:n0:7")
    try:
        assert oct(server.dir.stat().st_mode & 0o777) == "0o700"  # only this user may connect
        assert client.since_ack() is None
        sent = [_hb(1, 1, periods=(0,)), _hb(2, 2)]
        sent[0]["sent"] -= 0.5  # sent half a second ago
        for hb in sent:
            assert client.send(hb)
        deadline = time.monotonic() + 10
        while len(server.pending) < 1 or server.pending["w:n0:7"][0]["beat"] < 2:
            server.take()
            assert time.monotonic() < deadline, "the relay delivered nothing in 10 s"
            time.sleep(0.01)
        (entry,) = server.entries()
        assert entry["beat"] == 2 and entry["step"] == 2 and [p["index"] for p in entry["periods"]] == [0]
        assert 0 <= entry["age"] < 5
        server.ack(server.carried())
        assert server.entries() == []
        while client.since_ack() is None:
            assert time.monotonic() < deadline, "no ack in 10 s"
            time.sleep(0.01)
        assert client.since_ack() < 5
        client.sock.send(b"not json")  # dropped, not a crash of the agent
        client.sock.send(b'{"pid": "seven"}')
        time.sleep(0.2)
        server.take()
        assert server.entries() == []
    finally:
        client.close()
        server.close()
        ctx.term()
    assert not server.dir.exists()


def test_the_controller_reads_a_node_heartbeat_only_with_its_own_workers_heartbeats():
    node_hb = {"t": "node_hb", "node": "n0", "procs": [], "workers": [_hb(1, 3)]}
    assert message_problem(node_hb) is None
    other = {**node_hb, "workers": [_hb(1, 3, node="n1")]}
    assert message_problem(other) == "a 'node_hb' message carrying another node's worker heartbeat"
    bad = {**node_hb, "workers": [{**_hb(1, 3), "step": "three"}]}
    assert message_problem(bad) == "a 'node_hb' message carrying a 'hb' message whose 'step' is a str"
    assert message_problem({**node_hb, "workers": ["hb"]}) is not None


@pytest.mark.skipif(os.name != "posix", reason="the controller's run lock and sockets are POSIX")
def test_a_relayed_heartbeat_counts_from_when_its_worker_sent_it_and_each_beat_once(tmp_path):
    from .test_controller_growth import _node_hb, close, running_controller

    ctl, pid = running_controller(tmp_path, 2)
    try:
        name = ctl.state.members[0]
        ident = f"w:{name}:{pid[name]}"
        w = ctl.workers[ident]
        w.last_heartbeat = time.monotonic() - 10  # last heard 10 s ago
        hb = {**_hb(5, 7, pid=pid[name], node=name), "age": 1.0}
        ctl.handle(f"n:{name}", {**_node_hb(name, pid[name]), "workers": [hb]})
        assert w.step == 7 and 0.5 < time.monotonic() - w.last_heartbeat < 2.0  # heard a second before
        ctl.handle(ident, {**hb, "step": 9})  # the same beat directly: handled once
        assert w.step == 7
        w.disconnected_at = 123.0
        ctl.handle(f"n:{name}", {**_node_hb(name, pid[name]), "workers": [{**_hb(6, 8, pid=pid[name], node=name)}]})
        assert w.step == 8 and w.disconnected_at == 123.0  # relayed: says nothing of its own connection
        ctl.handle(ident, _hb(7, 9, pid=pid[name], node=name))
        assert w.step == 9 and w.disconnected_at is None
        ctl.handle(ident, {**_hb(3, 4, pid=pid[name], node=name), "sent": time.time() - 5})  # an older beat
        assert w.step == 9
        reused = _hb(1, 0, pid=pid[name], node=name)  # a new process with the same pid: beats from 1, sent later
        ctl.handle(ident, {**reused, "state": "warm", "gen": -1, "rank": -1})
        assert w.beat == 1 and w.state == "warm"
    finally:
        close(ctl)


def test_a_done_worker_reports_directly():
    assert goes_direct(7, 0.1, 0.25, "done") and not goes_direct(7, 0.1, 0.25, "training")


@pytest.mark.skipif(os.name != "posix", reason="the controller's run lock and sockets are POSIX")
def test_a_member_that_exits_before_its_relayed_heartbeats_arrive_is_still_a_member(tmp_path):
    """The agent reports an exit at once; the worker's heartbeats since its assignment wait in the agent's
    relay.  The controller knows the pid it assigned each rank: an exit with code 2 there ends the job."""
    from .test_controller_growth import _node_hb, close, running_controller

    ctl, pid = running_controller(tmp_path, 2)
    try:
        name = ctl.state.members[1]
        w = ctl.workers[f"w:{name}:{pid[name]}"]
        w.gen, w.rank = -1, -1  # as the warm spare's last heartbeat said
        ctl.handle(f"n:{name}", {**_node_hb(name, pid[name]), "procs": [{"pid": pid[name], "rc": 2}]})
        assert ctl.state.phase == "failed" and (w.gen, w.rank) == (0, 1)
        (exit_event,) = [e for e in ctl.events.events if e["event"] == "worker_exit"]
        assert exit_event["member"] and exit_event["rank"] == 1
    finally:
        close(ctl)


@pytest.mark.skipif(os.name != "posix", reason="the controller's run lock and sockets are POSIX")
def test_a_spare_heard_only_through_its_agent_is_not_given_a_rank(tmp_path):
    """At 1,024 simulated nodes a new generation waited forever: 447 of its ranks had gone to spares whose own
    connection had never come up (their heartbeats came through their agents), and the assignments were lost.
    A spare takes a rank only once it has been heard on its own connection."""
    from .test_controller_growth import _node_hb, close, running_controller

    ctl, pid = running_controller(tmp_path, 2)
    try:
        name = ctl.state.members[0]
        spare = {**_hb(1, 0, pid=5000, node=name), "state": "warm", "gen": -1, "rank": -1}
        ctl.handle(f"n:{name}", {**_node_hb(name, pid[name]), "workers": [spare]})
        assert ctl.workers[f"w:{name}:5000"].state == "warm" and ctl._warm_worker(name) is None
        ctl.handle(f"w:{name}:5000", {**spare, "beat": 2})
        assert ctl._warm_worker(name) is ctl.workers[f"w:{name}:5000"]
    finally:
        close(ctl)

"""The controller's message edge (issue 39, item 2): an authentic message it cannot read is refused in one place,
counted with the rejected messages and named once in the log; the controller goes on serving.

Before, a signed heartbeat without ``procs`` or with a string ``pid`` raised KeyError/ValueError out of
``Controller.run`` and ended the job's controller.  The controller here is built in-process (no JAX, no agents).
"""

from __future__ import annotations

import logging
import time

import pytest

from jaxdist.controller.messages import message_problem

GOOD_NODE_HB = {"t": "node_hb", "node": "n0", "host": "h", "checks": {}, "probe": "h:1", "free_port": 1, "procs": []}
GOOD_HB = {"t": "hb", "node": "n0", "pid": 7, "state": "warm", "gen": -1, "rank": -1, "step": 0, "tokens_per_s": 0.0}
GOOD_EXIT = {"t": "exit", "node": "n0", "pid": 7, "rc": 0, "gen": -1, "rank": -1, "role": "warm"}

BAD = [
    ({**GOOD_NODE_HB, "procs": None}, "'procs' is a NoneType"),
    ({k: v for k, v in GOOD_NODE_HB.items() if k != "procs"}, "without 'procs'"),
    ({**GOOD_NODE_HB, "procs": [{"pid": "7", "rc": None}]}, "process entry"),
    ({**GOOD_NODE_HB, "checks": "ok"}, "'checks' is a str"),
    ({**GOOD_HB, "pid": "7"}, "'pid' is a str"),
    ({k: v for k, v in GOOD_HB.items() if k != "step"}, "without 'step'"),
    ({**GOOD_HB, "tokens_per_s": "fast"}, "'tokens_per_s' is a str"),
    ({**GOOD_EXIT, "rc": None}, "'rc' is a NoneType"),
    ({"t": "probe_result", "node": "n0", "rtt": [1.0]}, "'rtt' is a list"),
]


@pytest.mark.parametrize("msg,phrase", BAD, ids=[p for _, p in BAD])
def test_an_unreadable_message_is_named(msg, phrase):
    assert phrase in message_problem(msg)


def test_good_messages_pass():
    for msg in (GOOD_NODE_HB, GOOD_HB, GOOD_EXIT, {"t": "probe_result", "node": "n0", "rtt": {"n1": 0.01}}):
        assert message_problem(msg) is None, msg
    assert message_problem({"t": "something newer", "x": object()}) is None  # kinds it does not read: ignored


def test_the_controller_refuses_counts_and_goes_on(ctl, caplog):
    caplog.set_level(logging.WARNING, "jaxdist.controller")
    for msg, _ in BAD + BAD:  # each kind of problem is named once, counted every time
        ctl.handle("n:n0", msg)
    ctl._save(force=True)
    assert ctl.state.rejected_messages == 2 * len(BAD)
    assert len([r for r in caplog.records if "refused a message" in r.getMessage()]) == len(BAD)
    ctl.handle("n:n0", GOOD_NODE_HB)  # the controller still serves
    ctl.handle("w:n0:7", GOOD_HB)
    assert "n0" in ctl.nodes and ctl.workers["w:n0:7"].state == "warm"


def test_a_spare_whose_connection_dropped_is_not_warm_until_it_is_heard_again(ctl):
    """A node whose agent died and came back before the node counted as lost (2 x heartbeat_timeout): the old
    agent's spare died with it, and its dropped connection is all the controller knows. It is not offered for a
    rank (assigning it failed the next generation at once); a live spare's next heartbeat makes it warm again."""
    ctl.handle("w:n0:7", GOOD_HB)
    assert ctl._warm_worker("n0").pid == 7
    ctl.workers["w:n0:7"].disconnected_at = 1.0  # what Controller.run records for the endpoint's disconnect
    assert ctl._warm_worker("n0") is None
    ctl.handle("w:n0:7", GOOD_HB)
    assert ctl._warm_worker("n0").pid == 7


def test_the_generation_clusters_servers_refuse_unreadable_requests_before_their_handler(caplog):
    """The dispatcher's and the receiver's requests are checked by the channel's one edge (Server's fields):
    an authentic request with a missing or mistyped field gets a one-phrase refusal and never reaches the
    handler, whose int()/[] would have raised out of the server loop."""
    import threading

    from jaxdist.gen.channel import Client, Server
    from jaxdist.gen.delivery import REQUEST_FIELDS as RECEIVER
    from jaxdist.gen.job import REQUEST_FIELDS as DISPATCHER

    token, seen = "a" * 64, []
    srv = Server(token, "dispatcher", fields={**DISPATCHER, **RECEIVER})
    stop = threading.Event()
    loop = threading.Thread(
        target=lambda: [
            srv.serve_once(lambda *a: seen.append(a[1]) or {"ok": True}, 0.1) for _ in iter(stop.is_set, True)
        ],
        daemon=True,
    )
    loop.start()
    c = Client(token, "g:w0", srv.address)
    try:
        cases = [
            ({"t": "done", "task": "3", "stage": 0}, "'task' is a str"),
            ({"t": "done", "stage": 0}, "without 'task'"),
            ({"t": "want", "stage": "0"}, "'stage' is a str"),
            ({"t": "retry", "task": 1.5}, "'task' is a float"),
            ({"t": "deliver", "key": "k", "sha256": "00", "n_bytes": "9"}, "'n_bytes' is a str"),
        ]
        for msg, phrase in cases:
            r = c.request(msg, deadline_s=20.0)
            assert r is not None and r["ok"] is False and phrase in r["refused"], (msg, r)
        assert seen == []
        good = {"t": "done", "stage": 0, "task": 3, "outcome": "passed", "seconds": 0.5, "outputs": []}
        assert c.request(good, deadline_s=20.0)["ok"] is True and seen[0]["task"] == 3
    finally:
        c.close()
        stop.set()
        loop.join(timeout=10)
        srv.close()


def test_a_node_back_from_lost_retires_the_spares_written_off_and_gets_new_ones(ctl):
    """A node declared lost (silent for 2 x heartbeat_timeout) has its spares written off; when its agent comes
    back with those processes still running, the controller kills them and asks for new spares. Before, the agent
    kept counting the written-off spare, started none, and a recovery whose plan took that node waited for a warm
    spare forever (seen at 1,024 simulated nodes after a starved host's nodes flapped)."""
    sent = []
    ctl.endpoint.send = lambda to, msg: sent.append((to, msg))
    running = {**GOOD_NODE_HB, "procs": [{"pid": 7, "role": "spare", "gen": -1, "rank": -1, "rc": None}]}
    ctl.handle("n:n0", running)
    ctl.handle("w:n0:7", GOOD_HB)
    assert ctl._warm_worker("n0").pid == 7
    ctl.nodes["n0"].last_heartbeat -= 10 * ctl.cc.heartbeat_timeout  # the node and its spare silent
    ctl.workers["w:n0:7"].last_heartbeat -= 10 * ctl.cc.heartbeat_timeout
    ctl.tick(time.monotonic())  # n0 is lost: its spare written off
    assert ctl.nodes["n0"].lost and ctl._warm_worker("n0") is None
    sent.clear()
    ctl.handle("n:n0", running)  # back, reporting pid 7 still running
    assert ("n:n0", {"t": "kill", "pids": [7]}) in sent and ("n:n0", {"t": "replenish", "at_least": 1}) in sent
    sent.clear()
    ctl.handle("n:n0", running)  # once, at the return, not on every heartbeat
    assert not [m for _, m in sent if m["t"] in ("kill", "replenish")]
    ctl.handle("w:n0:8", {**GOOD_HB, "pid": 8})  # the new spare
    assert ctl._warm_worker("n0").pid == 8


def test_a_nodes_dead_processes_leave_its_live_index(ctl):
    """Each recovery leaves every node one more dead process; the per-node lookups of every tick (warm spares,
    heard workers) walk only the live ones, so their cost does not grow with the job's generations."""
    for pid in range(100, 140):  # 40 generations' processes, reported dead by the node
        ctl.handle(f"w:n0:{pid}", {**GOOD_HB, "pid": pid})
        ctl.handle("n:n0", {**GOOD_NODE_HB, "procs": [{"pid": pid, "role": "spare", "gen": -1, "rank": -1, "rc": -9}]})
    ctl.handle("w:n0:7", GOOD_HB)
    assert [w.pid for w in ctl._workers_on("n0")] == [7] and len(ctl.workers) == 41


def test_no_node_is_lost_while_its_heartbeats_may_wait_unread(ctl):
    """A controller process that stalled (descheduled on a loaded host) finds every node's heartbeats queued: it
    reads them before judging any silence (at 1,024 simulated nodes, judging after the first batch took 576 live
    nodes for silent), for at most heartbeat_timeout."""
    ctl.handle("n:n0", GOOD_NODE_HB)
    now = time.monotonic()
    ctl.nodes["n0"].last_heartbeat = now - 10 * ctl.cc.heartbeat_timeout
    ctl.endpoint.backlog_since = now - 0.1
    ctl.tick(now)
    assert not ctl.nodes["n0"].lost
    ctl.tick(now + ctl.cc.heartbeat_timeout)  # a backlog that lasts: judged anyway
    assert ctl.nodes["n0"].lost

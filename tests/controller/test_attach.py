"""A restarted controller attaching to its running job at scale (issue 37): it judges the job only once it has
heard every member node (at most ``ATTACH_MAX_S``), and does not probe the links of the job's own members.

At 1,024 simulated nodes the member nodes' reconnections to a restarted controller took longer than its fixed
4-s attach window: it planned a smaller group from the few nodes it had heard, and probed every member's links
at once (8 CURVE connections per node), which starved the simulated hosts.  The controllers here are built in
this process (no JAX, no agents).
"""

from __future__ import annotations

import pytest

from jaxdist.config import load_config
from jaxdist.controller.controller import ATTACH_MAX_S, Controller


def node_hb(name: str) -> dict:
    return {
        "t": "node_hb",
        "node": name,
        "host": "h",
        "checks": {"ok": True},
        "probe": "h:1",
        "free_port": 1,
        "procs": [],
        "welcomed": True,
    }


@pytest.fixture
def restarted(tmp_path):
    """A controller restarted while its job ran generation 0 on n0 and n1; what it sends is in ``.sent``."""
    cfg = load_config(None, [f"train.runs_dir={tmp_path}", "train.name=ctl", "mesh.cluster=cpu-2x4"])
    first = Controller(cfg, [])
    first.state.phase, first.state.generation, first.state.members = "running", 0, {0: "n0", 1: "n1"}
    first._save(force=True)
    first.endpoint.close()
    first.run_lock.release()
    c = Controller(cfg, [])
    c.sent = []
    c.endpoint.send = lambda to, msg: c.sent.append((to, msg))
    yield c
    c.endpoint.close()
    c.run_lock.release()


def test_a_restarted_controller_judges_only_once_every_member_node_is_heard(restarted):
    c = restarted
    assert c.attaching
    c.handle("n:n0", node_hb("n0"))
    c.tick(c.t0 + 2 * c.cc.heartbeat_timeout + 2.0)  # past the fixed window, n1 not heard yet
    assert c.attaching and not [e for e in c.events.events if e["event"] == "attached"]
    c.handle("n:n1", node_hb("n1"))
    c.tick(c.t0 + 2 * c.cc.heartbeat_timeout + 2.0)
    assert not c.attaching


def test_a_member_never_heard_is_judged_after_the_attach_bound(restarted):
    c = restarted
    c.handle("n:n0", node_hb("n0"))
    c.tick(c.t0 + ATTACH_MAX_S - 1.0)
    assert c.attaching
    c.tick(c.t0 + ATTACH_MAX_S + 1.0)
    assert not c.attaching


def test_the_links_of_a_member_heard_by_a_restarted_controller_are_not_probed(restarted):
    c = restarted
    c.handle("n:n0", node_hb("n0"))
    c.handle("n:n9", node_hb("n9"))  # a standby: checked as at any start
    probed = [to for to, msg in c.sent if msg["t"] == "probe"]
    assert c.nodes["n0"].link_ok and probed == ["n:n9"]


def test_the_exits_a_node_lists_from_before_the_restart_are_history_not_events(restarted):
    """A node's heartbeat lists its processes of the last hour, dead ones too. A restarted controller takes those
    of older generations (and spares) that it never heard as history, recorded without an event or a judgment;
    a process of the running generation that died while it was away is still an exit."""
    c = restarted
    c.state.generation = 3
    old = [{"pid": 100 + i, "role": "active", "gen": i % 3, "rank": 0, "rc": -9} for i in range(50)]
    died = {"pid": 7, "role": "active", "gen": 3, "rank": 1, "rc": -9}
    for _ in range(2):
        c.handle("n:n0", {**node_hb("n0"), "procs": [*old, died]})
    exits = [e for e in c.events.events if e["event"] == "worker_exit"]
    assert [e["pid"] for e in exits] == [7]
    assert c.workers["w:n0:100"].exit_code == -9 and c._workers_on("n0") == []

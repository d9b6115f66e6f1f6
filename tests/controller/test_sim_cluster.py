"""The real controller against a simulated cluster (tests/controller/sim_cluster.py): 24 nodes in 2 processes.

The job trains the stub workers' hash chain on 22 nodes (2 standbys) at the controller's defaults, through two
nodes lost at once (their agents and workers gone, nothing said) and a crashed worker.  It must end with every
batch trained once (the hash chain's final state), the lost nodes blamed, and the link checks linear in the
node count: each node pings itself and at most ``PROBE_PEERS`` others (an all-pairs check would be
N(N+1)/2 pings; issue 37's 1,024 nodes made that 67 GB of pings at the start).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxdist.controller.generations import KILL_CONFIRM_S
from jaxdist.controller.policy import PROBE_PEERS, lineage
from jaxdist.controller.timeline import generations_trained

sys.path.insert(0, str(Path(__file__).parent))
from sim_cluster import SimCluster  # noqa: E402
from stub_worker import expected_final  # noqa: E402

NODES, GROUP, HOSTS, STEPS = 24, 22, 2, 40
TIMEOUT = 240


def test_a_simulated_cluster_trains_exactly_once_through_a_lost_node_and_a_crash(tmp_path):
    job = SimCluster(NODES, GROUP, HOSTS, tmp_path, STEPS, step_s=0.1)
    try:
        job.start()
        job.wait_until(lambda s: s["phase"] == "running" and s["last_step"] >= 3, TIMEOUT, "step 3")
        lost, host = job.rank_host(5)
        # A second member on the same simulated host, lost in the same instant (as a rack's switch failing)
        other = next(n for r, n in sorted(job.state()["members"].items()) if n != lost and job.host_of(n) == host)
        job.command(host, "lose", nodes=[lost, other])
        job.wait_until(lambda s: s["generation"] == 1 and s["phase"] == "running", TIMEOUT, "generation 1")
        job.wait_until(lambda s: s["last_step"] >= s["history"][-1]["resume_step"] + 3, TIMEOUT, "3 more steps")
        crashed, host = job.rank_host(3)
        job.command(host, "crash", rank=3)
        job.wait_until(lambda s: s["generation"] == 2 and s["phase"] == "running", TIMEOUT, "generation 2")
        assert job.wait(TIMEOUT) == 0, job.summary()
    finally:
        job.close()

    final = json.loads((job.run_dir / "stub" / "final.json").read_text())
    assert final == {"step": STEPS, "state": expected_final(STEPS)}, "a batch was skipped or trained twice"
    gens = [[s for s, _ in g] for g in generations_trained(job.run_dir).values()]  # what each rank 0 trained
    assert lineage([(g[0] - 1, g[-1]) for g in gens], STEPS) == list(range(STEPS))
    hist = job.state()["history"]
    lost_events = [e for e in job.events() if e["event"] == "node_lost"]
    assert sorted(e["node"] for e in lost_events) == sorted([lost, other]), lost_events  # those, no false alarm
    assert {lost, other}.isdisjoint(hist[1]["members"].values()) and len(hist[1]["members"]) == GROUP
    failures = [e for e in job.events() if e["event"] == "failure"]
    assert [f["kinds"] for f in failures] == [["silent"], ["exit"]], failures
    # one failure names both, or only the one judged first (the other is blamed with it when the blame settles)
    assert failures[0]["nodes"] and set(failures[0]["nodes"]) <= {lost, other} and failures[1]["ranks"] == [3]
    # the lost nodes blamed as nodes (moved off: both standbys take their ranks), the crash as its process (the
    # rank restarts on its node)
    blames = [e["scope"] for e in job.events() if e["event"] == "blame"]
    assert blames == [{lost: "node", other: "node"}, {crashed: "process"}], blames
    # The recovery from the lost node did not wait for exit reports the lost node can never send: the new group
    # started about heartbeat_timeout (1.5 s, the silence that tells a lost node from a crashed process) after
    # the failure, where the wait for those reports made it at least KILL_CONFIRM_S (5 s).
    (start,) = [e for e in job.events() if e["event"] == "start" and e["gen"] == 1]
    assert start["time"] - failures[0]["time"] < KILL_CONFIRM_S, (start, failures[0])

    counts = job.host_counts()
    assert counts["ping_sent"] == counts["ping_answered"]  # every link answered
    assert NODES <= counts["ping_sent"] <= NODES * (PROBE_PEERS + 1), counts  # linear: all pairs would be 300
    # The workers' heartbeats went through their node agents (jaxdist.controller.relay): one in DIRECT_EVERY
    # directly, and the first few before the agent's first ack (all would go directly without the relay)
    assert counts["hb_direct"] < 0.5 * counts["hb"], counts


def test_a_stuck_rank_is_named_and_a_slow_rank_raises_its_node(tmp_path):
    """A rank held in its host's own work (the data phase) while the others wait is named alone (not the whole
    group as a device hang), and a rank whose steps take longer raises a slow-node alarm on its own node, not on
    the other ranks its simulated host carries."""
    job = SimCluster(12, 12, HOSTS, tmp_path, steps=1_000_000, step_s=0.1)
    try:
        job.start()
        job.wait_until(lambda s: s["phase"] == "running" and s["last_step"] >= 3, TIMEOUT, "step 3")
        stuck, host = job.rank_host(2)
        job.command(host, "stuck", rank=2)
        job.wait_until(lambda s: s["generation"] == 1 and s["phase"] == "running", TIMEOUT, "generation 1")
        (failure,) = [e for e in job.events() if e["event"] == "failure"]
        assert failure["kinds"] == ["stuck"] and failure["nodes"] == [stuck] and failure["ranks"] == [2], failure
        slow, host = job.rank_host(3)
        job.command(host, "slow", rank=3, s=0.5)
        job.wait_until(lambda s: any(e["event"] == "slow_node" for e in job.events()), TIMEOUT, "a slow-node alarm")
        alarms = [e["node"] for e in job.events() if e["event"] == "slow_node"]
        assert alarms == [slow], alarms
    finally:
        job.close()

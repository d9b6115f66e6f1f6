"""Issue 37's fault injections at scale: the real controller at its defaults against N simulated nodes.

``tests/controller/sim_cluster.py`` runs N node agents and their workers (the real protocol: CURVE, HMAC,
heartbeats every 0.25 s through each node's relay) in one process per 128 nodes on this machine; N - 16 train
(the stub workers' hash chain, a checkpoint every step), 16 are standbys.  After the start and a fault-free
phase of ``--quiet-s`` seconds (any failure, lost node or health alarm in it is a false alarm), the faults
come one after the other, each judged before the next:

- ``lose``: one member node gone (its sockets closed, nothing said): a failure naming it, the node blamed
  (``node_lost``, the blame's scope "node"), its rank on a standby;
- ``crash``: a member's worker exits -9, reported by its node: the process blamed, the rank restarted on its
  own node;
- ``stop``: a member hangs (neither steps nor heartbeats; its connection still answers): found silent;
- ``stuck``: a member heartbeats but does not step while the others wait: a "stuck" failure naming it;
- ``slow``: a member's steps take 1 s longer: a health alarm (``slow_node``) naming its node (then normal);
- ``lose 1 %``: ceil(N / 100) member nodes on different simulated hosts lost in the same instant: those
  blamed and only those;
- ``controller restart``: the controller SIGKILLed and started again: it attaches to the running job, no
  failure, and the job steps on.

Then the job's bookkeeping: every step rank 0 recorded (``trained.jsonl``) belongs to one lineage that trains
each batch exactly once in order (``policy.lineage``), and the newest checkpoint's hash chain is the chain of
every batch up to its step.  One row per fault: seconds from the injection to the failure (or alarm), to the
new group's assignments, who was blamed, and whether that is right.

    python benchmarks/scale_faults.py --nodes 1024 --quiet-s 600     # about 20 minutes here
    python benchmarks/scale_faults.py --nodes 64 --quiet-s 10        # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "controller"))
from sim_cluster import SimCluster  # noqa: E402  (the test harness: simulated agents speaking the real protocol)
from stub_worker import expected_final  # noqa: E402

from jaxdist.controller.policy import lineage  # noqa: E402
from jaxdist.controller.timeline import generations_trained  # noqa: E402

STANDBYS = 16
ALARMS = ("node_lost", "failure", "health", "slow_node", "agent_silent")


def _after(job: SimCluster, kind: str, at: float) -> list[dict]:
    return [e for e in job.events() if e["event"] == kind and e["time"] >= at]


def _member_on_host(job: SimCluster, host: int, avoid: set[str]) -> tuple[int, str]:
    s = job.state()
    return next((int(r), n) for r, n in sorted(s["members"].items(), key=lambda x: int(x[0]))
                if int(r) > 0 and n not in avoid and job.host_of(n) == host)  # fmt: skip


def settle(job: SimCluster, timeout: float, gone: int = 0) -> None:
    """Wait for every node but the ``gone`` ones (lost on purpose) to hold a warm spare again (each recovery
    starts a new process on every member node: on 2 cores the simulated hosts need a while), then 10 s more."""
    n = len(job.names) - gone
    job.wait_until(
        lambda s: len(s["warm_nodes"]) >= n - 2 or s["phase"] != "running", timeout, "every node warm", poll=0.5
    )
    time.sleep(10)


def said(failures: list[dict]) -> list[str]:
    """What each failure event says, shortly (for a row's ``what``)."""
    return [f"{e['kinds']} on {len(e['nodes'])} nodes: {e['detail'][:200]}" for e in failures]


def show(row: dict) -> dict:
    print(json.dumps(row, default=str), flush=True)
    return row


def recovery(job: SimCluster, at: float, timeout: float, lost: int = 0) -> dict:
    """Wait for the failure after ``at`` and the next generation's first step (and for ``lost`` nodes declared
    lost: a node is declared lost once silent for twice the heartbeat timeout, which may come after the
    recovery); what the events say."""
    gen = job.state()["generation"]
    job.wait_until(lambda s: s["generation"] > gen and s["phase"] == "running", timeout, "the recovery")
    if lost:
        job.wait_until(
            lambda s: len(_after(job, "node_lost", at)) >= lost, timeout, "the lost nodes", need_state=False, poll=0.5
        )
    (failure, *more), start = _after(job, "failure", at), _after(job, "start", at)[0]
    blame = _after(job, "blame", at)
    return {
        "detect s": failure["time"] - at,
        "told s": start["time"] - failure["time"],
        "kinds": failure["kinds"] + [k for f in more for k in f["kinds"]],
        "nodes": sorted({n for f in [failure, *more] for n in f["nodes"]}),
        # every blame before the new group started: a member found lost after the first settled is blamed late
        "scope": {k: v for b in blame if b["time"] <= start["time"] for k, v in b["scope"].items()},
        "lost": sorted(e["node"] for e in _after(job, "node_lost", at)),
    }


FAULTS = ("lose", "crash", "stop", "stuck", "slow", "lose1%", "restart")


def run(n: int, quiet_s: float, timeout: float, faults: tuple[str, ...] = FAULTS, keep: bool = False) -> list[dict]:
    """The rows of ``faults`` (in FAULTS' order) after the fault-free phase; ``keep``: leave the run's folder
    (the controller's events, state and logs, every agent's log) in place when a row is wrong."""
    root = Path(tempfile.mkdtemp(prefix=f"jaxdist-faults{n}-"))
    hosts = max(2, math.ceil(n / 128))
    job = SimCluster(n, n - STANDBYS, hosts, root, steps=1_000_000, step_s=0.5)
    rows: list[dict] = []
    try:
        t0 = time.monotonic()
        job.start()
        job.wait_until(lambda s: s["phase"] == "running" and s["last_step"] >= 3, timeout, "the first steps")
        print(f"{n} nodes: training after {time.monotonic() - t0:.1f} s", flush=True)
        at = time.time()
        time.sleep(quiet_s)
        false = [e for e in job.events() if e["event"] in ALARMS and e["time"] >= at]
        rows.append(show({"fault": f"none ({quiet_s:g} s)", "right": not false, "what": [e["event"] for e in false]}))
        settle(job, timeout)
        gone = 0
        for fault in (f for f in FAULTS if f in faults):
            rows.append(show(INJECT[fault](job, n, hosts, timeout)))
            gone += len(rows[-1].get("lost", []))
            if fault != "restart":
                at = time.time()
                settle(job, timeout, gone)
                if unasked := _after(job, "failure", at):  # no fault was injected: a false alarm
                    rows.append(
                        show({"fault": f"(after {fault}, none injected)", "right": False, "what": said(unasked)})
                    )
                    job.wait_until(lambda s: s["phase"] == "running", timeout, "the recovery from the false alarm")
                    settle(job, timeout, gone)
        time.sleep(5)
    except TimeoutError as e:  # the table says how far it came
        rows.append(show({"fault": "(stopped)", "right": False, "what": [str(e)[:300]]}))
    finally:
        job.close()
    gens = [[s for s, _ in g] for g in generations_trained(job.run_dir).values()]
    last = max(g[-1] for g in gens)
    once = lineage([(g[0] - 1, g[-1]) for g in gens], last) == list(range(last))
    ckpt = job.run_dir / "checkpoints"
    newest = max(int(p.parent.name) for p in ckpt.glob("*/jaxdist_commit.json"))
    chain = json.loads((ckpt / str(newest) / "state.json").read_text())["state"] == expected_final(newest)
    rows.append({"fault": "bookkeeping", "right": once and chain, "what": [f"{last} steps", f"checkpoint {newest}"]})
    if keep and not all(r["right"] for r in rows):
        print(f"kept the run's folder: {root}", flush=True)
    else:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def lose(job: SimCluster, n: int, hosts: int, timeout: float) -> dict:
    node, host = job.rank_host(1)
    at = time.time()
    job.command(host, "lose", nodes=[node])
    r = recovery(job, at, timeout, lost=1)
    right = r["nodes"] == [node] and r["lost"] == [node] and r["scope"] == {node: "node"}
    return {"fault": "lose", **r, "right": right}


def on_rank(do: str):
    def inject(job: SimCluster, n: int, hosts: int, timeout: float) -> dict:
        rank = 2
        node, host = job.rank_host(rank)
        at = time.time()
        job.command(host, do, rank=rank)
        r = recovery(job, at, timeout)
        kind = {"crash": "exit", "stop": "silent", "stuck": "stuck"}[do]
        right = r["nodes"] == [node] and kind in r["kinds"] and not r["lost"]
        return {"fault": do, **r, "right": right}

    return inject


def slow(job: SimCluster, n: int, hosts: int, timeout: float) -> dict:
    node, host = job.rank_host(3)
    at = time.time()
    job.command(host, "slow", rank=3, s=1.0)
    job.wait_until(lambda s: _after(job, "slow_node", at), timeout, "a slow-node alarm", need_state=False, poll=1.0)
    job.command(host, "slow", rank=3, s=0.0)
    alarm, failures = _after(job, "slow_node", at)[0], _after(job, "failure", at)  # slow is not failed
    return {
        "fault": "slow",
        "detect s": alarm["time"] - at,
        "nodes": [alarm["node"]],
        "right": alarm["node"] == node and not failures,
        "what": said(failures),
    }


def lose_many(job: SimCluster, n: int, hosts: int, timeout: float) -> dict:
    k, avoid = math.ceil(n / 100), set()
    lost = []
    for i in range(k):
        _, name = _member_on_host(job, i % hosts, avoid)
        avoid.add(name)
        lost.append(name)
    at = time.time()
    for h in range(hosts):
        if names := [x for x in lost if job.host_of(x) == h]:
            job.command(h, "lose", nodes=names)
    r = recovery(job, at, timeout, lost=k)
    right = r["lost"] == sorted(lost) and set(r["scope"]) == set(lost) and set(r["nodes"]) <= set(lost)
    return {"fault": f"lose {k} at once", **r, "right": right}


def restart(job: SimCluster, n: int, hosts: int, timeout: float) -> dict:
    step, at = job.state()["last_step"], time.time()
    job.kill_controller()
    job.start_controller()
    job.wait_until(lambda s: s["last_step"] >= step + 10, timeout, "10 steps after the controller restart")
    failures = _after(job, "failure", at)
    attached = _after(job, "attached", at)
    regrouped = [e["event"] for e in job.events() if e["event"] in ("start", "shrink", "grow") and e["time"] >= at]
    return {  # attached to the running generation, which steps on: no failure, no new group
        "fault": "controller restart",
        "detect s": attached[0]["time"] - at if attached else float("nan"),
        "right": bool(attached) and attached[0]["phase"] == "running" and not failures and not regrouped,
        "what": [f["detail"] for f in failures] + regrouped,
    }


INJECT = {
    "lose": lose,
    "crash": on_rank("crash"),
    "stop": on_rank("stop"),
    "stuck": on_rank("stuck"),
    "slow": slow,
    "lose1%": lose_many,
    "restart": restart,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--quiet-s", type=float, default=600.0, help="the fault-free phase's seconds")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds each wait may take")
    ap.add_argument("--faults", nargs="+", choices=FAULTS, default=FAULTS, help="which faults (default: all)")
    ap.add_argument("--keep", action="store_true", help="keep the run's folder when a row is wrong")
    args = ap.parse_args()
    print(f"host load (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    rows = run(args.nodes, args.quiet_s, args.timeout, tuple(args.faults), args.keep)
    head = ["fault", "detect s", "told s", "kinds", "nodes", "scope", "right", "what"]
    print(f"\nFault injections at {args.nodes} simulated nodes (controller defaults)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [f"{r[h]:.2f}" if isinstance(r.get(h), float) else str(r.get(h, "-")) for h in head]
        print("| " + " | ".join(cells) + " |")
    print(f"\nhost load (1 min) at end: {os.getloadavg()[0]:.2f}")
    if not all(r["right"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()

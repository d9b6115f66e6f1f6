"""A chaos run: 8 kills spread over the nodes of a real job, with the controller's default failure limits.

Real processes on this machine, as ``jaxdist launch`` runs them: a controller,
4 node agents and a standby, JAX workers of 2 simulated CPU devices each (the
tiny model; the node-local checkpoint tier every step, the run directory every
20 steps). Defaults: ``controller.max_failures=2`` (lost nodes),
``controller.max_process_failures=4`` (crashed processes on healthy nodes),
``controller.crashed_rank=same_node``. ``controller.start_grace`` lets the start
wait for all four nodes; ``controller.min_nodes=1`` lets the job shrink.

The kills, each a few steps after the previous recovery's first step, on the
rank the plan names:

* ``process``: SIGKILL of the rank's worker (its node agent stays): the rank
  restarts on its own node;
* ``node``: SIGKILL of the rank's node agent and worker together (a lost node):
  the standby takes the rank, and once no standby is left the group shrinks to
  the largest size the mesh and batch allow.

At the end: the job's exit code, every generation's size and the steps each
recovery recomputed, and the exactly-once check of the run's batch list
against its training log (``jaxdist data verify``), in one summary line.

    python benchmarks/chaos.py
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from jaxdist.controller.local import LocalJob
from jaxdist.controller.timeline import generations_trained
from jaxdist.data.audit import check_exactly_once

COMMON = [
    "model=tiny",
    "mesh.cluster=cpu-4x2",
    "train.batch_size=16",
    "train.seq_len=32",
    "data.max_bytes=300000",
    "train.progress=false",
    "train.tensorboard=false",
    "checkpoint.every=20",
    "checkpoint.local_dir=local/{node}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.runs_dir=runs",
    "train.name=chaos",
    "controller.min_nodes=1",
    "controller.max_nodes=4",
    "controller.start_grace=120",
]
PLAN = [
    (0, "process"),
    (1, "node"),
    (2, "process"),
    (3, "process"),
    (0, "node"),
    (1, "process"),
    (0, "process"),
    (1, "node"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--dir", help="work directory (default: a fresh temporary one)")
    a = p.parse_args(argv)
    cwd = Path(a.dir or tempfile.mkdtemp(prefix="jaxdist-chaos-"))
    cwd.mkdir(parents=True, exist_ok=True)
    job = LocalJob([*COMMON, f"train.steps={a.steps}"], nodes=5, cwd=cwd)
    kills = []
    t0 = time.time()
    try:
        job.start(timeout=a.timeout)
        for k, (rank, kind) in enumerate(PLAN):
            s = job.wait_until(lambda s: s["generation"] == k and s["phase"] == "running", a.timeout, f"gen {k}")
            base = s["last_step"]
            job.wait_until(lambda s: s["last_step"] >= base + 3 or s["phase"] != "running", a.timeout, "3 steps")
            s = job.state()
            assert s["phase"] == "running", f"the job ended before kill {k + 1}: raise --steps"
            rank = rank % len(s["members"])
            node = s["members"][str(rank)]
            if kind == "node":  # the node dies: its agent and every process under it
                job.lose_node(node)
            else:
                os.kill(int(s["pids"][str(rank)]), signal.SIGKILL)
            kills.append({"kind": kind, "rank": rank, "node": node, "step": s["last_step"]})
            print(f"kill {k + 1}: {kind} of rank {rank} on {node} at step {s['last_step']}", flush=True)
        rc = job.wait(a.timeout)
    finally:
        job.close()
    events = job.events()
    starts = [e for e in events if e["event"] == "start"]
    sizes = [len(e["members"]) for e in starts]
    segs = list(generations_trained(job.run_dir).values())
    lost = [segs[i][-1][0] - (segs[i + 1][0][0] - 1) for i in range(len(segs) - 1)]
    blame = [e["scope"] for e in events if e["event"] == "blame"]
    shrinks = sum(e["event"] == "shrink" for e in events)
    report = check_exactly_once(job.run_dir)
    print(f"\nkills: {[(x['kind'], x['node']) for x in kills]}")
    print(f"blame per failure: {blame}")
    print(
        f"chaos run: exit {rc}; {len(starts)} generations of sizes {sizes} ({shrinks} shrink(s)); steps recomputed "
        f"per recovery {lost}; {report['trained']} steps trained, exactly once: {report['ok']} "
        f"({report['duplicates']} duplicates, {report['missing']} missing); {time.time() - t0:.0f} s in {cwd}"
    )
    return 0 if rc == 0 and report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

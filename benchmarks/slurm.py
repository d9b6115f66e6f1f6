"""The Slurm launcher against the local one: start, first step, and recovery from a crash and a dead node.

A real Slurm cluster on this machine (``tests/slurm/local_cluster.py``: munged, slurmctld, 4 slurmd with 8
fake GPUs each) and, in the same run, the same jobs under the local launcher (``LocalJob``).  Each job trains
on 3 nodes with 1 standby (workers: the JAX-free stub of the controller tests, or ``--worker jax``: the tiny
model on 2 simulated CPU devices per node).  Per repeat:

* Slurm: the cluster is started (fresh state; seconds until every node is idle), the job is submitted as
  ``jaxdist launch --print ... controller.launcher=slurm | sbatch``; local: ``LocalJob.start()``;
* *submit to first step*: from sbatch (local: the controller's start) to the first completed step;
* a worker of rank 1 is killed (SIGKILL): *failure to first step* is from the controller's failure event to
  the restarted group's first step (detection: injection to the failure event);
* a member node dies: on Slurm its slurmd and every process of its job steps are SIGKILLed
  (``LocalSlurmCluster.kill_node``; not the batch host, where the controller runs), locally its node agent
  and workers (``LocalJob.lose_node``); the standby takes its rank.  The controller waits ``KILL_CONFIRM_S`` (5 s) for the exits a dead node cannot
  report before it restarts the group: that wait is in this figure on both launchers.

Prints one table: median (and max) of each figure over ``--repeats``, Slurm beside local.  Requires root and
Debian's slurmctld, slurmd, slurm-client and munge packages.

    python benchmarks/slurm.py                     # 3 repeats, stub workers (~2 minutes)
    python benchmarks/slurm.py --worker jax --repeats 1
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxdist.controller.local import LocalJob  # noqa: E402
from jaxdist.controller.slurm_job import SlurmJob  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "slurm"))
from local_cluster import LocalSlurmCluster  # noqa: E402  (the test harness: a real Slurm cluster on this machine)

STUB = REPO / "tests" / "controller" / "stub_worker.py"
TIMEOUT = 600


def job_args(name: str, worker: str) -> list[str]:
    args = [
        "model=tiny",
        "mesh.cluster=cpu-4x2",
        "train.batch_size=24",
        "train.seq_len=32",
        "train.steps=100000",  # never reached: each job is closed after its last recovery
        "train.runs_dir=runs",
        f"train.name={name}",
        "controller.min_nodes=3",
        "controller.max_nodes=3",
        "controller.standbys=1",
        "controller.start_grace=1",
    ]
    if worker == "stub":
        return args + [f"controller.worker_command={{python}} {STUB}"]
    return args + [
        "data.max_bytes=300000",
        "train.progress=false",
        "train.tensorboard=false",
        "checkpoint.every=50",
        "checkpoint.local_dir=local/{node}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
    ]


def measure(job, submitted_at: float, kill_node, spare=lambda: "") -> dict[str, float]:
    """Drive a started job through a SIGKILL and a dead node (a member other than ``spare()``); the figures (s)."""
    t = TIMEOUT
    job.wait_until(lambda s: s.get("phase") == "running", t, "the first step")
    out = {"submit to first step": job.events_of("first_step")[0]["time"] - submitted_at}
    job.wait_until(lambda s: len(s.get("standbys", [])) == 1 and len(s.get("warm_nodes", [])) == 4, t, "all warm")
    crash = job.inject(1, signal.SIGKILL)
    s = job.wait_until(lambda s: s["generation"] == 1 and s["phase"] == "running", t, "generation 1")
    job.wait_until(lambda s: len(s.get("warm_nodes", [])) == 4, t, "all warm again")
    keep = spare()
    node = next(n for _, n in sorted(s["members"].items()) if n != keep)
    dead = kill_node(node)
    job.wait_until(lambda s: s["generation"] == 2 and s["phase"] == "running", t, "generation 2")
    fail, first = job.events_of("failure"), job.events_of("first_step")
    out["SIGKILL: detection"] = fail[0]["time"] - crash["time"]
    out["SIGKILL: failure to first step"] = first[1]["time"] - fail[0]["time"]
    out["dead node: detection"] = fail[1]["time"] - dead
    out["dead node: failure to first step"] = first[2]["time"] - fail[1]["time"]
    return out


def slurm_repeat(root: Path, worker: str, env: dict[str, str]) -> dict[str, float]:
    cluster = LocalSlurmCluster(root / "cluster")
    out = {"cluster start (all nodes idle)": cluster.start()}
    os.environ.update(cluster.env)
    job = SlurmJob(job_args("slurm", worker), cwd=root / "jobs", env=env)
    try:
        job.submit(job.script())

        def kill(node: str) -> float:
            t = time.time()
            cluster.kill_node(node)
            return t

        # the batch host runs the controller (in the batch step): another node dies
        out.update(measure(job, job.submitted_at, kill, spare=lambda: job.record().batch_host))
    finally:
        job.close()
        cluster.stop()
    return out


def local_repeat(root: Path, worker: str, env: dict[str, str]) -> dict[str, float]:
    job = LocalJob(job_args("local", worker), nodes=4, cwd=root / "jobs", env=env)
    try:
        t0 = time.time()
        job.start()

        def kill(node: str) -> float:
            t = time.time()
            job.lose_node(node)
            return t

        return measure(job, t0, kill)
    finally:
        job.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", choices=("stub", "jax"), default="stub")
    p.add_argument("--step-s", type=float, default=0.1, help="stub workers: seconds per step")
    args = p.parse_args()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    if args.worker == "stub":
        env["JAXDIST_STUB_STEP_S"] = str(args.step_s)
    rows: dict[str, dict[str, list[float]]] = {"slurm": {}, "local": {}}
    print(f"load average at the start: {os.getloadavg()[0]:.1f}", file=sys.stderr)
    for r in range(args.repeats):
        for launcher in ("slurm", "local"):
            with tempfile.TemporaryDirectory(prefix=f"jaxdist-bench-{launcher}-") as tmp:
                root = Path(tmp)
                os.chmod(root, 0o755)  # munged: every directory above its socket searchable
                (root / "jobs").mkdir()
                got = (slurm_repeat if launcher == "slurm" else local_repeat)(root, args.worker, env)
            for k, v in got.items():
                rows[launcher].setdefault(k, []).append(v)
            print(f"repeat {r + 1} {launcher}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), file=sys.stderr)
    keys = list(rows["slurm"])
    head = f"{'seconds (median / max over ' + str(args.repeats) + ')':<42} {'slurm':>14} {'local':>14}"
    print(f"\nworkers: {args.worker}; load average now {os.getloadavg()[0]:.1f}\n{head}\n{'-' * len(head)}")
    for k in keys:
        cells = []
        for launcher in ("slurm", "local"):
            v = rows[launcher].get(k)
            cells.append(f"{statistics.median(v):6.2f} / {max(v):5.2f}" if v else f"{'-':>14}")
        print(f"{k:<42} {cells[0]:>14} {cells[1]:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

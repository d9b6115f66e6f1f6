"""Recovery from failures with warm standbys against requeueing the whole job.

Real processes on this machine: a controller, ``--nodes`` node agents (one
more as a standby) and JAX workers of ``--devices`` simulated CPU devices each
(the tiny model; every controller, checkpoint and log setting at its default:
the local tier on (``checkpoint.local_dir=auto``, every step), the run directory
every 100 steps, ``train.log_every=10``, a crashed rank restarted on its own node).  Into one running job per mode,
``--injections`` failures are injected one after the other, each at a random
step of a random rank (rank 0 included): SIGKILL, and every ``--stop-every``-th
a SIGSTOP (a hang, found by heartbeat timeout).

* ``standby``: the controller kills the group and restarts it at once from warm
  processes (JAX imported, data loaded, compilation cache on disk), the failed
  rank on its own node's warm spare (``crashed_rank=same_node``);
* ``requeue``: every process is killed and started cold, as a requeued job
  would be (without the scheduler's queueing time, which comes on top).

Per mode it prints, over the injections: time to detect (injection to the
controller's decision; target <= 2 s), time from detection to the first
completed step after the restart (target <= 10 s) and steps of compute lost
(target <= 1), as median / 90th percentile / max.  Each failure comes once
every node is warm again (the standby and the members' spares), as between two
rare failures; a job is closed after its last recovery.  Then the elastic start
(assignment after the ``min_nodes``-th ready node) and the cached setup (time
from assignment to the first step: the first job, which builds the setup cache
entry and compiles, against the second, which finds it).

    python benchmarks/recovery.py                    # 20 injections per mode, 4 nodes x 2 devices
    python benchmarks/recovery.py --injections 5 --modes standby
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "controller"))
from helpers import BUSY_LOOP  # noqa: E402  (a busy process that ends with its parent: tests/controller/helpers.py)

from jaxdist.controller.local import LocalJob, write_cpu_cluster
from jaxdist.controller.state import read_events
from jaxdist.controller.timeline import recoveries, summary

COMMON = [  # model, data and output only: every controller, checkpoint and log setting at its default
    "model=tiny",
    "train.batch_size=16",
    "train.seq_len=32",
    "data.max_bytes=300000",
    "train.progress=false",
    "train.tensorboard=false",
    "train.runs_dir=runs",
]


def _job(cwd: Path, name: str, nodes: int, devices: int, steps: int, *extra: str, standbys: int = 1) -> LocalJob:
    cluster = write_cpu_cluster(cwd / f"cpu-{nodes}x{devices}.toml", nodes, devices)
    args = [
        *COMMON,
        f"mesh.cluster={cluster}",
        f"train.steps={steps}",
        f"train.name={name}",
        *extra,
    ]
    return LocalJob(args + [f"controller.standbys={standbys}"], nodes=nodes + standbys, cwd=cwd)


LONG_JOB_STEPS = 100_000  # never reached: each job is closed after its last recovery


def run_mode(cwd: Path, mode: str, args, rng: random.Random) -> list[dict]:
    """One job of ``mode``: ``args.injections`` failures, each once every node is warm again."""
    job = _job(
        cwd,
        f"bench-{mode}",
        args.nodes,
        args.devices,
        LONG_JOB_STEPS,
        f"controller.recovery={mode}",
        f"controller.max_failures={args.injections + 1}",
        f"controller.max_process_failures={args.injections + 1}",
    )
    t0 = time.time()
    try:
        job.start(late=1, timeout=args.timeout)
        for k in range(args.injections):
            job.wait_until(
                lambda s, k=k: s.get("generation", -1) == k and s["phase"] == "running",
                args.timeout,
                f"generation {k} running",
            )
            # every node warm again (the standby and the members' spares), as between two rare failures
            job.wait_until(
                lambda s: len(s["warm_nodes"]) >= args.nodes + 1 - len(s["banned"]), args.timeout, "every node warm"
            )
            target = job.state()["last_step"] + rng.randint(1, 3)
            job.wait_until(lambda s, target=target: s["last_step"] >= target, args.timeout, f"step {target}")
            sig = signal.SIGSTOP if args.stop_every and (k + 1) % args.stop_every == 0 else signal.SIGKILL
            rec = job.inject(rng.randrange(args.nodes), sig)
            print(
                f"  {mode}: injection {k + 1}/{args.injections}: {rec['signal']} rank {rec['rank']} at step "
                f"~{rec['step']} ({time.time() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        n = args.injections
        job.wait_until(lambda s: s["generation"] == n and s["phase"] == "running", args.timeout, "the last recovery")
    finally:
        job.close()
    return recoveries(job.run_dir)


def _cell(values: list[float], fmt: str) -> str:
    v = summary(values)
    return f"{v['median']:{fmt}} / {v['p90']:{fmt}} / {v['max']:{fmt}}  (n={v['n']})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--injections", type=int, default=20, help="failures injected per mode (default: 20)")
    p.add_argument("--nodes", type=int, default=4, help="training nodes (one more is the standby; default: 4)")
    p.add_argument("--devices", type=int, default=2, help="simulated CPU devices per node (default: 2)")
    p.add_argument("--modes", default="standby,requeue", help="comma-separated: standby, requeue")
    p.add_argument("--stop-every", type=int, default=4, help="every N-th injection is a SIGSTOP (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one wait may take")
    p.add_argument("--dir", help="working directory (default: a temporary one)")
    p.add_argument("--report-only", action="store_true", help="only print the tables of the runs in --dir")
    p.add_argument("--hog", type=int, default=0, help="busy processes loading the host for the whole run")
    args = p.parse_args(argv)
    cwd = Path(args.dir or tempfile.mkdtemp(prefix="jaxdist-recovery-")).absolute()
    cwd.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    print(f"working in {cwd}", file=sys.stderr)

    hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.hog)]
    try:
        if not args.report_only:
            for m in args.modes.split(","):  # the first job builds the setup cache entry, the next one reuses it
                run_mode(cwd, m, args, rng)
        report(cwd, args.modes.split(","), args.nodes, args.devices)
    finally:
        for h in hogs:
            h.kill()
    return 0


def report(cwd: Path, modes: list[str], nodes: int, devices: int) -> None:
    """Print the tables from the runs under ``cwd`` (``runs/cold``, ``runs/bench-<mode>``)."""
    results = {m: recoveries(cwd / "runs" / f"bench-{m}") for m in modes}
    print(
        f"\nrecovery, {nodes} nodes x {devices} CPU devices + 1 standby, tiny model, local checkpoint every step; "
        f"each cell median / p90 / max (n); host load now {os.getloadavg()}"
    )
    print(f"{'':<34}" + "".join(f"{m:<34}" for m in modes))
    metrics = [
        ("time to detect (s)", "detect_s", None, ".2f"),
        ("  SIGKILL (node reports the exit)", "detect_s", "SIGKILL", ".2f"),
        ("  SIGSTOP (heartbeat timeout)", "detect_s", "SIGSTOP", ".2f"),
        ("detection -> first step (s)", "to_first_step_s", None, ".1f"),
        ("steps of compute lost", "lost_steps", None, ".0f"),
    ]
    for label, key, sig, fmt in metrics:
        cells = [_cell([r[key] for r in results[m] if sig is None or r["signal"] == sig], fmt) for m in modes]
        print(f"{label:<34}" + "".join(f"{c:<34}" for c in cells))
    cells = []
    for m in modes:
        tiers = [r.get("resumed_from") for r in results[m]]
        cells.append(", ".join(f"{t} {tiers.count(t)}" for t in sorted(set(tiers), key=str)))
    print(f"{'restored from (checkpoint tier)':<34}" + "".join(f"{c:<34}" for c in cells))
    print("targets: detect <= 2 s, detection -> first step <= 10 s, <= 1 step lost")

    first = read_events(cwd / "runs" / f"bench-{modes[0]}" / "controller" / "events.jsonl")
    ready = [e for e in first if e["event"] == "node_ready"]
    start = next(e for e in first if e["event"] == "start")
    print(
        f"\nelastic start: assignment {1e3 * (start['time'] - ready[nodes - 1]['time']):.0f} ms after the "
        f"{nodes}th ready node (target <= 1000 ms)"
    )
    print("cached setup, assignment -> first step of generation 0 (the first job builds the entry):")
    for m in modes:
        ev = read_events(cwd / "runs" / f"bench-{m}" / "controller" / "events.jsonl")
        st = next(e for e in ev if e["event"] == "start")
        f = next(e for e in ev if e["event"] == "first_step")
        label = f"{m} job, entry {st['setup']}"
        print(
            f"  {label:<30}{f['since_assign_s']:5.1f} s   compilation cache hits {f['cache_hits']}, "
            f"misses {f['cache_misses']} per rank"
        )


if __name__ == "__main__":
    sys.exit(main())

"""Recovery from failures with warm standbys against requeueing the whole job.

Real processes on this machine: a controller, ``--nodes`` node agents (one
more as a standby) and JAX workers of ``--devices`` simulated CPU devices each
(the tiny model, a checkpoint every step).  Into one running job per mode,
``--injections`` failures are injected one after the other, each at a random
step of a random rank (rank 0 included): SIGKILL, and every ``--stop-every``-th
a SIGSTOP (a hang, found by heartbeat timeout).

* ``standby``: the controller kills the group and restarts it at once from warm
  processes (JAX imported, data loaded, compilation cache on disk), the failed
  rank on the standby;
* ``requeue``: every process is killed and started cold, as a requeued job
  would be (without the scheduler's queueing time, which comes on top).

Per mode it prints, over the injections: time to detect (injection to the
controller's decision; target <= 2 s), time from detection to the first
completed step after the restart (target <= 10 s) and steps of compute lost
(target <= 1), as median / 90th percentile / max.  Then the elastic start
(assignment after the ``min_nodes``-th ready node) and the cached setup (time
from assignment to the first step: the cold first job against the same job
resubmitted).

    python benchmarks/recovery.py                    # 20 injections per mode, 4 nodes x 2 devices
    python benchmarks/recovery.py --injections 5 --modes standby
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

from jaxdist.controller.local import LocalJob, write_cpu_cluster
from jaxdist.controller.state import read_events
from jaxdist.controller.timeline import recoveries, summary

COMMON = ["model=tiny", "train.batch_size=16", "train.seq_len=32", "data.max_bytes=300000",
          "train.progress=false", "train.tensorboard=false", "checkpoint.every=1", "train.log_every=1",
          "train.eval_every=0", "train.eval_batches=1", "train.runs_dir=runs"]


def _job(cwd: Path, name: str, nodes: int, devices: int, steps: int, *extra: str, standbys: int = 1) -> LocalJob:
    cluster = write_cpu_cluster(cwd / f"cpu-{nodes}x{devices}.toml", nodes, devices)
    args = [*COMMON, f"mesh.cluster={cluster}", f"train.steps={steps}", f"train.name={name}",
            f"controller.min_nodes={nodes}", f"controller.max_nodes={nodes}", *extra]
    return LocalJob(args + [f"controller.standbys={standbys}"], nodes=nodes + standbys, cwd=cwd)


def run_mode(cwd: Path, mode: str, args, rng: random.Random) -> list[dict]:
    steps = 3 * args.injections + 8
    job = _job(cwd, f"bench-{mode}", args.nodes, args.devices, steps, f"controller.recovery={mode}",
               f"controller.max_failures={args.injections + 1}")
    t0 = time.time()
    try:
        job.start(late=1, timeout=args.timeout)
        for k in range(args.injections):
            s = job.wait_until(lambda s: s.get("generation", -1) == k and s["phase"] == "running", args.timeout,
                               f"generation {k} running")
            target = s["last_step"] + rng.randint(1, 2)
            job.wait_until(lambda s: s["last_step"] >= target or s["phase"] != "running", args.timeout,
                           f"step {target}")
            job.wait_until(lambda s: s["standbys"] or s["phase"] != "running" or mode == "requeue", args.timeout,
                           "a warm standby")
            sig = signal.SIGSTOP if args.stop_every and (k + 1) % args.stop_every == 0 else signal.SIGKILL
            rec = job.inject(rng.randrange(args.nodes), sig)
            print(f"  {mode}: injection {k + 1}/{args.injections}: {rec['signal']} rank {rec['rank']} at step "
                  f"~{rec['step']} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        rc = job.wait(args.timeout)
        assert rc == 0, job.summary()
    finally:
        job.close()
    return recoveries(job.run_dir)


def _row(name: str, values: list[float], unit: str, fmt: str) -> str:
    s = summary(values)
    return (f"{name:<34} {s['n']:>3}  " + "  ".join(f"{s[k]:>8{fmt}}" for k in ("median", "p90", "max"))
            + f"  {unit}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--injections", type=int, default=20, help="failures injected per mode (default: 20)")
    p.add_argument("--nodes", type=int, default=4, help="training nodes (one more is the standby; default: 4)")
    p.add_argument("--devices", type=int, default=2, help="simulated CPU devices per node (default: 2)")
    p.add_argument("--modes", default="standby,requeue", help="comma-separated: standby, requeue")
    p.add_argument("--stop-every", type=int, default=4, help="every N-th injection is a SIGSTOP (0: never)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one wait may take")
    p.add_argument("--dir", help="working directory (default: a temporary one)")
    args = p.parse_args(argv)
    cwd = Path(args.dir or tempfile.mkdtemp(prefix="jaxdist-recovery-")).absolute()
    cwd.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    print(f"working in {cwd}", file=sys.stderr)

    # A short cold job first: it builds the setup cache entry that the later jobs reuse.
    t = time.time()
    cold = _job(cwd, "cold", args.nodes, args.devices, 4, standbys=0)
    try:
        cold.start()
        assert cold.wait(args.timeout) == 0, cold.summary()
    finally:
        cold.close()
    print(f"  cold job: {time.time() - t:.0f} s", file=sys.stderr)

    results = {m: run_mode(cwd, m, args, rng) for m in args.modes.split(",")}

    print(f"\nrecovery, {args.nodes} nodes x {args.devices} CPU devices + 1 standby, tiny model, checkpoint every "
          "step; median / p90 / max")
    print(f"{'':<34} {'n':>3}  {'median':>8}  {'p90':>8}  {'max':>8}")
    for mode, rows in results.items():
        print(f"-- {mode}")
        print(_row("time to detect", [r["detect_s"] for r in rows], "s", ".2f"))
        for kind in ("SIGKILL", "SIGSTOP"):
            print(_row(f"  of which {kind}", [r["detect_s"] for r in rows if r["signal"] == kind], "s", ".2f"))
        print(_row("detection -> first step after", [r["to_first_step_s"] for r in rows], "s", ".1f"))
        print(_row("steps of compute lost", [r["lost_steps"] for r in rows], "steps", ".0f"))
    print("targets: detect <= 2 s, detection -> first step <= 10 s, <= 1 step lost")

    cold_ev = read_events(cold.dir / "events.jsonl")
    first = {m: read_events(cwd / "runs" / f"bench-{m}" / "controller" / "events.jsonl") for m in results}
    ready = [e for e in cold_ev if e["event"] == "node_ready"]
    start = next(e for e in cold_ev if e["event"] == "start")
    print(f"\nelastic start: assignment {1e3 * (start['time'] - ready[args.nodes - 1]['time']):.0f} ms after the "
          f"{args.nodes}th ready node (target <= 1000 ms)")
    print("cached setup: assignment -> first step of generation 0")
    c = next(e for e in cold_ev if e["event"] == "first_step")
    print(f"  cold ({start['setup']}):{'':<14}{c['since_assign_s']:6.1f} s, compilation cache misses per rank "
          f"{c['cache_misses']}")
    for m, ev in first.items():
        st = next(e for e in ev if e["event"] == "start")
        f = next(e for e in ev if e["event"] == "first_step")
        print(f"  resubmitted ({st['setup']}, {m}): {f['since_assign_s']:6.1f} s, misses {f['cache_misses']}, "
              f"hits {f['cache_hits']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A chain's measured throughput: streams chosen per model from profiles against every "same streams for all".

Two cheap stages with known cost curves (``tests/gen/genfns.py``: a task of
``s`` samples sleeps ``a (1 + c (s - 1))`` s; a generator ``variants``,
``a, c = 0.05, 0.25``, two outputs per sample, and a scorer ``score``,
``0.04, 0.5``) run as real generation jobs on this machine: dispatcher, worker
processes, a receiver, every round's node selection. The whole loop:

1. profiling runs of the job at ``--profile-streams`` (2 workers per stage);
2. the stages' profiles fitted from their run logs (``jaxdist gen profile``:
   what a worker spends on a task, the shard's delivery included, not only the
   sleep), the job's mix (two scorer requests per item) from the same logs
   (``gen.job_logs``);
3. the chosen plan (``gen.task_size=0``: streams and workers per stage from a
   pool of ``--nodes``, the most throughput within ``--target`` s per task),
   and each fixed choice (``gen.task_size=s`` for both stages, with the best
   workers per stage for it: the same plan, streams fixed).

Throughput = chain outputs delivered (the last stage's samples) over the
time from the first task's start to the last one's end (the workers' run
logs: process start-up excluded). A choice whose profiled task latency is over
a stage's target is marked: the objective allows only choices within the
targets; the measured median task latencies are printed beside the profile's.

    python benchmarks/gen_chain.py     # about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxdist.data import RunBatchList  # noqa: E402
from jaxdist.gen.delivery import Receiver  # noqa: E402
from jaxdist.gen.profile import fit_profiles, format_table, save_profiles  # noqa: E402
from jaxdist.gen.runlog import read_run_logs  # noqa: E402
from jaxdist.gen.schedule import stages_from_log  # noqa: E402
from tests.gen import genfns  # noqa: E402

FA, FB = "tests.gen.genfns:variants", "tests.gen.genfns:score"
COSTS = {FA: genfns.VARIANTS_COST, FB: genfns.SCORE_COST}


def run_job(tmp: Path, tag: str, samples: Path, settings: list[str]) -> tuple[float, list, list, list[float]]:
    """(outputs/s, streams per stage, workers per stage, median task latency per stage in s) of one job."""
    run = tmp / f"run-{tag}"
    RunBatchList(run, np.arange(2 * 17 * 10, dtype=np.uint32) % 250, "synthetic", 1, 2, 16)
    rec = Receiver(run)
    t = threading.Thread(target=rec.serve, args=(time.monotonic() + 300,), daemon=True)
    t.start()
    state = tmp / f"st-{tag}"
    args = [f"samples={samples}", f"stages={FA},{FB}", "workers=2", f"deliver_to={rec.address}", f"run={run}"]
    args += [f"state_dir={state}", f"name={tag}", *settings]
    env = {k: v for k, v in os.environ.items() if k != "JAXDIST_JOB_TOKEN"}
    env["PYTHONPATH"] = str(REPO)
    try:
        out = subprocess.run([sys.executable, "-m", "jaxdist.cli", "gen", *args], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    finally:
        rec.stop()
        t.join(timeout=5)
        rec.close()
    if out.returncode != 0:
        raise SystemExit(f"job {tag} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    status = json.loads((state / "status.json").read_text())
    recs = read_run_logs(sorted(state.glob("runlog.*.jsonl"))).records
    last = [r for r in recs if r.model == FB]
    span = max(r.end for r in last) - min(r.start for r in recs)
    latency = [float(np.median([r.seconds for r in recs if r.model == f])) for f in (FA, FB)]
    return len(last) / span, status["streams"], status["nodes"], latency


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--target", type=float, default=0.09, help="latency target per task (s)")
    p.add_argument("--profile-streams", default="1,2,4,8", help="the profiling runs' streams")
    p.add_argument("--fixed", default="1,2,3,4,6,8")
    p.add_argument("--nodes", type=int, default=4, help="worker processes of the pool, all stages together")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gen-chain-"))
    samples = tmp / "p.txt"
    samples.write_text("\n".join(f"sample {i}" for i in range(a.samples)))
    t0 = time.perf_counter()
    # 1. profiling runs of the job at several streams (2 workers per stage): the stages' run logs
    pilot = tmp / "pilot.txt"
    pilot.write_text("\n".join(f"sample {i}" for i in range(32)))  # samples like the job's
    for s in [int(x) for x in a.profile_streams.split(",")]:
        run_job(tmp, f"profile{s}", pilot, [f"task_size={s}"])
    logs = sorted(str(x) for x in tmp.glob("st-profile*/runlog.*.jsonl"))
    # 2. the stages' profiles from them (jaxdist gen profile), saved for the dispatcher
    profiles = fit_profiles(read_run_logs(logs).records)
    save_profiles(tmp / "prof.json", profiles)
    planned = [f"profile={tmp / 'prof.json'}", f"nodes={a.nodes}", f"latency_target_s={a.target}"]
    planned.append(f"job_logs={tmp / 'st-profile*' / 'runlog.*.jsonl'}")  # the job's mix: 2 scorer requests each
    # 3. the chosen plan, then every fixed streams with its best workers per stage
    rows = [("chosen", *run_job(tmp, "chosen", samples, ["task_size=0", *planned]))]
    for s in [int(x) for x in a.fixed.split(",")]:
        rows.append((f"fixed {s}", *run_job(tmp, f"fixed{s}", samples, [f"task_size={s}", *planned])))
    print(format_table(profiles, curves=False))

    def within(streams: list[int]) -> bool:  # the objective's test: the profiles' latency of the job's requests
        return all(profiles[st.model].latency_s(s, st.tokens_in, st.tokens_out) <= a.target
                   for st, s in zip(stages, streams))  # fmt: skip

    stages = stages_from_log(read_run_logs(logs).records, [FA, FB], {FA: a.target, FB: a.target})
    print(
        f"\n{a.samples} samples -> {2 * a.samples} chain outputs; stages {FA} (a task of s samples sleeps "
        f"{COSTS[FA][0]} (1 + {COSTS[FA][1]} (s - 1)) s) and {FB} ({COSTS[FB][0]} (1 + {COSTS[FB][1]} (s - 1)) s); "
        f"profiles fitted from runs at {a.profile_streams} streams; a pool of {a.nodes} workers; latency target "
        f"{a.target} s per task; {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.1f} "
        f"({os.cpu_count()} cores)\n"
    )
    print("| strategy | streams (generator, scorer) | workers | outputs/s | task latency p50, s (profile) | "
          "within the latency targets |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rate, streams, nodes, lat in rows:
        fitted = [profiles[st.model].latency_s(s, st.tokens_in, st.tokens_out) for st, s in zip(stages, streams)]
        lats = ", ".join(f"{m:.3f} ({f:.3f})" for m, f in zip(lat, fitted))
        print(f"| {name} | {streams[0]}, {streams[1]} | {nodes[0]}, {nodes[1]} | {rate:.1f} | {lats} | "
              f"{'yes' if within(streams) else 'no'} |")  # fmt: skip
    chosen = rows[0][1]
    ok = [r for r in rows[1:] if within(r[2])]
    best = max(ok, key=lambda r: r[1]) if ok else None
    if best:
        print(f"\nchosen {chosen:.1f} outputs/s; best fixed choice within the targets: {best[0]}, {best[1]:.1f}/s "
              f"(chosen/best = {chosen / best[1]:.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

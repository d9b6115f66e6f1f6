"""A chain's measured throughput: streams chosen per model from profiles against every "same streams for all".

Two cheap stages with known cost curves (``tests/gen/genfns.py``: a task of
``s`` samples sleeps ``a (1 + c (s - 1))`` s; a generator ``variants``,
``a, c = 0.05, 0.25``, two outputs per sample, and a scorer ``score``,
``0.04, 0.5``) run as a real generation job on this machine: dispatcher,
2 worker processes per stage, a receiver, every round's node selection.
Their profiles are the curves themselves; with a latency target of
``--target`` seconds per task the dispatcher chooses each stage's streams
(``gen.task_size=0``: the most throughput within the target). Each fixed
choice runs with ``gen.task_size=s`` for both stages.

Throughput = chain outputs delivered (the last stage's samples) over the
time from the first task's start to the last one's end (the workers' run
logs: process start-up excluded). A fixed choice over a stage's latency
target is marked: the objective allows only choices within the targets.

    python benchmarks/gen_chain.py     # about a minute
"""

from __future__ import annotations

import argparse
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
from jaxdist.gen.profile import ModelProfile, save_profiles  # noqa: E402
from jaxdist.gen.runlog import read_run_logs  # noqa: E402
from tests.gen import genfns  # noqa: E402

FA, FB = "tests.gen.genfns:variants", "tests.gen.genfns:score"
COSTS = {FA: genfns.VARIANTS_COST, FB: genfns.SCORE_COST}


def run_job(tmp: Path, tag: str, samples: Path, settings: list[str]) -> tuple[float, list[int], int]:
    """(outputs/s, streams per stage, outputs) of one job."""
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
    recs = read_run_logs(sorted(state.glob("runlog.*.jsonl"))).records
    last = [r for r in recs if r.model == FB]
    span = max(r.end for r in last) - min(r.start for r in recs)
    streams = [max(r.streams for r in recs if r.model == f) for f in (FA, FB)]
    return len(last) / span, streams, len(last)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--target", type=float, default=0.09, help="latency target per task (s)")
    p.add_argument("--fixed", default="1,2,3,4,6,8")
    a = p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="gen-chain-"))
    samples = tmp / "p.txt"
    samples.write_text("\n".join(f"sample {i}" for i in range(a.samples)))
    prof = {f: ModelProfile.with_contention(f, ca, 0.0, 0.0, cc, 10.0, 10.0) for f, (ca, cc) in COSTS.items()}
    save_profiles(tmp / "prof.json", prof)

    def within(streams: list[int]) -> bool:
        return all(COSTS[f][0] * (1 + COSTS[f][1] * (s - 1)) <= a.target + 1e-12 for f, s in zip((FA, FB), streams))

    t0 = time.perf_counter()
    rows = [("chosen", *run_job(tmp, "chosen", samples, ["task_size=0", f"profile={tmp / 'prof.json'}",
                                                          f"latency_target_s={a.target}"]))]  # fmt: skip
    for s in [int(x) for x in a.fixed.split(",")]:
        rows.append((f"fixed {s}", *run_job(tmp, f"fixed{s}", samples, [f"task_size={s}"])))
    print(
        f"{a.samples} samples -> {2 * a.samples} chain outputs; stages {FA} (a, c = {COSTS[FA]}) and {FB} "
        f"({COSTS[FB]}); 2 workers per stage; latency target {a.target} s per task; {time.perf_counter() - t0:.0f} s\n"
    )
    print("| strategy | streams (generator, scorer) | outputs | outputs/s | within the latency targets |")
    print("| --- | --- | --- | --- | --- |")
    for name, rate, streams, n in rows:
        print(f"| {name} | {streams[0]}, {streams[1]} | {n} | {rate:.1f} | {'yes' if within(streams) else 'no'} |")
    chosen = rows[0][1]
    ok = [r for r in rows[1:] if within(r[2])]
    best = max(ok, key=lambda r: r[1]) if ok else None
    if best:
        print(f"\nchosen {chosen:.1f} outputs/s; best fixed choice within the targets: {best[0]}, {best[1]:.1f}/s "
              f"(chosen/best = {chosen / best[1]:.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

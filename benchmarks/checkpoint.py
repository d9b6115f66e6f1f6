"""Distributed checkpoints: bytes per process, save time, and how long a save blocks training.

Part 1 runs 4 JAX processes x 2 simulated CPU devices on this machine
(jax.distributed on 127.0.0.1, gloo) and saves a train state (params + AdamW
moments of the ``small`` preset widened by default to ~163 MB, filled with
pseudo-random values so compression cannot flatter anyone) with fully
replicated parameters (``data=8``) and with ``fsdp=8``, each under jaxdist's
balanced plan and under the naive "replica 0 writes every replicated shard"
(= process 0 writes every replicated array), and with plain orbax
(``ocp.StandardCheckpointer``: async, OCDBT, orbax's own replica choice) on
the same state in the same process group.  It prints the bytes of the
files each process wrote (max/mean: target <= 1.05), the save wall time
from ``save()`` until the checkpoint is committed (median of ``--saves``),
with the part of it the caller was blocked, restores onto the same
sharding (jaxdist: with its checksum verification; each checked bit for bit
against the saved values; median of ``--saves`` - 1 after one warm-up), and
jaxdist balanced / plain orbax.  No step is deleted while timed (every one is
kept); jaxdist balanced and plain orbax save and restore the same state
alternately, which goes first swapped every round.

Part 2 trains in one process with 8 devices (``data=8``) and saves
asynchronously every ``--every`` steps: it prints the median step time, the
time each save blocked the loop (device-to-host copy plus orbax's
bookkeeping), their ratio (target <= 5%) and the same amortised over the
save interval.

    python benchmarks/checkpoint.py                     # ~4-5 minutes on 2 cores
    python benchmarks/checkpoint.py --quick             # the small preset as is, fewer saves
    python benchmarks/checkpoint.py --size 1000 --part1-only           # part 1 at about 1 GB
    python benchmarks/checkpoint.py --size 4000 --mesh fsdp --part1-only  # 4 GB (data=8 needs 8 copies: 32 GB)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "checkpoint"))
from procs import Group, cluster_file  # noqa: E402  (the multi-process launcher the tests use)

WIDE = ["model.d_model=512", "model.d_ff=1536", "model.n_heads=8", "model.head_dim=64", "model.n_kv_heads=4"]
# --size: the ``small`` preset widened to about this many MB of train state (params + AdamW moments, fp32)
SIZES = {
    "160": WIDE,
    "1000": ["model.d_model=1152", "model.d_ff=4608", "model.n_heads=18", "model.head_dim=64", "model.n_kv_heads=6"],
    "4000": ["model.d_model=2304", "model.d_ff=9216", "model.n_heads=18", "model.head_dim=128", "model.n_kv_heads=6"],
}


def part1(tmp: Path, model: list[str], saves: int, axes: tuple[str, ...] = ("data", "fsdp")) -> list[dict]:
    cl = cluster_file(tmp, 4, 2)
    base = [
        "model=small",
        *model,
        "train.seq_len=32",
        "train.batch_size=8",
        "data.max_bytes=200000",
        f"mesh.cluster={cl}",
        f"train.runs_dir={tmp / 'runs'}",
    ]
    jobs = []
    for axis in axes:
        common = {"overrides": base + [f"mesh.{axis}=8", f"train.name={axis}"], "saves": saves, "mesh": f"{axis}=8"}
        # jaxdist balanced and plain orbax on the same state, alternately (who goes first swapped every round)
        jobs.append({**common, "ckpt": str(tmp / f"{axis}-pair"), "strategy": "pair", "restores": saves})
        jobs.append({**common, "ckpt": str(tmp / f"{axis}-replica0"), "strategy": "replica0", "keep": saves})
    with Group(tmp, 4, 2, ["save", json.dumps({"jobs": jobs})], tag="bench-save") as g:
        g.wait(1200)
        per_process = [g.results(i) for i in range(4)]

    def row(job: dict, strategy: str, times: list[dict], marker: dict) -> dict:
        # A save is done when the slowest process is done; skip the first (warm-up).
        first = 1 if saves > 1 else 0
        walls = [max(t["save_s"][k][1] for t in times) for k in range(first, saves)]
        blocked = [max(t["save_s"][k][0] for t in times) for k in range(first, saves)]
        restores = [statistics.median(t["restore_s"][1:]) for t in times if t["restore_s"][1:]]
        return {
            "mesh": job["mesh"],
            "strategy": strategy,
            "written": marker["bytes_written_per_process"],
            "planned": marker["planned_bytes_per_process"],
            "wall_s": statistics.median(walls),
            "blocked_s": statistics.median(blocked),
            "restore_s": max(restores) if restores else None,  # the slowest process's median after the first
        }

    rows = []
    for j, job in enumerate(jobs):
        got = [per_process[p][j] for p in range(4)]
        if job["strategy"] == "pair":
            marker = json.loads((Path(job["ckpt"]) / "jaxdist" / str(saves) / "jaxdist_commit.json").read_text())
            rows.append(row(job, "balanced", [g["jaxdist"] for g in got], marker))
            plain = {"bytes_written_per_process": got[0]["orbax"]["written"], "planned_bytes_per_process": None}
            rows.append(row(job, "orbax", [g["orbax"] for g in got], plain))
        else:
            marker = json.loads((Path(job["ckpt"]) / str(saves) / "jaxdist_commit.json").read_text())
            rows.append(row(job, job["strategy"], got, marker))
    return rows


def part2(tmp: Path, model: list[str], steps: int, every: int, batch: int, seq: int) -> dict:
    overrides = [
        "model=small",
        *model,
        f"train.seq_len={seq}",
        f"train.batch_size={batch}",
        "data.max_bytes=2000000",
        "mesh.data=8",
        "mesh.cluster=cpu-8",
        f"train.runs_dir={tmp / 'runs'}",
        "train.name=steps",
    ]
    spec = {"overrides": overrides, "ckpt": str(tmp / "steps-ckpt"), "steps": steps, "every": every}
    with Group(tmp, 1, 8, ["steps", json.dumps(spec)], tag="bench-steps") as g:
        g.wait(1200)
        return g.results(0)[0]


def part2_report(tmp: Path, model: list[str], args: argparse.Namespace) -> None:
    """Part 2's run and its lines."""
    s = part2(tmp, model, args.steps, args.every, args.batch, args.seq)
    saved_steps = {(i + 1) for i in range(args.steps) if (i + 1) % args.every == 0}
    plain = [t for i, t in enumerate(s["step_s"]) if i not in saved_steps and (i + 1) not in saved_steps]
    step = statistics.median(plain)
    after = [s["step_s"][i] for i in range(args.steps) if i in saved_steps]
    blocked = statistics.median(s["blocked_s"])
    print(
        f"\nPart 2: 1 process x 8 CPU devices, data=8, batch {args.batch} x {args.seq}, "
        f"async save every {args.every} steps ({len(s['blocked_s'])} saves)"
    )
    print(f"step time (median, steps without a save nearby)   {step * 1e3:9.1f} ms")
    print(
        f"step time right after a save (median)              {statistics.median(after) * 1e3:9.1f} ms" if after else ""
    )
    print(
        f"blocked by a save (median; max {max(s['blocked_s']) * 1e3:.1f} ms)        {blocked * 1e3:9.1f} ms"
        f"  = {100 * blocked / step:.1f}% of a step"
    )
    print(f"waited for the previous save (total)               {sum(s['waited_s']) * 1e3:9.1f} ms")
    print(
        f"  amortised over the save interval                             = "
        f"{100 * blocked / (step * args.every):.2f}% of training time"
    )
    bg = [b for b in s["background_s"] if b is not None]
    print(
        f"background part of a save (median)                 {statistics.median(bg) * 1e3:9.1f} ms"
        f"  (overlaps the next steps; saves found busy: {s['busy']})"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small preset as is (~10 MB state), 2 saves")
    ap.add_argument("--size", choices=sorted(SIZES, key=int), default="160", help="part 1's state, about MB")
    ap.add_argument("--mesh", nargs="+", choices=["data", "fsdp"], default=["data", "fsdp"], help="part 1's meshes")
    ap.add_argument("--part1-only", action="store_true", help="skip part 2 (the training loop's blocked time)")
    ap.add_argument("--saves", type=int, default=4, help="saves per configuration in part 1 (first one is warm-up)")
    ap.add_argument("--steps", type=int, default=12, help="training steps timed in part 2")
    ap.add_argument("--every", type=int, default=4, help="part 2: save every N steps")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--keep-files", action="store_true", help="keep the checkpoints (for `jaxdist ckpt plan DIR`)")
    args = ap.parse_args(argv)
    model = [] if args.quick else SIZES[args.size]
    saves = 2 if args.quick else args.saves
    tmp = Path(tempfile.mkdtemp(prefix="jaxdist-ckpt-bench-"))
    t0 = time.perf_counter()
    rows = part1(tmp, model, saves, tuple(args.mesh))
    total = sum(next(r["planned"] for r in rows if r["planned"]))
    orbax = {r["mesh"]: r for r in rows if r["strategy"] == "orbax"}
    print(
        f"\nPart 1: 4 processes x 2 CPU devices, state {total / 1e6:.1f} MB (array bytes), "
        f"files on {tmp} (one local disk)"
    )
    head = (
        f"{'mesh':<8} {'strategy':<9} "
        + " ".join(f"{'p' + str(i) + ' MB':>8}" for i in range(4))
        + f" {'max/mean':>8} {'plan':>6} {'save s':>7} {'blocked s':>9} {'restore s':>9}"
        + f" {'save x':>7} {'blocked x':>9} {'restore x':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        w, p, o = r["written"], r["planned"], orbax[r["mesh"]]
        restore = f"{r['restore_s']:>9.3f}" if r["restore_s"] is not None else f"{'':>9}"
        ratios = ""
        if r["strategy"] == "balanced":
            ratios = "".join(f" {r[k] / o[k]:>{n}.2f}" for k, n in (("wall_s", 7), ("blocked_s", 9), ("restore_s", 9)))
        print(
            f"{r['mesh']:<8} {r['strategy']:<9} "
            + " ".join(f"{b / 1e6:>8.2f}" for b in w)
            + f" {max(w) * 4 / sum(w):>8.3f} {max(p) * 4 / sum(p) if p else float('nan'):>6.3f}"
            + f" {r['wall_s']:>7.3f} {r['blocked_s']:>9.3f}{restore}{ratios}"
        )
    print(
        "MB: file bytes each process wrote (its ocdbt.process_<i> folder; root metadata to process 0); "
        "plan: max/mean of array bytes in the write plan; save s: save() until committed on every process, "
        f"median of {max(1, saves - 1)}; blocked s: of which the caller waited; restore s: the slowest process's "
        f"median of {max(1, saves - 1)} restores after one; x: jaxdist balanced / plain orbax."
    )

    if not args.part1_only:
        part2_report(tmp, model, args)
    if args.keep_files:
        print(f"\ntotal {time.perf_counter() - t0:.0f} s; checkpoints in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The fast local checkpoint tier against persistent checkpoints, every step.

4 JAX processes x 2 simulated CPU devices on this machine (jax.distributed on
127.0.0.1, gloo), with ``fsdp=4 tensor=2`` (every process holds different
shards) and with ``data=4 fsdp=2`` (every process holds the same pieces, so
the peer needs none of them sent), the ``small`` preset widened to ~163 MB of
train state (params + AdamW moments).  In one group it times ``--steps`` training steps three ways:
without checkpoints, with an asynchronous orbax save to the run directory
after every step (the persistent tier), and with a local-tier save after every
step (host copy + replication of each process's shards to the next process +
background write to node-local disk).  Then it restores the step both ways,
the local one with rank 2's own files deleted (a replaced node: its shards
come back from its peer).  Every tier writes to this machine's one disk, so
the ratio shows the work each tier does, not the gap between a node's SSD and
a shared file system (which only widens it).

    python benchmarks/local_tier.py               # ~3 minutes on 2 cores
    python benchmarks/local_tier.py --quick       # the small preset as is (~10 MB)
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


LAYOUTS = {
    "fsdp=4 tensor=2": ["mesh.fsdp=4", "mesh.tensor=2"],  # every process holds different shards
    "data=4 fsdp=2": ["mesh.data=4", "mesh.fsdp=2"],
}  # every process holds the same pieces


def run(tmp: Path, layout: str, args) -> list[dict]:
    overrides = [
        "model=small",
        *([] if args.quick else WIDE),
        f"train.seq_len={args.seq}",
        f"train.batch_size={args.batch}",
        "data.max_bytes=2000000",
        *LAYOUTS[layout],
        f"mesh.cluster={cluster_file(tmp, 4, 2)}",
        f"train.runs_dir={tmp / 'runs'}",
        f"train.name=tiers-{layout.replace(' ', '-')}",
    ]
    spec = {
        "overrides": overrides,
        "ckpt": str(tmp / f"persistent-{layout}"),
        "local": str(tmp / f"local-{layout}"),
        "steps": args.steps,
    }
    with Group(tmp, 4, 2, ["tiers", json.dumps(spec)], tag="tiers", nodes=[f"node{i}" for i in range(4)]) as g:
        g.wait(1800)
        return [g.results(i)[0] for i in range(4)]


def report(layout: str, res: list[dict], args) -> None:
    med = statistics.median
    r0 = res[0]
    payload, sent = [r["local_payload"] for r in res], [r["local_sent"] for r in res]
    print(
        f"\n{layout}: local payload per process {med(payload) / 1e6:.1f} MB, sent to the peer "
        f"{med(sent) / 1e6:.3f} MB (pieces the peer holds itself stay home); median over {args.steps} steps, "
        "process 0"
    )
    base = med(r0["none"])
    rows = [
        ("no checkpoint", r0["none"], None, None),
        ("persistent save every step", r0["persistent"], r0["persistent_blocked"], r0["persistent_background"]),
        ("local tier every step", r0["local"], r0["local_blocked"], r0["local_background"]),
    ]
    head = f"{'':<28}{'step+save ms':>13}{'vs none':>9}{'blocked ms':>12}{'background ms':>15}"
    print(head + "\n" + "-" * len(head))
    for name, times, blocked, bg in rows:
        cells = f"{med(times) * 1e3:>13.1f}{med(times) / base:>9.2f}"
        cells += f"{med(blocked) * 1e3:>12.1f}" if blocked else f"{'':>12}"
        bgv = [b for b in (bg or []) if b is not None]
        cells += f"{med(bgv) * 1e3:>15.1f}" if bgv else f"{'':>15}"
        print(f"{name:<28}{cells}")
    print(f"  of the local tier's blocked time, replication to the peer: {med(r0['local_replicate']) * 1e3:.1f} ms")
    print(
        f"restore of the last step (slowest process): local tier {max(r['local_restore_s'] for r in res):.2f} s "
        f"(rank 2's pieces from its peer), persistent {max(r['persistent_restore_s'] for r in res):.2f} s"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small preset as is (~10 MB of state)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per way")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="jaxdist-local-bench-"))
    t_start = time.perf_counter()
    print(
        f"local tier vs persistent checkpoints, every step: 4 processes x 2 CPU devices, batch {args.batch} x "
        f"{args.seq}, {'small' if args.quick else 'small widened to d_model 512'} model"
    )
    try:
        for layout in args.layouts.split(","):
            report(layout, run(tmp, layout, args), args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

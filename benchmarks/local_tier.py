"""The fast local checkpoint tier against persistent checkpoints, every step.

4 JAX processes x 2 simulated CPU devices on this machine (jax.distributed on
127.0.0.1, gloo), ``fsdp=4 tensor=2`` (every process holds different shards),
the ``small`` preset widened to ~163 MB of train state (params + AdamW
moments).  In one group it times ``--steps`` training steps three ways:
without checkpoints, with an asynchronous orbax save to the run directory
after every step (the persistent tier), and with a local-tier save after every
step (host copy + replication of each process's shards to the next process +
background write to node-local disk).  Then it restores the step both ways,
the local one with rank 2's own files deleted (a replaced node: its shards
come back from its peer).  Every tier writes to this machine's one disk, so
the ratio shows the work each tier does, not the gap between a node's SSD and
a shared file system (which only widens it).

    python benchmarks/local_tier.py               # ~2 minutes on 2 cores
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small preset as is (~10 MB of state)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per way")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="jaxdist-local-bench-"))
    t_start = time.perf_counter()
    overrides = ["model=small", *([] if args.quick else WIDE), f"train.seq_len={args.seq}",
                 f"train.batch_size={args.batch}", "data.max_bytes=2000000", "mesh.fsdp=4", "mesh.tensor=2",
                 f"mesh.cluster={cluster_file(tmp, 4, 2)}", f"train.runs_dir={tmp / 'runs'}", "train.name=tiers"]
    spec = {"overrides": overrides, "ckpt": str(tmp / "persistent"), "local": str(tmp / "local"),
            "steps": args.steps}
    try:
        with Group(tmp, 4, 2, ["tiers", json.dumps(spec)], tag="tiers", nodes=[f"node{i}" for i in range(4)]) as g:
            g.wait(1800)
            res = [g.results(i)[0] for i in range(4)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    r0 = res[0]
    payload = [r["local_payload"] for r in res]
    print(f"\nlocal tier vs persistent checkpoints, every step: 4 processes x 2 CPU devices, fsdp=4 tensor=2, "
          f"batch {args.batch} x {args.seq}; local payload per process {med(payload) / 1e6:.1f} MB "
          f"({sum(payload) / 1e6:.1f} MB in all, as much again received from the peers); "
          f"median over {args.steps} steps, process 0")
    base = med(r0["none"])
    rows = [("no checkpoint", r0["none"], None, None),
            ("persistent save every step", r0["persistent"], r0["persistent_blocked"], r0["persistent_background"]),
            ("local tier every step", r0["local"], r0["local_blocked"], r0["local_background"])]
    head = f"{'':<28}{'step+save ms':>13}{'vs none':>9}{'blocked ms':>12}{'background ms':>15}"
    print(head + "\n" + "-" * len(head))
    for name, times, blocked, bg in rows:
        cells = f"{med(times) * 1e3:>13.1f}{med(times) / base:>9.2f}"
        cells += f"{med(blocked) * 1e3:>12.1f}" if blocked else f"{'':>12}"
        bgv = [b for b in (bg or []) if b is not None]
        cells += f"{med(bgv) * 1e3:>15.1f}" if bgv else f"{'':>15}"
        print(f"{name:<28}{cells}")
    print(f"  of the local tier's blocked time, replication to the peer: {med(r0['local_replicate']) * 1e3:.1f} ms")
    print(f"restore of the last step: local tier {max(r['local_restore_s'] for r in res):.2f} s "
          f"(rank 2's shards from its peer), persistent {max(r['persistent_restore_s'] for r in res):.2f} s "
          "(slowest process)")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Batch-list loader throughput against the training step rate of the default model.

Two sources, each read through a fresh batch list (version 1) in a temporary run directory:

- ``embedded``: the default corpus (the standard library's .py files, ~29 M train tokens);
- ``tokens-1GiB``: a flat uint16 token file of 1 GiB (512 Mi random ids < 260), written to a
  temporary directory now and deleted at the end (so it is in the page cache: warm reads).

For each: ``build`` = seconds to create version 1 (SHA-256 of every token, the shuffled order);
``host`` = batches/s of ``BatchReader.batch`` (numpy int32 [B, T+1], one thread, random positions of
the list in order); ``loader`` = batches/s of ``BatchLoader`` handing out global ``jax.Array``s on the
training mesh (each device's rows read by the callback, as the Trainer consumes them).

Then the default model (``small`` preset, default batch 32 x 128, mesh data=8 on 8 simulated CPU
devices): train steps/s on one batch repeated (no data) and fed by the loader, and the seconds per
step spent waiting for data. The loader keeps the accelerator fed when its batches/s exceed the
steps/s by a wide margin.

    python benchmarks/data.py                    # both sources, 3000 batches each, 20 train steps
    python benchmarks/data.py --gib 0.25 --batches 1000 --train-steps 0
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "jax" not in sys.modules:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])

import numpy as np  # noqa: E402

from jaxdist.config import DataConfig, load_config  # noqa: E402
from jaxdist.data import BatchLoader, RunBatchList, load_source  # noqa: E402

MIB = 2**20


def write_big_token_file(path: Path, gib: float) -> Path:
    """``gib`` GiB of uint16 ids in [0, 260), written in 64 MiB pieces (bounded memory)."""
    n = int(gib * 2**30) // 2
    rng = np.random.default_rng(0)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for start in range(0, n, 32 * MIB):
            rng.integers(0, 260, min(32 * MIB, n - start), dtype=np.uint16).tofile(f)
    os.replace(tmp, path)
    return path


def measure_source(name: str, data: DataConfig, batch: int, seq: int, n_batches: int, sharding) -> dict:
    split = load_source(data)
    with tempfile.TemporaryDirectory() as run:
        t0 = time.perf_counter()
        bl = RunBatchList(run, split.train, split.name, data.seed, batch, seq)
        build = time.perf_counter() - t0
        reader = bl.reader
        n = min(n_batches, len(bl.current))
        reader.batch(0)  # builds the epoch's window permutation once
        t0 = time.perf_counter()
        for p in range(n):
            reader.batch(p)
        host = n / (time.perf_counter() - t0)
        with BatchLoader(reader, 0, sharding, depth=2) as loader:
            loader.get(0)
            t0 = time.perf_counter()
            for p in range(1, n):
                loader.get(p)[1].block_until_ready()
            dev = (n - 1) / (time.perf_counter() - t0)
    return {
        "source": name,
        "tokens": len(split.train),
        "batches": len(bl.current),
        "build_s": build,
        "host": host,
        "loader": dev,
        "mb_s": host * batch * (seq + 1) * 4 / MIB,
    }


def measure_training(steps: int) -> dict:
    import jax

    from jaxdist.train.trainer import Trainer

    with tempfile.TemporaryDirectory() as runs:
        cfg = load_config(
            None,
            [
                f"train.runs_dir={runs}",
                "checkpoint.enabled=false",
                "train.progress=false",
                "train.tensorboard=false",
                "train.eval_every=0",
                f"train.steps={steps + 3}",
            ],
        )
        with Trainer(cfg) as t:
            state = t.init_state()
            with t.batches.loader(0, t.batch_sharding) as loader:
                for i in range(3):  # compile + warm up
                    state, m = t.train_step(state, loader.get(i)[1])
                jax.block_until_ready(m)
                fixed = loader.get(3)[1]
                t0 = time.perf_counter()
                for _ in range(steps):
                    state, m = t.train_step(state, fixed)
                jax.block_until_ready(m)
                alone = steps / (time.perf_counter() - t0)
                wait, t0 = 0.0, time.perf_counter()
                for i in range(4, 4 + steps - 1):
                    w = time.perf_counter()
                    b = loader.get(i)[1]
                    wait += time.perf_counter() - w
                    state, m = t.train_step(state, b)
                jax.block_until_ready(m)
                fed = (steps - 1) / (time.perf_counter() - t0)
            desc = t.describe()
    return {
        "alone": alone,
        "fed": fed,
        "wait_ms": 1e3 * wait / (steps - 1),
        "desc": desc,
        "batch": cfg.train.batch_size,
        "seq": cfg.train.seq_len,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=3000, help="batches read per source (default 3000)")
    p.add_argument("--gib", type=float, default=1.0, help="size of the token file in GiB (0: skip; default 1)")
    p.add_argument("--train-steps", type=int, default=20, help="timed train steps (0: skip; default 20)")
    args = p.parse_args(argv)

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    cfg = load_config(None, [])
    B, T = cfg.train.batch_size, cfg.train.seq_len
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data", None))
    rows = [measure_source("embedded", cfg.data, B, T, args.batches, sharding)]
    tmp = Path(tempfile.mkdtemp(prefix="jaxdist-bench-data-"))
    try:
        if args.gib > 0:
            t0 = time.perf_counter()
            f = write_big_token_file(tmp / "tokens.bin", args.gib)
            print(
                f"wrote {f.stat().st_size / 2**30:.2f} GiB token file in {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
            )
            rows.append(
                measure_source(
                    f"tokens-{args.gib:g}GiB", DataConfig(source="tokens", path=str(f)), B, T, args.batches, sharding
                )
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    train = measure_training(args.train_steps) if args.train_steps > 0 else None

    print(
        f"\nbatch list loader, batch {B} x {T + 1} tokens, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"{os.cpu_count()} CPU cores"
    )
    print(
        f"{'source':<14} {'train tokens':>14} {'batches':>9} {'build s':>8} {'host b/s':>9} {'MiB/s':>7} "
        f"{'loader b/s':>11}" + (f" {'loader/step':>12}" if train else "")
    )
    for r in rows:
        ratio = f" {r['loader'] / train['fed']:>11.0f}x" if train else ""
        print(
            f"{r['source']:<14} {r['tokens']:>14,} {r['batches']:>9,} {r['build_s']:>8.2f} {r['host']:>9.0f} "
            f"{r['mb_s']:>7.0f} {r['loader']:>11.0f}{ratio}"
        )
    if train:
        print(f"\ndefault model: {train['desc']}")
        print(
            f"train steps/s: {train['alone']:.2f} on a fixed batch, {train['fed']:.2f} fed by the loader "
            f"(waiting {train['wait_ms']:.2f} ms/step for data)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

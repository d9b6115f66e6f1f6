"""The GPU check: one script, one H200 (or H100), under 8 minutes, one table.

1. llama-1b MFU (``benchmarks/mfu.py``'s measurement) with ``model.attention=xla`` and ``cudnn`` at seq 2048
   (batch 8) and seq 8192 (batch 2): step time, tokens/s, MFU, HFU and the device's peak memory.
2. The compiled peak memory of the step (``compiled.memory_analysis()``) against the planner's prediction
   (``jaxdist.planner.cost.memory``), for ``train.remat=full`` and ``none`` at seq 2048, batch 8 (compiled
   only, not run: ``none`` may not fit).
3. The remat selector (``train.remat=auto``) at one budget against ``dots_with_no_batch_dims_saveable``: step
   time, and the selector's budget beside the compiled peak.

Each row is one compile; a row that fails (out of memory, an unsupported kernel) prints its error and the
others still run.  ``--cpu-smoke`` runs the same rows on a shrunk model on the CPU to prove the script
works (cudnn rows say they need a GPU; the numbers mean nothing).

    python benchmarks/gpu_check.py              # on the GPU machine: pip install -e '.[cuda12]'
    python benchmarks/gpu_check.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mfu  # noqa: E402  (benchmarks/mfu.py: the MFU measurement and the shrunk smoke model)

from jaxdist.config import load_config  # noqa: E402  (jax-free: safe before the platform is chosen)

GIB = 2**30


def _mfu_row(attention: str, seq: int, batch: int, smoke: bool, extra: list[str]) -> dict[str, str]:
    """One MFU measurement as a dict of mfu.py's rows (or {"error": ...})."""
    argv = ["--seq", str(seq), "--batch", str(batch), "--steps", "3" if smoke else "8", "--warmup", "2"]
    argv += (["--cpu-smoke"] if smoke else []) + [f"model.attention={attention}", f"model.max_seq_len={seq}", *extra]
    try:
        return dict(mfu.run(mfu.parse_args(argv)))
    except Exception as e:  # out of memory, or a kernel this device does not have: say so, go on
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}


def _config(remat: str, seq: int, batch: int, smoke: bool, extra: list[str]):
    return load_config(
        None,
        [
            "model=llama-1b",
            *(mfu.SMOKE_MODEL if smoke else []),
            "model.dtype=bfloat16",
            f"model.max_seq_len={seq}",
            "mesh.data=1",
            f"train.batch_size={batch}",
            f"train.seq_len={seq}",
            f"train.remat={remat}",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.enabled=false",
            "data.max_bytes=4000000",
            f"train.runs_dir={os.environ.get('TMPDIR', '/tmp')}/jaxdist-gpu-check",
            *extra,
        ],
    )


def _memory_rows(seq: int, batch: int, smoke: bool, extra: list[str]) -> list[tuple[str, str]]:
    """Planner-predicted against compiled peak bytes per device for the planner's remat choices full and none."""
    import jax

    from jaxdist.cluster import load_cluster
    from jaxdist.planner.candidates import strategy_of
    from jaxdist.planner.computation import computation_view
    from jaxdist.planner.cost import memory
    from jaxdist.resolve import resolve
    from jaxdist.train.trainer import Trainer

    rows = []
    for remat in ("full", "none"):
        cfg = _config(remat, seq, batch, smoke, extra)
        try:
            resolved = resolve(cfg, jax.devices()[:1])
            cfg = resolved.config
            predicted = memory(computation_view(cfg.model, seq), strategy_of(cfg, 1), batch).total
            with Trainer(resolved) as t:
                m = t.compile_train_step().memory_analysis()
            compiled = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            rows.append(
                (
                    f"memory, remat {remat}",
                    f"compiled {compiled / GIB:.2f} GiB, planner {predicted / GIB:.2f} GiB "
                    f"(planner / compiled {predicted / compiled:.3f}; {load_cluster(cfg.mesh.cluster).name} terms)",
                )
            )
        except Exception as e:
            rows.append((f"memory, remat {remat}", f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
    return rows


def _selector_rows(seq: int, batch: int, budget: int, smoke: bool, extra: list[str]) -> list[tuple[str, str]]:
    """The remat selector's plan at ``budget`` bytes against dots_with_no_batch_dims_saveable."""
    rows = []
    for remat in ("auto", "dots_with_no_batch_dims_saveable"):
        more = [f"train.remat_budget_bytes={budget}"] if remat == "auto" else []
        argv = ["--seq", str(seq), "--batch", str(batch), "--steps", "3" if smoke else "8", "--warmup", "2"]
        argv += (["--cpu-smoke"] if smoke else []) + ["--remat", remat, *more, *extra]
        try:
            r = dict(mfu.run(mfu.parse_args(argv)))
            rows.append((f"remat {remat}", f"step {r['step time'].split(' (')[0]}, MFU {r['MFU']}, {r['peak memory']}"))
        except Exception as e:
            rows.append((f"remat {remat}", f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
    size = f"{budget / GIB:.2f} GiB" if budget >= GIB else f"{budget / 2**20:.1f} MiB"
    rows.append(("selector budget", f"{size} of saved activations per device (train.remat_budget_bytes)"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-smoke", action="store_true", help="a shrunk model on the CPU: proves the script runs")
    p.add_argument("--budget-gib", type=float, default=8.0, help="the remat selector's budget (default 8 GiB)")
    p.add_argument("overrides", nargs="*", help="further config overrides for every row")
    args = p.parse_args(argv)
    smoke = args.cpu_smoke
    if smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    t0 = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    seqs = ((128, 4), (256, 2)) if smoke else ((2048, 8), (8192, 2))
    print(f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print("\n| attention | seq x batch | step | tokens/s | MFU | HFU | peak memory |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seq, batch in seqs:
        for attention in ("xla", "cudnn"):
            if attention == "cudnn" and not on_gpu:
                print(f"| cudnn | {seq} x {batch} | needs a GPU | | | | |")
                continue
            r = _mfu_row(attention, seq, batch, smoke, args.overrides)
            if "error" in r:
                print(f"| {attention} | {seq} x {batch} | {r['error']} | | | | |")
                continue
            print(
                f"| {attention} | {seq} x {batch} | {r['step time'].split(' (')[0]} | {r['tokens/s'].split(' (')[0]} "
                f"| {r['MFU']} | {r['HFU'].split(' (')[0]} | {r['peak memory']} |"
            )
    seq, batch = seqs[0]
    budget = int(args.budget_gib * GIB) if not smoke else 4 << 20
    rows = _memory_rows(seq, batch, smoke, args.overrides) + _selector_rows(seq, batch, budget, smoke, args.overrides)
    width = max(len(k) for k, _ in rows)
    print()
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Attention implementations: compiled peak memory and step time of ``xla`` against ``blockwise`` on one device.

For each sequence length (default 1k, 4k, 16k tokens) the gradient of the training loss
(``jaxdist.train.step.loss_and_grads``: forward, loss, backward; no optimizer) of a small model (default the
``small`` preset, batch 1, ``model.max_seq_len`` raised to the sequence) is compiled with
``model.attention=xla`` and with ``blockwise``.  Peak memory is XLA's plan from ``compiled.memory_analysis()``:
temp + arguments + outputs - aliased (MiB).  Step time is the median of ``--steps`` timed steps after one
warmup, each waited on with ``block_until_ready``; a program whose planned peak exceeds ``--budget-gib``
(default: 60% of this machine's available memory) is compiled but not run.  The last columns are the ratios
xla / blockwise.

The second table (``--context-seq``, default 16384; ``--contexts 1,2,4,8``) is the whole compiled train step
(the Trainer's: forward, backward, adam update) of the same model, batch 1, with the sequence split over
``mesh.context`` devices of the 8 simulated CPU devices: peak memory per device (memory_analysis), the
planner's prediction for that strategy, ``peak(1) / peak(c)`` against the ideal ``c``, and a step time
(one timed step after one warmup; ``--context-steps 0`` compiles only).  Its first row is ``xla`` attention on
one device.  ``--budget-mib`` (default 512) is a per-device budget: the last column says which rows fit it.

    python benchmarks/attention.py                      # 1k, 4k, 16k on one CPU device, then the context rows
    python benchmarks/attention.py --seqs 1024,2048 --block 256 --steps 3 --context-seq 4096
    python benchmarks/attention.py --seqs '' --context-steps 0     # the context rows only, compile only
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def available_gib() -> float:
    """MemAvailable of /proc/meminfo in GiB (16 where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 16.0


def measure(preset: str, seq: int, impl: str, block: int, steps: int, budget_gib: float) -> dict:
    """{'peak_mib', 'step_s' (None: not run), 'compile_s'} of one loss-and-gradient program."""
    import jax
    import numpy as np

    from jaxdist.config import load_config
    from jaxdist.models.transformer import create_abstract, init_params
    from jaxdist.train.step import loss_and_grads

    cfg = load_config(
        None,
        [f"model={preset}", f"model.max_seq_len={seq}", f"model.attention={impl}", f"model.attention_block={block}"],
    )
    graphdef, _, _ = create_abstract(cfg.model)
    params = jax.jit(lambda: init_params(cfg.model, seed=0))()
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (1, seq + 1), dtype=np.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(lambda p, t: loss_and_grads(graphdef, p, t)).lower(params, tokens).compile()
    compile_s = time.perf_counter() - t0
    m = compiled.memory_analysis()
    peak = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    out = {"peak_mib": peak / 2**20, "step_s": None, "compile_s": compile_s}
    if peak > budget_gib * 2**30:
        return out
    jax.block_until_ready(compiled(params, tokens))  # warmup
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, tokens))
        times.append(time.perf_counter() - t0)
    out["step_s"] = statistics.median(times)
    return out


def measure_context(preset: str, seq: int, impl: str, context: int, block: int, steps: int) -> dict:
    """{'peak_mib', 'predicted_mib', 'step_s' (None: not run), 'compile_s'} of the Trainer's step with the
    sequence split over ``context`` devices (batch 1)."""
    import jax

    from jaxdist.measure.steps import measure_step, measurement_config
    from jaxdist.planner.candidates import strategy_of
    from jaxdist.planner.computation import computation_view
    from jaxdist.planner.cost import memory

    cfg = measurement_config(
        [
            f"model={preset}",
            f"model.max_seq_len={seq}",
            f"train.seq_len={seq}",
            f"model.attention={impl}",
            f"model.attention_block={block}",
            f"mesh.context={context}",
            "mesh.data=1",
            "train.batch_size=1",
            f"data.max_bytes={max(200000, 64 * seq)}",
            "data.eval_fraction=0.5",  # the eval split needs a window of seq + 1 tokens,
        ]
    )
    t0 = time.perf_counter()
    m = measure_step(cfg, jax.devices()[:context], steps=steps, warmup=1)
    predicted = memory(computation_view(cfg.model, seq), strategy_of(cfg, context), 1).total
    return {
        "peak_mib": m.memory_bytes / 2**20,
        "predicted_mib": predicted / 2**20,
        "step_s": m.step_time,
        "seconds": time.perf_counter() - t0,
    }


def context_table(args) -> None:
    """The context rows: peak per device falling with context, and the budget demonstration."""
    seq = args.context_seq
    print(
        f"\n# context rows: {args.preset}, seq {seq}, batch 1, Trainer step (adam), block {args.block}; "
        f"per-device budget {args.budget_mib} MiB"
    )
    head = (
        "| attention | context | peak MiB/device | planner MiB | peak(1)/peak(c) | of ideal c | step s | fits budget |"
    )
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    rows = [("xla", 1)] + [("blockwise", int(c)) for c in args.contexts.split(",")]
    base = None
    for impl, c in rows:
        # xla at long sequences is compiled only: its [T, T] scores would not fit this machine's memory
        steps = 0 if impl == "xla" and seq > 4096 else args.context_steps
        r = measure_context(args.preset, seq, impl, c, args.block, steps)
        if impl == "blockwise" and c == 1:
            base = r["peak_mib"]
        ratio = f"{base / r['peak_mib']:.2f}" if base and impl == "blockwise" else "-"
        ideal = f"{base / r['peak_mib'] / c:.0%}" if base and impl == "blockwise" else "-"
        step = f"{r['step_s']:.2f}" if r["step_s"] else "compile only"
        fits = "yes" if r["peak_mib"] <= args.budget_mib else "no"
        print(
            f"| {impl} | {c} | {r['peak_mib']:.0f} | {r['predicted_mib']:.0f} | {ratio} | {ideal} | {step} | {fits} |",
            flush=True,
        )
    print(
        "# What does not shrink with context: the weights, gradients and adam state (replicated over context;\n"
        "# 16 bytes per parameter), the ring's score tiles (about 6 x heads x block^2 float32, fixed by\n"
        "# model.attention_block, not by the sequence) and its key/value block in transit; the rest is per T/c."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seqs", default="1024,4096,16384", help="sequence lengths (tokens), comma-separated")
    ap.add_argument("--block", type=int, default=512, help="model.attention_block of the blockwise runs (tokens)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=0.6 * available_gib())
    ap.add_argument("--context-seq", type=int, default=16384, help="sequence of the context rows (0: none)")
    ap.add_argument("--contexts", default="1,2,4,8", help="mesh.context sizes of the context rows")
    ap.add_argument("--context-steps", type=int, default=1, help="timed steps per context row (0: compile only)")
    ap.add_argument("--budget-mib", type=float, default=512, help="per-device budget of the context rows (MiB)")
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax

    print(
        f"# {args.preset}, batch 1, one {jax.devices()[0].platform} device, block {args.block}, JAX {jax.__version__}"
    )
    print(f"# loss + gradient programs; not run when the planned peak exceeds {args.budget_gib:.1f} GiB")
    head = (
        "| seq | xla peak MiB | blockwise peak MiB | xla step s | blockwise step s "
        "| peak xla/blockwise | step xla/blockwise |"
    )
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    for seq in (int(s) for s in args.seqs.split(",") if s):
        r = {
            impl: measure(args.preset, seq, impl, args.block, args.steps, args.budget_gib)
            for impl in ("xla", "blockwise")
        }
        x, b = r["xla"], r["blockwise"]

        def step(m):
            return f"{m['step_s']:.3f}" if m["step_s"] is not None else "not run (over budget)"

        ratio = f"{x['step_s'] / b['step_s']:.2f}" if x["step_s"] and b["step_s"] else "-"
        print(
            f"| {seq} | {x['peak_mib']:.0f} | {b['peak_mib']:.0f} | {step(x)} | {step(b)} | "
            f"{x['peak_mib'] / b['peak_mib']:.1f} | {ratio} |",
            flush=True,
        )
    if args.context_seq:
        context_table(args)


if __name__ == "__main__":
    main()

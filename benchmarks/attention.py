"""Attention implementations: compiled peak memory and step time of ``xla`` against ``blockwise`` on one device.

For each sequence length (default 1k, 4k, 16k tokens) the gradient of the training loss
(``jaxdist.train.step.loss_and_grads``: forward, loss, backward; no optimizer) of a small model (default the
``small`` preset, batch 1, ``model.max_seq_len`` raised to the sequence) is compiled with
``model.attention=xla`` and with ``blockwise``.  Peak memory is XLA's plan from ``compiled.memory_analysis()``:
temp + arguments + outputs - aliased (MiB).  Step time is the median of ``--steps`` timed steps after one
warmup, each waited on with ``block_until_ready``; a program whose planned peak exceeds ``--budget-gib``
(default: 60% of this machine's available memory) is compiled but not run.  The last columns are the ratios
xla / blockwise.

    python benchmarks/attention.py                      # 1k, 4k, 16k on one CPU device, a few minutes
    python benchmarks/attention.py --seqs 1024,2048 --block 256 --steps 3
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seqs", default="1024,4096,16384", help="sequence lengths (tokens), comma-separated")
    ap.add_argument("--block", type=int, default=512, help="model.attention_block of the blockwise runs (tokens)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-gib", type=float, default=0.6 * available_gib())
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
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
    for seq in (int(s) for s in args.seqs.split(",")):
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


if __name__ == "__main__":
    main()

"""Pipeline schedules on 8 simulated CPU devices: bubble, activation memory, step time.

For each schedule and a few (stages p, microbatches m, chunks s) it compiles the
pipeline executor's loss-and-gradients program (one jitted program, shard_map
over the pipeline axis, the rest of the 8 devices data parallel) and prints:

* the bubble: the closed form (p-1)/(s*m+p-1) and the idle share of the
  timeline the program executed (each stage records the branch it ran per tick);
* XLA's temp bytes per device (``compiled.memory_analysis()``), which the
  stashed activations dominate in this deep, narrow model;
* for seq1f1b, the memory ratio to 1f1b with the same (p, m), next to the
  closed form (s+p-1)/(s*p) and their relative difference;
* the fastest of ``--steps`` step times (ms) of the compiled program.  Eight simulated devices
  share the host's cores, so step times show overheads, not pipeline speedups.

    python benchmarks/pipeline.py [--layers 16] [--seq 256] [--per-device 2] [--steps 3] [--quick]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.models import init_params  # noqa: E402
from jaxdist.parallel.mesh import build_mesh  # noqa: E402
from jaxdist.parallel.pipeline import pipeline_loss_and_grads, plan_pipeline  # noqa: E402
from jaxdist.parallel.rules import activation_sharding  # noqa: E402
from jaxdist.parallel.schedule import activation_memory_ratio, bubble_formula  # noqa: E402


def measure(model, p: int, m: int, s: int, kind: str, args) -> dict:
    """Compile and time one pipelined loss-and-grads program; returns the table row."""
    devices = jax.devices()[:8]
    mesh_cfg = load_config(None, [f"mesh.pipeline={p}", f"mesh.data={len(devices) // p}"]).mesh
    mesh = build_mesh(mesh_cfg, devices)
    batch = m * (len(devices) // p) * args.per_device
    plan = plan_pipeline(model, p, m, args.seq, kind, s, args.split)
    params = jax.jit(lambda: init_params(model))()
    tokens = jax.random.randint(jax.random.key(0), (batch, args.seq + 1), 0, model.vocab_size)
    fn = jax.jit(
        lambda pr, t: pipeline_loss_and_grads(
            pr, t, model=model, mesh=mesh, plan=plan, remat=args.remat, with_trace=True
        )
    )
    t0 = time.perf_counter()
    with activation_sharding(mesh):
        compiled = fn.lower(params, tokens).compile()
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss, _, trace = jax.block_until_ready(compiled(params, tokens))
        times.append(time.perf_counter() - t0)
    trace = np.asarray(trace)
    return dict(
        kind=kind,
        p=p,
        m=m,
        s=s,
        bounds=plan.bounds,
        slots=plan.tables.slots,
        bubble_formula=bubble_formula(kind, p, m, s),
        bubble_measured=float(np.mean(trace == 0)),
        temp=compiled.memory_analysis().temp_size_in_bytes,
        compile_s=compile_s,
        step_ms=1e3 * min(times),
        loss=float(loss),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16, help="blocks of the model (divisible by every p)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--per-device", type=int, default=2, help="sequences per device per microbatch")
    ap.add_argument("--steps", type=int, default=3, help="timed runs per program (the fastest is shown)")
    ap.add_argument("--remat", default="none", help="train.remat policy of the stages")
    ap.add_argument("--split", default="equal", choices=("equal", "cost"), help="chunk boundaries")
    ap.add_argument("--quick", action="store_true", help="only p=2, m=4 (a minute on 2 cores)")
    ap.add_argument("--shapes", default="2x4,4x8", help="comma-separated PxM: stages x microbatches")
    args = ap.parse_args()
    model = load_config(
        None,
        ["model=tiny", f"model.n_layers={args.layers}", f"model.max_seq_len={args.seq}", f"train.seq_len={args.seq}"],
    ).model
    shapes = [(2, 4)] if args.quick else [tuple(int(v) for v in x.split("x")) for x in args.shapes.split(",")]
    rows = []
    for p, m in shapes:
        for kind, s in (("gpipe", 1), ("1f1b", 1), ("seq1f1b", 2), ("seq1f1b", 4)):
            rows.append(measure(model, p, m, s, kind, args))
            r = rows[-1]
            print(f"  measured {kind} p={p} m={m} s={s}: compile {r['compile_s']:.1f} s", flush=True)

    print(
        f"\nmodel tiny x {args.layers} layers (d={model.d_model}), seq {args.seq}, "
        f"{args.per_device} sequences per device per microbatch, remat={args.remat}, {args.split} chunks; "
        f"8 CPU devices: pipeline=p x data=8/p"
    )
    head = (
        f"{'schedule':<8} {'p':>2} {'m':>2} {'s':>2} {'slots':>5} {'bubble':>7} {'measured':>8} "
        f"{'temp MiB':>9} {'vs 1f1b':>8} {'(s+p-1)/sp':>10} {'diff':>6} {'step ms':>8}  loss"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        base = next(x for x in rows if x["kind"] == "1f1b" and x["p"] == r["p"] and x["m"] == r["m"])
        ratio = r["temp"] / base["temp"]
        if r["kind"] == "seq1f1b":
            formula = activation_memory_ratio(r["p"], r["s"])
            cmp = f"{formula:>10.3f} {100 * (ratio / formula - 1):>+5.1f}%"
        else:
            cmp = f"{'':>10} {'':>6}"
        print(
            f"{r['kind']:<8} {r['p']:>2} {r['m']:>2} {r['s']:>2} {r['slots']:>5} {r['bubble_formula']:>7.3f} "
            f"{r['bubble_measured']:>8.3f} {r['temp'] / 2**20:>9.2f} {ratio:>8.3f} {cmp} {r['step_ms']:>8.0f}  "
            f"{r['loss']:.6f}"
        )
    print("\nbubble: idle share of stage-ticks (F and B one tick each); measured: from the executed trace.")
    print("temp MiB: XLA temp bytes per device; vs 1f1b: ratio to the 1f1b row with the same p, m.")


if __name__ == "__main__":
    main()

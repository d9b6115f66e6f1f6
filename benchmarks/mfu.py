"""Model FLOPs utilisation of the Trainer's step on one GPU (H100 / H200).

Trains a llama-1b-shaped model (the ``llama-1b`` preset: bf16 compute, fp32
master weights and AdamW state) with the Trainer's own jitted step on one
device (mesh data=1), on batches from the default corpus (``data.max_bytes``
keeps loading it cheap; the byte tokens only use the first 260 rows of the
vocabulary, which does not change the step's cost).  After a warmup it times
``--steps`` steps dispatched back to back, as ``Trainer.fit`` does, and prints
tokens/s, step time, model TFLOP/s and MFU against the device's dense bf16 peak
from ``meshes/*.toml`` (the preset whose ``device_kind`` matches
``jax.devices()[0].device_kind``), and beside it the hardware FLOP utilisation
(HFU): the FLOPs the compiled step executes by XLA's ``cost_analysis()``
(each loop body once per trip; recomputation included) over the same peak.

Model FLOPs follow PaLM: 6 x matmul parameters + 12 x layers x heads x
head_dim x seq_len per token (``jaxdist.models.arithmetic.train_flops_per_token``);
recomputation (remat) is not counted, so remat lowers MFU.

The default remat policy, ``dots_with_no_batch_dims_saveable``, keeps the
outputs of the weight matmuls (projections, MLP) and recomputes the attention
scores in the backward pass.  Without remat, batch 8 x 2048 keeps every
layer's float32 attention scores: XLA plans about 233 GiB per device, more
than an H200 holds; with the default about 60 GiB, with ``full`` about 38 GiB
(``--memory-plan`` prints XLA's plan for any setting without running a step;
on a CPU host it plans for the CPU backend, a close guide).

    python benchmarks/mfu.py                          # llama-1b, batch 8 x seq 2048
    python benchmarks/mfu.py --remat none --batch 2   # no recomputation, smaller batch
    python benchmarks/mfu.py --memory-plan            # XLA's memory plan only, no step run
    python benchmarks/mfu.py --cpu-smoke              # a shrunk model on CPU: proves the script runs
    python benchmarks/mfu.py model.n_layers=8         # any further config override
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from jaxdist.config import load_config  # jax-free: safe before the platform is chosen
from jaxdist.models.arithmetic import param_count  # jax-free too

# --cpu-smoke: the llama-1b structure (GQA 4:1, SwiGLU, tied embeddings, bf16) at a size a CPU runs in seconds.
SMOKE_MODEL = [
    "model.vocab_size=1024",
    "model.d_model=128",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=1",
    "model.head_dim=32",
    "model.d_ff=512",
    "model.max_seq_len=256",
]
GIB = 2**30


def si(x: float, unit: str) -> str:
    """``si(3.2e14, "FLOP/s") == "320.00 TFLOP/s"``: three significant-ish digits with a decimal prefix."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f} {prefix}{unit}"
    return f"{x:.2f} {unit}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="llama-1b", help="model preset (default: llama-1b)")
    p.add_argument("--batch", type=int, default=None, help="global batch in sequences (default: 8; smoke: 4)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: 2048; smoke: 128)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 20; smoke: 3)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first, compile included (default: 3; smoke: 1)"
    )
    p.add_argument(
        "--remat",
        default="dots_with_no_batch_dims_saveable",
        help="train.remat policy: none, full, save:NAME[,NAME] or a jax.checkpoint_policies name "
        "(default: dots_with_no_batch_dims_saveable, i.e. recompute attention only)",
    )
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps (default: 1)")
    p.add_argument(
        "--devices", type=int, default=1, help="devices to use, all data-parallel (default: 1); MFU is per device"
    )
    p.add_argument(
        "--memory-plan",
        action="store_true",
        help="only compile the step and print XLA's per-device memory plan (no step runs)",
    )
    p.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run a shrunk model on the CPU to check the script (numbers mean nothing)",
    )
    p.add_argument("overrides", nargs="*", help="further config overrides, e.g. model.n_layers=8")
    args = p.parse_args(argv)
    small = args.cpu_smoke
    for name, full, smoke in (("batch", 8, 4), ("seq", 2048, 128), ("steps", 20, 3), ("warmup", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if small else full)
    if args.steps <= 0 or args.warmup < 1 or args.devices < 1:
        p.error("--steps and --devices must be positive and --warmup at least 1 (it compiles)")
    return args


def device_peak(devices) -> tuple[str, float, float]:
    """(cluster preset name, dense bf16 FLOP/s, fp32 FLOP/s) of one device, from meshes/*.toml.

    The preset is the one whose ``device_kind`` matches; a kind no preset
    describes gets the nominal figures of ``cluster_from_devices`` and the
    name ``"<kind> (no preset: nominal peak)"``.
    """
    from jaxdist.cluster import list_clusters, load_cluster
    from jaxdist.parallel.mesh import cluster_from_devices

    kind = devices[0].device_kind
    for name in list_clusters():
        spec = load_cluster(name)
        if spec.device_kind.lower() == kind.lower():
            return name, spec.peak_flops_bf16, spec.peak_flops_fp32
    spec = cluster_from_devices(devices)
    return f"{kind} (no preset: nominal peak)", spec.peak_flops_bf16, spec.peak_flops_fp32


def peak_memory_bytes(device) -> int | None:
    """Most bytes the device has held at once, where the runtime reports it (GPUs; not CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # CPU raises or returns None
        return None
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def memory_plan(trainer) -> list[tuple[str, str]]:
    """Table rows with XLA's per-device memory plan of the train step (bytes -> GiB); allocates nothing."""
    t0 = time.perf_counter()
    compiled = trainer.compile_train_step()  # the step fit() runs, its sharding applied inside
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    total = m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return [
        ("compile", f"{seconds:.2f} s"),
        (
            "memory plan",
            f"{total / GIB:.2f} GiB per device = temp {m.temp_size_in_bytes / GIB:.2f} "
            f"+ arguments {m.argument_size_in_bytes / GIB:.2f} + outputs "
            f"{m.output_size_in_bytes / GIB:.2f} - donated {m.alias_size_in_bytes / GIB:.2f}",
        ),
    ]


def run(args: argparse.Namespace) -> list[tuple[str, str]]:
    """Train, time and return the table rows (label, value)."""
    import jax

    from jaxdist.parallel.mesh import describe_mesh
    from jaxdist.resolve import resolve
    from jaxdist.train.trainer import Trainer

    devices = jax.devices()[: args.devices]
    if len(devices) < args.devices:
        raise SystemExit(f"--devices {args.devices}: only {len(devices)} {devices[0].platform} devices here")
    cluster, peak_bf16, peak_fp32 = device_peak(devices)
    tokens_needed = args.batch * (args.seq + 1)
    runs = tempfile.mkdtemp(prefix="jaxdist-mfu-")  # config.json and metrics.jsonl only; removed at the end
    overrides = [
        f"model={args.preset}",
        *(SMOKE_MODEL if args.cpu_smoke else []),
        "model.dtype=bfloat16",
        "model.param_dtype=float32",
        "mesh.data=-1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        f"train.batch_size={args.batch}",
        f"train.seq_len={args.seq}",
        f"train.microbatches={args.microbatches}",
        f"train.remat={args.remat}",
        f"train.steps={args.warmup + args.steps + 1}",
        f"train.runs_dir={runs}",
        "train.progress=false",
        "train.tensorboard=false",
        "checkpoint.enabled=false",
        # The eval split (5% of files) must hold one batch too.
        f"data.max_bytes={max(4_000_000, 40 * tokens_needed)}",
        *args.overrides,
    ]
    if cluster in ("h100x8", "h200x8", "h100x64"):
        overrides.insert(0, f"mesh.cluster={cluster}")
    cfg = load_config(None, overrides)
    m = cfg.model
    head = [
        ("device", f"{len(devices)} x {devices[0].device_kind} ({jax.default_backend()}, jax {jax.__version__})"),
        (
            "model",
            f"{m.preset}{' shrunk (--cpu-smoke)' if args.cpu_smoke else ''}: "
            f"{param_count(m) / 1e6:,.1f}M params, compute {m.dtype}, master weights {m.param_dtype}",
        ),
        (
            "batch",
            f"{args.batch} x {args.seq} = {args.batch * args.seq:,} tokens/step, "
            f"microbatches {args.microbatches}, remat {args.remat}",
        ),
    ]

    try:
        with Trainer(resolve(cfg, devices), devices=devices) as trainer:  # resolve: train.remat=auto's plan
            head.insert(2, ("mesh", describe_mesh(trainer.mesh)))
            if args.memory_plan:
                return head + memory_plan(trainer)
            state = trainer.init_state()
            batches = [trainer.batch(i) for i in range(4)]
            jax.block_until_ready((state, batches))

            t0 = time.perf_counter()
            state, metrics = trainer.train_step(state, batches[0])
            jax.block_until_ready((state, metrics))
            first_s = time.perf_counter() - t0
            for i in range(1, args.warmup):
                state, metrics = trainer.train_step(state, batches[i % len(batches)])
            jax.block_until_ready((state, metrics))

            # Back to back, as Trainer.fit dispatches them; one wait at the end.
            t0 = time.perf_counter()
            for i in range(args.steps):
                state, metrics = trainer.train_step(state, batches[i % len(batches)])
            jax.block_until_ready((state, metrics))
            step_s = (time.perf_counter() - t0) / args.steps
            loss = float(metrics["loss"])
            flops_per_step = trainer.flops_per_step
            hardware_flops = trainer.hardware_flops_per_step()  # XLA's count of the compiled step, recompute in
    finally:
        shutil.rmtree(runs, ignore_errors=True)

    n = len(devices)
    peak = peak_bf16 if m.dtype == "bfloat16" else peak_fp32
    tokens = args.batch * args.seq
    achieved = flops_per_step / step_s / n  # model FLOP/s per device
    nominal = " (nominal CPU figure: MFU means nothing here)" if devices[0].platform == "cpu" else ""
    mem = peak_memory_bytes(devices[0])
    return head + [
        ("first step (compile)", f"{first_s:.2f} s"),
        ("step time", f"{step_s * 1e3:.2f} ms (mean of {args.steps} steps after {args.warmup} warmup)"),
        ("tokens/s", f"{tokens / step_s:,.0f} ({tokens / step_s / n:,.0f} per device)"),
        ("model FLOPs", f"{si(flops_per_step, 'FLOP')}/step, {si(flops_per_step / tokens, 'FLOP')}/token"),
        ("model FLOP/s", f"{si(achieved, 'FLOP/s')} per device"),
        ("peak FLOP/s", f"{si(peak, 'FLOP/s')} per device, dense {m.dtype}, from {cluster}{nominal}"),
        ("MFU", f"{100 * achieved / peak:.1f} %"),
        (
            "hardware FLOPs",
            f"{si(hardware_flops, 'FLOP')}/step (XLA cost_analysis, loop trips counted; "
            f"{hardware_flops / flops_per_step:.3f} x model)"
            if hardware_flops
            else "not reported",
        ),
        (
            "HFU",
            f"{100 * hardware_flops / step_s / n / peak:.1f} % (counts recomputation)"
            if hardware_flops
            else "not reported",
        ),
        ("peak memory", f"{mem / GIB:.2f} GiB on device 0" if mem is not None else "not reported by this runtime"),
        ("last loss", f"{loss:.3f} nats/token"),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        assert "jax" not in sys.modules, "choose the platform before importing jax"
        os.environ["JAX_PLATFORMS"] = "cpu"
    rows = run(args)
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

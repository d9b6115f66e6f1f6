"""Mixture of experts on 8 simulated CPU devices: accounting a user can check, and throughput.

Table 1, per mesh: expert weight bytes per device (predicted E*3*d*f*bytes /
(expert-parallel x expert-tensor), measured from the sharded arrays) and the
bytes passed to all-to-all in one MoE layer (predicted by
``jaxdist.parallel.moe.dispatch_bytes``, parsed from ``compiled.as_text()``),
for the layer's forward pass and for the whole train step (forward + backward;
the layers are scanned, so the compiled program holds each layer's
collectives once).

Table 2: tokens/s of the Trainer's train step for the MoE model on several
meshes, and for a dense model with the same active parameters (d_ff = k x the
expert width), after a warmup, median of ``--steps`` steps.

Table 3: the MoE model on pipeline stages, gpipe (jaxdist/parallel/pipeline_blocks.py) and the 1f1b and seq1f1b
executor (jaxdist/parallel/pipeline.py), against data=8: step time (the 8 CPU devices share the cores, so it
follows the work of all of them), the compiled step's FLOPs per device (``cost_analysis`` plus the loop bodies it
counts once), the schedule's bubble (its closed form: the idle share of a stage's ticks; gpipe's stages compute
through theirs, so its blocks' work is (m + p - 1) / m of the model's), and the all-to-all bytes per step,
predicted (:func:`stage_all_to_all_bytes`) and parsed from the compiled program, with the collective-permutes
between stages.  With dropless dispatch jaxdist's planned dispatch runs inside the stages (manual over data and
expert there).  An executor's collective sits in one branch of its tick's switch, which a stage runs once per
microbatch: the parsed bytes count each branch's collectives that often; XLA's FLOP count (and the loop
correction) holds every branch at every tick, an upper bound, so those rows show none.  XLA:CPU runs the dropless
``ragged_dot`` as a dense product over the experts: the FLOPs are CPU's.

    python benchmarks/moe.py                   # both tables (about 2-3 minutes on 2 cores)
    python benchmarks/moe.py --steps 5 --only accounting
    python benchmarks/moe.py --only pipeline
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

from jaxdist.models.arithmetic import param_count

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

MESHES = [  # (label, overrides); the last keeps attention at tensor=4, experts 4-way x 2-way tensor
    ("expert=8", ["mesh.data=1", "mesh.expert=8"]),
    ("expert=4 tensor=2", ["mesh.data=1", "mesh.expert=4", "mesh.tensor=2"]),
    ("data=2 expert=2 tensor=2", ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2"]),
    ("tensor=4 expert=2 expert_tensor=2", ["mesh.data=1", "mesh.tensor=4", "mesh.expert=2", "mesh.expert_tensor=2"]),
]
MODEL = [
    "model=moe-tiny",
    "model.d_model=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.head_dim=32",
    "model.moe.experts=8",
    "model.moe.top_k=2",
    "model.moe.d_ff=256",
    "model.max_seq_len=128",
]


def config(overrides, steps, runs, batch, seq):
    from jaxdist.config import load_config

    return load_config(
        None,
        [
            *overrides,
            f"train.steps={steps}",
            f"train.batch_size={batch}",
            f"train.seq_len={seq}",
            "train.progress=false",
            "train.tensorboard=false",
            "train.eval_every=0",
            "train.log_every=1000",
            "checkpoint.enabled=false",
            "data.max_bytes=2000000",
            f"train.runs_dir={runs}",
            "train.name=bench",
        ],
    )


def compiled_step_text(trainer) -> str:
    return trainer.compile_train_step().as_text()


def accounting(runs: str, batch: int, seq: int) -> list[list[str]]:
    """Rows of table 1."""
    import jax
    import jax.numpy as jnp

    from jaxdist.models import moe as M
    from jaxdist.parallel import moe as EP
    from jaxdist.parallel.rules import activation_sharding
    from jaxdist.train.trainer import Trainer

    rows = []
    for label, mesh in MESHES:
        cfg = config(MODEL + mesh, 1, runs, batch, seq)
        m = cfg.model
        with Trainer(cfg) as t:
            lay = t.expert_layout
            state = t.init_state()
            measured = sum(state["params"]["layers"][k].addressable_shards[0].data.nbytes for k in M.EXPERT_KEYS)
            measured //= M.moe_layer_count(m)
            predicted = EP.expert_param_bytes(m, lay, 4)
            n_tokens = batch * seq
            x = jnp.zeros((n_tokens, m.d_model), jnp.float32)
            # Host copies: a jit without in_shardings cannot take arrays of two meshes (model and expert view).
            p = jax.device_get({k: state["params"]["layers"][k][0] for k in ("router", *M.EXPERT_KEYS)})

            def forward(p, x):
                r = M.route(x, p["router"], m)  # noqa: B023 (used in this iteration)
                return EP.run_experts(x, r.experts, r.weights, {k: p[k] for k in M.EXPERT_KEYS}, m)[0]  # noqa: B023 (used in this iteration)

            with activation_sharding(t.mesh, t.rules), EP.expert_parallelism(lay):
                fwd_hlo = jax.jit(forward).lower(p, x).compile().as_text()
            step_hlo = compiled_step_text(t)
        pred = EP.dispatch_bytes(m, lay, n_tokens, 4)
        rows.append(
            [
                label,
                f"{lay.ep_size}x{lay.etp_size}",
                f"{predicted:,}",
                f"{measured:,}",
                f"{pred['total']:,}",
                f"{EP.collective_bytes(fwd_hlo):,}",
                f"{pred['total'] + pred['rows']:,}",
                f"{EP.collective_bytes(step_hlo):,}",
            ]
        )
    return rows


def step_seconds(trainer, steps: int) -> float:
    """The median seconds of ``steps`` train steps on one batch, after two warm-up steps."""
    import jax

    state, b = trainer.init_state(), trainer.batch(0)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, b)
        jax.block_until_ready(metrics)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def throughput(runs: str, batch: int, seq: int, steps: int) -> list[list[str]]:
    """Rows of table 2."""

    from jaxdist.train.trainer import Trainer

    k, f = 2, 256
    dense = [o for o in MODEL if not o.startswith("model.moe")] + ["model.moe.experts=0", f"model.d_ff={k * f}"]
    cases = [("MoE 8x256 top-2", MODEL + mesh, label) for label, mesh in MESHES[:3]]
    cases.append(("MoE 8x256 top-2", MODEL + ["mesh.data=8"], "data=8 (no expert parallelism)"))
    cases.append(("dense d_ff=512", dense + ["mesh.data=8"], "data=8"))
    cases.append(("dense d_ff=512", dense + ["mesh.data=4", "mesh.tensor=2"], "data=4 tensor=2"))
    rows = []
    for model, overrides, label in cases:
        cfg = config(overrides, steps + 3, runs, batch, seq)
        with Trainer(cfg) as t:
            med = step_seconds(t, steps)
            rows.append(
                [
                    model,
                    label,
                    f"{param_count(cfg.model, active=True) / 1e6:.3f}M",
                    f"{param_count(cfg.model) / 1e6:.3f}M",
                    f"{1e3 * med:.0f}",
                    f"{batch * seq / med:,.0f}",
                ]
            )
    return rows


PIPELINES = [  # (stages, microbatches, schedule, chunks, mesh overrides): expert=2 inside each stage
    (1, 1, "none", 1, ["mesh.data=8"]),
    (2, 2, "gpipe", 1, ["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2"]),
    (2, 4, "gpipe", 1, ["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2"]),
    (2, 8, "gpipe", 1, ["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2"]),
    (2, 2, "1f1b", 1, ["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2"]),
    (2, 4, "1f1b", 1, ["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2"]),
    (2, 4, "seq1f1b", 2, ["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2"]),
    (4, 4, "gpipe", 1, ["mesh.pipeline=4", "mesh.expert=2", "mesh.data=1"]),
    (4, 8, "gpipe", 1, ["mesh.pipeline=4", "mesh.expert=2", "mesh.data=1"]),
    (4, 4, "1f1b", 1, ["mesh.pipeline=4", "mesh.expert=2", "mesh.data=1"]),
    (4, 8, "seq1f1b", 2, ["mesh.pipeline=4", "mesh.expert=2", "mesh.data=1"]),
]


def stage_all_to_all_bytes(
    m, sizes: dict[str, int], rows: tuple[str, ...], tokens: int, micro: int, schedule: str = "gpipe"
) -> int:
    """All-to-all operand bytes per device per step of an MoE model on pipeline stages with the planned dispatch
    inside (``rows``: the axes the stages split a microbatch's tokens over; none: no all-to-all).  An MoE block
    exchanges the padded buffer of expert x tokens x min(top-k, local experts) rows, as
    jaxdist.parallel.moe.dispatch_bytes counts: the forward its rows out and back (R each) and the int32 expert
    ids (I).  gpipe: every tick, the bubble's too, the forward and its transpose, 4R + I.  The 1f1b and seq1f1b
    executor: each unit once, forward 2R + I and backward 4R + I (its vjp recomputes the dispatch, which the
    stage's remat policy does not save, and sends the transposes); a sequence chunk's buffer is its share of
    the microbatch's, so the chunks add up to the microbatch."""
    ep, p = sizes.get("expert", 1), sizes.get("pipeline", 1)
    if not rows or ep == 1:
        return 0
    n = tokens // micro // math.prod(sizes[a] for a in rows)  # one device's tokens of a microbatch
    buffer_rows = ep * n * min(m.moe.top_k, m.moe.experts // ep)
    r, i = buffer_rows * m.d_model * 4, buffer_rows * 4  # fp32 rows; int32 ids
    blocks = m.n_layers // m.moe.every // p
    if schedule == "gpipe":
        return (4 * r + i) * blocks * (micro + p - 1)
    return (6 * r + 2 * i) * blocks * micro


def executed_all_to_all(collectives, n_ticks: int, micro: int) -> int:
    """The all-to-all bytes a device runs per step from the parsed ``collectives``: a collective in a branch of
    the executor's tick loop (``branch_<i>_fun`` in its name) runs in ``micro`` of the ``n_ticks`` ticks its
    loop count includes; any other as often as counted."""
    total = 0
    for c in collectives:
        if c.kind != "all-to-all":
            continue
        in_branch = "/while/body/closed_call/cond/branch_" in c.op_name
        total += c.bytes * (c.count // n_ticks * micro if in_branch else c.count)
    return total


def pipelined(runs: str, batch: int, seq: int, steps: int) -> list[list[str]]:
    """Rows of table 3."""

    from jaxdist.parallel.hlo import collective_bytes, parse_collectives
    from jaxdist.parallel.schedule import bubble_formula, build_schedule
    from jaxdist.train.programs import executed_flops
    from jaxdist.train.trainer import Trainer

    rows, base = [], None
    for p, m, kind, chunks, mesh in PIPELINES:
        extra = ["mesh.fsdp=1"]
        if p > 1:
            extra += [f"pipeline.schedule={kind}", f"pipeline.chunks={chunks}", f"train.microbatches={m}"]
        cfg = config(MODEL + mesh + extra, steps + 3, runs, batch, seq)
        with Trainer(cfg) as t:
            compiled = t.compile_train_step()
            flops = executed_flops(compiled, 1)  # cost_analysis with every loop trip counted
            hlo = compiled.as_text()
            moved = collective_bytes(hlo, 8)
            med = step_seconds(t, steps)
            sizes = dict(t.mesh.shape)
            predicted = stage_all_to_all_bytes(t.config.model, sizes, t.stage_rows, batch * seq, m, kind)
        ticks = build_schedule(p, m, chunks, kind).n_ticks if p > 1 else 1
        parsed = executed_all_to_all(parse_collectives(hlo, 8), ticks, m) if kind not in ("none", "gpipe") else None
        base = base or (med, flops)
        rows.append(
            [
                " ".join(o.removeprefix("mesh.") for o in mesh),
                kind if chunks == 1 else f"{kind} x{chunks}",
                str(m),
                f"{1e3 * med:.0f}",
                f"{med / base[0]:.2f}",
                f"{flops / 1e9:.3f}" if parsed is None else "-",  # an executor's count holds every branch
                f"{flops / base[1]:.2f}" if parsed is None else "-",
                f"{bubble_formula(kind, p, m, chunks):.2f}" if p > 1 else "-",
                f"{predicted / 2**20:.2f}",
                f"{(moved.get('all-to-all', 0) if parsed is None else parsed) / 2**20:.2f}",
                f"{moved.get('collective-permute', 0) / 2**20:.2f}",
            ]
        )
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per case (default 8)")
    ap.add_argument("--only", choices=["accounting", "throughput", "pipeline"], help="print one table only")
    args = ap.parse_args(argv)
    import jax

    print(
        f"{len(jax.devices())} {jax.devices()[0].platform} devices; model: d_model=128, 4 blocks, "
        f"8 experts x 256 top-2; batch {args.batch} x {args.seq} tokens, float32",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="jaxdist-moe-") as runs:
        if args.only in (None, "accounting"):
            print("\nPer device, one MoE layer (bytes): expert weights; all-to-all operands, predicted vs compiled")
            print(
                table(
                    [
                        "mesh",
                        "ep x etp",
                        "weights pred",
                        "weights meas",
                        "a2a fwd pred",
                        "a2a fwd HLO",
                        "a2a step pred",
                        "a2a step HLO",
                    ],
                    accounting(runs, args.batch, args.seq),
                )
            )
        if args.only in (None, "throughput"):
            print(f"\nTrain step on 8 CPU devices (median of {args.steps} steps)")
            print(
                table(
                    ["model", "mesh", "active", "total", "step ms", "tokens/s"],
                    throughput(runs, args.batch, args.seq, args.steps),
                )
            )
        if args.only in (None, "pipeline"):
            print(f"\nMoE on pipeline stages, expert=2 inside each, against data=8 (median of {args.steps} steps)")
            print(
                table(
                    ["mesh", "schedule", "micro", "step ms", "x data=8", "GFLOP/dev", "x data=8", "bubble",
                     "a2a MiB pred", "a2a MiB", "permute MiB"],
                    pipelined(runs, args.batch, args.seq, args.steps),
                )
            )  # fmt: skip


if __name__ == "__main__":
    main()

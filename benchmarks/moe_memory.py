"""The planner's MoE memory prediction against the compiled peak, with the MoE terms it adds (issue 36).

For moe-tiny variants (experts, top-k, expert width, batch, mesh with expert=2/4/8 and expert_tensor, dropless
and capacity dispatch, remat) on 8 simulated CPU devices it prints the planner's predicted bytes per device
(:func:`jaxdist.planner.cost.estimate`), the compiled train step's peak (arguments + outputs + temp - aliased,
:func:`jaxdist.train.aot.compiled_peak`, compile only), their error, and in MiB what the MoE terms of
:data:`jaxdist.planner.cost.XLA_CPU_MEMORY` add (each coefficient times its quantity of
:func:`jaxdist.planner.cost.memory_terms`):

* ``rows``: the routed activations sized by the rows a device's experts take (:class:`~jaxdist.planner.cost.ExpertRows`)
  instead of top-k rows per token: kept activations and one block's working layer, beside the top-k count;
* ``weights``: ``expert_weight_copies`` (XLA:CPU's copies of the stacked expert weights for the layer scans);
* ``ragged``: ``ragged_dot_working`` (XLA:CPU's emulation of ``jax.lax.ragged_dot``, dropless only), or under
  remat=full in a layer loop ``ragged_full`` (the emulation's buffers counted at the recomputing backward's peak);
* ``dispatch``: ``dispatch_working`` (a block's rows gathered, exchanged and scattered back), or ``dispatch_full``.

Under remat=full the last two count only where they exceed the block's dense working set (``cost.ROUTED_FULL``).

With ``--stages``, MoE pipeline stages instead (:data:`STAGES`): gpipe by autodiff and the executor's 1f1b and
seq1f1b stages (jaxdist/parallel/pipeline.py; with dropless dispatch manual over data, fsdp and expert, the stage's
weights gathered whole along fsdp for the step, jaxdist/parallel/pipeline_sync.py), predicted against compiled.

    python benchmarks/moe_memory.py            # ~2 minutes on 2 cores
    python benchmarks/moe_memory.py --stages   # ~6 minutes
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

CAP = "model.moe.dispatch=capacity"
SETTINGS = [  # (overrides beside the mesh, mesh, experts, top-k, expert d_ff, batch, remat)
    ([], ["mesh.data=8"], 8, 2, 64, 16, "none"),
    ([], ["mesh.data=8"], 16, 2, 64, 16, "none"),
    ([], ["mesh.data=8"], 8, 4, 64, 16, "none"),
    ([], ["mesh.data=8"], 8, 2, 128, 16, "none"),
    ([], ["mesh.data=8"], 8, 2, 64, 32, "none"),
    ([], ["mesh.data=8"], 8, 2, 64, 16, "full"),
    ([], ["mesh.data=4", "mesh.expert=2"], 8, 2, 64, 16, "none"),
    ([], ["mesh.data=4", "mesh.expert=2"], 8, 2, 64, 32, "full"),
    ([], ["mesh.data=2", "mesh.expert=4"], 8, 2, 64, 16, "none"),
    ([], ["mesh.expert=8"], 8, 2, 64, 16, "none"),
    (["model.n_layers=1"], ["mesh.data=8"], 8, 2, 64, 16, "none"),
    (["model.n_layers=1"], ["mesh.data=8"], 8, 2, 64, 16, "full"),
    (["model.n_layers=4"], ["mesh.data=8"], 8, 2, 64, 16, "none"),
    (["model.n_layers=4"], ["mesh.data=8"], 8, 2, 64, 16, "full"),
    # expert=4 and expert=8
    ([], ["mesh.data=2", "mesh.expert=4"], 16, 2, 64, 32, "none"),
    ([], ["mesh.data=2", "mesh.expert=4"], 8, 2, 128, 16, "full"),
    ([], ["mesh.expert=4", "mesh.tensor=2"], 8, 2, 64, 16, "none"),
    ([], ["mesh.expert=8"], 16, 4, 64, 16, "none"),
    ([], ["mesh.expert=8"], 8, 2, 64, 32, "full"),
    # expert_tensor: the rest of tensor joins expert parallelism
    ([], ["mesh.data=4", "mesh.tensor=2", "mesh.expert_tensor=1"], 8, 2, 64, 16, "none"),
    ([], ["mesh.tensor=4", "mesh.expert=2", "mesh.expert_tensor=2"], 8, 2, 64, 16, "none"),
    ([], ["mesh.data=4", "mesh.tensor=2"], 8, 2, 64, 16, "none"),
    # capacity dispatch
    ([CAP], ["mesh.data=8"], 8, 2, 64, 16, "none"),
    ([CAP], ["mesh.data=8"], 8, 2, 64, 16, "full"),
    ([CAP, "model.moe.capacity_factor=2.0"], ["mesh.data=8"], 16, 2, 128, 16, "none"),
    ([CAP], ["mesh.data=4", "mesh.expert=2"], 8, 2, 64, 16, "none"),
    ([CAP], ["mesh.data=2", "mesh.expert=4"], 8, 2, 64, 32, "full"),
    ([CAP], ["mesh.expert=8"], 8, 2, 64, 16, "none"),
    ([CAP], ["mesh.tensor=4", "mesh.expert=2", "mesh.expert_tensor=2"], 8, 2, 64, 16, "none"),
]


WIDE = [
    "model.d_model=128",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.moe.experts=16",
    "model.moe.d_ff=512",
    "model.d_ff=512",
]  # fmt: skip  (more weights than activations: the gathered stage weights show)
STAGES = [  # (schedule, chunks, microbatches, mesh beside pipeline=2, model overrides, remat); batch 16 x 64
    ("gpipe", 1, 2, ["mesh.data=2", "mesh.expert=2"], [], "none"),
    ("1f1b", 1, 2, ["mesh.data=2", "mesh.expert=2"], [], "none"),
    ("1f1b", 1, 4, ["mesh.data=2", "mesh.expert=2"], [], "none"),
    ("seq1f1b", 2, 4, ["mesh.data=2", "mesh.expert=2"], [], "none"),
    ("seq1f1b", 4, 2, ["mesh.data=2", "mesh.expert=2"], [], "none"),
    ("1f1b", 1, 2, ["mesh.fsdp=2", "mesh.expert=2", "mesh.data=1"], [], "none"),
    ("1f1b", 1, 2, ["mesh.data=4"], [], "none"),
    ("1f1b", 1, 2, ["mesh.tensor=2", "mesh.expert=2"], [], "none"),
    ("1f1b", 1, 2, ["mesh.fsdp=2", "mesh.expert=2", "mesh.data=1"], WIDE, "none"),
    ("seq1f1b", 2, 2, ["mesh.fsdp=4", "mesh.data=1"], WIDE, "none"),
    ("1f1b", 1, 2, ["mesh.data=2", "mesh.expert=2"], WIDE, "none"),
    # several groups per stage, remat=full
    ("1f1b", 1, 2, ["mesh.data=2", "mesh.expert=2"], ["model.n_layers=4"], "none"),
    ("1f1b", 1, 4, ["mesh.data=2", "mesh.expert=2"], ["model.n_layers=4"], "none"),
    ("1f1b", 1, 2, ["mesh.data=2", "mesh.expert=2"], ["model.n_layers=8"], "none"),
    ("1f1b", 1, 2, ["mesh.data=4"], ["model.n_layers=4"], "none"),
    ("seq1f1b", 2, 2, ["mesh.data=2", "mesh.expert=2"], ["model.n_layers=4"], "none"),
    ("gpipe", 1, 2, ["mesh.data=2", "mesh.expert=2"], ["model.n_layers=4"], "none"),
    ("1f1b", 1, 2, ["mesh.data=2", "mesh.expert=2"], [], "full"),
    ("1f1b", 1, 2, ["mesh.data=2", "mesh.expert=2"], ["model.n_layers=4"], "full"),
    ("gpipe", 1, 2, ["mesh.data=2", "mesh.expert=2"], [], "full"),
]


def stages() -> int:
    """Print the STAGES table (``--stages``)."""
    import jax

    from jaxdist.cluster import load_cluster
    from jaxdist.config import load_config
    from jaxdist.planner import cost
    from jaxdist.planner.candidates import strategy_of
    from jaxdist.planner.cluster import cluster_view
    from jaxdist.planner.computation import computation_view
    from jaxdist.train.aot import compiled_peak

    view, mib = cluster_view(load_cluster("cpu-8")), 2**20
    print(
        "moe-tiny (d_model 64, 2 blocks, 8 experts x 64, top-2, seq 64, batch 16, dropless) on pipeline=2, 8 CPU devices"
    )
    head = f"{'schedule':<10} {'micro':>5} {'mesh':<22} {'model':<8} {'remat':<5} {'pred MiB':>8} {'compiled':>8} {'error':>7}"
    print(head + "\n" + "-" * len(head))
    for kind, chunks, micro, mesh, extra, remat in STAGES:
        cfg = load_config(
            None,
            ["model=moe-tiny", "mesh.cluster=cpu-8", "train.seq_len=64", "train.batch_size=16", f"train.remat={remat}",
             f"train.microbatches={micro}", f"pipeline.schedule={kind}", f"pipeline.chunks={chunks}", *extra,
             "mesh.pipeline=2", *mesh],
        )  # fmt: skip
        e = cost.estimate(computation_view(cfg.model, 64), view, strategy_of(cfg, 8), 16)
        got = compiled_peak(cfg, jax.devices()[:8])
        model = "wide" if extra == WIDE else " ".join(x.split(".")[-1] for x in extra) or "-"
        sched = kind if chunks == 1 else f"{kind} x{chunks}"
        words = " ".join(m.removeprefix("mesh.") for m in mesh if not m.endswith("=1"))
        print(
            f"{sched:<10} {micro:>5} {words:<22} {model:<8} {remat:<5} {e.memory.total / mib:>8.2f}"
            f" {got.peak_bytes / mib:>8.2f} {e.memory.total / got.peak_bytes - 1:>+7.1%}",
            flush=True,
        )
    return 0


def label(extra: list[str], mesh: list[str]) -> str:
    """Short text of a row's mesh and its other overrides."""
    words = [m.split(".", 1)[1].replace("expert_tensor", "etp") for m in mesh]
    for o in extra:
        key, value = o.split("=")
        words.append({"model.moe.dispatch": "cap", "model.n_layers": f"L{value}"}.get(key, f"cf{value}"))
    return " ".join(w for w in words if w != "cap") + (" cap" if CAP in extra else "")


def main() -> int:
    import dataclasses

    import jax

    from jaxdist.cluster import load_cluster
    from jaxdist.config import load_config
    from jaxdist.planner import cost
    from jaxdist.planner.candidates import strategy_of
    from jaxdist.planner.cluster import cluster_view
    from jaxdist.planner.computation import computation_view
    from jaxdist.train.aot import compiled_peak

    view = cluster_view(load_cluster("cpu-8"))
    coeff = cost.XLA_CPU_MEMORY
    moe_terms = getattr(cost, "ExpertRows", None) is not None  # False on the model before issue 36's terms
    mib = 2**20
    head = (
        f"{'setting':<26} {'E':>3} {'k':>2} {'f':>4} {'batch':>5} {'remat':<5} {'pred MiB':>8} {'compiled':>8}"
        f" {'error':>7} {'rows':>6} {'weights':>7} {'ragged':>6} {'dispatch':>8}"
    )
    print("moe-tiny (d_model 64, 2 blocks unless L says, seq 64, dropless unless cap) on 8 CPU devices")
    print(head + "\n" + "-" * len(head))
    worst = 0.0
    for extra, mesh, experts, k, f, batch, remat in SETTINGS:
        cfg = load_config(
            None,
            [
                "model=moe-tiny",
                "mesh.cluster=cpu-8",
                "train.seq_len=64",
                f"train.batch_size={batch}",
                f"train.remat={remat}",
                f"model.moe.experts={experts}",
                f"model.moe.top_k={k}",
                f"model.moe.d_ff={f}",
                *extra,
                *mesh,
            ],
        )
        s = strategy_of(cfg, 8)
        cv = computation_view(cfg.model, cfg.train.seq_len)
        e = cost.estimate(cv, view, s, batch)
        got = compiled_peak(cfg, jax.devices()[:8])
        err = e.memory.total / got.peak_bytes - 1
        worst = max(worst, abs(err))
        parts = [0.0] * 4
        if moe_terms:
            t = cost.memory_terms(cv, s, batch)
            flat = dataclasses.replace(cv, blocks=tuple(dataclasses.replace(b, dispatch_rows=0) for b in cv.blocks))
            top_k = cost.memory_terms(flat, s, batch)  # routed tensors at top-k rows per token, no MoE terms
            parts = [
                t.memory(coeff).activations
                - top_k.activations
                + coeff.working(s.remat)
                * (t.scaled[f"layer_working:{s.remat}"] - top_k.scaled[f"layer_working:{s.remat}"])
                * ("dispatch_full" not in t.scaled),  # remat=full in a loop: the routed rows are dispatch_full's
                *(
                    sum(getattr(coeff, n) * t.scaled.get(n, 0.0) for n in names)
                    for names in (
                        ("expert_weight_copies",),
                        ("ragged_dot_working", "ragged_full"),
                        ("dispatch_working", "dispatch_full"),
                    )
                ),
            ]
        print(
            f"{label(extra, mesh):<26} {experts:>3} {k:>2} {f:>4} {batch:>5} {remat:<5}"
            f" {e.memory.total / mib:>8.2f} {got.peak_bytes / mib:>8.2f} {err:>+7.1%}"
            + "".join(f" {p / mib:>{w}.2f}" for p, w in zip(parts, (6, 7, 6, 8))),
            flush=True,
        )
    print(f"worst |error| over {len(SETTINGS)} settings: {worst:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(stages() if "--stages" in sys.argv[1:] else main())

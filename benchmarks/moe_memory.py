"""Where the planner's MoE memory prediction falls short: predicted against compiled peak, and the gap's sizes.

For moe-tiny variants (experts, top-k, expert width, batch, mesh, remat) on 8 simulated CPU devices it prints
the planner's predicted bytes per device (:func:`jaxdist.planner.cost.estimate`), the compiled train step's peak
(:func:`jaxdist.train.aot.compiled_peak`, compile only), the gap, and two candidate explanations of it in MiB:

* ``copies``: ``local experts x dispatched rows x (d_model + expert d_ff) x 4`` per device: what XLA:CPU's
  emulation of ``jax.lax.ragged_dot`` materialises (a masked copy of the rows per expert; a lone ``ragged_dot``
  of [m, k] rows against [g, k, n] weights has a temp buffer of g x m x (k + 2) x 4 bytes here);
* ``ep rows``: ``expert x dispatched rows x d_model x 4``: rows an expert-parallel device can receive from
  every peer (dropless: the receive buffer is sized for the worst case).

    python benchmarks/moe_memory.py        # ~1 minute on 2 cores
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

SETTINGS = [  # (mesh, experts, top-k, expert d_ff, batch, remat)
    (["mesh.data=8"], 8, 2, 64, 16, "none"),
    (["mesh.data=8"], 16, 2, 64, 16, "none"),
    (["mesh.data=8"], 8, 4, 64, 16, "none"),
    (["mesh.data=8"], 8, 2, 128, 16, "none"),
    (["mesh.data=8"], 8, 2, 64, 32, "none"),
    (["mesh.data=8"], 8, 2, 64, 16, "full"),
    (["mesh.data=4", "mesh.expert=2"], 8, 2, 64, 16, "none"),
    (["mesh.data=4", "mesh.expert=2"], 8, 2, 64, 32, "full"),
    (["mesh.data=2", "mesh.expert=4"], 8, 2, 64, 16, "none"),
    (["mesh.expert=8"], 8, 2, 64, 16, "none"),
    (["mesh.data=8", "model.n_layers=1"], 8, 2, 64, 16, "none"),
    (["mesh.data=8", "model.n_layers=1"], 8, 2, 64, 16, "full"),
    (["mesh.data=8", "model.n_layers=4"], 8, 2, 64, 16, "none"),
    (["mesh.data=8", "model.n_layers=4"], 8, 2, 64, 16, "full"),
]


def main() -> int:
    import jax

    from jaxdist.cluster import load_cluster
    from jaxdist.config import load_config
    from jaxdist.planner.candidates import strategy_of
    from jaxdist.planner.cluster import cluster_view
    from jaxdist.planner.computation import computation_view
    from jaxdist.planner.cost import estimate
    from jaxdist.train.aot import compiled_peak

    view = cluster_view(load_cluster("cpu-8"))
    mib = 2**20
    head = (
        f"{'mesh':<22} {'E':>3} {'k':>2} {'f':>4} {'batch':>5} {'remat':<5} {'pred MiB':>8} {'compiled':>8}"
        f" {'error':>7} {'gap':>6} {'copies':>6} {'ep rows':>7}"
    )
    print("moe-tiny (d_model 64, 2 blocks unless n_layers says, seq 64) on 8 CPU devices")
    print(head + "\n" + "-" * len(head))
    for mesh, experts, k, f, batch, remat in SETTINGS:
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
                *mesh,
            ],
        )
        s = strategy_of(cfg, 8)
        e = estimate(computation_view(cfg.model, cfg.train.seq_len), view, s, batch)
        got = compiled_peak(cfg, jax.devices()[:8])
        rows = batch // (s.data * s.fsdp * s.expert) * cfg.train.seq_len * k  # dispatched rows per device
        d = cfg.model.d_model
        copies = experts // s.expert * rows * (d + f) * 4
        ep_rows = s.expert * rows * d * 4 if s.expert > 1 else 0
        gap = got.peak_bytes - e.memory.total
        print(
            f"{' '.join(m.split('.', 1)[1] for m in mesh):<22} {experts:>3} {k:>2} {f:>4} {batch:>5} {remat:<5}"
            f" {e.memory.total / mib:>8.2f} {got.peak_bytes / mib:>8.2f} {e.memory.total / got.peak_bytes - 1:>+7.1%}"
            f" {gap / mib:>6.2f} {copies / mib:>6.2f} {ep_rows / mib:>7.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

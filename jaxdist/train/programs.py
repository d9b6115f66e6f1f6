"""What a compiled train step says about itself: the FLOPs it executes and whether bf16 stayed bf16.

Pure readings of a ``jax.stages.Compiled`` (or its HLO text), used by the Trainer's metrics (``hfu``) and
by ``jaxdist train``'s notice; nothing here runs a program.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxdist.parallel.hlo import dot_operand_types, loop_flops_correction


def executed_flops(compiled: Any, n_devices: int) -> float | None:
    """FLOPs ``compiled`` executes on all ``n_devices`` (XLA's ``cost_analysis()``, recomputation included, its
    loop bodies counted once per trip: see :func:`jaxdist.parallel.hlo.loop_flops_correction`), or None when
    the backend gives no count."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older JAX: one dict per program
    flops = (cost or {}).get("flops")
    if flops is None:
        return None
    # XLA counts a loop body once; the layer and microbatch scans run theirs many times.
    return float(flops + loop_flops_correction(compiled.as_text())) * n_devices


def bf16_notice(dtype: str, hlo_text: str, platform: str) -> str | None:
    """One sentence when ``model.dtype`` is bfloat16 but the program (``hlo_text``) multiplies mostly in float32.

    Read from the compiled program (its dots' operand types), not from a version table: XLA:CPU in JAX 0.10
    turns most bf16 matmuls into fp32 ones.
    """
    if dtype != "bfloat16":
        return None
    dots = dot_operand_types(hlo_text)
    upcast, native = dots.get("f32", 0), dots.get("bf16", 0)
    if upcast <= native:
        return None
    return (
        f"{upcast} of the train step's {upcast + native} matmuls run in float32 although "
        f"model.dtype=bfloat16: this JAX {jax.__version__} {platform} backend upcasts them, so bf16 runs "
        "at fp32 speed here"
        + (" (Python 3.12 with JAX 0.12 multiplies them natively on CPU)." if platform == "cpu" else ".")
    )

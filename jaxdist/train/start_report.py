"""What ``jaxdist train`` says before its first step (process 0, on stderr): the run, what was chosen for it and
why, so a user sees the decisions made for them."""

from __future__ import annotations

import jax

from jaxdist.models.attention import attention_note
from jaxdist.parallel.comm import describe_xla_options


def start_report(trainer) -> list[str]:
    """Lines about a built Trainer: mesh, model, batch and run; ``train.remat=auto``'s closed loop (predicted
    against compiled, and whether its program runs); the XLA options a GPU's gradient plan chose; per_block's
    collectives; which attention runs."""
    c = trainer.config
    lines = [trainer.describe()]
    chosen = trainer.resolved.remat.plan
    if hasattr(chosen, "trials"):  # train.remat=auto closed against the compiler: predicted vs compiled
        reuse = (
            "the run executes the chosen candidate's compiled program"
            if trainer.adopted_step
            else "the train step is compiled once more to run (on CPU the loop's compiles are LLVM level 0)"
        )
        lines.append(chosen.table() + "\n" + chosen.describe() + f"; {reuse}")
    if trainer.xla_options:  # GPUs: the options the gradient plan chose
        lines.append(describe_xla_options(trainer.xla_options))
    if c.train.grad_sync == "per_block":
        p = trainer.comm_plan
        lines.append(
            f"gradients reduced per block: {len(p.buckets)} collectives per step, {p.layers_per_bucket} "
            "layer(s) per bucket (jaxdist comm plan prints them)"
        )
    note = attention_note(c.model, c.train.seq_len, jax.devices()[0])
    if c.mesh.context > 1:  # the sequence is split: attention is the ring of jaxdist/parallel/context.py
        note = (
            f"attention: a ring over context={c.mesh.context} (blockwise blocks of {c.model.attention_block} "
            "tokens, load-balanced chunks)"
        )
    lines.append(note)
    return lines

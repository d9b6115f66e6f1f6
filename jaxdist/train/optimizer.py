"""AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from jaxdist.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig, steps: int | None = None) -> optax.Schedule:
    """Learning rate per step: linear warmup to ``learning_rate``, cosine decay to ``min_lr_ratio`` of it
    over ``steps`` (default ``train.schedule_steps``, or ``train.steps`` when that is 0), constant after."""
    steps = steps or cfg.schedule_steps or cfg.steps
    warmup = max(0, min(cfg.warmup_steps, steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1),
        end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )


def decay_mask(params) -> dict:
    """True for weights that get weight decay: matrices, not norm scales."""

    def keep(path, _):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return not name.endswith("norm")

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(
    cfg: TrainConfig, schedule_steps: int | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(AdamW, schedule over ``schedule_steps``, see :func:`learning_rate_schedule`).  Gradient clipping
    (``cfg.grad_clip``) is done by the train step, which already computes the global norm for its metrics.
    The optimizer state has the same structure whatever the schedule's length."""
    schedule = learning_rate_schedule(cfg, schedule_steps)
    opt = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
    return opt, schedule


def resumed_schedule_steps(cfg: TrainConfig, meta: dict, current: int) -> tuple[int, str | None]:
    """(schedule length in steps, a one-line notice or None) for a run resuming from a checkpoint's ``meta``.

    The schedule the run started with continues (its length is in the checkpoint) unless
    ``train.schedule_steps`` sets another; a checkpoint of an older jaxdist records no length, and then
    its run's train.steps was the length.  The notice says so when train.steps changed.  ``current``: the
    length the Trainer was built with (when nothing is recorded).
    """
    before = meta.get("config", {}).get("train", {})
    recorded = int(meta.get("schedule_steps") or before.get("schedule_steps") or before.get("steps") or 0)
    steps = cfg.schedule_steps or recorded or current
    if before.get("steps") in (None, cfg.steps):
        return steps, None
    how = (
        f"is now train.schedule_steps={steps} steps long"
        if cfg.schedule_steps
        else f"keeps its recorded length of {steps} steps (then stays at learning_rate * min_lr_ratio); "
        "set train.schedule_steps to change it"
    )
    return steps, f"train.steps changed from {before['steps']} to {cfg.steps}: the learning-rate schedule {how}"

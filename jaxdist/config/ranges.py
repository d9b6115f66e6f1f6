"""Values outside their meaning: numbers a field's mathematics cannot use, refused before anything runs.

Each section's own check (its ``check()``) tests what makes a setting
impossible with the others; these are the ranges of single values that are
accepted by their type but only fail later, as a ``nan`` loss at step 1 or a
traceback deep in a library: a beta of 1.5, a learning-rate floor above the
peak, a negative seed, a rotary base of 0, an odd head size.  One sentence
each, naming the key and the range.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any, Literal

from jaxdist.errors import ConfigError

SEED_MAX = 2**32 - 1  # jax.random.key and numpy's default_rng both take it; larger ones overflow in JAX
POSITIONS_MAX = 2**31 - 1  # token positions are int32


def _finite(key: str, v: float, low: float, high: float, low_open: bool = False, high_open: bool = False) -> None:
    ok = math.isfinite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
    if not ok:
        lo = f"{'>' if low_open else '>='} {low:g}"
        hi = "" if math.isinf(high) else f" and {'<' if high_open else '<='} {high:g}"
        raise ConfigError(f"{key}={v} is outside its range: it must be a finite number {lo}{hi}.")


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints`` of a config section class, resolved once (a config is checked thousands of
    times by the controller at scale: once per group size)."""
    return typing.get_type_hints(cls)


def check_choices(section: Any, prefix: str) -> None:
    """Every Literal-typed field of ``section`` and the sections inside it holds one of its values, whether or
    not the setting is in use (``model.moe.router=bogus`` on a dense model is a typo all the same)."""
    hints = type_hints(type(section))
    for f in dataclasses.fields(section):
        value, typ = getattr(section, f.name), hints.get(f.name)
        if dataclasses.is_dataclass(value):
            check_choices(value, f"{prefix}{f.name}.")
        elif typing.get_origin(typ) is Literal and value not in typing.get_args(typ):
            allowed = [str(a) for a in typing.get_args(typ)]
            raise ConfigError(
                f"{prefix}{f.name}='{value}' is not one of its values: use "
                + (", ".join(allowed[:-1]) + f" or {allowed[-1]}" if len(allowed) > 1 else allowed[0])
                + "."
            )


def check_ranges(cfg: Any) -> None:
    """Raise ConfigError for the first value of ``cfg`` outside its meaning (see the module docstring)."""
    for f in dataclasses.fields(cfg):
        if dataclasses.is_dataclass(getattr(cfg, f.name)):
            check_choices(getattr(cfg, f.name), f"{f.name}.")
    t, m, d = cfg.train, cfg.model, cfg.data
    _finite("train.b1", t.b1, 0, 1, high_open=True)  # AdamW's moment decays: 1 never forgets, > 1 diverges
    _finite("train.b2", t.b2, 0, 1, high_open=True)
    _finite("train.min_lr_ratio", t.min_lr_ratio, 0, 1)  # the floor of the schedule, a share of the peak
    _finite("train.learning_rate", t.learning_rate, 0, 1e3)
    if t.eval_batches < 0:
        raise ConfigError(f"train.eval_batches={t.eval_batches} must be 0 (no evaluation) or positive.")
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every={t.eval_every} must be 0 (only at the end) or positive.")
    for key, seed in (("train.seed", t.seed), ("data.seed", d.seed)):
        if not 0 <= seed <= SEED_MAX:
            raise ConfigError(f"{key}={seed} is not a seed: use a whole number from 0 to {SEED_MAX}.")
    _finite("model.rope_theta", m.rope_theta, 0, math.inf, low_open=True, high_open=True)
    _finite("model.norm_eps", m.norm_eps, 0, 1, low_open=True)
    if m.head_dim % 2:
        raise ConfigError(
            f"model.head_dim={m.head_dim} is odd: rotary embeddings turn pairs of dimensions, so it must be even."
        )
    if m.max_seq_len > POSITIONS_MAX:
        raise ConfigError(
            f"model.max_seq_len={m.max_seq_len} is beyond the int32 positions a model can address ({POSITIONS_MAX})."
        )
    _finite("model.init_std", m.init_std, 0, 10, low_open=True)
    if m.moe.every <= 0:
        raise ConfigError(f"model.moe.every={m.moe.every} must be positive: every k-th block is an MoE block.")
    if d.max_bytes < 0:
        raise ConfigError(f"data.max_bytes={d.max_bytes} must be 0 (all the text) or positive.")
    c = cfg.checkpoint
    if c.local_every <= 0 or c.local_keep <= 0:
        raise ConfigError(
            f"checkpoint.local_every={c.local_every} and checkpoint.local_keep={c.local_keep} must be positive."
        )

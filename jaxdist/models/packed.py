"""Packed rows (``data.packing=documents``, :mod:`jaxdist.data.documents`) as the model reads them, on the device:
the train step and the pipeline's stages unpack the flags of :mod:`jaxdist.packed_row` here."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxdist.packed_row import ID_MASK, NO_LOSS, START


def unpack(words: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Packed rows ``words`` [B, T+1] as (input ids [B, T], segments, positions, label ids [B, T], targets [B, T]
    bool): a token's segment counts the START flags up to it (never decreasing along a row), its position
    restarts at each; prediction j is a target unless token j+1 starts a segment or carries NO_LOSS."""
    inp, labels = words[:, :-1], words[:, 1:]
    start = (inp & START) != 0
    index = jnp.broadcast_to(jnp.arange(inp.shape[1], dtype=jnp.int32), inp.shape)
    segments = jnp.cumsum(start.astype(jnp.int32), axis=1)
    positions = index - jax.lax.cummax(jnp.where(start, index, 0), axis=1)
    targets = (labels & (START | NO_LOSS)) == 0
    return inp & ID_MASK, segments, positions, labels & ID_MASK, targets


def target_count(words: jax.Array) -> jax.Array:
    """The targets of packed rows ``words`` [B, T+1] (float32, at least 1)."""
    return jnp.maximum(jnp.sum((words[:, 1:] & (START | NO_LOSS)) == 0, dtype=jnp.float32), 1.0)

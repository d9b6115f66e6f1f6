"""The sampler's device programs: prefill, one decoding step, and the choice of each next token.

**Layout of a batch: left padding, with positions per row.**  The prompts of
a batch are padded on the left to the longest one, P tokens, so every row's
last prompt token sits in the same column and the whole batch moves one
shared *time slot* t per decoding step.  Row b starts ``pads[b]`` slots late;
its token in slot t has position ``t - pads[b]`` (the rotary angle), exactly
the position it would have alone, so a row's logits do not depend on the
other rows (the exactness test compares each row with its own unpadded
recomputation).  The shared slot is what lets the cache be written with one
``jax.lax.dynamic_update_slice`` at a traced scalar index instead of a
scatter per row.  (With ``moe.dispatch=capacity`` the padding tokens take
expert slots too, so there a row can depend on the others; dropless MoE, the
default, cannot.)

**The cache** is a fixed buffer of S slots per layer (``k``, ``v``
[layers, B, S, kv_heads, head_dim], :func:`jaxdist.models.transformer.
init_kv_cache`), sharded like the activations (rows over the data axes,
key/value heads over ``tensor``: ``KV_CACHE_NAMES`` through the model's
constraint hook and the jit shardings).  The token of time slot t is written
to cache slot ``t mod S``: S = P + new tokens when that fits in
``model.max_seq_len``, else S = max_seq_len and the buffer is a ring, each
new token attending to the newest max_seq_len positions (a sliding window, so
generation can run past the length the model was trained on).  Cache slot j
holds at time t the token of time slot ``t - ((t - j) mod S)``; a query sees
it when that slot is one of its row's real tokens (``>= pads[b]``): the
padding, the not yet written slots and (in a prefill) the later prompt
tokens are masked.

**Programs.**  :func:`prefill` runs the whole padded prompt batch [B, P] in
one call and chooses the first new token; :func:`decode_step` feeds one
token per row at time slot t (a traced int32 scalar) and chooses the next.
Neither program's shapes depend on t, so the decoding step compiles once per
(batch, cache length).  Sampling settings are traced scalars too (one
program for greedy, temperature, top-k and top-p).

**Token choice** (:func:`choose_tokens`): temperature 0 is greedy (argmax);
otherwise the logits are divided by the temperature, cut to the ``top_k``
largest (0: no cut; ties at the k-th value are kept) and to the smallest
set of largest tokens whose probability reaches ``top_p`` (nucleus), and
one token is drawn with ``jax.random.categorical`` under
``fold_in(key, t)``: the same seed gives the same tokens.  Ids the tokenizer
cannot decode (a model vocabulary larger than the tokenizer's) are never
chosen.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.config import ModelConfig
from jaxdist.models.hooks import constrain
from jaxdist.models.transformer import forward_with_cache, init_kv_cache


class Settings(NamedTuple):
    """Sampling settings as traced scalars (one compiled program for all of them)."""

    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = no cut
    top_p: jax.Array  # float32 in (0, 1]
    eos: jax.Array  # int32 id that ends a row; -1 = none


def left_pad(prompts: list[np.ndarray], rows: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [rows, P] int32, pads [rows] int32): the prompts right-aligned after ``pad`` ids, P the longest
    prompt's length; rows past the prompts (filler) are all padding (pads = P)."""
    p = max(len(r) for r in prompts)
    tokens = np.full((rows, p), pad, np.int32)
    pads = np.full((rows,), p, np.int32)
    for i, r in enumerate(prompts):
        tokens[i, p - len(r) :], pads[i] = r, p - len(r)
    return tokens, pads


def slot_times(t: jax.Array, length: int) -> jax.Array:
    """[..., S]: the time slot whose token cache slot j holds at time ``t`` (any shape), or a negative one if none yet."""
    j = jnp.arange(length, dtype=jnp.int32)
    return t[..., None] - jnp.mod(t[..., None] - j, length)


def visible_slots(times: jax.Array, pads: jax.Array, length: int) -> jax.Array:
    """[B, T, S] bool: which cache slots the queries at time slots ``times`` [T] see, rows padded by ``pads`` [B]."""
    held = slot_times(times, length)  # [T, S]
    return held[None, :, :] >= pads[:, None, None]


def choose_tokens(logits: jax.Array, key: jax.Array, s: Settings, vocab: int) -> jax.Array:
    """Next token ids [B] int32 (< ``vocab``) from logits [B, V] float32; see the module docstring.

    The settings are traced, so the branches are ``lax.cond``s: greedy decoding
    runs only the argmax, and plain temperature sampling skips the sort.
    """
    v = logits.shape[-1]
    if vocab < v:  # ids the tokenizer cannot decode
        logits = jnp.where(jnp.arange(v) < vocab, logits, -jnp.inf)

    def greedy(logits):
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(logits):
        scaled = logits / s.temperature
        scaled = jax.lax.cond((s.top_k > 0) | (s.top_p < 1), partial(_top_k_top_p, s=s, vocab=vocab), _keep, scaled)
        return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)

    return jax.lax.cond(s.temperature > 0, draw, greedy, logits)


def _keep(scaled: jax.Array) -> jax.Array:
    return scaled


def _top_k_top_p(scaled: jax.Array, s: Settings, vocab: int) -> jax.Array:
    """``scaled`` [B, V] with every token outside the top-k and the top-p nucleus set to -inf."""
    desc = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)  # largest first
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jax.lax.dynamic_index_in_dim(desc, k - 1, axis=-1, keepdims=True)  # [B, 1]
    in_k = desc >= kth
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept = in_k & ((mass_before < s.top_p) | (s.top_p >= 1))  # the largest token is always kept
    cutoff = jnp.min(jnp.where(kept, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def _next(logits, key, t, done, s: Settings, vocab: int, pad: int):
    """(token [B], done [B]): the chosen tokens, ``pad`` for rows already done; a row is done after EOS."""
    # The token choice on the whole [B, V], replicated in and out: its lax.conds then hold no collectives (XLA:CPU can
    # deadlock when devices reach collectives inside a conditional in different orders).
    logits = constrain(logits, (None, None))
    token = constrain(choose_tokens(logits, jax.random.fold_in(key, t), s, vocab), (None,))
    token = jnp.where(done, pad, token)
    return token, done | (token == s.eos)


def prefill(
    params: dict,
    tokens: jax.Array,
    pads: jax.Array,
    done: jax.Array,
    key: jax.Array,
    s: Settings,
    *,
    cfg: ModelConfig,
    length: int,
    vocab: int,
    pad: int,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array], jax.Array]:
    """The prompts [B, P] (left-padded by ``pads`` [B]) through the model into a new cache of ``length`` slots.

    ``done`` [B]: rows that generate nothing (the batch's filler rows).
    Returns (first new token [B], its logits [B, V] float32, cache, done).
    """
    b, p = tokens.shape
    times = jnp.arange(p, dtype=jnp.int32)
    positions = jnp.maximum(times[None, :] - pads[:, None], 0)
    cache = init_kv_cache(cfg, b, length)
    visible = visible_slots(times, pads, length)
    logits, cache = forward_with_cache(params, tokens, positions, cache, jnp.int32(0), visible, cfg)
    last = logits[:, -1]
    token, done = _next(last, key, jnp.int32(p - 1), done, s, vocab, pad)
    return token, last, cache, done


def decode_step(
    params: dict,
    token: jax.Array,
    t: jax.Array,
    pads: jax.Array,
    cache: dict[str, jax.Array],
    done: jax.Array,
    key: jax.Array,
    s: Settings,
    *,
    cfg: ModelConfig,
    vocab: int,
    pad: int,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array], jax.Array]:
    """Feed ``token`` [B] at time slot ``t`` (int32 scalar); returns (next token [B], its logits [B, V], cache, done)."""
    length = cache["k"].shape[2]
    positions = (t - pads)[:, None]
    visible = visible_slots(t[None], pads, length)
    logits, cache = forward_with_cache(params, token[:, None], positions, cache, jnp.mod(t, length), visible, cfg)
    logits = logits[:, 0]
    token, done = _next(logits, key, t, done, s, vocab, pad)
    return token, logits, cache, done

"""Context parallelism: each sequence split over the ``context`` mesh axis, attention as a ring.

Outside attention the activations are split over ``context`` along the sequence (the ``seq`` logical axis,
:mod:`jaxdist.parallel.rules`): norms, the MLP and the loss work on their own tokens with no communication.
Attention (installed into the model as its sequence attention, :mod:`jaxdist.models.hooks`) runs in
``shard_map`` over ``context``:

* **Load-balanced chunks.**  The sequence is cut into ``2 * context`` chunks; device i holds chunks i and
  ``2 * context - 1 - i`` (:func:`chunk_order`), so under the causal mask every device has the same work
  (:func:`causal_work`).  The activations arrive in plain order (device i holds chunks 2i and 2i+1); q, k, v
  are moved into the balanced order by two ``ppermute``s each and the output moved back, inside attention only,
  so positions (rotary), labels and the loss never see the permutation.
* **Ring.**  Each device keeps its queries and passes its key/value block around the ring with
  ``jax.lax.ppermute``; partial results over one block at a time combine by the online softmax (per-row
  log-sum-exp), so no device holds more than two key/value blocks of T / context tokens, nor scores beyond one
  block (the blocks run :func:`jaxdist.models.attention.blockwise_partial`).  With the balanced order a block
  from another device is exactly half visible: one from an earlier device is seen whole, through its first
  chunk, by both local chunks; one from a later device whole, through both its chunks, by the later local
  chunk only.  The masked half is skipped (``lax.cond``), so every step costs every device the same.
* **Backward** is a custom VJP (flash attention's): the ring runs again, the key/value blocks travel with
  their gradient accumulators and come home after ``context`` steps; the saved residuals are the local
  q, k, v, output and log-sum-exp only.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxdist.config import ModelConfig
from jaxdist.models import hooks
from jaxdist.models.attention import blockwise_partial, blockwise_partial_grads
from jaxdist.parallel import rules as _rules

AXIS = "context"


# --------------------------------------------------------------------------- the chunk order (pure)


def chunk_order(context: int) -> list[tuple[int, int]]:
    """The two chunk ids (of ``2 * context`` equal chunks of a sequence) each device of the ring holds:
    device i holds chunks i and ``2 * context - 1 - i``."""
    return [(i, 2 * context - 1 - i) for i in range(context)]


def causal_work(assignment: Sequence[Sequence[int]]) -> list[float]:
    """Per device, the (query chunk, key chunk) pairs a causal mask leaves to compute, in chunk-pair units:
    a pair below the diagonal counts 1, the diagonal pair 1/2 (half its scores are masked)."""
    chunks = [c for dev in assignment for c in dev]
    return [sum(1.0 if y < x else 0.5 if y == x else 0.0 for x in dev for y in chunks) for dev in assignment]


def _owner(chunk: int, context: int) -> int:
    """The device that holds ``chunk`` in :func:`chunk_order`."""
    return chunk if chunk < context else 2 * context - 1 - chunk


# --------------------------------------------------------------------------- inside shard_map (per device)


def _to_balanced(x: jax.Array, context: int) -> jax.Array:
    """x [b, 2h, ...] holding chunks 2i, 2i+1 (plain order) -> the same array holding chunks i, 2c-1-i."""
    h = x.shape[1] // 2
    even_dev = jax.lax.axis_index(AXIS) % 2 == 0
    # The even chunks go to their owners by one permutation, the odd ones by another (each a bijection).
    from_even = jax.lax.ppermute(x[:, :h], AXIS, [(i, _owner(2 * i, context)) for i in range(context)])
    from_odd = jax.lax.ppermute(x[:, h:], AXIS, [(i, _owner(2 * i + 1, context)) for i in range(context)])
    # Device j's first chunk j has j's parity; its second chunk 2c-1-j the other one.
    first = jnp.where(even_dev, from_even, from_odd)
    second = jnp.where(even_dev, from_odd, from_even)
    return jnp.concatenate([first, second], axis=1)


def _to_plain(y: jax.Array, context: int) -> jax.Array:
    """The inverse of :func:`_to_balanced`."""
    h = y.shape[1] // 2
    even_dev = jax.lax.axis_index(AXIS) % 2 == 0
    even_chunk = jnp.where(even_dev, y[:, :h], y[:, h:])
    odd_chunk = jnp.where(even_dev, y[:, h:], y[:, :h])
    a = jax.lax.ppermute(even_chunk, AXIS, [(_owner(2 * i, context), i) for i in range(context)])
    b = jax.lax.ppermute(odd_chunk, AXIS, [(_owner(2 * i + 1, context), i) for i in range(context)])
    return jnp.concatenate([a, b], axis=1)


def _rows(lse: jax.Array) -> jax.Array:
    """lse [B, KV, G, T] -> [B, T, KV*G, 1], to weight an output [B, T, H, D] row by row."""
    b, kv, g, t = lse.shape
    return lse.transpose(0, 3, 1, 2).reshape(b, t, kv * g)[..., None]


def _partial(q, k, v, block, offset, sq=None, sk=None):
    out, lse = blockwise_partial(q, k, v, block, offset, sq, sk)
    return out.astype(jnp.float32), lse[..., : q.shape[1]]


def _merge(o1, l1, o2, l2):
    """Two partial results over disjoint key sets combined (the online softmax's rescaling)."""
    lse = jnp.logaddexp(l1, l2)
    return o1 * jnp.exp(_rows(l1 - lse)) + o2 * jnp.exp(_rows(l2 - lse)), lse


def _ring_perm(context: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % context) for i in range(context)]


def _halves(seg, h):
    """A segments block [b, 2h] (or None: no documents) as its two chunks."""
    return (None, None) if seg is None else (seg[:, :h], seg[:, h:])


def _ring_forward(q, k, v, seg, context, block):
    """(out [b, 2h, H, D] float32, lse [b, KV, G, 2h]) of the local queries (balanced order) over every key;
    ``seg`` [b, 2h]: the local tokens' document segments (None: no documents), travelling with k and v."""
    h = q.shape[1] // 2
    me = jax.lax.axis_index(AXIS)
    qa, qb = q[:, :h], q[:, h:]
    sa, sb = _halves(seg, h)

    def lower(o, lse, kb, vb, skb):  # a block from an earlier device: its first chunk, seen whole by every query
        return _merge(o, lse, *_partial(q, kb[:, :h], vb[:, :h], block, h, seg, _halves(skb, h)[0]))

    def upper(o, lse, kb, vb, skb):  # a later device: both its chunks, seen whole by the later local chunk only
        o2, l2 = _merge(o[:, h:], lse[..., h:], *_partial(qb, kb, vb, block, 2 * h, sb, skb))
        return jnp.concatenate([o[:, :h], o2], axis=1), jnp.concatenate([lse[..., :h], l2], axis=3)

    def hop(t, o, lse, cur):
        kb, vb, skb = cur
        return jax.lax.cond((me - t) % context < me, lower, upper, o, lse, kb, vb, skb)

    # Each hop sends its block on before computing with it: the transfer has no dependency on the compute, so
    # XLA can overlap the next block's ppermute with this block's attention.  The middle hops run in a loop
    # (not unrolled) so that one hop's score tiles are live at a time, whatever the ring's size.
    cur = (k, v, seg)
    nxt = jax.lax.ppermute(cur, AXIS, _ring_perm(context)) if context > 1 else None
    # The device's own block: chunk a causal, chunk b sees a whole and b causally.
    o_a, l_a = _partial(qa, k[:, :h], v[:, :h], block, 0, sa, sa)
    o_b, l_b = _merge(
        *_partial(qb, k[:, :h], v[:, :h], block, h, sb, sa), *_partial(qb, k[:, h:], v[:, h:], block, 0, sb, sb)
    )
    o, lse = jnp.concatenate([o_a, o_b], axis=1), jnp.concatenate([l_a, l_b], axis=3)

    def middle(t, carry):
        o, lse, cur = carry
        nxt = jax.lax.ppermute(cur, AXIS, _ring_perm(context))
        o, lse = hop(t, o, lse, cur)
        return o, lse, nxt

    if context > 1:
        o, lse, cur = jax.lax.fori_loop(1, context - 1, middle, (o, lse, nxt))
        o, lse = hop(context - 1, o, lse, cur)  # the last hop sends nothing on
    return o, lse


def _ring_backward(q, k, v, seg, out, lse, dout, context, block):
    """(dq, dk, dv) of :func:`_ring_forward`'s attention; k/v (and their segments) and their gradients travel the
    ring together."""
    h = q.shape[1] // 2
    me = jax.lax.axis_index(AXIS)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    sa, sb = _halves(seg, h)

    def grads(qs, kb, vb, rows, offset, sq, sk):
        dq, dk, dv = blockwise_partial_grads(
            qs, kb, vb, out[:, rows], lse[..., rows], dout[:, rows], block, offset, sq, sk
        )
        return f32(dq), f32(dk), f32(dv)

    first, second, whole = slice(0, h), slice(h, 2 * h), slice(0, 2 * h)

    def lower(kb, vb, skb):
        dq, dk, dv = grads(q, kb[:, :h], vb[:, :h], whole, h, seg, _halves(skb, h)[0])
        pad = jnp.zeros_like(dk)
        return dq, jnp.concatenate([dk, pad], axis=1), jnp.concatenate([dv, pad], axis=1)

    def upper(kb, vb, skb):
        dq, dk, dv = grads(q[:, h:], kb, vb, second, 2 * h, sb, skb)
        return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

    def own(kb, vb):  # the device's own block (hop 0)
        dqa, dka, dva = grads(q[:, :h], kb[:, :h], vb[:, :h], first, 0, sa, sa)
        dqb1, dka1, dva1 = grads(q[:, h:], kb[:, :h], vb[:, :h], second, h, sb, sa)
        dqb2, dkb2, dvb2 = grads(q[:, h:], kb[:, h:], vb[:, h:], second, 0, sb, sb)
        ddq = jnp.concatenate([dqa, dqb1 + dqb2], axis=1)
        ddk = jnp.concatenate([dka + dka1, dkb2], axis=1)
        ddv = jnp.concatenate([dva + dva1, dvb2], axis=1)
        return ddq, ddk, ddv

    def hop(t, dq, dkv, kv):
        kb, vb, skb = kv
        ddq, ddk, ddv = jax.lax.cond((me - t) % context < me, lower, upper, kb, vb, skb)
        # The gradient of the block held now goes on with it; after `context` moves it is back with its owner.
        return dq + ddq, jax.lax.ppermute((dkv[0] + ddk, dkv[1] + ddv), AXIS, _ring_perm(context))

    kv = (k, v, seg)
    nxt = jax.lax.ppermute(kv, AXIS, _ring_perm(context)) if context > 1 else None  # overlaps the compute
    ddq, ddk, ddv = own(k, v)
    dq = ddq
    dkv = jax.lax.ppermute((ddk, ddv), AXIS, _ring_perm(context))

    def middle(t, carry):  # a loop, not unrolled: one hop's buffers live at a time (as in the forward)
        dq, dkv, kv = carry
        nxt = jax.lax.ppermute(kv, AXIS, _ring_perm(context))
        dq, dkv = hop(t, dq, dkv, kv)
        return dq, dkv, nxt

    if context > 1:
        dq, dkv, kv = jax.lax.fori_loop(1, context - 1, middle, (dq, dkv, nxt))
        dq, dkv = hop(context - 1, dq, dkv, kv)
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _ring(q, k, v, seg, context, block):
    return _ring_forward(q, k, v, seg, context, block)[0].astype(q.dtype)


def _ring_fwd(q, k, v, seg, context, block):
    out, lse = _ring_forward(q, k, v, seg, context, block)
    out = out.astype(q.dtype)
    return out, (q, k, v, seg, out, lse)


def _ring_bwd(context, block, res, dout):
    return (*_ring_backward(*res, dout, context, block), None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _local(q, k, v, seg, context, block):
    q, k, v = (_to_balanced(x, context) for x in (q, k, v))
    seg = None if seg is None else _to_balanced(seg, context)
    return _to_plain(_ring(q, k, v, seg, context, block), context)


# --------------------------------------------------------------------------- installing it


def _block_size(half: int, block: int) -> int:
    """A key/value block that divides a chunk of ``half`` tokens (so no partial result is padded)."""
    if half <= block:
        return half
    return block if half % block == 0 else math.gcd(half, block)


def ring_attention(
    mesh: Mesh,
    rules: _rules.Rules,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cfg: ModelConfig,
    segments: jax.Array | None = None,
):
    """Causal attention of q [B, T, H, D] over k, v [B, T, KV, D] (global arrays) as a ring over ``context``.

    T must divide into ``2 * mesh.context`` chunks (jaxdist.config.schema refuses other lengths).  Batch and heads keep
    their own shardings (data/fsdp, tensor); when tensor splits the query heads but not the key/value heads
    (fewer KV heads than tensor), k and v are repeated to one per query head first.  ``segments`` [B, T] (packed
    documents, never decreasing along a row): a query sees only its own segment's keys; the segments travel the
    ring with the keys, and a key block with none of a query block's documents is skipped.
    """
    context = dict(mesh.shape)[AXIS]
    t = q.shape[1]
    assert t % (2 * context) == 0, f"sequence of {t} tokens does not split into 2 x {context} chunks"
    q_spec = _rules.logical_to_spec(("batch", "seq", "heads", "head_dim"), rules, mesh, q.shape)
    kv_spec = _rules.logical_to_spec(("batch", "seq", "kv_heads", "head_dim"), rules, mesh, k.shape)
    if q_spec[2] != kv_spec[2]:
        k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
        kv_spec = q_spec
    assert q_spec[1] == AXIS, f"attention's sequence is not split over {AXIS}: {q_spec}"
    local = functools.partial(_local, context=context, block=_block_size(t // (2 * context), cfg.attention_block))
    specs, args = (q_spec, kv_spec, kv_spec), (q, k, v)
    if segments is None:
        local = functools.partial(local, seg=None)
    else:
        specs, args = (*specs, jax.sharding.PartitionSpec(*q_spec[:2])), (*args, segments)
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=specs,
        out_specs=q_spec,
        # The blockwise loops start their carries from constants, which the varying-axes check rejects; the
        # body's collectives are all explicit ppermutes over context, and the exactness tests check the result.
        check_vma=False,
    )
    with _rules.activation_sharding(None):  # whole-mesh constraints do not apply inside shard_map
        return fn(*args)


@contextlib.contextmanager
def context_parallelism(mesh: Mesh | None, rules: _rules.Rules = _rules.DEFAULT_RULES) -> Iterator[None]:
    """Within this block, a model being traced runs its whole-sequence attention as :func:`ring_attention` on
    ``mesh`` when its ``context`` axis is larger than 1 (otherwise ``model.attention``'s own)."""
    on = mesh is not None and dict(mesh.shape).get(AXIS, 1) > 1
    with hooks.attending(functools.partial(ring_attention, mesh, rules) if on else None):
        yield

"""Causal grouped-query attention behind one function, with three implementations (``model.attention``).

* ``xla``: the whole score matrix [B, H, Tq, Tk] in float32, softmax, one matmul each way
  (:func:`causal_attention`, :func:`attention_over_cache`); memory grows with T^2.
* ``blockwise``: key/value blocks of ``model.attention_block`` tokens with an online softmax
  (``lax.fori_loop`` over the key blocks a query block can see, ``lax.map`` over query blocks) and a
  custom VJP that saves only the output and the per-row log-sum-exp (both tagged ``attn_context``) and
  recomputes the blocks in the backward pass, as flash attention does; memory grows with T.  Blocks above
  the causal diagonal are skipped (neither computed nor stored).
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)``, GPUs only.

``auto`` picks one per call from the platform and the key length (:func:`choose_attention`).  The
sequence-chunked pipeline's queries at positions P..P+Tc-1 (``q_offset`` = P) and the sampler's
masked cache (:func:`cached_attention`) are covered by ``xla`` and ``blockwise``; ``cudnn`` hands those to
``blockwise`` and ``xla`` (its causal mask is aligned to position 0, and it takes no per-row mask).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxdist.config import ModelConfig
from jaxdist.errors import ConfigError
from jaxdist.models import hooks

# Without cuDNN, blockwise from this many key tokens on: from there it is at least as fast as xla's attention
# and holds far less memory (benchmarks/attention.py; the figures are in benchmarks/README.md).
# Shorter sequences keep xla: their scores are small, and their programs stay exactly what they were.
BLOCKWISE_MIN_SEQ = 2048
_MIN = float(jnp.finfo(jnp.float32).min)


def cudnn_supports(cfg: ModelConfig, platform: str, compute_capability: str | None = None) -> bool:
    """Whether cuDNN's fused attention runs this model here: a CUDA GPU of compute capability 8.0 or newer
    (None: not known, assumed), bfloat16 compute and head_dim a multiple of 8 up to 128."""
    if platform not in ("gpu", "cuda"):
        return False
    if compute_capability is not None and float(compute_capability) < 8.0:
        return False
    return cfg.dtype == "bfloat16" and cfg.head_dim % 8 == 0 and cfg.head_dim <= 128


def choose_attention(
    cfg: ModelConfig, seq_len: int, platform: str, compute_capability: str | None = None
) -> tuple[str, str]:
    """(implementation, reason) for attention over ``seq_len`` key tokens on ``platform`` (``jax.default_backend()``).

    ``model.attention`` other than ``auto`` is taken as it is; ``auto`` is ``cudnn`` where
    :func:`cudnn_supports`, else ``blockwise`` from :data:`BLOCKWISE_MIN_SEQ` tokens on, else ``xla``.
    """
    if cfg.attention != "auto":
        return cfg.attention, "model.attention"
    if cudnn_supports(cfg, platform, compute_capability):
        return "cudnn", f"auto: cuDNN fused attention on {platform}"
    if seq_len >= BLOCKWISE_MIN_SEQ:
        return "blockwise", f"auto: seq {seq_len} >= {BLOCKWISE_MIN_SEQ} on {platform}"
    return "xla", f"auto: seq {seq_len} < {BLOCKWISE_MIN_SEQ} on {platform}"


def check_attention_platform(cfg: ModelConfig, platform: str) -> None:
    """ConfigError (one sentence) when ``model.attention=cudnn`` is asked for off a GPU."""
    if cfg.attention == "cudnn" and platform not in ("gpu", "cuda"):
        raise ConfigError(
            f"model.attention=cudnn needs a CUDA GPU but this job runs on {platform}: "
            "use model.attention=auto, xla or blockwise."
        )


def attention_note(cfg: ModelConfig, seq_len: int, device) -> str:
    """One line for the console: which attention a step of ``seq_len`` tokens runs on ``device`` (a jax Device),
    and why, e.g. ``attention: blockwise (auto: seq 8192 >= 2048 on cpu)``."""
    impl, why = choose_attention(cfg, seq_len, device.platform, getattr(device, "compute_capability", None))
    return f"attention: {impl} ({why})"


def _implementation(cfg: ModelConfig, seq_len: int) -> str:
    platform = jax.default_backend()
    check_attention_platform(cfg, platform)
    return choose_attention(cfg, seq_len, platform)[0]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cfg: ModelConfig,
    q_offset: int = 0,
    segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
) -> jax.Array:
    """Causal grouped-query attention with ``cfg.attention``'s implementation.

    q: [B, Tq, H, D]; k, v: [B, Tk, KV, D], H a multiple of KV; query i sits at position q_offset + i and
    sees keys 0..q_offset + i.  Returns [B, Tq, H, D] in q's dtype.  ``segments`` [B, Tq] (packed documents)
    and ``kv_segments`` [B, Tk] (default ``segments``): a query sees only the keys of its own segment, in the
    ``xla``, ``blockwise`` and ring implementations (``auto``'s cudnn runs blockwise; jaxdist.config.schema
    refuses model.attention=cudnn with documents).
    """
    ring = hooks.sequence_attention()
    if ring is not None and q_offset == 0 and q.shape[1] == k.shape[1]:  # tokens split over mesh.context
        return ring(q, k, v, cfg) if segments is None else ring(q, k, v, cfg, segments)
    if segments is not None:
        impl = _implementation(cfg, k.shape[1])  # auto's cudnn takes no document mask here: blockwise does
        if impl in ("blockwise", "cudnn"):
            kv_segments = segments if kv_segments is None else kv_segments
            return _document_attention(q, k, v, segments, kv_segments, q_offset, cfg.attention_block, True)
        return causal_attention(q, k, v, q_offset, segments, kv_segments)
    impl = _implementation(cfg, k.shape[1])
    if impl == "cudnn" and q_offset == 0 and q.shape[1] == k.shape[1]:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if impl in ("blockwise", "cudnn"):  # cudnn's causal mask starts at position 0: chunks go blockwise
        return blockwise_attention(q, k, v, q_offset, cfg.attention_block)
    return causal_attention(q, k, v, q_offset)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Attention of q [B, Tq, H, D] over a key/value cache k, v [B, S, KV, D] where ``visible`` [B, Tq, S].

    ``blockwise`` runs the online softmax over cache blocks (no [Tq, S] scores; not differentiated, so no
    custom VJP); ``xla`` and ``cudnn`` the whole score matrix (:func:`attention_over_cache`: cuDNN takes no
    per-row mask, and with one query per decoding step the scores are only [1, S]).
    """
    if _implementation(cfg, k.shape[1]) == "blockwise":
        out, _ = _blockwise_forward(q, k, v, min(cfg.attention_block, k.shape[1]), visible=visible)
        return out
    return attention_over_cache(q, k, v, visible)


# --------------------------------------------------------------------------- xla (whole score matrix)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offset: int = 0,
    segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query causal attention.

    q: [B, Tq, H, D]; k, v: [B, Tk, KV, D] with H a multiple of KV.  Query i sits
    at absolute position q_offset + i and sees keys 0..q_offset + i, and with ``segments`` [B, Tq]
    only those of its own segment (``kv_segments`` [B, Tk], default ``segments``).  Returns [B, Tq, H, D].
    Softmax in float32.
    """
    b, tq, h, dh = q.shape
    kv = k.shape[2]
    g = h // kv
    qg = q.reshape(b, tq, kv, g, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(dh))
    tk = k.shape[1]
    mask = (jnp.arange(tq)[:, None] + q_offset) >= jnp.arange(tk)[None, :]
    if segments is None:
        scores = jnp.where(mask[None, None, None], scores, jnp.finfo(jnp.float32).min)
    else:  # [B, Tq, Tk]: causal and within the query's segment
        kv_segments = segments if kv_segments is None else kv_segments
        mask = mask[None] & (segments[:, :, None] == kv_segments[:, None, :])
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, h, dh).astype(q.dtype)


def attention_over_cache(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array) -> jax.Array:
    """Grouped-query attention of q [B, Tq, H, D] over cached k, v [B, S, KV, D] where ``visible`` [B, Tq, S].

    :func:`causal_attention` with an explicit per-row mask instead of the
    causal one (kept apart so the training program does not change).
    Returns [B, Tq, H, D].  Softmax in float32.
    """
    b, tq, h, dh = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, tq, kv, h // kv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores / jnp.sqrt(jnp.float32(dh))
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, tq, h, dh).astype(q.dtype)


# --------------------------------------------------------------------------- blockwise (online softmax)


def _pad_seq(x: jax.Array, length: int) -> jax.Array:
    """x [B, T, ...] padded with zeros along T to ``length``."""
    return jnp.pad(x, [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def _blocks(tq: int, tk: int, block: int) -> tuple[int, int, int, int]:
    """(query block, key block, query blocks, key blocks): blocks of ``block`` tokens, no larger than the sequence."""
    bq, bk = min(block, tq), min(block, tk)
    return bq, bk, -(-tq // bq), -(-tk // bk)


def _scores(qi, kj, d, rows, cols, tk, q_offset, visible, seg_q=None, seg_k=None):
    """(scaled scores [B, KV, G, bq, bk] float32, mask) of one query block against one key block; ``seg_q`` [B, bq]
    and ``seg_k`` [B, bk]: packed documents' segments, a query sees only its own segment's keys."""
    s = jnp.einsum("btkgd,bskd->bkgts", qi, kj, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(d))
    if visible is None:  # causal, and the zero padding past the last key hidden
        mask = ((rows[:, None] + q_offset) >= cols[None, :]) & (cols < tk)[None, :]
        mask = mask[None, None, None]
        if seg_q is not None:
            mask = mask & (seg_q[:, :, None] == seg_k[:, None, :])[:, None, None]
    else:
        mask = visible[:, None, None]
    return s, mask


def _segment_blocks(segments, kv_segments, tq, tk, bq, bk, nq, nk):
    """Padded query and key segments [B, nq*bq], [B, nk*bk] (-1 past the end) and each key block's last real key's
    segment [B, nk]: what the document skip compares (segments grow along a row, so a key block whose last
    segment is below a query's holds none of that query's document, nor does any block before it)."""
    seg_q = jnp.pad(segments, [(0, 0), (0, nq * bq - tq)], constant_values=-1)
    seg_k = jnp.pad(kv_segments, [(0, 0), (0, nk * bk - tk)], constant_values=-1)
    last = kv_segments[:, jnp.minimum((jnp.arange(nk) + 1) * bk, tk) - 1]
    return seg_q, seg_k, last


def _blockwise_forward(q, k, v, block, q_offset=0, visible=None, segments=None, skip=True, kv_segments=None):
    """(out [B, Tq, H, D], lse [B, KV, G, Tq padded] float32): the online-softmax forward.

    ``visible`` [B, Tq, S] replaces the causal mask (the sampler's cache); then every key block is visited.
    ``segments`` [B, Tq] (packed documents): a query sees only the keys of its own segment, ``kv_segments``
    [B, Tk] (default ``segments``: Tq = Tk); segment ids never decrease along a row.  A key block whose
    segments all lie before every row's first query of the block is skipped (neither computed nor masked;
    ``skip=False`` visits every causal block and masks: benchmarks/documents.py's comparison).
    """
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bq, bk, nq, nk = _blocks(tq, tk, block)
    qg = _pad_seq(q, nq * bq).reshape(b, nq * bq, kvh, g, d)
    kp, vp = _pad_seq(k, nk * bk), _pad_seq(v, nk * bk)
    if visible is not None:
        visible = jnp.pad(visible, [(0, 0), (0, nq * bq - tq), (0, nk * bk - tk)])
    if segments is not None:
        kv_segments = segments if kv_segments is None else kv_segments
        segq, segk, last_seg = _segment_blocks(segments, kv_segments, tq, tk, bq, bk, nq, nk)

    def query_block(i):
        qi = jax.lax.dynamic_slice_in_dim(qg, i * bq, bq, axis=1)
        rows = i * bq + jnp.arange(bq)
        seg_q = None if segments is None else jax.lax.dynamic_slice_in_dim(segq, i * bq, bq, axis=1)

        def key_block(j, carry):
            m, l, acc = carry
            kj = jax.lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1)
            vj = jax.lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1)
            vis = seg_k = None
            if visible is not None:
                vis = jax.lax.dynamic_slice(visible, (0, i * bq, j * bk), (b, bq, bk))
            if segments is not None:
                seg_k = jax.lax.dynamic_slice_in_dim(segk, j * bk, bk, axis=1)
            s, mask = _scores(qi, kj, d, rows, j * bk + jnp.arange(bk), tk, q_offset, vis, seg_q, seg_k)
            m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _MIN), axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = alpha * l + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
            return m_new, l, alpha[..., None] * acc + pv

        # Causal: only the key blocks holding keys <= the block's last query position.
        n = nk if visible is not None else jnp.minimum(nk, (q_offset + (i + 1) * bq - 1) // bk + 1)
        # Documents: from the first key block that reaches the segment of some row's first query of the block.
        lo = 0 if segments is None or not skip else jnp.min(jnp.sum(last_seg < segq[:, i * bq, None], axis=1))
        init = (
            jnp.full((b, kvh, g, bq), _MIN, jnp.float32),
            jnp.zeros((b, kvh, g, bq), jnp.float32),
            jnp.zeros((b, kvh, g, bq, d), jnp.float32),
        )
        m, l, acc = jax.lax.fori_loop(lo, n, key_block, init)
        l = jnp.where(l == 0.0, 1.0, l)  # a row that sees nothing (only the sampler's padding rows): zeros
        return acc / l[..., None], m + jnp.log(l)

    out, lse = jax.lax.map(query_block, jnp.arange(nq))  # [nq, B, KV, G, bq, D], [nq, B, KV, G, bq]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, h, d)[:, :tq].astype(q.dtype)
    lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, kvh, g, nq * bq)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_offset: int = 0, block: int = 512) -> jax.Array:
    """:func:`causal_attention` computed over key/value blocks of ``block`` tokens (same arguments, same result).

    Its gradient recomputes the blocks from the saved output and per-row log-sum-exp, so neither pass holds
    more than one [bq, bk] score block per head.
    """
    return _blockwise_forward(q, k, v, block, q_offset)[0]


def _blockwise_fwd(q, k, v, q_offset, block):
    out, lse = _blockwise_forward(q, k, v, block, q_offset)
    # What the backward reads besides q, k, v.  The log-sum-exp carries the context's name: a remat policy that
    # keeps ``attn_context`` (the remat selector's names) keeps both, and the forward loop is not run again.
    out, lse = checkpoint_name(out, "attn_context"), checkpoint_name(lse, "attn_context")
    return out, (q, k, v, out, lse)


def _blockwise_bwd(q_offset, block, res, dout):
    return _blockwise_grads(q_offset, block, res, dout)


def _blockwise_grads(q_offset, block, res, dout, segments=None, skip=True, kv_segments=None):
    """(dq, dk, dv) of the blockwise forward from its residuals; ``segments`` and ``kv_segments`` as in
    :func:`_blockwise_forward` (a query block none of whose queries sees a key block is skipped for it)."""
    q, k, v, out, lse = res
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    bq, bk, nq, nk = _blocks(tq, tk, block)
    qg = _pad_seq(q, nq * bq).reshape(b, nq * bq, kvh, g, d)
    dog = _pad_seq(dout, nq * bq).reshape(b, nq * bq, kvh, g, d)
    og = _pad_seq(out, nq * bq).reshape(b, nq * bq, kvh, g, d)
    kp, vp = _pad_seq(k, nk * bk), _pad_seq(v, nk * bk)
    # delta_i = sum_d dout * out: the softmax's own term of dscores, per row [B, KV, G, Tq padded]
    delta = jnp.sum(dog.astype(jnp.float32) * og.astype(jnp.float32), axis=-1).transpose(0, 2, 3, 1)
    scale = 1.0 / math.sqrt(d)
    if segments is not None:
        kv_segments = segments if kv_segments is None else kv_segments
        segq, segk, last_seg = _segment_blocks(segments, kv_segments, tq, tk, bq, bk, nq, nk)
        real = jnp.arange(nq * bq) < tq

    def key_block(dq, j):
        kj = jax.lax.dynamic_slice_in_dim(kp, j * bk, bk, axis=1)
        vj = jax.lax.dynamic_slice_in_dim(vp, j * bk, bk, axis=1)
        cols = j * bk + jnp.arange(bk)
        seg_k = None if segments is None else jax.lax.dynamic_slice_in_dim(segk, j * bk, bk, axis=1)

        def query_block(i, carry):
            dq, dk, dv = carry
            qi = jax.lax.dynamic_slice_in_dim(qg, i * bq, bq, axis=1)
            doi = jax.lax.dynamic_slice_in_dim(dog, i * bq, bq, axis=1)
            lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
            delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
            seg_q = None if segments is None else jax.lax.dynamic_slice_in_dim(segq, i * bq, bq, axis=1)
            s, mask = _scores(qi, kj, d, i * bq + jnp.arange(bq), cols, tk, q_offset, None, seg_q, seg_k)
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
            dv = dv + jnp.einsum("bkgts,btkgd->bskd", p.astype(dout.dtype), doi, preferred_element_type=jnp.float32)
            dp = jnp.einsum("btkgd,bskd->bkgts", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i[..., None]) * scale
            dq_i = jnp.einsum("bkgts,bskd->btkgd", ds.astype(k.dtype), kj, preferred_element_type=jnp.float32)
            dq = jax.lax.dynamic_update_slice_in_dim(
                dq, jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=1) + dq_i, i * bq, axis=1
            )
            dk = dk + jnp.einsum("bkgts,btkgd->bskd", ds.astype(q.dtype), qi, preferred_element_type=jnp.float32)
            return dq, dk, dv

        # Causal: only the query blocks whose last position reaches this block's first key.
        first = jnp.maximum(0, (j * bk - q_offset) // bq)
        # Documents: up to the query block holding the last query whose segment is not past this block's last.
        last = nq
        if segments is not None and skip:
            reach = jnp.max(jnp.sum(real & (segq <= last_seg[:, j, None]), axis=1))
            last = jnp.minimum(nq, -(-reach // bq))
        zeros = jnp.zeros((b, bk, kvh, d), jnp.float32)
        dq, dk, dv = jax.lax.fori_loop(first, last, query_block, (dq, zeros, zeros))
        return dq, (dk, dv)

    dq0 = jnp.zeros((b, nq * bq, kvh, g, d), jnp.float32)
    dq, (dk, dv) = jax.lax.scan(key_block, dq0, jnp.arange(nk))  # dk, dv: [nk, B, bk, KV, D]

    def whole(x):
        return x.transpose(1, 0, 2, 3, 4).reshape(b, nk * bk, kvh, d)[:, :tk]

    dq = dq.reshape(b, nq * bq, h, d)[:, :tq]
    return dq.astype(q.dtype), whole(dk).astype(k.dtype), whole(dv).astype(v.dtype)


blockwise_attention.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_document_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array, block: int = 512, skip: bool = True
) -> jax.Array:
    """:func:`blockwise_attention` of packed documents: a query sees the earlier keys of its own segment
    (``segments`` [B, T]) and key/value blocks holding none of them are skipped, forward and backward
    (``skip=False``: visited and masked, the comparison benchmarks/documents.py makes)."""
    return _document_attention(q, k, v, segments, segments, 0, block, skip)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _document_attention(q, k, v, segments, kv_segments, q_offset, block, skip):
    """Blockwise attention of queries in ``segments`` [B, Tq] at positions q_offset.. over keys in
    ``kv_segments`` [B, Tk] at 0.. (the sequence-chunked pipeline's chunks: q_offset > 0, Tk = q_offset + Tq)."""
    return _blockwise_forward(q, k, v, block, q_offset, None, segments, skip, kv_segments)[0]


def _document_fwd(q, k, v, segments, kv_segments, q_offset, block, skip):
    out, lse = _blockwise_forward(q, k, v, block, q_offset, None, segments, skip, kv_segments)
    out, lse = checkpoint_name(out, "attn_context"), checkpoint_name(lse, "attn_context")
    return out, (q, k, v, out, lse, segments, kv_segments)


def _document_bwd(q_offset, block, skip, res, dout):
    *res, segments, kv_segments = res
    return (*_blockwise_grads(q_offset, block, tuple(res), dout, segments, skip, kv_segments), None, None)


_document_attention.defvjp(_document_fwd, _document_bwd)


# --------------------------------------------------------------------------- pieces for ring attention


def blockwise_partial(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    block: int,
    q_offset: int,
    segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(out [B, Tq, H, D] in q's dtype, lse [B, KV, G, Tq padded to the block] float32) of q against one
    key/value block only, query i at position q_offset + i (keys at 0..Tk-1).  Partial results over disjoint
    key blocks combine by their log-sum-exp (context parallelism's ring, jaxdist.parallel.context).  Packed
    documents: the queries' ``segments`` [B, Tq] and the keys' ``kv_segments`` [B, Tk]; a row that sees no key
    of this block gets output 0 and log-sum-exp float32 min (it adds nothing when combined)."""
    return _blockwise_forward(q, k, v, block, q_offset, None, segments, True, kv_segments)


def blockwise_partial_grads(
    q, k, v, out, lse, dout, block: int, q_offset: int, segments=None, kv_segments=None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(dq, dk, dv) of one key/value block's share of attention, as :func:`blockwise_partial`'s arguments.

    ``out`` and ``lse`` are those of the attention over *every* key block (the combined result), ``dout`` its
    cotangent: with them the block's gradients are independent of the other blocks (flash attention's
    backward), so a ring can compute them one block at a time."""
    return _blockwise_grads(q_offset, block, (q, k, v, out, lse), dout, segments, True, kv_segments)

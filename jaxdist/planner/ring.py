"""The context axis in the cost model: what the ring of :mod:`jaxdist.parallel.context` holds and sends.

With ``context = c > 1`` every sequence is split into ``c`` parts of ``T / c`` tokens, one per device of the
ring.  Everything outside attention (norms, projections, MLP, logits, loss) works on its own ``T / c`` tokens,
so the kept activations, the working buffers and the logits shrink by ``c`` (:func:`jaxdist.planner.cost.
memory_terms` divides the tokens per device by ``c``); the parameters, gradients and optimizer state are
replicated over ``context`` and do not shrink.  Attention is always the blockwise ring (one log-sum-exp per
row is kept, never ``[T, T]`` scores), whatever ``model.attention`` says.

Beyond that the ring adds, per device, while one block is differentiated (:func:`ring_buffer_bytes`): the
key/value block in transit beside the one being used (forward and backward), the float32 gradient
accumulators of the travelling key/value block and of the local queries, and the score tiles of the
blockwise partials (heads x block x block float32).

Transfers (:func:`ring_collectives`), per layer, microbatch and pass, per device: ``c - 1`` hops of the
key/value block forward (again when full remat recomputes the forward), ``c - 1`` hops of it backward plus
``c`` hops of its float32 gradients; and the load-balancing reorder of q, k, v and the output into and out
of the balanced chunk order (half a block per ``ppermute``).  Each hop is issued before the current block's
compute, so a hop costs only what its transfer exceeds the compute of one block pair: the exposed time per
hop is ``max(0, transfer - compute)``; :class:`~jaxdist.planner.cost.CommItem` ``overlap_flops`` carries that
compute, :func:`jaxdist.planner.cost.estimate` converts it to seconds.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from jaxdist.config import ModelConfig
from jaxdist.models import arithmetic
from jaxdist.planner.candidates import Strategy
from jaxdist.planner.computation import ComputationView, computation_view

# Score tiles (heads x block x block, float32) XLA keeps live at once while a layer's ring is
# differentiated: about two for the device's own block and two per hop, with at most two hops live (the
# middle hops run in a loop, jaxdist.parallel.context), as the buffer assignment of the compiled step
# shows; tests/planner/test_context.py holds the whole prediction to the compiled peak.


def live_score_tiles(context: int) -> int:
    """Score tiles of one block pair live at the peak of a layer's backward with ``context`` devices."""
    return 2 + 2 * min(context, 2)


def ring_view(view: ComputationView, s: Strategy) -> ComputationView:
    """The computation view the strategy runs: with ``context > 1`` attention is the blockwise ring (no [T, T]
    scores kept), so a view of an ``xla`` / ``auto`` model is swapped for its blockwise twin."""
    if s.context == 1 or view.model.attention in ("blockwise", "cudnn"):
        return view
    return _blockwise_view(view.model, view.seq_len)


@functools.lru_cache(maxsize=64)
def _blockwise_view(model: ModelConfig, seq_len: int) -> ComputationView:
    return computation_view(dataclasses.replace(model, attention="blockwise"), seq_len)


def ring_block(seq_len: int, context: int, attention_block: int) -> int:
    """Key/value tokens per blockwise partial inside the ring (jaxdist.parallel.context._block_size)."""
    half = seq_len // (2 * context)
    if half <= attention_block:
        return half
    return attention_block if half % attention_block == 0 else math.gcd(half, attention_block)


def _heads_local(m: ModelConfig, s: Strategy) -> tuple[float, float]:
    """(query heads, key/value heads) per device: tensor splits both; k/v are repeated to one per query
    head when tensor does not divide the key/value heads (ring_attention)."""
    h = m.n_heads / s.tensor
    kv = m.n_kv_heads / s.tensor if m.n_kv_heads % s.tensor == 0 else h
    return h, kv


def ring_buffer_bytes(view: ComputationView, s: Strategy, rows: int) -> float:
    """Bytes per device the ring holds beyond the kept activations while one block is differentiated,
    for ``rows`` sequences per device per microbatch (0 without context parallelism)."""
    if s.context == 1:
        return 0.0
    m, c, T, a = view.model, s.context, view.seq_len, view.act_bytes
    h, kv = _heads_local(m, s)
    tokens = rows * T / c
    kv_block = 2 * tokens * kv * m.head_dim  # k and v elements of one block
    q_block = tokens * h * m.head_dim
    in_transit = kv_block * a  # the next block, sent while this one is used
    grads = 2 * kv_block * 4 + q_block * 4  # travelling dk, dv (now and sent) and the dq accumulator, float32
    b = ring_block(T, c, m.attention_block)
    tiles = live_score_tiles(c) * rows * h * b * b * 4
    return in_transit + grads + tiles


def ring_collectives(view: ComputationView, s: Strategy, rows: int, recompute_forward: bool) -> list[dict]:
    """The ring's transfers of one step as keyword arguments of cost.collectives' add (name, kind, axes, nbytes, count, overlap_flops),
    ``rows`` sequences per device per microbatch; empty without context parallelism."""
    if s.context == 1:
        return []
    m, c, T, a = view.model, s.context, view.seq_len, view.act_bytes
    h, kv = _heads_local(m, s)
    tokens = rows * T / c
    kv_bytes = 2 * tokens * kv * m.head_dim * a
    q_bytes = tokens * h * m.head_dim * a
    layers = math.ceil(view.n_layers / s.pipeline) * s.microbatches
    forwards = 2 if recompute_forward else 1
    # One hop's compute: the local queries against half of one block (the balanced order's visible half),
    # scores and context, forward; the backward's four matmuls against it cost twice that.
    hop_fwd = tokens * arithmetic.score_flops_fwd(m, T // c) / s.tensor
    return [
        dict(
            name="context ring k/v (forward)",
            kind="collective-permute",
            axes=("context",),
            nbytes=kv_bytes,
            count=(c - 1) * layers * forwards,
            overlap_flops=hop_fwd,
        ),
        dict(
            name="context ring k/v + grads (backward)",
            kind="collective-permute",
            axes=("context",),
            nbytes=kv_bytes + 2 * kv_bytes * 4 / a * c / max(c - 1, 1),  # c gradient hops spread over c - 1
            count=(c - 1) * layers,
            overlap_flops=2 * hop_fwd,
        ),
        dict(
            name="context chunk reorder",
            kind="collective-permute",
            axes=("context",),
            nbytes=(2 * q_bytes + kv_bytes) / 8,  # q, k, v in and the output out: two halves each, per pass
            count=8 * layers * (forwards + 1),
            overlap_flops=0.0,
        ),
    ]

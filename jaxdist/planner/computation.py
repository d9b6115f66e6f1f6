"""Computation view: what one training step of a model computes and stores.

From a :class:`~jaxdist.config.ModelConfig` alone (no devices, no tracing;
the weights come from the model's own shape tables) it lists, for each kind
of transformer block (dense; MoE where the model has experts) and for the
embedding / output head:

* every parameter: shape, logical axes (as the model tags them), bytes;
* every activation the block produces: logical axes and elements per token
  (attention scores grow with the sequence: ``heads x seq`` per token);
* forward and backward FLOPs per token.

The cost model combines these with a mesh (how each logical axis is split)
and a remat choice (which activations are kept for the backward pass).

Which activations the backward pass keeps without remat mirrors what XLA keeps
for :func:`jaxdist.models.transformer.block_forward` (the residuals of JAX's
linearisation after XLA removes duplicates): six model-width tensors (layer
input, the two RMSNorm outputs and their unscaled forms, the residual after
attention), rotated query and key, value, the attention scores and
probabilities (float32), the context, and six MLP-width tensors (gate, up,
and the SiLU terms of its derivative).  An MoE block keeps the same per
routed copy of a token (top-k of them) plus the router scores.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

from jaxdist.config import ModelConfig
from jaxdist.models import arithmetic
from jaxdist.models.arithmetic import DTYPE_BYTES
from jaxdist.models.moe import DENSE_MLP_KEYS, moe_param_specs
from jaxdist.models.names import block_param_specs


@dataclass(frozen=True)
class ParamTensor:
    """One weight: ``shape`` (elements; per layer for block weights) and its logical ``axes``."""

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        """Elements."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ActivationTensor:
    """One activation of a block, per token: ``shape`` after the (batch, seq) dimensions.

    ``axes`` are the logical names of those trailing dimensions; ``"seq"`` in
    them (attention scores) means the tensor grows with the sequence length.
    ``dtype_bytes`` is bytes per element (compute dtype, or 4 for float32
    softmax terms).  ``checkpoint_name`` is the name a remat policy saves it by
    (empty for untagged intermediates); ``read_by_backward`` is false for a
    tensor the backward pass never needs (a policy naming it keeps nothing).
    ``routed``: one row per routed copy of a token (top-k per token), held where
    the token's experts run: the cost model sizes it by the rows an expert
    device receives (:func:`jaxdist.planner.cost.expert_rows`), not by k.
    """

    name: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype_bytes: int
    checkpoint_name: str = ""
    read_by_backward: bool = True
    routed: bool = False

    @property
    def elements_per_token(self) -> int:
        """Elements per token (for one given sequence length already in ``shape``)."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class BlockKind:
    """One kind of transformer block (dense, or MoE), ``count`` of them in the model.

    ``params`` are one block's weights; ``activations`` what its forward pass
    produces per token; ``saved_without_remat`` the names of those the backward
    pass keeps when nothing is recomputed; ``flops_fwd`` forward FLOPs per
    token; ``attention_flops_fwd`` the part of it in the scores matmul (what a
    remat that keeps every tagged tensor recomputes).  ``dispatch_rows``:
    token copies sent to experts per token (top-k; 0 for a dense block).
    """

    name: str
    count: int
    params: tuple[ParamTensor, ...]
    activations: tuple[ActivationTensor, ...]
    saved_without_remat: tuple[str, ...]
    flops_fwd: float
    attention_flops_fwd: float
    dispatch_rows: int = 0

    def __hash__(self) -> int:  # the planner's caches look a block up for every strategy: hashed once
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, f.name) for f in fields(self)))

    @property
    def param_count(self) -> int:
        """Parameter elements of one block."""
        return sum(p.size for p in self.params)

    def activation(self, name: str) -> ActivationTensor:
        """The activation called ``name`` (KeyError if none)."""
        for a in self.activations:
            if a.name == name:
                return a
        raise KeyError(name)


@dataclass(frozen=True)
class ComputationView:
    """Parameters, activations and FLOPs of one model at one sequence length ``seq_len`` (tokens)."""

    model: ModelConfig
    seq_len: int
    blocks: tuple[BlockKind, ...]  # dense blocks first, then MoE blocks (if any)
    other_params: tuple[ParamTensor, ...]
    param_bytes: int  # bytes per parameter element (param_dtype)
    act_bytes: int  # bytes per activation element (compute dtype)
    head_flops_fwd: float  # FLOPs per token of the output projection's forward pass

    @property
    def n_layers(self) -> int:
        """Transformer blocks."""
        return sum(b.count for b in self.blocks)

    @property
    def n_experts(self) -> int:
        """Routed experts per MoE block (0: dense model)."""
        return self.model.moe.experts

    @property
    def param_count(self) -> int:
        """Parameter elements of the whole model."""
        return sum(b.count * b.param_count for b in self.blocks) + sum(p.size for p in self.other_params)

    def flops_per_token(self, recompute: dict[str, float] | None = None) -> float:
        """Training FLOPs per token: forward + backward (2 x forward) + recomputed forward FLOPs per block kind.

        Without ``recompute`` this is :func:`jaxdist.models.arithmetic.train_flops_per_token`
        (the blocks' FLOPs come from there).
        """
        recompute = recompute or {}
        layers = sum(b.count * (3.0 * b.flops_fwd + recompute.get(b.name, 0.0)) for b in self.blocks)
        return layers + 3.0 * self.head_flops_fwd


def _attention(m: ModelConfig, t: int, a: int) -> tuple[list[ParamTensor], list[ActivationTensor], tuple[str, ...]]:
    d, h, kv, hd = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    params = [
        ParamTensor(name, shape, axes)
        for name, (shape, axes) in block_param_specs(m).items()
        if name not in DENSE_MLP_KEYS
    ]
    acts = [
        ActivationTensor("layer_input", (d,), ("embed",), a),
        ActivationTensor("attn_norm_unscaled", (d,), ("embed",), a),
        ActivationTensor("attn_norm", (d,), ("embed",), a, "attn_norm"),
        ActivationTensor("query", (h, hd), ("heads", "head_dim"), a, "query_proj"),
        ActivationTensor("key", (kv, hd), ("kv_heads", "head_dim"), a, "key_proj"),
        ActivationTensor("value", (kv, hd), ("kv_heads", "head_dim"), a, "value_proj"),
        *_qk_norm_tensors(m, a),
        ActivationTensor("query_rotated", (h, hd), ("heads", "head_dim"), a),
        ActivationTensor("key_rotated", (kv, hd), ("kv_heads", "head_dim"), a),
        *_score_tensors(m, h, t),
        ActivationTensor("attn_context", (h, hd), ("heads", "head_dim"), a, "attn_context"),
        ActivationTensor("attn_out", (d,), ("embed",), a, "attn_out"),
        ActivationTensor("attn_residual", (d,), ("embed",), a),
        ActivationTensor("mlp_norm_unscaled", (d,), ("embed",), a),
        ActivationTensor("mlp_norm", (d,), ("embed",), a, "mlp_norm"),
        ActivationTensor("mlp_out", (d,), ("embed",), a, "mlp_out", read_by_backward=False),
    ]
    saved = (
        "layer_input",
        "attn_norm_unscaled",
        "attn_norm",
        "query_rotated",
        "key_rotated",
        "value",
        *(x.name for x in _qk_norm_tensors(m, a)),
        *(x.name for x in _score_tensors(m, h, t)),
        "attn_context",
        "attn_residual",
        "mlp_norm_unscaled",
        "mlp_norm",
    )
    return params, acts, saved


def _qk_norm_tensors(m: ModelConfig, a: int) -> list[ActivationTensor]:
    """The normalised, unscaled queries and keys of ``model.qk_norm`` (Qwen3), which the norms' backward reads."""
    if not m.qk_norm:
        return []
    return [
        ActivationTensor("query_normed", (m.n_heads, m.head_dim), ("heads", "head_dim"), a),
        ActivationTensor("key_normed", (m.n_kv_heads, m.head_dim), ("kv_heads", "head_dim"), a),
    ]


def _score_tensors(m: ModelConfig, h: int, t: int) -> list[ActivationTensor]:
    """What attention keeps besides q, k, v and the context: the [T, T] scores and probabilities (float32) of
    ``model.attention=xla``; blockwise and cudnn keep one log-sum-exp per query row and head.  ``auto`` is
    counted as xla: the platform (cudnn or not) is not known here, so this errs on the side of memory."""
    if m.attention in ("blockwise", "cudnn"):
        return [ActivationTensor("attn_lse", (h,), ("heads",), 4)]
    return [
        ActivationTensor("attn_scores", (h, t), ("heads", "seq"), 4),
        ActivationTensor("attn_probs", (h, t), ("heads", "seq"), 4),
    ]


def _swiglu(
    prefix: str, f: int, rows: int, axis: str, a: int, routed: bool = False
) -> tuple[list[ActivationTensor], tuple[str, ...]]:
    """The SwiGLU activations per token (``rows`` copies of width ``f``) and the six the backward keeps."""
    names = ("gate", "up", "sigmoid", "silu", "silu_grad", "hidden")
    tags = {"gate": "mlp_gate", "up": "mlp_up"} if prefix == "mlp" else {}
    acts = [
        ActivationTensor(
            f"{prefix}_{n}",
            (rows, f) if rows > 1 else (f,),
            (None, axis) if rows > 1 else (axis,),
            a,
            tags.get(n, ""),
            routed=routed,
        )
        for n in names
    ]
    return acts, tuple(x.name for x in acts)


def computation_view(model: ModelConfig, seq_len: int) -> ComputationView:
    """The computation view of ``model`` trained on sequences of ``seq_len`` tokens."""
    m = model
    d, f, v = m.d_model, m.d_ff, m.vocab_size
    a, t = DTYPE_BYTES[m.dtype], seq_len
    scores = arithmetic.score_flops_fwd(m, t)
    blocks = []
    n_moe = arithmetic.moe_blocks(m)
    specs = block_param_specs(m)
    if m.n_layers - n_moe:
        params, acts, saved = _attention(m, t, a)
        params += [ParamTensor(name, *specs[name]) for name in DENSE_MLP_KEYS]
        mlp, mlp_saved = _swiglu("mlp", f, 1, "mlp", a)
        blocks.append(
            BlockKind(
                "dense",
                m.n_layers - n_moe,
                tuple(params),
                tuple(acts + mlp),
                saved + mlp_saved,
                arithmetic.dense_block_flops_fwd(m, t),
                scores,
            )
        )
    if n_moe:
        experts, fe, k, fs = m.moe.experts, m.moe.d_ff or f, m.moe.top_k, m.moe.shared_d_ff
        params, acts, saved = _attention(m, t, a)
        params += [ParamTensor(name, shape, axes) for name, (shape, axes) in moe_param_specs(m).items()]
        expert_acts, expert_saved = _swiglu("expert", fe, k, "expert_mlp", a, routed=True)
        acts += expert_acts + [
            ActivationTensor("router_probs", (experts,), (None,), 4),
            ActivationTensor("dispatched", (k, d), (None, "embed"), a, routed=True),
        ]
        saved += expert_saved + ("router_probs", "dispatched")
        if fs:  # the shared expert's weights came with moe_param_specs
            shared, shared_saved = _swiglu("shared", fs, 1, "mlp", a)
            acts += shared
            saved += shared_saved
        blocks.append(
            BlockKind("moe", n_moe, tuple(params), tuple(acts), saved, arithmetic.moe_block_flops_fwd(m, t), scores, k)
        )
    other = [ParamTensor("embed", (v, d), ("vocab", "embed")), ParamTensor("final_norm", (d,), ("norm",))]
    if not m.tie_embeddings:
        other.append(ParamTensor("lm_head", (d, v), ("embed", "vocab")))
    return ComputationView(
        model=m,
        seq_len=t,
        blocks=tuple(blocks),
        other_params=tuple(other),
        param_bytes=DTYPE_BYTES[m.param_dtype],
        act_bytes=a,
        head_flops_fwd=arithmetic.head_flops_fwd(m),
    )

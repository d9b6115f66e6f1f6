"""Model arithmetic without JAX: parameter counts, training FLOPs per token, train-state bytes.

The one home of these numbers: the planner's computation view and cost model,
the remat selector's memory breakdown and the Trainer's MFU all read them here.
Everything is a pure function of a :class:`~jaxdist.config.ModelConfig` (and a
sequence length, or the parameter elements one device holds); nothing here
imports JAX or flax, so the planner and the CLI can use it before JAX starts.

FLOPs follow PaLM's accounting (Chowdhery et al. 2022, appendix B): a matmul
of a token through a ``d_in x d_out`` weight costs ``2 d_in d_out`` forward and
twice that backward, so a training step costs ``6 x matmul parameters`` per
token, plus ``12 x layers x heads x head_dim x seq_len`` for the attention
scores (``q k^T``) and context (``p v``).  Counted as written:

* attention is **not** causal-discounted: the full ``seq_len x seq_len`` score
  matrix is counted, as the model computes it (a masked dense softmax);
* **remat recompute is excluded**: these are model FLOPs, what MFU divides by;
  the planner adds the recomputed forward FLOPs of a remat choice itself
  (:func:`jaxdist.planner.cost.recompute_flops`);
* the input embedding is a lookup (no FLOPs); the output head is a matmul,
  tied to the embedding or not; MoE blocks count the router and the
  ``moe.top_k`` experts a token runs through (plus a shared expert), not all;
* elementwise work (norms, rotary, SiLU, softmax, the loss) and the
  optimizer update are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxdist.config import ModelConfig

# Bytes per element of the dtypes a ModelConfig names (model.dtype, model.param_dtype).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# --------------------------------------------------------------------------- parameters (elements)


def moe_blocks(m: ModelConfig) -> int:
    """Number of MoE blocks: every ``moe.every``-th of ``n_layers`` (0 for a dense model)."""
    return m.n_layers // m.moe.every if m.moe.experts else 0


def attention_params(m: ModelConfig) -> int:
    """Matmul parameters of one block's attention: query, key, value and output projections."""
    return m.d_model * m.head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)


def dense_mlp_params(m: ModelConfig) -> int:
    """Parameters of one dense SwiGLU MLP (gate, up, down: ``3 x d_model x d_ff``)."""
    return 3 * m.d_model * m.d_ff


def moe_mlp_params(m: ModelConfig, active: bool = False) -> int:
    """Parameters of one MoE block's feed-forward part: router, routed experts, shared expert.

    ``active=True`` counts the ``moe.top_k`` experts one token runs through instead of all of them.
    """
    d = m.d_model
    experts = m.moe.top_k if active else m.moe.experts
    return d * m.moe.experts + experts * 3 * d * (m.moe.d_ff or m.d_ff) + 3 * d * m.moe.shared_d_ff


def ffn_params(m: ModelConfig, active: bool = False) -> int:
    """Matmul parameters of all feed-forward blocks (dense MLPs, routers, experts, shared experts).

    ``active=True`` counts only the moe.top_k experts one token runs through.
    """
    n_moe = moe_blocks(m)
    return (m.n_layers - n_moe) * dense_mlp_params(m) + n_moe * moe_mlp_params(m, active)


def param_count(m: ModelConfig, active: bool = False) -> int:
    """Parameter elements of the model (embedding included, a tied output head counted once).

    ``active=True``: the parameters one token uses (MoE: top-k experts only).
    """
    d, v = m.d_model, m.vocab_size
    norms = 2 * d + (2 * m.head_dim if m.qk_norm else 0)  # a block's RMSNorm scales (and its q/k head norms)
    biases = (m.n_heads + 2 * m.n_kv_heads) * m.head_dim if m.qkv_bias else 0  # q, k, v projection biases
    head = 0 if m.tie_embeddings else d * v
    return v * d + m.n_layers * (attention_params(m) + norms + biases) + ffn_params(m, active) + d + head


def matmul_params(m: ModelConfig, active: bool = True) -> int:
    """Parameters that multiply a token in a matmul: attention, feed-forward, output head (tied or not).

    Norm scales and the input embedding (a lookup) are left out; ``active``
    (default) counts the routed experts a token runs through.
    """
    return m.n_layers * attention_params(m) + ffn_params(m, active) + m.d_model * m.vocab_size


# --------------------------------------------------------------------------- FLOPs (per token)


def score_flops_fwd(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one block's attention scores ``q k^T`` (the context ``p v`` costs as much)."""
    return 2.0 * m.n_heads * m.head_dim * seq_len


def attention_flops_fwd(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one block's attention: four projections, scores and context (no causal discount)."""
    return 2.0 * attention_params(m) + 2 * score_flops_fwd(m, seq_len)


def dense_block_flops_fwd(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one dense block (attention + SwiGLU MLP)."""
    return attention_flops_fwd(m, seq_len) + 2.0 * dense_mlp_params(m)


def moe_block_flops_fwd(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one MoE block (attention + router + top-k experts + shared expert)."""
    return attention_flops_fwd(m, seq_len) + 2.0 * moe_mlp_params(m, active=True)


def head_flops_fwd(m: ModelConfig) -> float:
    """Forward FLOPs per token of the output projection (``d_model x vocab_size``)."""
    return 2.0 * m.d_model * m.vocab_size


def forward_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of the whole model on sequences of ``seq_len`` tokens."""
    n_moe = moe_blocks(m)
    blocks = (m.n_layers - n_moe) * dense_block_flops_fwd(m, seq_len) + n_moe * moe_block_flops_fwd(m, seq_len)
    return blocks + head_flops_fwd(m)


def train_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), PaLM's accounting (see the module docstring).

    Equals ``6 x matmul_params(m) + 12 x n_layers x n_heads x head_dim x seq_len``;
    causal masking not discounted, remat recompute not counted.
    """
    return 3.0 * forward_flops_per_token(m, seq_len)


# --------------------------------------------------------------------------- train-state bytes (per device)


@dataclass(frozen=True)
class TrainStateBytes:
    """Bytes per device of the train state: parameters, one copy of the gradients, AdamW's two moments."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        """Bytes per device of parameters, gradients and optimizer state together."""
        return self.params + self.grads + self.optimizer


def train_state_bytes(local_params: float, param_dtype: str) -> TrainStateBytes:
    """The train state one device holds, for ``local_params`` parameter elements on it.

    ``local_params`` is the sum over weights of (elements x the shard fraction
    one device holds); ``param_count(m) * fraction`` when every weight is split
    alike.  Parameters and gradients are stored in ``param_dtype``, and so are
    AdamW's first and second moments (optax keeps them in the parameters'
    dtype): 4 copies in all.
    """
    b = local_params * DTYPE_BYTES[param_dtype]
    return TrainStateBytes(params=b, grads=b, optimizer=2 * b)

"""The ``[model]`` and ``[model.moe]`` sections and the model presets; each section checks itself.  No JAX."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxdist.config.fields import Attention, Dispatch, DType, RopeScaling, Router, choices, one_of, option
from jaxdist.errors import ConfigError


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (the ``[model.moe]`` table): routed experts per MoE block; experts = 0 makes a dense model."""

    experts: int = option(0, "Routed experts per MoE block; 0 makes a dense model.")
    top_k: int = option(2, "Experts each token is routed to (the k of top-k), 1..experts.")
    d_ff: int = option(0, "Hidden width of one expert's SwiGLU FFN; 0 uses d_ff.")
    every: int = option(
        1,
        "Every k-th block is an MoE block (blocks k-1, 2k-1, ...), the others keep the dense MLP; must divide n_layers.",
    )
    shared_d_ff: int = option(0, "Hidden width of a shared expert every token also goes through (0: none).")
    router: Router = option("softmax", "Router scores: softmax (Mixtral) or sigmoid (DeepSeek-V3).")
    renormalize: bool = option(True, "Rescale each token's k expert weights to sum to 1.")
    dispatch: Dispatch = option(
        "dropless",
        "dropless (tokens sorted by expert, grouped matmul, none dropped) or capacity (fixed slots per expert, overflow dropped).",
    )
    capacity_factor: float = option(
        1.25,
        "Capacity mode: slots per expert = ceil(factor x tokens x k / experts), counted over each device's tokens.",
    )
    aux_loss_coef: float = option(
        0.01, "Weight of the load-balancing loss (mean over MoE blocks) in the training objective."
    )
    z_loss_coef: float = option(
        0.001, "Weight of the router z-loss (mean squared log-sum-exp of the router logits) in the training objective."
    )

    def check(self) -> None:
        """ConfigError (one sentence) for MoE settings that cannot work by themselves."""
        check_moe(self)


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape and numerics."""

    preset: str = option(
        "small", "Preset the other model fields start from (see MODEL_PRESETS); `model=NAME` on the CLI sets it."
    )
    vocab_size: int = option(260, "Vocabulary size (tokens). The byte tokenizer uses 256 bytes + 4 specials = 260.")
    d_model: int = option(128, "Residual stream width (features).")
    n_layers: int = option(4, "Number of transformer blocks (stacked and scanned).")
    n_heads: int = option(4, "Query heads per block.")
    n_kv_heads: int = option(2, "Key/value heads (grouped-query attention); must divide n_heads.")
    head_dim: int = option(32, "Features per attention head.")
    d_ff: int = option(384, "Hidden width of the SwiGLU MLP.")
    max_seq_len: int = option(128, "Longest sequence the rotary tables cover (tokens).")
    rope_theta: float = option(10000.0, "Rotary embedding base.")
    norm_eps: float = option(1e-5, "RMSNorm epsilon.")
    tie_embeddings: bool = option(True, "Share the input embedding with the output projection.")
    dtype: DType = option("float32", "Compute dtype of activations and matmuls: float32 or bfloat16.")
    param_dtype: DType = option(
        "float32", "Storage dtype of the master weights: float32 (recommended with bf16 compute) or bfloat16."
    )
    init_std: float = option(0.02, "Standard deviation of the normal weight initialiser.")
    attention: Attention = option(
        "auto",
        "Attention implementation: xla (whole [T, T] scores), blockwise (online softmax over key/value blocks, "
        "memory linear in T), cudnn (fused, CUDA GPUs, bfloat16), or auto (cudnn where supported, else blockwise "
        "from 2048 tokens, else xla).",
    )
    attention_block: int = option(512, "Tokens per query and key/value block of blockwise attention.")
    rope_scaling: RopeScaling = option(
        "none",
        "Rotary frequency scaling: none, linear (every frequency / rope_factor) or llama3 (Llama 3.1's blend).",
    )
    rope_factor: float = option(1.0, "Rotary scaling factor of rope_scaling=linear or llama3.")
    rope_low_freq_factor: float = option(
        1.0, "llama3 scaling: wavelengths above rope_original_max_len / this are divided by rope_factor."
    )
    rope_high_freq_factor: float = option(
        4.0, "llama3 scaling: wavelengths below rope_original_max_len / this are kept (blended in between)."
    )
    rope_original_max_len: int = option(
        8192, "llama3 scaling: the context length the model was pretrained with (tokens)."
    )
    qkv_bias: bool = option(False, "Learned biases on the query, key and value projections (Qwen2).")
    qk_norm: bool = option(
        False, "RMSNorm of each query and key head over head_dim, before the rotary embedding (Qwen3)."
    )
    init_from: str = option(
        "",
        "A Hugging Face model directory (config.json + *.safetensors): the model fields come from its config.json, "
        "a run without a checkpoint starts from its weights, and its tokenizer (tokenizer.json or tokenizer.model) "
        "is data.tokenizer for data.source=tokens unless that is set.",
    )
    moe: MoEConfig = field(
        default_factory=lambda: MoEConfig(), metadata={"help": "Mixture of experts: the `[model.moe]` table (below)."}
    )

    def check(self) -> None:
        """ConfigError (one sentence) for model settings that cannot work by themselves."""
        check_model(self)


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: compiles in a second, still has every feature (GQA, scan over 2 layers).
    "tiny": dict(
        vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, max_seq_len=128
    ),
    # The embedded default: trains in a few minutes on 2 CPU cores.
    "small": dict(
        vocab_size=260, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384, max_seq_len=128
    ),
    # Real shapes, for planning and for GPUs.
    "llama-1b": dict(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        d_ff=8192,
        max_seq_len=4096,
        rope_theta=500000.0,
        tie_embeddings=True,
        dtype="bfloat16",
    ),
    "llama-8b": dict(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
        dtype="bfloat16",
    ),
    "llama-70b": dict(
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        d_ff=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
        dtype="bfloat16",
    ),
    # Mixture of experts.  Tests and `jaxdist train model=moe-tiny`: 8 experts, top-2.
    "moe-tiny": dict(
        vocab_size=260,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        max_seq_len=128,
        moe=dict(experts=8, top_k=2, d_ff=64),
    ),
    # Real shapes, for planning: Mixtral-8x7B (8 experts, top-2, 46.7B params, 12.9B active).
    "mixtral-8x7b": dict(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        max_seq_len=32768,
        rope_theta=1e6,
        tie_embeddings=False,
        dtype="bfloat16",
        moe=dict(experts=8, top_k=2),
    ),
    # Qwen3 (per-head q/k RMSNorm, rope_theta 1e6): Qwen3-0.6B and Qwen3-8B, for planning and `model.init_from`.
    "qwen3-0.6b": dict(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        d_ff=3072,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=True,
        qk_norm=True,
        dtype="bfloat16",
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        d_model=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=12288,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        dtype="bfloat16",
    ),
    # Qwen3-30B-A3B: 128 experts of width 768, top-8 renormalised (norm_topk_prob), 30.5B params, 3.3B active.
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        d_ff=6144,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        dtype="bfloat16",
        moe=dict(experts=128, top_k=8, d_ff=768, renormalize=True),
    ),
    # Fine-grained experts shaped like DeepSeekMoE-16B: 64 small experts, top-6, 2 shared (as one of width 2x1408).
    "deepseek-moe-16b": dict(
        vocab_size=102400,
        d_model=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=16,
        head_dim=128,
        d_ff=10944,
        max_seq_len=4096,
        tie_embeddings=False,
        dtype="bfloat16",
        moe=dict(experts=64, top_k=6, d_ff=1408, shared_d_ff=2816),
    ),
}


def check_model(m: ModelConfig) -> None:
    """Model shape and numerics, the MoE table included (ConfigError, one sentence)."""
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "max_seq_len"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}: "
            "choose n_kv_heads that divides n_heads."
        )
    for name in ("dtype", "param_dtype", "attention"):
        if getattr(m, name) not in choices(m, name):
            raise ConfigError(f"model.{name}='{getattr(m, name)}' is not supported: use {one_of(choices(m, name))}.")
    if m.attention_block <= 0:
        raise ConfigError(f"model.attention_block={m.attention_block} must be positive (tokens per block).")
    if m.attention == "cudnn" and m.dtype != "bfloat16":
        raise ConfigError(
            f"model.attention=cudnn runs in bfloat16 only but model.dtype={m.dtype}: "
            "set model.dtype=bfloat16 or use model.attention=auto, xla or blockwise."
        )
    _check_rope(m)
    m.moe.check()
    if m.moe.experts and (m.moe.every <= 0 or m.n_layers % m.moe.every):
        raise ConfigError(
            f"model.moe.every={m.moe.every} does not divide model.n_layers={m.n_layers}: "
            "choose an MoE interval that divides the number of blocks."
        )


def _check_rope(m: ModelConfig) -> None:
    """The rotary scaling fields (ConfigError, one sentence)."""
    if m.rope_scaling not in choices(m, "rope_scaling"):
        raise ConfigError(
            f"model.rope_scaling='{m.rope_scaling}' is not supported: use {one_of(choices(m, 'rope_scaling'))}."
        )
    if m.rope_scaling != "none" and not m.rope_factor > 0:
        raise ConfigError(
            f"model.rope_factor={m.rope_factor} must be positive with model.rope_scaling={m.rope_scaling}."
        )
    if m.rope_scaling == "llama3" and not (
        0 < m.rope_low_freq_factor < m.rope_high_freq_factor and m.rope_original_max_len > 0
    ):
        raise ConfigError(
            f"model.rope_scaling=llama3 needs 0 < rope_low_freq_factor ({m.rope_low_freq_factor}) < "
            f"rope_high_freq_factor ({m.rope_high_freq_factor}) and a positive rope_original_max_len "
            f"({m.rope_original_max_len}): fix those fields."
        )


def check_moe(e: MoEConfig) -> None:
    """The ``[model.moe]`` table by itself (ConfigError, one sentence); a dense model (experts = 0) passes."""
    if e.experts < 0:
        raise ConfigError(f"model.moe.experts={e.experts} must be positive (or 0 for a dense model).")
    if not e.experts:
        return
    if not 1 <= e.top_k <= e.experts:
        raise ConfigError(
            f"model.moe.top_k={e.top_k} must lie between 1 and model.moe.experts={e.experts}: "
            "route each token to at most as many experts as there are."
        )
    for name in ("d_ff", "shared_d_ff"):
        if getattr(e, name) < 0:
            raise ConfigError(f"model.moe.{name}={getattr(e, name)} must be positive (or 0).")
    if e.every <= 0:
        raise ConfigError(f"model.moe.every={e.every} must be positive: every k-th block is an MoE block.")
    if e.router not in choices(e, "router"):
        raise ConfigError(f"model.moe.router='{e.router}' is unknown: use {one_of(choices(e, 'router'))}.")
    if e.dispatch not in choices(e, "dispatch"):
        raise ConfigError(f"model.moe.dispatch='{e.dispatch}' is unknown: use {one_of(choices(e, 'dispatch'))}.")
    if e.dispatch == "capacity" and not e.capacity_factor > 0:
        raise ConfigError(
            f"model.moe.capacity_factor={e.capacity_factor} must be positive in capacity mode: "
            "use e.g. 1.25, or set model.moe.dispatch=dropless."
        )

"""What the models name, without JAX: checkpoint names and weight shapes (read by the planner).

``CHECKPOINT_NAMES``: the tagged intermediates (``checkpoint_name``) of a
block, in the order a block computes them; a remat policy saves a subset
(``jax.checkpoint_policies.save_only_these_names``).
``block_param_specs``: shape and logical axes of each per-layer weight; ``moe_param_specs`` those of an MoE
block's (jaxdist.models.moe runs them).
"""

from __future__ import annotations

from jaxdist.config import (
    CHECKPOINT_NAMES,  # defined with the config checks (train.remat is checked at load)
    ModelConfig,
)

__all__ = [
    "CHECKPOINT_NAMES",
    "DENSE_MLP_KEYS",
    "EXPERT_KEYS",
    "SHARED_KEYS",
    "block_param_specs",
    "expert_d_ff",
    "is_moe_layer",
    "moe_layer_count",
    "moe_param_specs",
]


def block_param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Per-layer weight name -> (shape, logical axes), without the leading layers axis."""
    d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    return {
        "attn_norm": ((d,), ("norm",)),
        "wq": ((d, h, hd), ("embed", "heads", "head_dim")),
        "wk": ((d, kv, hd), ("embed", "kv_heads", "head_dim")),
        "wv": ((d, kv, hd), ("embed", "kv_heads", "head_dim")),
        "wo": ((h, hd, d), ("heads", "head_dim", "embed")),
        "mlp_norm": ((d,), ("norm",)),
        "w_gate": ((d, f), ("embed", "mlp")),
        "w_up": ((d, f), ("embed", "mlp")),
        "w_down": ((f, d), ("mlp", "embed")),
        # Qwen2-style q/k/v biases (model.qkv_bias), zero at initialisation.
        **(
            {
                "bq": ((h, hd), ("heads", "head_dim")),
                "bk": ((kv, hd), ("kv_heads", "head_dim")),
                "bv": ((kv, hd), ("kv_heads", "head_dim")),
            }
            if cfg.qkv_bias
            else {}
        ),
        # Qwen3-style RMSNorm scales of each query and key head (model.qk_norm), one at initialisation.
        **({"q_norm": ((hd,), ("head_dim",)), "k_norm": ((hd,), ("head_dim",))} if cfg.qk_norm else {}),
    }


# Per-layer expert parameters and the dense MLP parameters an MoE layer replaces.
EXPERT_KEYS = ("we_gate", "we_up", "we_down")
SHARED_KEYS = ("ws_gate", "ws_up", "ws_down")
DENSE_MLP_KEYS = ("w_gate", "w_up", "w_down")


def expert_d_ff(cfg: ModelConfig) -> int:
    """Hidden width of one routed expert (``moe.d_ff``, or ``d_ff`` when that is 0)."""
    return cfg.moe.d_ff or cfg.d_ff


def moe_layer_count(cfg: ModelConfig) -> int:
    """Number of MoE blocks: every ``moe.every``-th block of ``n_layers`` (0 for a dense model)."""
    return cfg.n_layers // cfg.moe.every if cfg.moe.experts else 0


def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    """Whether block i (0-based) is an MoE block: the last block of each group of ``moe.every``."""
    return bool(cfg.moe.experts) and (i + 1) % cfg.moe.every == 0


def moe_param_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Shape and logical axes of one MoE block's weights (without the leading layers axis).

    The router's expert dimension is left unnamed (replicated): every token
    needs all E scores.
    """
    if not cfg.moe.experts:
        return {}
    d, e, f = cfg.d_model, cfg.moe.experts, expert_d_ff(cfg)
    specs = {
        "router": ((d, e), ("embed", None)),
        "we_gate": ((e, d, f), ("expert", "embed", "expert_mlp")),
        "we_up": ((e, d, f), ("expert", "embed", "expert_mlp")),
        "we_down": ((e, f, d), ("expert", "expert_mlp", "embed")),
    }
    if cfg.moe.shared_d_ff:
        fs = cfg.moe.shared_d_ff
        specs.update(
            {
                "ws_gate": ((d, fs), ("embed", "mlp")),
                "ws_up": ((d, fs), ("embed", "mlp")),
                "ws_down": ((fs, d), ("mlp", "embed")),
            }
        )
    return specs

"""What the models name, without JAX: checkpoint names and weight shapes (read by the planner).

``CHECKPOINT_NAMES``: the tagged intermediates (``checkpoint_name``) of a
block, in the order a block computes them; a remat policy saves a subset
(``jax.checkpoint_policies.save_only_these_names``).
``block_param_specs``: shape and logical axes of each per-layer weight.
"""

from __future__ import annotations

from jaxdist.config import (
    CHECKPOINT_NAMES,  # defined with the config checks (train.remat is checked at load)
    ModelConfig,
)

__all__ = ["CHECKPOINT_NAMES", "block_param_specs"]


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

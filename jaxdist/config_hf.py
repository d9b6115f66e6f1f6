"""Hugging Face ``config.json`` to and from jaxdist's :class:`~jaxdist.config.ModelConfig` (no JAX).

Llama 2/3 (``LlamaForCausalLM``), Mistral, Qwen2 (q/k/v biases) and Mixtral
(MoE: softmax router, top-k renormalised, every block an MoE block) map onto
jaxdist's decoder; anything the decoder does not compute (another activation,
an output-projection bias, a sliding window shorter than the sequences, another
rope scaling) is refused with one sentence rather than imported wrong.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxdist.config_hf_dir import check_numbers
from jaxdist.config_sections import ModelConfig
from jaxdist.errors import ConfigError

# Architecture name -> model_type, for the ones whose weights and forward pass jaxdist reproduces.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
}
# Model fields that fix a weight's shape (or presence): an explicit override that differs from config.json is an
# error, since the checkpoint's tensors could not be loaded.  The other mapped fields are overridable.
SHAPE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "d_ff",
    "tie_embeddings",
    "qkv_bias",
    "moe.experts",
    "moe.d_ff",
    "moe.every",
    "moe.shared_d_ff",
)


def read_hf_config(hf_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model directory (ConfigError if missing or not JSON)."""
    path = Path(hf_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"{path} does not exist: point to a Hugging Face model directory with a config.json."
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e}): download the model's config.json again.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds no JSON object: download the model's config.json again.")
    return data


def architecture(hf: dict[str, Any]) -> str:
    """The single supported architecture name of a config.json (ConfigError naming the supported ones)."""
    names = hf.get("architectures") or []
    supported = ", ".join(ARCHITECTURES)
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise ConfigError(f"architecture {names or 'none'} in config.json is not supported: jaxdist reads {supported}.")
    return names[0]


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Dotted ModelConfig fields (``d_model``, ``moe.experts``, ...) of a config.json; ConfigError if unsupported."""
    arch = architecture(hf)
    check_numbers(hf)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act='{act}' in config.json is not supported: jaxdist's MLP is SwiGLU (silu).")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=true in config.json is not supported: jaxdist's MLP has no biases.")
    if arch == "LlamaForCausalLM" and hf.get("attention_bias"):
        raise ConfigError(
            "attention_bias=true in config.json adds an output-projection bias, which jaxdist does not have: "
            "only Qwen2's q/k/v biases are supported."
        )
    heads = int(hf["num_attention_heads"])
    d = int(hf["hidden_size"])
    fields: dict[str, Any] = {
        "vocab_size": int(hf["vocab_size"]),
        "d_model": d,
        "n_layers": int(hf["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": int(hf.get("head_dim") or d // heads),
        "d_ff": int(hf["intermediate_size"]),
        "max_seq_len": int(hf.get("max_position_embeddings", 2048)),
        "rope_theta": float(hf.get("rope_theta", 10000.0)),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": arch == "Qwen2ForCausalLM",
        **rope_fields(hf.get("rope_scaling")),
    }
    if arch == "MixtralForCausalLM":
        fields.update(
            {
                "moe.experts": int(hf["num_local_experts"]),
                "moe.top_k": int(hf.get("num_experts_per_tok", 2)),
                "moe.d_ff": 0,
                "moe.every": 1,
                "moe.shared_d_ff": 0,
                "moe.router": "softmax",
                "moe.renormalize": True,
                "moe.dispatch": "dropless",
            }
        )
    else:
        fields["moe.experts"] = 0
    return fields


def rope_fields(rs: dict[str, Any] | None) -> dict[str, Any]:
    """The rope_* ModelConfig fields of config.json's ``rope_scaling`` (ConfigError for another type)."""
    if not rs:
        return {"rope_scaling": "none"}
    kind = rs.get("rope_type") or rs.get("type")
    if kind == "default":
        return {"rope_scaling": "none"}
    if kind == "linear":
        return {"rope_scaling": "linear", "rope_factor": float(rs["factor"])}
    if kind == "llama3":
        return {
            "rope_scaling": "llama3",
            "rope_factor": float(rs["factor"]),
            "rope_low_freq_factor": float(rs["low_freq_factor"]),
            "rope_high_freq_factor": float(rs["high_freq_factor"]),
            "rope_original_max_len": int(rs["original_max_position_embeddings"]),
        }
    raise ConfigError(f"rope_scaling type '{kind}' in config.json is not supported: jaxdist reads linear and llama3.")


def check_sliding_window(hf: dict[str, Any], max_seq_len: int) -> None:
    """ConfigError when config.json's sliding window is shorter than ``max_seq_len`` (jaxdist attends to all)."""
    window = hf.get("sliding_window")
    if architecture(hf) == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
        return
    if window is not None and int(window) < max_seq_len:
        raise ConfigError(
            f"config.json's sliding_window={window} is shorter than model.max_seq_len={max_seq_len} and jaxdist "
            f"attends over the whole sequence: set model.max_seq_len={window} or less."
        )


def _get(m: ModelConfig, key: str) -> Any:
    obj: Any = m
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _replace(m: ModelConfig, key: str, value: Any) -> ModelConfig:
    if key.startswith("moe."):
        return dataclasses.replace(m, moe=dataclasses.replace(m.moe, **{key[4:]: value}))
    return dataclasses.replace(m, **{key: value})


def model_from_hf(hf: dict[str, Any], base: ModelConfig, explicit: set[str] = frozenset()) -> ModelConfig:
    """``base`` with config.json's fields, except those in ``explicit`` (dotted model keys set by the user).

    An explicit shape field (:data:`SHAPE_FIELDS`) that differs from config.json is a ConfigError.
    """
    m = base
    for key, value in model_fields(hf).items():
        if key in explicit:
            if key in SHAPE_FIELDS and _get(base, key) != value:
                raise ConfigError(
                    f"model.{key}={_get(base, key)} conflicts with {key}={value} of the checkpoint's config.json: "
                    f"drop the override, the weights have that shape."
                )
            continue
        m = _replace(m, key, value)
    check_sliding_window(hf, m.max_seq_len)
    return m


def apply_init_from(cfg: Any, explicit: set[str]) -> Any:
    """A Config whose model follows ``model.init_from``'s config.json (``explicit``: dotted keys the user set)."""
    if not cfg.model.init_from:
        return cfg
    hf = read_hf_config(cfg.model.init_from)
    mine = {k[len("model.") :] for k in explicit if k.startswith("model.")}
    try:
        model = model_from_hf(hf, cfg.model, mine)
    except ConfigError:
        raise
    except (KeyError, TypeError, ValueError) as e:  # a key the specific checks do not know, missing or malformed
        raise ConfigError(
            f"{Path(cfg.model.init_from) / 'config.json'} cannot be read as a model ({type(e).__name__}: {e}): "
            "download the model's config.json again."
        ) from None
    return dataclasses.replace(cfg, model=model)


def hf_from_model(m: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
    """The config.json of a jaxdist model (ConfigError for a model no Hugging Face architecture describes)."""
    if m.moe.experts:
        if m.moe.every != 1 or m.moe.shared_d_ff or m.moe.router != "softmax" or not m.moe.renormalize:
            raise ConfigError(
                "only an MoE with every block routed (moe.every=1), no shared expert, a softmax router and "
                "renormalised weights has a Hugging Face form (Mixtral): this model has none."
            )
        arch = "MixtralForCausalLM"
    else:
        arch = "Qwen2ForCausalLM" if m.qkv_bias else "LlamaForCausalLM"
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        "hidden_act": "silu",
        "hidden_size": m.d_model,
        "intermediate_size": m.moe.d_ff or m.d_ff if m.moe.experts else m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "rope_scaling": _hf_rope(m),
        "tie_word_embeddings": m.tie_embeddings,
        "vocab_size": m.vocab_size,
        "torch_dtype": torch_dtype,
    }
    if arch == "LlamaForCausalLM":
        out.update(attention_bias=False, mlp_bias=False)
    if arch == "MixtralForCausalLM":
        out.update(num_local_experts=m.moe.experts, num_experts_per_tok=m.moe.top_k, sliding_window=None)
    if arch == "Qwen2ForCausalLM":
        out.update(use_sliding_window=False)
    return out


def _hf_rope(m: ModelConfig) -> dict[str, Any] | None:
    if m.rope_scaling == "linear":
        return {"rope_type": "linear", "factor": m.rope_factor}
    if m.rope_scaling == "llama3":
        return {
            "rope_type": "llama3",
            "factor": m.rope_factor,
            "low_freq_factor": m.rope_low_freq_factor,
            "high_freq_factor": m.rope_high_freq_factor,
            "original_max_position_embeddings": m.rope_original_max_len,
        }
    return None

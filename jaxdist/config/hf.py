"""Hugging Face ``config.json`` to and from jaxdist's :class:`~jaxdist.config.ModelConfig` (no JAX).

Llama 2/3 (``LlamaForCausalLM``), Mistral, Qwen2 (q/k/v biases), Qwen3
(per-head q/k RMSNorm), Mixtral (MoE: softmax router, top-k renormalised,
every block an MoE block) and Qwen3-MoE (softmax router, top-k renormalised
with ``norm_topk_prob``, every ``decoder_sparse_step``-th block an MoE block)
map onto jaxdist's decoder.  Both generations of ``config.json`` are read as
``transformers`` 5 reads them: 4.x's top-level ``rope_theta`` +
``rope_scaling`` + ``torch_dtype`` and 5.x's ``rope_parameters`` table +
``dtype`` + ``layer_types`` (a ``rope_scaling`` table wins over
``rope_parameters``, a theta inside the table over the top-level one).
Anything the decoder does not compute (another activation, an
output-projection bias, a sliding window shorter than the sequences, another
rope type or an unread rope parameter, partial rotary, MLP-only layers) is
refused with one sentence rather than imported wrong.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jaxdist.config.hf_dir import check_numbers
from jaxdist.config.model import ModelConfig
from jaxdist.errors import ConfigError

# Architecture name -> model_type, for the ones whose weights and forward pass jaxdist reproduces.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# Architectures whose attention_bias=true adds q/k/v *and* output-projection biases (jaxdist has no output bias).
_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Architectures whose sliding window applies only to the layers marked sliding (layer_types, or max_window_layers).
_LAYERED_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
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
    "qk_norm",
    "moe.experts",
    "moe.d_ff",
    "moe.every",
    "moe.shared_d_ff",
)
# The parameters each rope type reads besides rope_type/type, rope_theta and partial_rotary_factor (an
# original_max_position_embeddings is tolerated everywhere: transformers adds it and only llama3 reads it).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
_ROPE_COMMON = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "original_max_position_embeddings")


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


def _check_unsupported(hf: dict[str, Any], arch: str) -> None:
    """ConfigError for a key of config.json that changes the forward pass in a way jaxdist does not compute."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act='{act}' in config.json is not supported: jaxdist's MLP is SwiGLU (silu).")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=true in config.json is not supported: jaxdist's MLP has no biases.")
    if arch in _ATTENTION_BIAS and hf.get("attention_bias"):
        raise ConfigError(
            "attention_bias=true in config.json adds an output-projection bias, which jaxdist does not have: "
            "only Qwen2's q/k/v biases are supported."
        )
    if arch == "Qwen3MoeForCausalLM" and hf.get("mlp_only_layers"):
        raise ConfigError(
            f"mlp_only_layers={hf['mlp_only_layers']} in config.json is not supported: jaxdist places MoE blocks "
            "every decoder_sparse_step-th block only."
        )
    for kind in hf.get("layer_types") or []:
        if kind not in ("full_attention", "sliding_attention"):
            raise ConfigError(
                f"layer_types entry '{kind}' in config.json is not supported: jaxdist reads full_attention and "
                "sliding_attention."
            )


def model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Dotted ModelConfig fields (``d_model``, ``moe.experts``, ...) of a config.json; ConfigError if unsupported."""
    arch = architecture(hf)
    check_numbers(hf)
    _check_unsupported(hf, arch)
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
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": arch == "Qwen2ForCausalLM",
        "qk_norm": arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        **rope_fields(hf),
        "moe.experts": 0,
    }
    if arch in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        fields.update(_moe_fields(hf, arch, fields["n_layers"]))
    return fields


def _moe_fields(hf: dict[str, Any], arch: str, n_layers: int) -> dict[str, Any]:
    """The moe.* fields of a Mixtral or Qwen3-MoE config.json (both route softmax, then top-k)."""
    experts = hf.get("num_local_experts") if arch == "MixtralForCausalLM" else None
    experts = experts or hf.get("num_experts") or hf.get("num_local_experts")
    fields = {
        "moe.experts": int(experts),
        "moe.top_k": int(hf.get("num_experts_per_tok", 2)),
        "moe.d_ff": 0,
        "moe.every": 1,
        "moe.shared_d_ff": 0,
        "moe.router": "softmax",
        "moe.renormalize": True,
        "moe.dispatch": "dropless",
    }
    if arch == "Qwen3MoeForCausalLM":
        every = int(hf.get("decoder_sparse_step", 1))
        if every <= 0 or n_layers % every:
            raise ConfigError(
                f"decoder_sparse_step={every} in config.json does not divide num_hidden_layers={n_layers}: jaxdist "
                "needs whole groups of blocks ending in an MoE block."
            )
        fields.update(
            {
                "moe.d_ff": int(hf["moe_intermediate_size"]),
                "moe.every": every,
                "moe.renormalize": bool(hf.get("norm_topk_prob", False)),
            }
        )
    return fields


def rope_table(hf: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(key, table): the rotary table ``transformers`` 5 reads from a config.json, ``rope_scaling`` (4.x) before
    ``rope_parameters`` (5.x); ``("", {})`` for neither.  ConfigError for a table that is not one."""
    for key in ("rope_scaling", "rope_parameters"):
        table = hf.get(key)
        if not table:
            continue
        if not isinstance(table, dict):
            raise ConfigError(f"{key}={table!r} in config.json is not a table: write it as a JSON object or null.")
        if any(isinstance(v, dict) for v in table.values()):
            raise ConfigError(
                f"{key} in config.json holds one table per layer type ({', '.join(table)}): jaxdist reads a single "
                "rotary table."
            )
        return key, table
    return "", {}


def _number(key: str, where: str, table: dict[str, Any], default: Any = None) -> float:
    value = table.get(key, default)
    if value is None:
        raise ConfigError(f"{where} in config.json lacks '{key}': add it (see the model card) or drop the scaling.")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}'s {key}={value!r} in config.json is not a number: write a number.")
    return value


def rope_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope_* ModelConfig fields (``rope_theta`` included) of a config.json, 4.x or 5.x.

    ConfigError (one sentence) for another rope type, a parameter the type does not read, partial rotary
    or a missing factor.
    """
    where, table = rope_table(hf)
    kind = table.get("rope_type") or table.get("type") or "default"
    if kind not in _ROPE_KEYS:
        raise ConfigError(
            f"{where} type '{kind}' in config.json is not supported: jaxdist reads default, linear and llama3."
        )
    unread = sorted(set(table) - set(_ROPE_KEYS[kind]) - set(_ROPE_COMMON))
    if unread:
        raise ConfigError(
            f"{where} parameter '{unread[0]}' in config.json is not read by jaxdist's {kind} rotary embedding: "
            "it would change the model, so it is refused."
        )
    partial = table.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(
            f"partial_rotary_factor={partial} in config.json is not supported: jaxdist rotates the whole head."
        )
    theta = _number("rope_theta", where or "config.json", table, hf.get("rope_theta", 10000.0))
    out: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return {**out, "rope_scaling": "none"}
    out.update(rope_scaling=kind, rope_factor=float(_number("factor", where, table)))
    if kind == "llama3":
        original = hf.get("max_position_embeddings")  # transformers 5's default
        out.update(
            rope_low_freq_factor=float(_number("low_freq_factor", where, table)),
            rope_high_freq_factor=float(_number("high_freq_factor", where, table)),
            rope_original_max_len=int(_number("original_max_position_embeddings", where, table, original)),
        )
    return out


def sliding_window(hf: dict[str, Any]) -> int | None:
    """The sliding window (tokens) some layer of the config.json's model attends within, or None (all attend to
    the whole sequence), as ``transformers`` 5 decides it."""
    arch = architecture(hf)
    if arch == "LlamaForCausalLM":
        return None
    window = hf.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return None if window is None else int(window)
    if not hf.get("use_sliding_window", False) or window is None:
        return None
    if arch in _LAYERED_WINDOW:
        types = hf.get("layer_types")
        if types is None:  # 4.x: the layers from max_window_layers on slide
            n = int(hf["num_hidden_layers"])
            types = ["sliding_attention" if i >= int(hf.get("max_window_layers", 28)) else "x" for i in range(n)]
        if "sliding_attention" not in types:
            return None
    return int(window)


def check_sliding_window(hf: dict[str, Any], max_seq_len: int) -> None:
    """ConfigError when config.json's sliding window is shorter than ``max_seq_len`` (jaxdist attends to all)."""
    window = sliding_window(hf)
    if window is not None and window < max_seq_len:
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


def hf_architecture(m: ModelConfig) -> str:
    """The Hugging Face architecture that describes model ``m`` (ConfigError, one sentence, for none)."""
    if m.qk_norm and m.qkv_bias:
        raise ConfigError(
            "a model with both model.qk_norm and model.qkv_bias has no Hugging Face form (Qwen3 has no q/k/v-only "
            "biases): drop one of them."
        )
    if not m.moe.experts:
        return "Qwen3ForCausalLM" if m.qk_norm else "Qwen2ForCausalLM" if m.qkv_bias else "LlamaForCausalLM"
    e = m.moe
    if e.shared_d_ff or e.router != "softmax" or m.qkv_bias:
        raise ConfigError(
            "only an MoE with a softmax router, no shared expert and no q/k/v biases has a Hugging Face form "
            "(Mixtral, Qwen3-MoE): this model has none."
        )
    if m.qk_norm:
        return "Qwen3MoeForCausalLM"
    if e.every != 1 or not e.renormalize:
        raise ConfigError(
            "an MoE without model.qk_norm is written as Mixtral, which routes every block (moe.every=1) with "
            "renormalised weights (moe.renormalize=true): this model does not."
        )
    return "MixtralForCausalLM"


def hf_from_model(m: ModelConfig, torch_dtype: str = "float32", base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json keys of a jaxdist model, written so that transformers 4.x and 5.x read the same model.

    ``base``: the config.json the model came from; its ``rope_scaling`` is kept as it was spelled when it
    describes the same rotary embedding.  ConfigError for a model no Hugging Face architecture describes.
    """
    arch = hf_architecture(m)
    out: dict[str, Any] = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        "hidden_act": "silu",
        "hidden_size": m.d_model,
        "intermediate_size": m.moe.d_ff or m.d_ff if arch == "MixtralForCausalLM" else m.d_ff,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.head_dim,
        "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps,
        **_hf_rope(m, base),
        "tie_word_embeddings": m.tie_embeddings,
        "vocab_size": m.vocab_size,
        "dtype": torch_dtype,
        "torch_dtype": torch_dtype,
    }
    if arch in _ATTENTION_BIAS:
        out.update(attention_bias=False)
    if arch == "LlamaForCausalLM":
        out.update(mlp_bias=False)
    if arch == "MixtralForCausalLM":
        out.update(num_local_experts=m.moe.experts, num_experts_per_tok=m.moe.top_k, sliding_window=None)
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        out.update(use_sliding_window=False, layer_types=["full_attention"] * m.n_layers)
    if arch == "Qwen3MoeForCausalLM":
        out.update(
            num_experts=m.moe.experts,
            num_local_experts=m.moe.experts,  # the name transformers 5 writes
            num_experts_per_tok=m.moe.top_k,
            moe_intermediate_size=m.moe.d_ff or m.d_ff,
            decoder_sparse_step=m.moe.every,
            norm_topk_prob=m.moe.renormalize,
            mlp_only_layers=[],
        )
    return out


def _hf_rope(m: ModelConfig, base: dict[str, Any] | None) -> dict[str, Any]:
    """``rope_parameters`` (5.x) and ``rope_theta`` + ``rope_scaling`` (4.x) of model ``m``, all the same rotation."""
    table: dict[str, Any] = {"rope_type": "default" if m.rope_scaling == "none" else m.rope_scaling}
    table["rope_theta"] = m.rope_theta
    if m.rope_scaling in ("linear", "llama3"):
        table["factor"] = m.rope_factor
    if m.rope_scaling == "llama3":
        table.update(
            low_freq_factor=m.rope_low_freq_factor,
            high_freq_factor=m.rope_high_freq_factor,
            original_max_position_embeddings=m.rope_original_max_len,
        )
    scaling = None if m.rope_scaling == "none" else {k: v for k, v in table.items() if k != "rope_theta"}
    out = {"rope_parameters": table, "rope_theta": m.rope_theta, "rope_scaling": scaling}
    if base and base.get("rope_scaling") and not isinstance(base.get("rope_scaling"), str):
        try:
            same = rope_fields({**out, "rope_scaling": base["rope_scaling"]}) == rope_fields(out)
        except ConfigError:
            same = False
        if same:  # the same scaling, as the source spelled it
            out["rope_scaling"] = base["rope_scaling"]
    return out

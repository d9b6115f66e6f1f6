"""Small random Hugging Face checkpoints and a NumPy forward pass written from the Hugging Face definitions.

Nothing here uses jaxdist: the tensor names, layouts ([out, in] linear
weights) and the forward pass (LlamaRMSNorm, rotate_half rotary with the
scaled frequencies of ``_compute_llama3_parameters`` / linear scaling,
``repeat_kv`` grouped-query causal attention, SwiGLU ``down(silu(gate) * up)``,
Mixtral's softmax router with top-k weights renormalised) follow
``transformers``' modeling_llama / modeling_qwen2 / modeling_mixtral.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": False,
    "vocab_size": 272,
    "attention_bias": False,
    "torch_dtype": "float32",
}
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 96,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "torch_dtype": "float32",
}
QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_act": "silu",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "linear", "factor": 2.0},
    "sliding_window": 16,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
    "vocab_size": 80,
    "torch_dtype": "float32",
}


def head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def hf_tensors(c: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights named and shaped as transformers saves them."""
    rng = np.random.default_rng(seed)
    d, f, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], head_dim(c)
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d, scale=0.5), "model.norm.weight": 1 + w(d, scale=0.1)}
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = w(v, d)
    qwen = c["model_type"] == "qwen2"
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + w(d, scale=0.1)
        t[p + "post_attention_layernorm.weight"] = 1 + w(d, scale=0.1)
        t[p + "self_attn.q_proj.weight"] = w(h * hd, d)
        t[p + "self_attn.k_proj.weight"] = w(kv * hd, d)
        t[p + "self_attn.v_proj.weight"] = w(kv * hd, d)
        t[p + "self_attn.o_proj.weight"] = w(d, h * hd)
        if qwen:
            t[p + "self_attn.q_proj.bias"] = w(h * hd, scale=0.3)
            t[p + "self_attn.k_proj.bias"] = w(kv * hd, scale=0.3)
            t[p + "self_attn.v_proj.bias"] = w(kv * hd, scale=0.3)
        if c["model_type"] == "mixtral":
            t[p + "block_sparse_moe.gate.weight"] = w(c["num_local_experts"], d, scale=0.5)
            for e in range(c["num_local_experts"]):
                q = p + f"block_sparse_moe.experts.{e}."
                t[q + "w1.weight"], t[q + "w2.weight"], t[q + "w3.weight"] = w(f, d), w(d, f), w(f, d)
        else:
            t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = w(f, d), w(f, d)
            t[p + "mlp.down_proj.weight"] = w(d, f)
    return t


def write_checkpoint(directory: Path, c: dict, tensors: dict[str, np.ndarray], shards: int = 2) -> Path:
    """config.json + ``shards`` safetensors files + model.safetensors.index.json, as transformers writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(c, indent=2))
    names = list(tensors)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
    total = sum(a.nbytes for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def inv_freq(c: dict) -> np.ndarray:
    """_compute_default_rope_parameters, then the linear or llama3 rescaling."""
    dim = head_dim(c)
    inv = 1.0 / (c["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = c.get("rope_scaling")
    if not rs:
        return inv
    kind = rs.get("rope_type") or rs.get("type")
    if kind == "linear":
        return inv / rs["factor"]
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wl, high_wl = old / low, old / high
    wavelen = 2 * math.pi / inv
    inv_l = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, inv_l)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _silu(x):
    return x / (1 + np.exp(-x))


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def forward(c: dict, t: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] (float64) of tokens [B, T] for checkpoint tensors t."""
    t = {k: v.astype(np.float64) for k, v in t.items()}
    b, s = tokens.shape
    hd, h, kv, eps = head_dim(c), c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    freqs = np.arange(s)[:, None] * inv_freq(c)[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)  # [S, hd]
    x = t["model.embed_tokens.weight"][tokens]
    mask = np.tril(np.ones((s, s), bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hs = _rms(x, t[p + "input_layernorm.weight"], eps)

        def proj(name, heads):
            y = hs @ t[p + f"self_attn.{name}.weight"].T  # noqa: B023 (used in this iteration)
            if p + f"self_attn.{name}.bias" in t:  # noqa: B023 (used in this iteration)
                y = y + t[p + f"self_attn.{name}.bias"]  # noqa: B023 (used in this iteration)
            return y.reshape(b, s, heads, hd).transpose(0, 2, 1, 3)  # [B, heads, S, hd]

        q, k, v = proj("q_proj", h), proj("k_proj", kv), proj("v_proj", kv)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = np.repeat(k, h // kv, axis=1), np.repeat(v, h // kv, axis=1)  # repeat_kv
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
        scores = np.where(mask, scores, -np.inf)
        ctx = (_softmax(scores) @ v).transpose(0, 2, 1, 3).reshape(b, s, h * hd)
        x = x + ctx @ t[p + "self_attn.o_proj.weight"].T
        hs = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
        if c["model_type"] == "mixtral":
            probs = _softmax(hs @ t[p + "block_sparse_moe.gate.weight"].T)  # [B, S, E]
            top = np.argsort(-probs, axis=-1)[..., : c["num_experts_per_tok"]]
            weights = np.take_along_axis(probs, top, axis=-1)
            weights = weights / weights.sum(axis=-1, keepdims=True)
            out = np.zeros_like(hs)
            for e in range(c["num_local_experts"]):
                q_ = p + f"block_sparse_moe.experts.{e}."
                y = (_silu(hs @ t[q_ + "w1.weight"].T) * (hs @ t[q_ + "w3.weight"].T)) @ t[q_ + "w2.weight"].T
                out = out + y * np.sum(np.where(top == e, weights, 0.0), axis=-1, keepdims=True)
            x = x + out
        else:
            gate, up = hs @ t[p + "mlp.gate_proj.weight"].T, hs @ t[p + "mlp.up_proj.weight"].T
            x = x + (_silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    x = _rms(x, t["model.norm.weight"], eps)
    head = t["model.embed_tokens.weight"] if c["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T

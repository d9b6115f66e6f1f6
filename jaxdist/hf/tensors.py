"""Every Hugging Face tensor of a model and where it sits in jaxdist's parameter tree (no JAX).

Hugging Face stores a linear layer as ``weight [out, in]`` (``y = x W^T``);
jaxdist stores ``[in, out]`` with the heads split out (``wq [d, H, head_dim]``,
``wo [H, head_dim, d]``) and every per-block weight stacked along a leading
``layers`` axis (MoE weights along ``[moe blocks, experts, ...]``).  A
:class:`TensorMap` says, for one jaxdist parameter, which Hugging Face tensor
fills each layer (and expert) and how its axes map (:data:`KINDS`).

No q/k permutation is needed: Hugging Face's Llama, Mistral, Qwen2/3, Mixtral and Qwen3-MoE
rotate the two halves of each head (``rotate_half``), as jaxdist's
``apply_rotary`` does; the permutation in Meta's own conversion script turns
Meta's interleaved pairs into that layout, which the safetensors files already have.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxdist.config import ModelConfig

# How a jaxdist block [...] relates to the Hugging Face tensor W:
#   copy      : same array (embedding, norms)
#   transpose : [a, b] = W.T with W [b, a] (MLP, router, lm_head)
#   heads_in  : [d, H, hd] = W.T reshaped, W [H*hd, d] (q/k/v projections)
#   heads_out : [H, hd, d] = W.T reshaped, W [d, H*hd] (output projection)
#   heads_bias: [H, hd] = b reshaped, b [H*hd] (Qwen2's q/k/v biases)
KINDS = ("copy", "transpose", "heads_in", "heads_out", "heads_bias")


@dataclass(frozen=True)
class TensorMap:
    """One jaxdist parameter: ``path`` in the tree, the Hugging Face name template (``{layer}``,
    ``{expert}``), the layout ``kind``, the Hugging Face layer numbers along the stacked axis (empty:
    not stacked) and the number of experts along the next axis (0: none)."""

    path: tuple[str, ...]
    hf: str
    kind: str
    layers: tuple[int, ...] = ()
    experts: int = 0

    def names(self) -> list[str]:
        """Every Hugging Face tensor name this parameter reads, in storage order."""
        if not self.layers:
            return [self.hf]
        es = range(self.experts) if self.experts else [None]
        return [self.hf.format(layer=n, expert=e) for n in self.layers for e in es]


def hf_shape(kind: str, block: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the Hugging Face tensor behind a jaxdist block of shape ``block`` (one layer, one expert)."""
    if kind == "copy":
        return block
    if kind == "transpose":
        return block[::-1]
    if kind == "heads_in":
        return (block[1] * block[2], block[0])
    if kind == "heads_out":
        return (block[2], block[0] * block[1])
    assert kind == "heads_bias", kind
    return (block[0] * block[1],)


def to_hf(kind: str, x: np.ndarray) -> np.ndarray:
    """The Hugging Face tensor (contiguous) of one whole jaxdist block ``x``."""
    if kind == "copy":
        out = x
    elif kind == "transpose":
        out = x.T
    elif kind == "heads_in":
        out = x.reshape(x.shape[0], -1).T
    elif kind == "heads_out":
        out = x.reshape(-1, x.shape[2]).T
    else:
        out = x.reshape(-1)
    return np.ascontiguousarray(out)


def read_block(kind: str, tensor, ix: tuple[slice, ...], block: tuple[int, ...]) -> np.ndarray:
    """The part ``ix`` (unit-step slices, one per axis of ``block``) of a jaxdist block, read from ``tensor``.

    ``tensor[rows, cols]`` returns that part of the Hugging Face tensor (a safetensors slice); only the
    rows and columns the part needs are read (whole heads: a head_dim slice is taken after reading).
    """
    if kind == "copy":
        return np.asarray(tensor[ix])
    if kind == "transpose":
        return np.asarray(tensor[ix[::-1]]).T
    hd = block[-1] if kind == "heads_bias" else block[2] if kind == "heads_in" else block[1]
    h = ix[1] if kind == "heads_in" else ix[0]
    rows = slice(h.start * hd, h.stop * hd)  # whole heads, contiguous in the Hugging Face tensor
    nh = h.stop - h.start
    if kind == "heads_in":
        part = np.asarray(tensor[rows, ix[0]])  # [nh*hd, nd]
        return part.reshape(nh, hd, -1)[:, ix[2], :].transpose(2, 0, 1)
    if kind == "heads_out":
        part = np.asarray(tensor[ix[2], rows])  # [nd, nh*hd]
        return part.reshape(-1, nh, hd)[:, :, ix[1]].transpose(1, 2, 0)
    return np.asarray(tensor[rows]).reshape(nh, hd)[:, ix[1]]


def tensor_maps(m: ModelConfig) -> list[TensorMap]:
    """The TensorMap of every jaxdist parameter of model ``m`` (Llama / Mistral / Qwen2 / Qwen3 / Mixtral /
    Qwen3-MoE names)."""
    n = m.n_layers
    every = m.moe.every if m.moe.experts else 0
    moe_layers = tuple(i for i in range(n) if every and (i + 1) % every == 0)
    dense_layers = tuple(i for i in range(n) if i not in moe_layers)
    all_layers = tuple(range(n))
    a = "model.layers.{layer}.self_attn."
    out = [
        TensorMap(("embed",), "model.embed_tokens.weight", "copy"),
        TensorMap(("final_norm",), "model.norm.weight", "copy"),
        TensorMap(("layers", "attn_norm"), "model.layers.{layer}.input_layernorm.weight", "copy", all_layers),
        TensorMap(("layers", "mlp_norm"), "model.layers.{layer}.post_attention_layernorm.weight", "copy", all_layers),
        TensorMap(("layers", "wq"), a + "q_proj.weight", "heads_in", all_layers),
        TensorMap(("layers", "wk"), a + "k_proj.weight", "heads_in", all_layers),
        TensorMap(("layers", "wv"), a + "v_proj.weight", "heads_in", all_layers),
        TensorMap(("layers", "wo"), a + "o_proj.weight", "heads_out", all_layers),
    ]
    if not m.tie_embeddings:
        out.append(TensorMap(("lm_head",), "lm_head.weight", "transpose"))
    if m.qkv_bias:
        for p in "qkv":
            out.append(TensorMap(("layers", f"b{p}"), a + f"{p}_proj.bias", "heads_bias", all_layers))
    if m.qk_norm:  # Qwen3's per-head query and key norms
        for p in "qk":
            out.append(TensorMap(("layers", f"{p}_norm"), a + f"{p}_norm.weight", "copy", all_layers))
    if dense_layers:
        mlp = "model.layers.{layer}.mlp."
        for key, hf in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out.append(TensorMap(("layers", key), mlp + hf + ".weight", "transpose", dense_layers))
    if moe_layers:
        # Qwen3-MoE (the MoE with q/k norms, see jaxdist.config.hf.hf_architecture) or Mixtral names.
        moe = "model.layers.{layer}." + ("mlp." if m.qk_norm else "block_sparse_moe.")
        ffn = ("gate_proj", "down_proj", "up_proj") if m.qk_norm else ("w1", "w2", "w3")
        out.append(TensorMap(("layers", "router"), moe + "gate.weight", "transpose", moe_layers))
        for key, hf in zip(("we_gate", "we_down", "we_up"), ffn):
            out.append(
                TensorMap(
                    ("layers", key), moe + "experts.{expert}." + hf + ".weight", "transpose", moe_layers, m.moe.experts
                )
            )
    return out

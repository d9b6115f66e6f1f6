"""Decoder-only transformer LM: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, optional tied embeddings.

Parameters live in Flax NNX modules and carry logical axis names
(``sharding_names``); the per-layer weights are stacked along a leading
``layers`` axis and applied with ``jax.lax.scan`` so compile time does not
grow with depth.  The block itself is a pure function of a dict of arrays
(:func:`block_forward`), which is what remat profiling and pipeline stages
reuse, as they do the embedding (:func:`embed_tokens`), the output head
(:func:`head`) and the per-token loss (:func:`token_cross_entropy`).
Activations are constrained with logical names only (:mod:`jaxdist.models.
hooks`); which mesh axes those mean is decided outside this package
(the parallelism layer, ``parallel/``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxdist.config import ModelConfig
from jaxdist.models import hooks
from jaxdist.models.attention import attention, attention_over_cache, cached_attention, causal_attention  # noqa: F401  (re-exported)
from jaxdist.models.hooks import constrain
from jaxdist.models.moe import (
    DENSE_MLP_KEYS,
    group_member,
    moe_forward,
    moe_forward_sums,
    moe_layer_count,
    moe_param_specs,
    split_group,
    summarize_aux,
    summarize_microbatches,
)
from jaxdist.models.names import CHECKPOINT_NAMES, block_param_specs  # noqa: F401  (re-exported)


def array_dtype(name: str):
    """The jnp dtype of a config dtype name (``bfloat16``; anything else is float32)."""
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rotary_tables(
    positions: jax.Array, head_dim: int, theta: float, scaling: ModelConfig | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables of shape [T, head_dim/2] for integer positions [T].

    ``scaling``: the ModelConfig whose ``rope_scaling`` fields rescale the
    frequencies (``linear``, ``llama3``); None or ``rope_scaling="none"`` leaves them as they are.
    """
    if scaling is None or scaling.rope_scaling == "none":
        inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    else:
        inv = jnp.asarray(scaled_inv_freq(head_dim, theta, scaling), jnp.float32)
    ang = positions.astype(jnp.float32)[:, None] * inv[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def scaled_inv_freq(head_dim: int, theta: float, m: ModelConfig) -> np.ndarray:
    """Rotary inverse frequencies [head_dim/2] (radians per token) after ``m.rope_scaling``, in float64.

    ``linear``: every frequency divided by ``rope_factor`` (positions stretched).
    ``llama3`` (Llama 3.1): wavelengths longer than ``rope_original_max_len /
    rope_low_freq_factor`` divided by ``rope_factor``, those shorter than
    ``rope_original_max_len / rope_high_freq_factor`` kept, a linear blend in
    between (Hugging Face's ``_compute_llama3_parameters``).
    """
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if m.rope_scaling == "linear":
        return inv / m.rope_factor
    low, high, old = m.rope_low_freq_factor, m.rope_high_freq_factor, m.rope_original_max_len
    wavelen = 2 * np.pi / inv
    out = np.where(wavelen > old / low, inv / m.rope_factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * out / m.rope_factor + smooth * out
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, blended, out)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (first half, second half) of the last axis of x [B, T, H, D].

    cos, sin: [T, head_dim/2] (the same positions in every row) or [B, T, head_dim/2] (positions per row).
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    if cos.ndim == 2:  # one table for every row [T, half]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
    else:  # per-row tables [B, T, half] (the sampler's left-padded rows, see forward_with_cache)
        c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


def _attention_inputs(
    w: dict[str, jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Norm, q/k/v projections and rotary of one block: (q [B,T,H,D], k, v [B,T,KV,D]), named and constrained."""
    h = checkpoint_name(rms_norm(x, w["attn_norm"], cfg.norm_eps), "attn_norm")
    q = checkpoint_name(jnp.einsum("btd,dhk->bthk", h, w["wq"]), "query_proj")
    k = checkpoint_name(jnp.einsum("btd,dhk->bthk", h, w["wk"]), "key_proj")
    v = checkpoint_name(jnp.einsum("btd,dhk->bthk", h, w["wv"]), "value_proj")
    if "bq" in w:  # projection biases (model.qkv_bias, Qwen2), added before the rotation as in Hugging Face
        q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
    if "q_norm" in w:  # per-head RMSNorm over head_dim (model.qk_norm, Qwen3), before the rotation as in Hugging Face
        q, k = rms_norm(q, w["q_norm"], cfg.norm_eps), rms_norm(k, w["k_norm"], cfg.norm_eps)
    q = constrain(apply_rotary(q, cos, sin), ("batch", "seq", "heads", "head_dim"))
    k = constrain(apply_rotary(k, cos, sin), ("batch", "seq", "kv_heads", "head_dim"))
    v = constrain(v, ("batch", "seq", "kv_heads", "head_dim"))
    return q, k, v


def _attention_residual(w: dict[str, jax.Array], x: jax.Array, ctx: jax.Array) -> jax.Array:
    """x plus the output projection of the attention context ctx [B,T,H,D]."""
    ctx = constrain(checkpoint_name(ctx, "attn_context"), ("batch", "seq", "heads", "head_dim"))
    attn = checkpoint_name(jnp.einsum("bthk,hkd->btd", ctx, w["wo"]), "attn_out")
    return constrain(x + attn, ("batch", "seq", "embed"))


def _mlp_residual(w: dict[str, jax.Array], x: jax.Array, h: jax.Array) -> jax.Array:
    """x plus the SwiGLU MLP of its normed h."""
    gate = checkpoint_name(jnp.einsum("btd,df->btf", h, w["w_gate"]), "mlp_gate")
    up = checkpoint_name(jnp.einsum("btd,df->btf", h, w["w_up"]), "mlp_up")
    hidden = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))
    out = checkpoint_name(jnp.einsum("btf,fd->btd", hidden, w["w_down"]), "mlp_out")
    return constrain(x + out, ("batch", "seq", "embed"))


def block_forward(
    p: dict[str, jax.Array],
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    cfg: ModelConfig,
    with_aux: bool = False,
    segments: jax.Array | None = None,
) -> jax.Array:
    """One transformer block on activations x [B, T, d_model]; p holds one layer's weights.

    A block whose weights include a ``router`` runs the MoE (jaxdist.models.moe)
    in place of the MLP.  ``with_aux=True`` returns (x, aux): the MoE's router
    losses and load per block, ``{}`` for a dense block.  ``segments`` [B, T] (packed documents,
    jaxdist.data.documents): a token attends only to earlier tokens of its own segment.
    """
    dt = x.dtype
    w = {k: v.astype(dt) for k, v in p.items()}
    q, k, v = _attention_inputs(w, x, cos, sin, cfg)
    x = _attention_residual(w, x, attention(q, k, v, cfg, segments=segments))
    h = checkpoint_name(rms_norm(x, w["mlp_norm"], cfg.norm_eps), "mlp_norm")
    if "router" in p:  # MoE block: routed experts (with their own dtype handling) replace the MLP
        out, aux = moe_forward(p, h, cfg)
        x = constrain(x + checkpoint_name(out, "mlp_out"), ("batch", "seq", "embed"))
        return (x, aux) if with_aux else x
    x = _mlp_residual(w, x, h)
    return (x, {}) if with_aux else x


def block_forward_cached(
    p: dict[str, jax.Array],
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    cfg: ModelConfig,
    k_prefix: jax.Array | None = None,
    v_prefix: jax.Array | None = None,
    segments: jax.Array | None = None,
    kv_segments: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block on a chunk of a sequence whose earlier positions' keys and values are cached.

    x [B, Tc, d] holds positions P..P+Tc-1, P = k_prefix.shape[1] (0 without a
    prefix); cos, sin [Tc, head_dim/2] are the rotary tables of those positions;
    k_prefix, v_prefix [B, P, KV, D] are the rotated keys and the values of
    positions 0..P-1 in this block.  Returns (y [B, Tc, d], k, v [B, Tc, KV, D]):
    this chunk's rotated keys and values, for the next chunks' cache.  Without a
    prefix, y equals ``block_forward(p, x, cos, sin, cfg)``.  Same checkpoint
    names and constraints as block_forward; the sequence-chunked pipeline
    (``parallel/pipeline.py``) runs it.  Weights already in x's dtype are used
    as they are (no copy, so remat residuals can refer to them).  Packed documents: ``segments`` [B, Tc] are the
    chunk's tokens' segments, ``kv_segments`` [B, P+Tc] those of positions 0..P+Tc-1, and cos, sin per row
    [B, Tc, head_dim/2].  An MoE block (weights with a ``router``) returns a fourth output, its router's sums over
    the chunk's tokens (:func:`jaxdist.models.moe.moe_forward_sums`: the losses need every chunk's counts).
    """
    dt = x.dtype
    w = {k: v if v.dtype == dt else v.astype(dt) for k, v in p.items()}
    q, k, v = _attention_inputs(w, x, cos, sin, cfg)
    offset = 0 if k_prefix is None else k_prefix.shape[1]
    keys = k if k_prefix is None else jnp.concatenate([k_prefix, k], axis=1)
    values = v if v_prefix is None else jnp.concatenate([v_prefix, v], axis=1)
    x = _attention_residual(w, x, attention(q, keys, values, cfg, offset, segments, kv_segments))
    h = checkpoint_name(rms_norm(x, w["mlp_norm"], cfg.norm_eps), "mlp_norm")
    if "router" in p:  # MoE block: the chunk's router sums travel out (jaxdist.models.moe.moe_forward_sums)
        out, sums = moe_forward_sums(p, h, cfg)
        return constrain(x + checkpoint_name(out, "mlp_out"), ("batch", "seq", "embed")), k, v, sums
    return _mlp_residual(w, x, h), k, v


# --------------------------------------------------------------------------- key/value cache (sampling)

# Logical axes of a key/value cache array [layers, batch, cache slot, kv_heads, head_dim]: sharded like the
# activations (rows over the data axes, key/value heads over tensor).
KV_CACHE_NAMES = ("layers", "batch", "seq", "kv_heads", "head_dim")


def init_kv_cache(cfg: ModelConfig, batch: int, length: int) -> dict[str, jax.Array]:
    """An empty key/value cache of ``length`` slots: ``k`` and ``v`` [n_layers, batch, length, n_kv_heads,
    head_dim] in the compute dtype (call under jit with KV_CACHE_NAMES shardings to create it sharded)."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, array_dtype(cfg.dtype)), "v": jnp.zeros(shape, array_dtype(cfg.dtype))}


def block_forward_kv(
    p: dict[str, jax.Array],
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    cfg: ModelConfig,
    k_cache: jax.Array,
    v_cache: jax.Array,
    slot: jax.Array,
    visible: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block (dense or MoE) on x [B, Tc, d] whose keys and values go to cache slots slot..slot+Tc-1.

    k_cache, v_cache [B, S, KV, D]: this block's cache; ``slot``: an int32
    scalar (traced: one program for every position); cos, sin [B, Tc,
    head_dim/2]: the rotary tables of each row's positions; ``visible``
    [B, Tc, S]: which cache slots each query sees (its own slot included).
    This chunk's rotated keys and values are written first (``dynamic_update_slice``),
    then every query attends over the whole cache.  Returns (y [B, Tc, d], k_cache, v_cache).
    """
    dt = x.dtype
    w = {k: v.astype(dt) for k, v in p.items()}
    q, k, v = _attention_inputs(w, x, cos, sin, cfg)
    at = (0, slot, 0, 0)
    k_cache = constrain(jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), at), KV_CACHE_NAMES[1:])
    v_cache = constrain(jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), at), KV_CACHE_NAMES[1:])
    x = _attention_residual(w, x, cached_attention(q, k_cache, v_cache, visible, cfg))
    h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
    if "router" in p:  # MoE block, as in block_forward
        out, _ = moe_forward(p, h, cfg)
        return constrain(x + out, ("batch", "seq", "embed")), k_cache, v_cache
    return _mlp_residual(w, x, h), k_cache, v_cache


def forward_with_cache(
    params: dict,
    tokens: jax.Array,
    positions: jax.Array,
    cache: dict[str, jax.Array],
    slot: jax.Array,
    visible: jax.Array,
    cfg: ModelConfig,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(logits [B, Tc, V] float32, updated cache) for a chunk of tokens [B, Tc] written at cache slots slot.. .

    ``params``: the model's parameter dict (as ``init_params`` returns);
    ``positions`` [B, Tc] int32: each token's position in its own row (the
    rotary angle); ``cache``: ``k``, ``v`` [n_layers, B, S, KV, D]
    (:func:`init_kv_cache`); ``slot``, ``visible``: see :func:`block_forward_kv`.
    The prefill of a prompt is one call with Tc = its length; each decoding
    step one call with Tc = 1.  Which slots a query sees is the caller's
    bookkeeping (jaxdist.sample.sampler).  For a row whose tokens sit at slots
    0..Tc-1 with positions 0..Tc-1 and a causal ``visible``, the logits equal
    :meth:`Transformer.forward`'s.
    """
    cos, sin = rotary_tables(positions.reshape(-1), cfg.head_dim, cfg.rope_theta, cfg)
    cos, sin = (t.reshape(*positions.shape, -1) for t in (cos, sin))
    x = embed_tokens(params["embed"], tokens, cfg)
    stacked, k, v = params["layers"], cache["k"], cache["v"]

    def run(p, x, kc, vc):
        return block_forward_kv(p, x, cos, sin, cfg, kc, vc, slot, visible)

    if cfg.moe.experts:  # groups of moe.every blocks, the last of each an MoE block (as in Transformer.forward)
        g, every = cfg.n_layers // cfg.moe.every, cfg.moe.every

        def body(x, xs):
            group, kc, vc = xs
            ks, vs = [], []
            for j in range(every):
                x, kj, vj = run(group_member(group, j, cfg), x, kc[j], vc[j])
                ks.append(kj)
                vs.append(vj)
            return x, (jnp.stack(ks), jnp.stack(vs))

        grouped = (split_group(stacked, cfg), k.reshape(g, every, *k.shape[1:]), v.reshape(g, every, *v.shape[1:]))
        x, (k, v) = jax.lax.scan(body, x, grouped)
        k, v = k.reshape(cfg.n_layers, *k.shape[2:]), v.reshape(cfg.n_layers, *v.shape[2:])
    else:

        def body(x, xs):
            p, kc, vc = xs
            x, kc, vc = run(p, x, kc, vc)
            return x, (kc, vc)

        x, (k, v) = jax.lax.scan(body, x, (stacked, k, v))
    logits = head(head_params(params, cfg), x, cfg)
    return logits, {"k": constrain(k, KV_CACHE_NAMES), "v": constrain(v, KV_CACHE_NAMES)}


def embed_tokens(table: jax.Array, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Activations [B, T, d_model] in the compute dtype for tokens [B, T] int32 from the embedding table [V, d]."""
    # The gather needs the whole table on each device (like FSDP gathers a layer's
    # weights); a vocab- or embed-sharded table makes XLA rematerialise the lookup.
    table = constrain(table, (None, None))
    x = jnp.take(table, tokens, axis=0).astype(array_dtype(cfg.dtype))
    return constrain(x, ("batch", "seq", "embed"))


def head_params(params: dict, cfg: ModelConfig) -> dict[str, jax.Array]:
    """The weights :func:`head` reads from a parameter dict: ``final_norm`` and ``embed`` (tied) or ``lm_head``."""
    return {k: params[k] for k in ("final_norm", "embed" if cfg.tie_embeddings else "lm_head")}


def head(p: dict[str, jax.Array], x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Logits [B, T, V] float32 of the last block's output x [B, T, d]: final RMSNorm and output projection.

    ``p``: ``final_norm`` and ``embed`` (tied embeddings) or ``lm_head``, see :func:`head_params`.
    """
    x = rms_norm(x, p["final_norm"], cfg.norm_eps)
    w = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
    logits = jnp.einsum("btd,dv->btv", x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ("batch", "seq", "vocab"))


def token_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Cross-entropy (nats) of each position [B, T] of logits [B, T, V] float32 with labels [B, T] int32.

    The label's logit is a masked sum over the vocabulary, not a gather: XLA's
    SPMD partitioner aborts on a gather from vocab-sharded logits inside a
    ``shard_map`` that is manual over some axes only (a pipeline stage).  Equal
    to optax's ``softmax_cross_entropy_with_integer_labels``.
    """
    hit = jnp.arange(logits.shape[-1]) == labels[..., None]
    return jax.nn.logsumexp(logits, axis=-1) - jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)


class Transformer(nnx.Module):
    """Decoder-only LM.  ``model(tokens) -> logits`` with tokens [B, T] int32, logits [B, T, V] float32.

    ``remat_policy``: None (save everything), or a ``jax.checkpoint`` policy
    applied to each scanned block (``"full"`` saves nothing).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, remat_policy: Any = None):
        self.cfg = cfg
        self.remat_policy = remat_policy
        pdt = array_dtype(cfg.param_dtype)
        normal = nnx.initializers.normal(cfg.init_std)

        def param(shape, names, init=normal):
            return nnx.Param(init(rngs.params(), shape, pdt), sharding_names=names)

        self.embed = param((cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        layers = {}
        n_moe = moe_layer_count(cfg)  # MoE blocks keep attention but replace the dense MLP weights
        for name, (shape, names) in block_param_specs(cfg).items():
            count = cfg.n_layers - n_moe if name in DENSE_MLP_KEYS else cfg.n_layers
            if count == 0:
                continue
            init = nnx.initializers.ones if name.endswith("norm") else normal
            if name in ("wo", "w_down"):  # scaled init of residual outputs (GPT-2)
                init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
            if name in ("bq", "bk", "bv"):  # zero at the start: a fresh model computes what it would without them
                init = nnx.initializers.zeros
            layers[name] = param((count, *shape), ("layers", *names), init)
        for name, (shape, names) in moe_param_specs(cfg).items():
            init = normal
            if name in ("we_down", "ws_down"):
                init = nnx.initializers.normal(cfg.init_std / (2 * cfg.n_layers) ** 0.5)
            layers[name] = param((n_moe, *shape), ("layers", *names), init)
        self.layers = nnx.Dict(layers)
        self.final_norm = param((cfg.d_model,), ("norm",), nnx.initializers.ones)
        if not cfg.tie_embeddings:
            self.lm_head = param((cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.forward(tokens)[0]

    def forward(
        self, tokens: jax.Array, segments: jax.Array | None = None, positions: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(logits [B, T, V] float32, aux): aux is ``{}`` for a dense model, else
        jaxdist.models.moe.summarize_aux's router losses, drop rate and expert load.

        Packed documents (jaxdist.data.documents): ``segments`` [B, T] int32, a token attends only within its
        segment; ``positions`` [B, T] int32, each token's position in its document (the rotary angle)."""
        cfg = self.cfg
        t = tokens.shape[1]
        if positions is None:
            cos, sin = rotary_tables(jnp.arange(t), cfg.head_dim, cfg.rope_theta, cfg)
        else:  # per-row tables [B, T, head_dim/2]
            cos, sin = rotary_tables(positions.reshape(-1), cfg.head_dim, cfg.rope_theta, cfg)
            cos, sin = (a.reshape(*positions.shape, -1) for a in (cos, sin))

        sync = hooks.grad_sync()  # the parallelism layer's gradient reduction points (None: none)
        table = self.embed[...] if sync is None else sync({"embed": self.embed[...]}, "embed")["embed"]
        x = embed_tokens(table, tokens, cfg)

        def body(x, p):
            return block_forward(p, x, cos, sin, cfg, segments=segments), None

        stacked = {k: v[...] for k, v in self.layers.items()}

        def moe_group(x, group):  # moe.every blocks, the last an MoE block: (x, its router figures)
            aux = {}
            for j in range(cfg.moe.every):
                x, a = block_forward(group_member(group, j, cfg), x, cos, sin, cfg, True, segments)
                aux = a or aux
            return x, aux

        if sync is not None:  # scan steps of k blocks, each step's weights through the sync
            k = sync.layers_per_step  # a multiple of moe.every for an MoE model
            steps = cfg.n_layers // k

            def body(x, bucket):
                bucket = sync(bucket, "layers")
                if not cfg.moe.experts:
                    for j in range(k):
                        x = block_forward({n: w[j] for n, w in bucket.items()}, x, cos, sin, cfg, segments=segments)
                    return x, None
                groups, auxs = split_group(bucket, cfg, k // cfg.moe.every), []
                for g in range(k // cfg.moe.every):
                    x, a = moe_group(x, {n: w[g] for n, w in groups.items()})
                    auxs.append(a)
                return x, jax.tree.map(lambda *a: jnp.stack(a), *auxs)  # [groups per step, ...]

            # Each weight's stack (every layer's, the dense MLPs', the MoE layers') in ``steps`` equal parts.
            stacked = {n: w.reshape(steps, w.shape[0] // steps, *w.shape[1:]) for n, w in stacked.items()}
        elif cfg.moe.experts:  # scan over groups of moe.every blocks, the last of each an MoE block
            body = moe_group
            stacked = split_group(stacked, cfg)
        body = _with_remat(body, self.remat_policy)
        staged = hooks.layer_scan()  # an MoE model's pipeline stages (jaxdist.parallel.pipeline_blocks), or None
        if staged is not None and cfg.moe.experts and segments is None and positions is None:
            x, aux = staged(body, x, stacked)  # aux per microbatch: [m, groups, ...]
            aux = summarize_microbatches(aux, cfg)
        else:
            x, aux = jax.lax.scan(body, x, stacked)
            if cfg.moe.experts and sync is not None:  # [steps, groups per step, ...] -> [groups, ...]
                aux = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux)
            aux = summarize_aux(aux, cfg) if cfg.moe.experts else {}

        weights = {"final_norm": self.final_norm, "embed": self.embed, "lm_head": getattr(self, "lm_head", None)}
        hp = {k: v[...] for k, v in head_params(weights, cfg).items()}
        if sync is not None:  # a tied table passes again: its head gradient is reduced apart from the lookup's
            hp = sync(hp, "head")
        return head(hp, x, cfg), aux


def _with_remat(fn: Callable, policy: Any) -> Callable:
    if policy is None:
        return fn
    if policy == "full":
        return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
    return jax.checkpoint(fn, policy=policy)


def create_abstract(cfg: ModelConfig, seed: int = 0, remat_policy: Any = None):
    """(graphdef, abstract params as a pure dict of ShapeDtypeStruct, logical names per param).

    Nothing is allocated; use ``init_params`` under ``jax.jit(out_shardings=...)``
    to create the parameters directly sharded.
    """
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed), remat_policy=remat_policy))
    graphdef, state = nnx.split(model)
    names = jax.tree.map(
        lambda v: tuple(v.get_metadata().get("out_sharding") or ()),
        state,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    return graphdef, state.to_pure_dict(), _pure(names)


def _pure(state) -> dict:
    # nnx.State of plain leaves -> nested dict.
    return {k: _pure(v) if isinstance(v, (dict, nnx.State)) or hasattr(v, "items") else v for k, v in state.items()}


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Freshly initialised parameters as a pure dict of arrays (call under jit to shard)."""
    with nnx.use_eager_sharding(False):
        model = Transformer(cfg, rngs=nnx.Rngs(seed))
    return nnx.split(model)[1].to_pure_dict()


def apply(graphdef, params: dict, tokens: jax.Array) -> jax.Array:
    """Logits [B, T, V] float32 for tokens [B, T] with the given parameter dict."""
    return nnx.merge(graphdef, params)(tokens)


def apply_with_aux(
    graphdef, params: dict, tokens: jax.Array, segments: jax.Array | None = None, positions: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(logits [B, T, V] float32, aux) for tokens [B, T]; aux is ``{}`` for a dense model (see Transformer.forward,
    also for ``segments`` and ``positions``)."""
    return nnx.merge(graphdef, params).forward(tokens, segments, positions)

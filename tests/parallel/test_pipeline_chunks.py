"""Chunk boundaries against XLA's own FLOP counts, and the chunked block against the whole-sequence block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.config import load_config
from jaxdist.models.transformer import block_forward, block_forward_cached, causal_attention, init_params, rotary_tables
from jaxdist.parallel.chunks import SOFTMAX_FLOPS_PER_SCORE, ChunkCost, chunk_boundaries, chunk_cost_model


def xla_flops(fn, *shapes) -> float:
    cost = jax.jit(fn).lower(*shapes).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


def spread(costs):
    return max(costs) / min(costs)


def test_attention_cost_of_each_chunk_is_balanced():
    b, h, kv, hd, t, s = 1, 4, 2, 16, 2048, 4
    bounds = chunk_boundaries(t, s, ChunkCost(0.0, h * (4.0 * hd + SOFTMAX_FLOPS_PER_SCORE)))

    def attention_flops(bounds):
        out = []
        for a, e in zip(bounds, bounds[1:]):
            q = jax.ShapeDtypeStruct((b, e - a, h, hd), jnp.float32)
            k = jax.ShapeDtypeStruct((b, e, kv, hd), jnp.float32)
            out.append(xla_flops(lambda q, k, v, a=a: causal_attention(q, k, v, a), q, k, k))
        return out

    assert spread(attention_flops(bounds)) <= 1.05
    assert spread(attention_flops(chunk_boundaries(t, s, split="equal"))) > 3  # what equal tokens give


def test_block_cost_of_each_chunk_is_balanced():
    cfg = load_config(None, ["model=tiny", "model.max_seq_len=1024"]).model
    p = jax.eval_shape(lambda: jax.tree.map(lambda x: x[0], init_params(cfg)["layers"]))
    t, s = 1024, 4
    bounds = chunk_boundaries(t, s, chunk_cost_model(cfg))

    def block_flops(bounds):
        out = []
        for a, e in zip(bounds, bounds[1:]):
            x = jax.ShapeDtypeStruct((1, e - a, cfg.d_model), jnp.float32)
            kv = jax.ShapeDtypeStruct((1, a, cfg.n_kv_heads, cfg.head_dim), jnp.float32)

            def fn(p, x, kp, vp, a=a, e=e):
                cos, sin = rotary_tables(jnp.arange(a, e), cfg.head_dim, cfg.rope_theta)
                return block_forward_cached(p, x, cos, sin, cfg, kp if a else None, vp if a else None)[0]

            out.append(xla_flops(fn, p, x, kv, kv))
        return out

    costs = block_flops(bounds)
    assert spread(costs) <= 1.05, (bounds, costs)
    # The model's cost formula tracks XLA's count within a few percent.
    model = chunk_cost_model(cfg)
    np.testing.assert_allclose(costs, [model(a, e) for a, e in zip(bounds, bounds[1:])], rtol=0.05)
    equal = chunk_boundaries(t, s, split="equal")
    assert spread(block_flops(equal[:2]) + block_flops(equal[-2:])) > 1.2  # first and last chunk


def test_chunked_block_equals_whole_block():
    cfg = load_config(None, ["model=tiny"]).model
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda: jax.tree.map(lambda x: x[0], init_params(cfg)["layers"]))
    p = jax.tree.map(lambda s: (0.2 * rng.normal(size=s.shape)).astype(np.float32), shapes)
    x = rng.normal(size=(2, 12, cfg.d_model)).astype(np.float32)

    @jax.jit
    def both(p, x):
        cos, sin = rotary_tables(jnp.arange(12), cfg.head_dim, cfg.rope_theta)
        ks, vs, outs = None, None, []
        for a, e in ((0, 5), (5, 9), (9, 12)):
            y, k, v = block_forward_cached(p, x[:, a:e], cos[a:e], sin[a:e], cfg, ks, vs)
            outs.append(y)
            ks = k if ks is None else jnp.concatenate([ks, k], 1)
            vs = v if vs is None else jnp.concatenate([vs, v], 1)
        return jnp.concatenate(outs, 1), block_forward(p, x, cos, sin, cfg)

    chunked, whole = both(p, x)
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split", ["cost", "equal"])
def test_chunk_lengths_sum_to_sequence(split):
    cfg = load_config(None, []).model
    b = chunk_boundaries(128, 4, chunk_cost_model(cfg), split)
    assert b[0] == 0 and b[-1] == 128 and all(x < y for x, y in zip(b, b[1:]))

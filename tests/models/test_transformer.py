"""The transformer against plain references: attention, rotary, causality, tags, scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.config import load_config
from jaxdist.models import CHECKPOINT_NAMES, apply, create_abstract, init_params
from jaxdist.models.arithmetic import param_count
from jaxdist.models.transformer import apply_rotary, causal_attention, rotary_tables


def naive_attention(q, k, v):
    b, t, h, d = q.shape
    g = h // k.shape[2]
    out = np.zeros_like(q)
    for hi in range(h):
        kh, vh = k[:, :, hi // g], v[:, :, hi // g]
        s = np.einsum("btd,bsd->bts", q[:, :, hi], kh) / np.sqrt(d)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, hi] = np.einsum("bts,bsd->btd", p, vh)
    return out


def test_gqa_attention_matches_per_head_loop():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(2, 7, 6, 8)).astype(np.float32)
    k = rng.normal(size=(2, 7, 2, 8)).astype(np.float32)
    v = rng.normal(size=(2, 7, 2, 8)).astype(np.float32)
    np.testing.assert_allclose(causal_attention(q, k, v), naive_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_rotary_is_a_rotation_with_relative_positions():
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 5, 1, 8)).astype(np.float32)
    k = rng.normal(size=(1, 5, 1, 8)).astype(np.float32)
    cos, sin = rotary_tables(jnp.arange(5), 8, 10000.0)
    qr, kr = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    np.testing.assert_allclose(np.linalg.norm(qr, axis=-1), np.linalg.norm(q, axis=-1), rtol=1e-5)
    # q_i . k_j depends on i - j only: shift both by 2 positions.
    cos2, sin2 = rotary_tables(jnp.arange(2, 7), 8, 10000.0)
    q2, k2 = apply_rotary(q, cos2, sin2), apply_rotary(k, cos2, sin2)
    np.testing.assert_allclose(
        np.einsum("btd,bsd->bts", qr[:, :, 0], kr[:, :, 0]),
        np.einsum("btd,bsd->bts", q2[:, :, 0], k2[:, :, 0]),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(None, ["model=tiny"]).model
    graphdef, abstract, names = create_abstract(cfg)
    params = jax.jit(lambda: init_params(cfg))()
    return cfg, graphdef, params, names


def test_params_carry_logical_names(tiny):
    cfg, _, params, names = tiny
    assert names["layers"]["wq"] == ("layers", "embed", "heads", "head_dim")
    assert names["embed"] == ("vocab", "embed")
    assert params["layers"]["wq"].shape == (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.head_dim)
    assert sum(p.size for p in jax.tree.leaves(params)) == param_count(cfg)


def test_causal_future_tokens_do_not_change_past_logits(tiny):
    cfg, graphdef, params, _ = tiny
    tok = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    tok2 = tok.at[:, 10:].set((tok[:, 10:] + 7) % cfg.vocab_size)
    a, b = apply(graphdef, params, tok), apply(graphdef, params, tok2)
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def test_scan_equals_unrolled_layers(tiny):
    from jaxdist.models.transformer import block_forward, rms_norm

    cfg, graphdef, params, _ = tiny
    tok = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    cos, sin = rotary_tables(jnp.arange(12), cfg.head_dim, cfg.rope_theta)
    x = jnp.take(params["embed"], tok, axis=0)
    for i in range(cfg.n_layers):
        x = block_forward({k: v[i] for k, v in params["layers"].items()}, x, cos, sin, cfg)
    ref = rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["embed"].T
    np.testing.assert_allclose(apply(graphdef, params, tok), ref, rtol=1e-5, atol=1e-5)


def test_checkpoint_names_are_tagged(tiny):
    cfg, graphdef, params, _ = tiny
    tok = jnp.zeros((1, 8), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda p: apply(graphdef, p, tok))(params))
    for name in CHECKPOINT_NAMES:
        assert f"name={name}" in jaxpr, name


def test_compile_time_does_not_grow_with_depth():
    # The layers are scanned: the HLO of 2 and 16 layers has the same number of dots.
    counts = []
    for layers in (2, 16):
        cfg = load_config(None, ["model=tiny", f"model.n_layers={layers}"]).model
        graphdef, abstract, _ = create_abstract(cfg)
        hlo = (
            jax.jit(lambda p, t: apply(graphdef, p, t))  # noqa: B023 (used in this iteration)
            .lower(abstract, jax.ShapeDtypeStruct((1, 8), jnp.int32))
            .as_text()
        )
        counts.append(hlo.count("dot_general"))
    assert counts[0] == counts[1]


def test_bf16_compute_with_fp32_master_weights():
    cfg = load_config(None, ["model=tiny", "model.dtype=bfloat16"]).model
    graphdef, _, _ = create_abstract(cfg)
    params = jax.jit(lambda: init_params(cfg))()
    assert params["layers"]["wq"].dtype == jnp.float32
    logits = apply(graphdef, params, jnp.zeros((1, 8), jnp.int32))
    assert logits.dtype == jnp.float32
    f32 = load_config(None, ["model=tiny"]).model
    ref = apply(create_abstract(f32)[0], params, jnp.zeros((1, 8), jnp.int32))
    np.testing.assert_allclose(logits, ref, rtol=0.1, atol=0.1)
    # Closeness to fp32 cannot tell bf16 compute from fp32 compute: the program's matmuls must take bf16 operands.
    assert _dot_operand_types(cfg) == {"bf16"}
    assert _dot_operand_types(f32) == {"f32"}


def _dot_operand_types(cfg) -> set[str]:
    """The element types of every matmul operand in the lowered (pre-optimisation) forward program."""
    graphdef, abstract, _ = create_abstract(cfg)
    text = (
        jax.jit(lambda p, t: apply(graphdef, p, t)).lower(abstract, jax.ShapeDtypeStruct((1, 8), jnp.int32)).as_text()
    )
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) >= cfg.n_layers  # the scanned block's matmuls and the output projection
    operands = [line.rsplit(" : (", 1)[1].split(") ->")[0] for line in dots]
    return {t.rsplit("x", 1)[-1].rstrip(">") for ops in operands for t in ops.split(", ")}

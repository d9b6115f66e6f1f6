"""Computation view: parameters, FLOPs and activations against the model code and closed forms."""

import jax
import jax.numpy as jnp
import pytest

from jaxdist.config import MODEL_PRESETS, load_config
from jaxdist.models.arithmetic import param_count, train_flops_per_token
from jaxdist.models.transformer import CHECKPOINT_NAMES, block_forward, rotary_tables
from jaxdist.planner.computation import computation_view


@pytest.mark.parametrize("preset", list(MODEL_PRESETS))
def test_parameter_count_matches_the_model(preset):
    m = load_config(None, [f"model={preset}"]).model
    assert computation_view(m, 128).param_count == param_count(m)


@pytest.mark.parametrize("preset", ["tiny", "small", "llama-8b", "llama-70b"])
def test_flops_per_token_is_palm_accounting(preset):
    m = load_config(None, [f"model={preset}"]).model
    for seq in (64, 2048):
        assert computation_view(m, seq).flops_per_token() == pytest.approx(train_flops_per_token(m, seq), rel=1e-12)


def test_moe_flops_count_only_the_routed_experts():
    m = load_config(None, ["model=mixtral-8x7b"]).model
    v = computation_view(m, 4096)
    (moe,) = v.blocks
    d, f, k, e = m.d_model, m.d_ff, m.moe.top_k, m.moe.experts
    attn = 2 * (d * m.n_heads * m.head_dim * 2 + 2 * d * m.n_kv_heads * m.head_dim) + 4 * m.n_heads * m.head_dim * 4096
    assert moe.flops_fwd == attn + 2 * d * e + 6 * k * d * f
    assert moe.count == m.n_layers and moe.dispatch_rows == k


def test_tagged_activations_have_the_traced_shapes():
    """Every checkpoint_name of the traced block has the per-token shape the view gives it."""
    m = load_config(None, ["model=tiny"]).model
    seq = 16
    view = computation_view(m, seq)
    (block,) = view.blocks
    p = {x.name: jnp.zeros(x.shape, jnp.float32) for x in block.params}
    cos, sin = rotary_tables(jnp.arange(seq), m.head_dim, m.rope_theta)
    jaxpr = jax.make_jaxpr(lambda p, x: block_forward(p, x, cos, sin, m))(p, jnp.zeros((2, seq, m.d_model)))
    traced = {e.params["name"]: e.outvars[0].aval.shape for e in jaxpr.eqns if e.primitive.name == "name"}
    assert set(traced) == set(CHECKPOINT_NAMES)
    for name, shape in traced.items():
        (act,) = [a for a in block.activations if a.checkpoint_name == name]
        assert shape == (2, seq) + act.shape, name


def test_saved_activations_without_remat_closed_form():
    m = load_config(None, ["model=small"]).model
    seq = 96
    (block,) = computation_view(m, seq).blocks
    d, h, kv, hd, f = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim, m.d_ff
    per_token = sum(
        block.activation(n).elements_per_token * block.activation(n).dtype_bytes for n in block.saved_without_remat
    )
    # Six model-width tensors, rotated query and the context, rotated key and value, scores and
    # probabilities (float32, one per key position), six MLP-width tensors; float32 compute.
    assert per_token == 4 * (6 * d + 2 * h * hd + 2 * kv * hd + 6 * f) + 2 * 4 * h * seq

"""The block profile against JAX's own residual accounting and closed-form byte counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # JAX's list of what a checkpointed function saves

from jaxdist.config import load_config
from jaxdist.models.transformer import block_forward, create_abstract, rotary_tables
from jaxdist.remat import budget_range, named_policies, plan_remat, profile_block

B, T = 4, 32
CP = jax.checkpoint_policies
POLICIES = {
    "everything": CP.everything_saveable,
    "nothing": CP.nothing_saveable,
    "dots": CP.dots_saveable,
    "dots_no_batch": CP.dots_with_no_batch_dims_saveable,
    "qkv": CP.save_only_these_names("query_proj", "key_proj", "value_proj"),
    "attn_out": CP.save_only_these_names("attn_out"),
}


@pytest.fixture(scope="module")
def tiny():
    return load_config(None, ["model=tiny"]).model


@pytest.fixture(scope="module")
def profile(tiny):
    return profile_block(tiny, B, T, {}, peak_flops=5e10)


def _nbytes(a):
    return int(np.prod(a.shape)) * a.dtype.itemsize


def _truth(cfg, policy):
    """Bytes JAX saves for one block under ``policy``, beyond its arguments (global = per device here)."""
    _, abstract, _ = create_abstract(cfg)
    p = {k: jnp.ones(v.shape[1:], v.dtype) for k, v in abstract["layers"].items()}
    cos, sin = rotary_tables(jnp.arange(T), cfg.head_dim, cfg.rope_theta)
    fn = jax.checkpoint(lambda p, x: block_forward(p, x, cos, sin, cfg), policy=policy)
    res = saved_residuals(fn, p, jnp.ones((B, T, cfg.d_model)))
    return sum(_nbytes(a) for a, src in res if "argument" not in src and "constant" not in src)


@pytest.mark.parametrize("name", list(POLICIES))
def test_predicted_residuals_equal_jax(tiny, profile, name):
    ev = profile.evaluate(POLICIES[name])
    # JAX's list for one block holds layer-invariant values in full (the model's scan stores them once).
    assert sum(op.bytes for op, s in zip(profile.operators, ev.saved) if s) == _truth(tiny, POLICIES[name])


def test_profile_lists_tags_groups_and_costs(tiny, profile):
    assert profile.tags == (
        "attn_norm",
        "query_proj",
        "key_proj",
        "value_proj",
        "attn_context",
        "attn_out",
        "mlp_norm",
        "mlp_gate",
        "mlp_up",
        "mlp_out",
    )
    assert profile.input_bytes == B * T * tiny.d_model * 4
    dots = [op for op in profile.operators if op.primitive == "dot_general" and op.group == "mlp_gate"]
    assert len(dots) == 1 and dots[0].flops == 2 * B * T * tiny.d_model * tiny.d_ff  # XLA's count, one device
    assert dots[0].time == pytest.approx(dots[0].flops / 5e10)
    assert all(j < op.index for op in profile.operators for j in op.inputs)
    assert "mlp_gate" in profile.table() and "needed" in profile.table().splitlines()[0]


def test_sharded_bytes_per_device_closed_form(tiny):
    prof = profile_block(tiny, 8, T, {"data": 2, "fsdp": 2, "tensor": 2}, peak_flops=5e10)
    by_tag = {op.tag: op for op in prof.operators if op.tag}
    d, h, kv, hd, f = tiny.d_model, tiny.n_heads, tiny.n_kv_heads, tiny.head_dim, tiny.d_ff
    # batch over data*fsdp = 4; heads, kv_heads and mlp over tensor = 2
    assert prof.input_bytes == 8 * T * d * 4 // 4
    assert by_tag["attn_norm"].bytes == 8 * T * d * 4 // 4
    assert by_tag["query_proj"].bytes == 8 * T * h * hd * 4 // 8
    assert by_tag["key_proj"].bytes == 8 * T * kv * hd * 4 // 8
    assert by_tag["mlp_gate"].bytes == 8 * T * f * 4 // 8
    gate_dot = next(op for op in prof.operators if op.primitive == "dot_general" and op.group == "mlp_gate")
    assert gate_dot.flops == 2 * 8 * T * d * f / 8  # each device does 1/8 of the matmul


def test_plan_policy_saves_exactly_the_plan_inside_the_model(tiny):
    """The policy applied to the scanned blocks of the real model saves L x the plan's bytes (JAX's accounting)."""
    cfg = load_config(None, ["model=tiny", "model.n_layers=3", "mesh.data=1"]).model
    prof = profile_block(cfg, B, T, {}, peak_flops=5e10)
    lo, hi = budget_range(prof)
    from jaxdist.models.transformer import init_params
    from jaxdist.train.step import next_token_loss

    params = jax.jit(lambda: init_params(cfg))()
    tokens = jnp.zeros((B, T + 1), jnp.int32)

    from jaxdist.parallel.mesh import build_mesh
    from jaxdist.parallel.rules import activation_sharding

    mesh = build_mesh(load_config(None, ["mesh.data=1"]).mesh, jax.devices()[:1])

    def model_saved(policy, constrained=False):
        graphdef, _, _ = create_abstract(cfg, remat_policy=policy)
        with activation_sharding(mesh if constrained else None):  # the Trainer traces with constraints
            res = saved_residuals(lambda p: next_token_loss(graphdef, p, tokens), params)
        return sum(_nbytes(a) for a, src in res if "argument" not in src)

    base = model_saved(CP.nothing_saveable)
    for frac in (0.15, 0.5, 0.9):
        plan = plan_remat(prof, lo + frac * (hi - lo))
        assert model_saved(plan.policy()) - base == pytest.approx(cfg.n_layers * plan.block_bytes, rel=1e-12)
        assert model_saved(plan.policy(), True) - base == pytest.approx(cfg.n_layers * plan.block_bytes, rel=1e-12)
    for _name, policy in list(named_policies().items())[-3:]:  # the save:... recipes
        assert model_saved(policy) - base == pytest.approx(cfg.n_layers * prof.evaluate(policy).bytes, rel=1e-12)


def test_measured_times(tiny):
    prof = profile_block(tiny, B, T, {}, measure=True, repeats=3)
    times = np.array([op.time for op in prof.operators])
    assert np.isfinite(times).all() and (times >= 0).all() and times.sum() > 0
    assert prof.timing.startswith(f"measured on {jax.default_backend()}")


def test_moe_group_profile_matches_jax():
    moe = pytest.importorskip("jaxdist.models.moe")
    cfg = load_config(None, ["model=tiny", "model.moe.experts=4", "model.moe.every=2"]).model
    prof = profile_block(cfg, B, T, {}, peak_flops=5e10)
    assert prof.n_layers == cfg.n_layers // cfg.moe.every and prof.tags.count("attn_norm") == 2
    _, abstract, _ = create_abstract(cfg)
    group = jax.tree.map(
        lambda v: jnp.ones(v.shape[1:], v.dtype), jax.eval_shape(lambda s: moe.split_group(s, cfg), abstract["layers"])
    )
    cos, sin = rotary_tables(jnp.arange(T), cfg.head_dim, cfg.rope_theta)

    def body(g, x):
        for j in range(cfg.moe.every):
            x, _ = block_forward(moe.group_member(g, j, cfg), x, cos, sin, cfg, with_aux=True)
        return x

    for name in ("dots", "qkv"):
        res = saved_residuals(jax.checkpoint(body, policy=POLICIES[name]), group, jnp.ones((B, T, cfg.d_model)))
        truth = sum(_nbytes(a) for a, s in res if "argument" not in s and "constant" not in s)
        ev = prof.evaluate(POLICIES[name])
        assert sum(op.bytes for op, s in zip(prof.operators, ev.saved) if s) == truth

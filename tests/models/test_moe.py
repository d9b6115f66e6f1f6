"""The MoE layer on one device against plain references: routing, losses, dropless and capacity dispatch, the model."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.config import ConfigError, load_config
from jaxdist.models import apply, apply_with_aux, create_abstract, init_params, moe as M
from jaxdist.models.arithmetic import param_count
from jaxdist.models.transformer import block_forward, rms_norm, rotary_tables
from jaxdist.parallel.moe import run_experts
from tests.trees import leaf_pairs


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def layer(cfg, seed=0, n=48):
    """Random expert weights (one layer) and tokens for ``cfg``."""
    d, e, f = cfg.d_model, cfg.moe.experts, M.expert_d_ff(cfg)
    ks = jax.random.split(jax.random.key(seed), 5)
    p = {
        "router": jax.random.normal(ks[0], (d, e)),
        "we_gate": 0.3 * jax.random.normal(ks[1], (e, d, f)),
        "we_up": 0.3 * jax.random.normal(ks[2], (e, d, f)),
        "we_down": 0.3 * jax.random.normal(ks[3], (e, f, d)),
    }
    return p, jax.random.normal(ks[4], (n, d))


def moe_cfg(*overrides):
    return load_config(None, ["model=moe-tiny", "model.d_model=16", "model.moe.d_ff=8", *overrides]).model


# --------------------------------------------------------------------------- routing and losses


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_routing_picks_the_top_k_scores(router):
    cfg = moe_cfg(f"model.moe.router={router}", "model.moe.top_k=3")
    p, x = layer(cfg)
    r = M.route(x, p["router"], cfg)
    logits = np.asarray(x, np.float64) @ np.asarray(p["router"], np.float64)
    scores = (
        np.exp(logits - logits.max(1, keepdims=True))
        / np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)
        if router == "softmax"
        else 1 / (1 + np.exp(-logits))
    )
    top = np.argsort(-scores, axis=1)[:, :3]
    np.testing.assert_array_equal(np.asarray(r.experts), top)
    w = np.take_along_axis(scores, top, 1)
    np.testing.assert_allclose(r.weights, w / w.sum(1, keepdims=True), rtol=1e-5)
    raw = M.route(x, p["router"], dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, renormalize=False)))
    np.testing.assert_allclose(raw.weights, w, rtol=1e-5)


def test_balance_and_z_loss_closed_forms():
    cfg = moe_cfg()
    e = cfg.moe.experts
    p, x = layer(cfg)
    # A zero router: uniform probabilities, logits 0, so balance = E * sum(share * 1/E) = 1 and z = log(E)^2.
    r = M.route(x, jnp.zeros_like(p["router"]), cfg)
    losses = M.router_losses(r, e)
    assert float(losses["balance"]) == pytest.approx(1.0, rel=1e-6)
    assert float(losses["z"]) == pytest.approx(math.log(e) ** 2, rel=1e-6)
    # A real router: compare with counts done by hand.
    r = M.route(x, p["router"], cfg)
    losses = M.router_losses(r, e)
    counts = np.bincount(np.asarray(r.experts).ravel(), minlength=e)
    share = counts / counts.sum()
    np.testing.assert_allclose(losses["share"], share, rtol=1e-6)
    assert float(losses["balance"]) == pytest.approx(e * np.sum(share * np.asarray(r.probs).mean(0)), rel=1e-5)
    lse = np.log(np.exp(np.asarray(r.logits, np.float64)).sum(1))
    assert float(losses["z"]) == pytest.approx(np.mean(lse**2), rel=1e-5)


# --------------------------------------------------------------------------- dispatch on one device


@pytest.mark.parametrize("overrides", [[], ["model.moe.experts=16", "model.moe.top_k=8"]], ids=["8x2", "16x8"])
def test_dropless_equals_reference_values_and_grads(overrides):
    cfg = moe_cfg(*overrides)
    p, x = layer(cfg, n=40)

    def loss(p, x, experts_fn):
        r = M.route(x, p["router"], cfg)
        y = experts_fn(x, r.experts, r.weights, {k: p[k] for k in M.EXPERT_KEYS})
        return jnp.sum(jnp.sin(y)), y

    ref = lambda x, e, w, q: M.experts_reference(x, e, w, q)
    got = lambda x, e, w, q: run_experts(x, e, w, q, cfg)[0]
    (l0, y0), g0 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x, ref)
    (l1, y1), g1 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(p, x, got)
    assert rel_err(y1, y0) < 1e-5
    for a, b in leaf_pairs(g1, g0):
        assert rel_err(a, b) < 1e-5


def brute_force_keep(experts, n_experts, capacity):
    """Slots claimed first choice first, in token order; True where the claim got a slot."""
    experts = np.asarray(experts)
    used = np.zeros(n_experts, int)
    keep = np.zeros(experts.shape, bool)
    for j in range(experts.shape[1]):
        for t in range(experts.shape[0]):
            e = experts[t, j]
            keep[t, j] = used[e] < capacity
            used[e] += 1
    return keep


def test_capacity_equals_reference_on_kept_tokens_and_counts_drops():
    cfg = moe_cfg("model.moe.dispatch=capacity", "model.moe.capacity_factor=0.75")
    p, x = layer(cfg, n=40)
    r = M.route(x, p["router"], cfg)
    cap = M.expert_capacity(40, 2, 8, 0.75)
    assert cap == math.ceil(0.75 * 40 * 2 / 8) == 8
    keep_ref = brute_force_keep(r.experts, 8, cap)
    assert 0 < (~keep_ref).sum() < keep_ref.size  # the test means something: some dropped, some kept
    y, keep = run_experts(x, r.experts, r.weights, {k: p[k] for k in M.EXPERT_KEYS}, cfg)
    np.testing.assert_array_equal(np.asarray(keep), keep_ref)
    ref = M.experts_reference(x, r.experts, r.weights * keep_ref, p)  # dropped assignments contribute 0
    assert rel_err(y, ref) < 1e-5
    # The model-level drop rate is the count of dropped assignments over all N*k.
    _, aux = M.moe_forward(p, x[None], cfg)
    assert float(aux["drop_rate"]) == pytest.approx((~keep_ref).sum() / keep_ref.size, abs=1e-7)


def test_capacity_slots_are_unique_and_bounded():
    experts = jnp.asarray(np.random.default_rng(0).integers(0, 4, size=(30, 2)), jnp.int32)
    keep, slot = M.capacity_slots(experts, 4, 5)
    kept = np.asarray(slot)[np.asarray(keep)]
    assert len(set(kept.tolist())) == len(kept) and kept.max() < 4 * 5
    np.testing.assert_array_equal(np.asarray(slot)[~np.asarray(keep)], 20)
    np.testing.assert_array_equal(kept // 5, np.asarray(experts)[np.asarray(keep)])


# --------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def every2():
    cfg = load_config(
        None, ["model=moe-tiny", "model.n_layers=4", "model.moe.every=2", "model.moe.shared_d_ff=32"]
    ).model
    graphdef, abstract, names = create_abstract(cfg)
    params = jax.jit(lambda: init_params(cfg, seed=1))()
    return cfg, graphdef, params, names


def test_moe_every_k_layout_and_param_count(every2):
    cfg, _, params, names = every2
    layers = params["layers"]
    assert layers["wq"].shape[0] == 4 and layers["w_gate"].shape[0] == 2 and layers["we_gate"].shape[0] == 2
    assert layers["we_gate"].shape == (2, 8, 64, 64) and layers["ws_down"].shape == (2, 32, 64)
    assert names["layers"]["we_gate"] == ("layers", "expert", "embed", "expert_mlp")
    assert names["layers"]["we_down"] == ("layers", "expert", "expert_mlp", "embed")
    assert sum(p.size for p in jax.tree.leaves(params)) == param_count(cfg)
    d = cfg.d_model
    assert param_count(cfg) - param_count(cfg, active=True) == 2 * (8 - 2) * 3 * d * 64


def test_scanned_groups_equal_unrolled_blocks(every2):
    cfg, graphdef, params, _ = every2
    tok = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)
    logits, aux = jax.jit(lambda p, t: apply_with_aux(graphdef, p, t))(params, tok)
    cos, sin = rotary_tables(jnp.arange(12), cfg.head_dim, cfg.rope_theta)
    block = jax.jit(lambda p, x: block_forward(p, x, cos, sin, cfg, with_aux=True))
    x = jnp.take(params["embed"], tok, axis=0)
    lay = params["layers"]
    moe_keys = set(M.moe_param_specs(cfg))
    shares = []
    for i in range(cfg.n_layers):  # blocks 1 and 3 are MoE, 0 and 2 dense
        p = {k: v[i] for k, v in lay.items() if k not in moe_keys and k not in M.DENSE_MLP_KEYS}
        if i % 2:
            p.update({k: lay[k][i // 2] for k in moe_keys})
        else:
            p.update({k: lay[k][i // 2] for k in M.DENSE_MLP_KEYS})
        x, a = block(p, x)
        assert bool(a) == bool(i % 2)
        if a:
            shares.append(a["share"])
    ref = rms_norm(x, params["final_norm"], cfg.norm_eps) @ params["embed"].T
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(aux["moe_expert_share"], np.mean(shares, axis=0), rtol=1e-6)
    assert float(aux["moe_load_max"]) == pytest.approx(8 * np.mean([np.max(s) for s in shares]), rel=1e-6)
    expect = cfg.moe.aux_loss_coef * aux["moe_aux_loss"] + cfg.moe.z_loss_coef * aux["moe_z_loss"]
    assert float(aux["moe_loss"]) == pytest.approx(float(expect), rel=1e-6)


def test_train_step_objective_and_metrics_over_microbatches(every2):
    import optax

    from jaxdist.train.step import init_state, loss_metrics_and_grads, make_train_step, objective

    cfg, graphdef, params, _ = every2
    tokens = jax.random.randint(jax.random.key(2), (4, 9), 0, cfg.vocab_size)
    obj = jax.jit(lambda p, t: objective(graphdef, p, t))
    halves = [obj(params, tokens[i::2]) for i in range(2)]  # microbatch k = rows k, k+2
    loss, metrics, _ = jax.jit(lambda p, t: loss_metrics_and_grads(graphdef, p, t, microbatches=2))(params, tokens)
    assert float(loss) == pytest.approx(float(np.mean([h[0] for h in halves])), rel=1e-5)
    assert set(metrics) == {"loss", *M.MOE_METRICS, "moe_layers"}
    for k in M.MOE_METRICS + ("loss",):
        assert float(metrics[k]) == pytest.approx(float(np.mean([h[1][k] for h in halves])), rel=1e-5), k
    # Per MoE block (blocks 1 and 3): the tokens each expert got in the whole step (summed over microbatches,
    # equal to the routing of the whole batch at once) and the block's losses (the microbatches' mean).
    _, whole = jax.jit(lambda p, t: apply_with_aux(graphdef, p, t))(params, tokens[:, :-1])
    assert set(metrics["moe_layers"]) == {"block1", "block3"}
    for name, layer in metrics["moe_layers"].items():
        np.testing.assert_array_equal(layer["tokens"], whole["moe_layers"][name]["tokens"])
        assert layer["tokens"].dtype == whole["moe_layers"][name]["tokens"].dtype  # summed in their own dtype
        assert float(np.sum(layer["tokens"])) == 4 * 8 * cfg.moe.top_k  # every assignment of 4 rows x 8 tokens
        for k in ("aux_loss", "z_loss", "drop_rate"):
            want = np.mean([h[1]["moe_layers"][name][k] for h in halves])
            assert float(layer[k]) == pytest.approx(float(want), rel=1e-5), (name, k)
    # The step's scalars, as metrics.jsonl and TensorBoard get them.
    flat = M.router_metrics(metrics["moe_layers"])
    t = np.asarray(metrics["moe_layers"]["block3"]["tokens"])
    assert [float(flat[f"moe/block3/tokens_{k}"]) for k in ("max", "min", "mean")] == [t.max(), t.min(), t.mean()]
    assert len(flat) == 2 * 6 and float(flat["moe/block1/tokens_mean"]) == 4 * 8 * cfg.moe.top_k / cfg.moe.experts
    # The objective is the cross-entropy plus the weighted router losses.
    ce, m = halves[0][1]["loss"], halves[0][1]
    expect = ce + cfg.moe.aux_loss_coef * m["moe_aux_loss"] + cfg.moe.z_loss_coef * m["moe_z_loss"]
    assert float(halves[0][0]) == pytest.approx(float(expect), rel=1e-6)
    # The train step logs the blocks' figures flat, as router_metrics gives them (no nested moe_layers).
    sgd = optax.sgd(0.0)
    _, step_metrics = jax.jit(make_train_step(graphdef, sgd, None, microbatches=2))(init_state(params, sgd, 0), tokens)
    assert "moe_layers" not in step_metrics and set(flat) <= set(step_metrics)
    for k, v in flat.items():
        assert float(step_metrics[k]) == pytest.approx(float(v), rel=1e-5), k


def test_dense_model_has_no_aux_and_same_logits():
    cfg = load_config(None, ["model=tiny"]).model
    graphdef, _, _ = create_abstract(cfg)
    params = jax.jit(lambda: init_params(cfg))()
    tok = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
    logits, aux = apply_with_aux(graphdef, params, tok)
    assert aux == {}
    np.testing.assert_array_equal(logits, apply(graphdef, params, tok))


# --------------------------------------------------------------------------- configuration


def test_presets_have_the_published_sizes():
    mixtral = load_config(None, ["model=mixtral-8x7b"]).model
    assert round(param_count(mixtral) / 1e9, 1) == 46.7 and round(param_count(mixtral, active=True) / 1e9, 1) == 12.9
    fine = load_config(None, ["model=deepseek-moe-16b"]).model
    assert (fine.moe.experts, fine.moe.top_k, fine.moe.d_ff) == (64, 6, 1408)
    assert load_config(None, ["model=moe-tiny", "mesh.expert=8"]).model.moe.experts == 8


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["mesh.expert=4", "model.moe.experts=6"],
            "model.moe.experts=6 is not divisible by the expert-parallel size 4 (mesh.expert=4)",
        ),
        (
            ["mesh.expert=2", "mesh.tensor=4", "mesh.expert_tensor=1", "model.moe.experts=4"],
            "expert-parallel size 8 (mesh.expert=2 x mesh.tensor/mesh.expert_tensor=4)",
        ),
        (["model.moe.top_k=9"], "model.moe.top_k=9 must lie between 1 and model.moe.experts=8"),
        (
            ["model.moe.dispatch=capacity", "model.moe.capacity_factor=0"],
            "model.moe.capacity_factor=0.0 must be positive in capacity mode",
        ),
        (["mesh.tensor=4", "mesh.expert_tensor=3"], "mesh.expert_tensor=3 does not divide mesh.tensor=4"),
        (["model.n_layers=3", "model.moe.every=2"], "model.moe.every=2 does not divide model.n_layers=3"),
        (["model.moe.router=topk"], "model.moe.router='topk' is unknown"),
    ],
)
def test_bad_moe_settings_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["model=moe-tiny", *overrides])


def test_expert_axis_on_a_dense_model_is_refused():
    with pytest.raises(ConfigError, match="mesh.expert=2 needs an MoE model"):
        load_config(None, ["model=tiny", "mesh.expert=2"])
    load_config(None, ["model=moe-tiny", "mesh.expert=2"])  # fine with experts

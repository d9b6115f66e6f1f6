"""The train step against a plain optax reference; learning-rate schedule; FLOPs accounting."""

import jax
import numpy as np
import optax

from jaxdist.config import load_config
from jaxdist.models import create_abstract, init_params
from jaxdist.models.arithmetic import train_flops_per_token
from jaxdist.train.optimizer import decay_mask, learning_rate_schedule, make_optimizer
from jaxdist.train.step import init_state, loss_and_grads, make_train_step
from jaxdist.models.arithmetic import param_count
from tests.trees import leaf_pairs


def test_step_equals_optax_clip_then_adamw():
    cfg = load_config(None, ["model=tiny", "train.grad_clip=0.05", "train.warmup_steps=2"])
    graphdef, _, _ = create_abstract(cfg.model)
    params = init_params(cfg.model)
    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, cfg.model.vocab_size)
    opt, sched = make_optimizer(cfg.train)
    step = jax.jit(make_train_step(graphdef, opt, sched, 1, cfg.train.grad_clip))
    state = init_state(params, opt, 0)
    state, m1 = step(state, tokens)
    state, m2 = step(state, tokens)

    ref_opt = optax.chain(
        optax.clip_by_global_norm(0.05), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask)
    )
    p, s = params, ref_opt.init(params)
    for _ in range(2):
        loss, g = loss_and_grads(graphdef, p, tokens)
        u, s = ref_opt.update(g, s, p)
        p = optax.apply_updates(p, u)
    for a, b in leaf_pairs(state["params"], p):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert m1["grad_norm"] > 0.05  # clipping was active
    assert int(state["step"]) == 2 and float(m2["lr"]) == float(sched(1))


def test_clipping_scales_gradients_like_optax():
    # Adam hides a gradient scale, plain SGD does not: the clipped update must match exactly.
    cfg = load_config(None, ["model=tiny"])
    graphdef, _, _ = create_abstract(cfg.model)
    params = init_params(cfg.model)
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, cfg.model.vocab_size)
    sgd = optax.sgd(1.0)
    step = jax.jit(make_train_step(graphdef, sgd, lambda s: 1.0, 1, 0.01))
    state, m = step(init_state(params, sgd, 0), tokens)
    _, g = loss_and_grads(graphdef, params, tokens)
    ref = optax.chain(optax.clip_by_global_norm(0.01), optax.sgd(1.0))
    u, _ = ref.update(g, ref.init(params), params)
    for a, b in leaf_pairs(state["params"], optax.apply_updates(params, u)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)
    assert abs(float(m["grad_norm"]) - float(optax.global_norm(g))) < 1e-5 * float(m["grad_norm"])


def test_schedule_warmup_and_cosine_floor():
    cfg = load_config(
        None, ["train.steps=100", "train.warmup_steps=10", "train.learning_rate=1e-3", "train.min_lr_ratio=0.1"]
    ).train
    s = learning_rate_schedule(cfg)
    assert float(s(0)) == 0.0 and abs(float(s(10)) - 1e-3) < 1e-9
    assert abs(float(s(100)) - 1e-4) < 1e-9 and float(s(55)) < float(s(20))


def test_flops_per_token_closed_form():
    m = load_config(None, ["model=llama-8b"]).model
    # 6 N (matmul params incl. the output head) + attention: 6*8.03e9 ~ 4.8e10, plus 12*32*4096*seq
    f = train_flops_per_token(m, 2048)
    n = param_count(m) - m.vocab_size * m.d_model  # the input embedding is a lookup
    assert abs(f - (6 * (n - 2 * m.n_layers * m.d_model - m.d_model) + 12 * 32 * 4096 * 2048)) / f < 1e-9


def test_decay_mask_skips_norms():
    cfg = load_config(None, ["model=tiny"]).model
    _, abstract, _ = create_abstract(cfg)
    mask = decay_mask(abstract)
    assert mask["layers"]["wq"] and mask["embed"]
    assert not mask["layers"]["attn_norm"] and not mask["final_norm"]

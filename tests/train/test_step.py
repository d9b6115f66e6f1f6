"""The train step against a plain optax reference; learning-rate schedule; FLOPs accounting."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.config import load_config
from jaxdist.data.batchlist import token_digest
from jaxdist.data.documents import pack
from jaxdist.models import apply, create_abstract, init_params
from jaxdist.models.arithmetic import param_count, train_flops_per_token
from jaxdist.parallel.layout import sharded_tracing
from jaxdist.parallel.mesh import build_mesh
from jaxdist.train.optimizer import decay_mask, learning_rate_schedule, make_optimizer
from jaxdist.train.step import init_state, loss_and_grads, loss_metrics_and_grads, make_eval_step, make_train_step
from tests.data.test_documents import _stream
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


def _tiny(seed: int = 3, shape=(4, 9)):
    cfg = load_config(None, ["model=tiny"])
    graphdef, _, _ = create_abstract(cfg.model)
    tokens = jax.random.randint(jax.random.key(seed), shape, 0, cfg.model.vocab_size)
    return graphdef, init_params(cfg.model), tokens


def _cross_entropy(graphdef, params, tokens):
    """Mean next-token cross-entropy written out: log-softmax of the logits at each label (not optax's)."""
    logp = jax.nn.log_softmax(apply(graphdef, params, tokens[:, :-1]), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def test_microbatched_step_equals_the_whole_batch_step():
    """Two microbatches (rows 0, 2 and 1, 3) accumulate to the whole batch's mean loss and gradient: with plain
    SGD at rate 1 the new parameters are params - grad of the written-out cross-entropy over all rows."""
    graphdef, params, tokens = _tiny()
    sgd = optax.sgd(1.0)
    state, m = jax.jit(make_train_step(graphdef, sgd, lambda s: 1.0, microbatches=2))(
        init_state(params, sgd, 0), tokens
    )
    loss, g = jax.jit(jax.value_and_grad(lambda p: _cross_entropy(graphdef, p, tokens)))(params)
    np.testing.assert_allclose(m["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(m["grad_norm"], optax.global_norm(g), rtol=1e-4)
    for a, b in leaf_pairs(state["params"], jax.tree.map(lambda p, d: p - d, params, g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_by_default_the_whole_batch_is_one_microbatch_and_the_count_is_int32():
    """make_train_step and loss_and_grads without ``microbatches`` take the batch whole, whatever its row count (3
    here: no split in two); the step count is int32, exact past 2**24 steps where a float32 count is not."""
    graphdef, params, tokens = _tiny(7, (3, 9))
    loss, g = jax.jit(jax.value_and_grad(lambda p: _cross_entropy(graphdef, p, tokens)))(params)
    got, got_g = jax.jit(lambda p, t: loss_and_grads(graphdef, p, t))(params, tokens)
    np.testing.assert_allclose(got, loss, rtol=1e-5)
    for a, b in leaf_pairs(got_g, g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    got, metrics, _ = jax.jit(lambda p, t: loss_metrics_and_grads(graphdef, p, t))(params, tokens)
    np.testing.assert_allclose(got, loss, rtol=1e-5)
    assert metrics == {}  # a dense model's objective has no metrics of its own
    sgd = optax.sgd(1.0)
    s0 = init_state(params, sgd, 0)
    s1, m = jax.jit(make_train_step(graphdef, sgd, lambda s: 1.0))(s0, tokens)
    np.testing.assert_allclose(m["loss"], loss, rtol=1e-5)
    assert set(m) == {"loss", "grad_norm", "lr", "batch_digest"}  # plain rows: no packed-row "targets"
    assert s0["step"].dtype == s1["step"].dtype == jnp.int32 and int(s1["step"]) == 1


@pytest.mark.parametrize("norm,clip,scale", [(4.0, 1.0, 0.25), (0.5, 0.25, 0.5), (0.5, 1.0, 1.0)])
def test_a_grads_fn_replaces_the_models_gradients_and_its_grad_norm_is_the_one_clipped_by(norm, clip, scale):
    """The pipeline executor's and train.grad_sync=ordered's hook: ``grads_fn(params, tokens)`` gives the loss,
    metrics and gradients; a ``grad_norm`` among its metrics is the norm logged and clipped by.  Here it returns
    twice the model's gradients and claims ``norm``: clipping at ``clip`` scales them by min(1, clip / norm) (a
    norm above 1 and below it; below the clip nothing changes), which SGD at rate 1 shows in the parameters."""
    graphdef, params, tokens = _tiny(8)
    loss, g = jax.jit(lambda p, t: loss_and_grads(graphdef, p, t))(params, tokens)

    def grads_fn(p, t):
        got, grads = loss_and_grads(graphdef, p, t)
        return got, {"grad_norm": jnp.float32(norm)}, jax.tree.map(lambda x: 2 * x, grads)

    sgd = optax.sgd(1.0)
    step = jax.jit(make_train_step(graphdef, sgd, lambda s: 1.0, grad_clip=clip, grads_fn=grads_fn))
    state, m = step(init_state(params, sgd, 0), tokens)
    assert float(m["grad_norm"]) == norm
    np.testing.assert_allclose(m["loss"], loss, rtol=1e-6)
    for a, b in leaf_pairs(state["params"], jax.tree.map(lambda p, d: p - 2 * scale * d, params, g)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_step_keeps_every_state_leafs_dtype_with_bfloat16_parameters_and_clipping():
    """The jitted step donates the state and runs again on its output, so no leaf may change dtype: bfloat16
    parameters, AdamW (its moments follow the gradients' dtype) and an active clip (its float32 scale must not
    promote the bfloat16 gradients)."""
    cfg = load_config(None, ["model=tiny", "model.param_dtype=bfloat16", "model.dtype=bfloat16"])
    graphdef, _, _ = create_abstract(cfg.model)
    params = init_params(cfg.model)
    tokens = jax.random.randint(jax.random.key(9), (4, 9), 0, cfg.model.vocab_size)
    opt = optax.adamw(1e-3)
    s0 = init_state(params, opt, 0)
    s1, m = jax.jit(make_train_step(graphdef, opt, None, 1, 1e-3))(s0, tokens)
    assert float(m["grad_norm"]) > 1e-3  # the clip is active
    before, after = jax.tree.leaves(s0), jax.tree.leaves(s1)
    assert jax.tree.structure(s0) == jax.tree.structure(s1)
    assert [a.dtype for a in after] == [b.dtype for b in before]
    assert jnp.dtype(jnp.bfloat16) in {a.dtype for a in jax.tree.leaves(s1["opt_state"])}


def test_microbatches_split_over_a_mesh_equal_the_whole_batch_on_one_device():
    """Two microbatches traced under the mesh's activation sharding (data=2 fsdp=2 tensor=2, rows over data and
    fsdp, the microbatches' rows kept split the same way) give one device's whole-batch loss and gradients."""
    cfg = load_config(None, ["model=tiny", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    mesh = build_mesh(cfg.mesh, jax.devices()[:8])
    graphdef, params, tokens = _tiny(11, (16, 17))
    sharded = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None)))
    with sharded_tracing(mesh):
        lowered = jax.jit(lambda p, t: loss_metrics_and_grads(graphdef, p, t, 2)).lower(params, sharded)
    loss, _, grads = lowered.compile()(params, sharded)
    want, want_g = jax.jit(lambda p, t: loss_and_grads(graphdef, p, t))(params, tokens)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    for a, b in leaf_pairs(grads, want_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_eval_step_is_the_mean_next_token_cross_entropy():
    graphdef, params, tokens = _tiny(4)
    want = jax.jit(lambda p: _cross_entropy(graphdef, p, tokens))(params)
    np.testing.assert_allclose(jax.jit(make_eval_step(graphdef))(params, tokens), want, rtol=1e-5)


def test_the_step_logs_its_tokens_and_schedule_and_advances_the_count_and_key():
    """batch_digest is the tokens' digest (computed here in NumPy); lr is the schedule at the step's own count; the
    count goes 0, 1, 2; the key moves every step, the same way from the same seed."""
    graphdef, params, tokens = _tiny(5)
    opt = optax.sgd(0.1)
    step = jax.jit(make_train_step(graphdef, opt, lambda s: 0.5 + s))
    s0 = init_state(params, opt, 7)
    s1, m1 = step(s0, tokens)
    s2, m2 = step(s1, tokens)
    assert int(m1["batch_digest"]) == int(token_digest(np.asarray(tokens)))
    assert float(m1["lr"]) == 0.5 and float(m2["lr"]) == 1.5
    assert [int(s["step"]) for s in (s0, s1, s2)] == [0, 1, 2]
    keys = [np.asarray(s["rng"]).tobytes() for s in (s0, s1, s2)]
    assert len(set(keys)) == 3
    assert np.asarray(step(init_state(params, opt, 7), tokens)[0]["rng"]).tobytes() == keys[1]
    assert np.asarray(init_state(params, opt, 8)["rng"]).tobytes() != keys[0]


def test_a_non_finite_step_changes_neither_the_parameters_nor_the_optimizer_state():
    """A NaN in a weight makes the loss NaN: the step leaves params and the AdamW state as they were (bit for
    bit) and only the count and key advance; metrics show the NaN for the host to act on."""
    graphdef, params, tokens = _tiny(6)
    params = dict(params, final_norm=params["final_norm"] * jnp.nan)
    opt, sched = make_optimizer(load_config(None, ["model=tiny"]).train)
    s0 = init_state(params, opt, 0)
    s1, m = jax.jit(make_train_step(graphdef, opt, sched, 1, 1.0))(s0, tokens)
    assert not np.isfinite(float(m["loss"]))
    for a, b in leaf_pairs((s1["params"], s1["opt_state"]), (s0["params"], s0["opt_state"])):
        np.testing.assert_array_equal(a, b)
    assert int(s1["step"]) == 1 and np.asarray(s1["rng"]).tobytes() != np.asarray(s0["rng"]).tobytes()


def test_packed_rows_train_and_evaluate_on_each_documents_own_next_token_loss():
    """data.packing=documents through the step functions themselves: the eval step's loss, and the train step's
    loss, ``targets``, gradient norm and SGD update (one microbatch and two), equal the mean next-token
    cross-entropy of each document run alone (a row of its own from position 0: the outside reference), over the
    tokens the loss counts (a chat token marked 0 is never a label; no prediction crosses a document's end)."""
    cfg = load_config(None, ["model=tiny", "model.attention=xla"])
    graphdef, _, _ = create_abstract(cfg.model)
    params = init_params(cfg.model, seed=6)
    lengths = [9, 5, 14, 3, 11, 7, 12, 6, 20, 4, 25]
    stream, starts, docs = _stream(lengths, cfg.model.vocab_size, seed=7)
    marks = np.ones(len(stream), np.uint8)
    marks[np.random.default_rng(8).choice(len(stream), 12, replace=False)] = 0  # tokens the loss skips
    p = pack(starts, len(stream), 32, marks)
    assert p.rows == 4 and len(p.piece_len) == len(docs)  # every document whole, in rows of unequal targets
    words = jnp.asarray(p.read(stream, np.arange(p.rows)))

    rows = np.zeros((len(docs), max(lengths)), np.int32)
    counted = np.zeros((len(docs), max(lengths) - 1), bool)
    for i, (s, d) in enumerate(zip(starts, docs)):
        rows[i, : len(d)] = d
        counted[i, : len(d) - 1] = marks[s + 1 : s + len(d)] == 1  # label j + 1 of document i is trained on

    def alone(params):
        ce = optax.softmax_cross_entropy_with_integer_labels(apply(graphdef, params, rows[:, :-1]), rows[:, 1:])
        return jnp.sum(jnp.where(counted, ce, 0.0)) / counted.sum()

    loss, grads = jax.jit(jax.value_and_grad(alone))(params)
    np.testing.assert_allclose(jax.jit(make_eval_step(graphdef, packed=True))(params, words), loss, rtol=1e-5)
    sgd = optax.sgd(1.0)
    for m in (1, 2):
        step = jax.jit(make_train_step(graphdef, sgd, lambda s: 1.0, microbatches=m, packed=True))
        state, metrics = step(init_state(params, sgd, 0), words)
        assert float(metrics["targets"]) == counted.sum(), m
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5, err_msg=str(m))
        np.testing.assert_allclose(metrics["grad_norm"], optax.global_norm(grads), rtol=1e-4, err_msg=str(m))
        for a, b in leaf_pairs(state["params"], jax.tree.map(lambda p, g: p - g, params, grads)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=str(m))


@pytest.mark.parametrize("loss_ok", [True, False])
def test_a_step_with_either_the_loss_or_the_gradient_norm_not_finite_changes_nothing(loss_ok):
    """Either alone is enough: a finite loss with an infinite gradient norm, or a NaN loss with a finite norm (a
    grads_fn that says so), leaves the parameters and the AdamW state as they were, bit for bit."""
    graphdef, params, tokens = _tiny(10)

    def grads_fn(p, t):
        loss, grads = loss_and_grads(graphdef, p, t)
        return (loss if loss_ok else loss * jnp.nan), {"grad_norm": jnp.float32(jnp.inf if loss_ok else 1.0)}, grads

    opt = optax.adamw(1e-2)
    s0 = init_state(params, opt, 0)
    s1, m = jax.jit(make_train_step(graphdef, opt, None, grads_fn=grads_fn))(s0, tokens)
    assert np.isfinite(float(m["loss"])) == loss_ok and np.isfinite(float(m["grad_norm"])) != loss_ok
    for a, b in leaf_pairs((s1["params"], s1["opt_state"]), (s0["params"], s0["opt_state"])):
        np.testing.assert_array_equal(a, b)
    assert int(s1["step"]) == 1

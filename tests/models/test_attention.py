"""The attention implementations (jaxdist/models/attention.py): blockwise equals xla in value and gradient
(one device and a data x fsdp x tensor mesh, grouped-query heads, sequences that are and are not multiples of
the block), on the pipeline's chunks and the sampler's cache; auto's choice; cudnn refused off a GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.config import load_config
from jaxdist.errors import ConfigError
from jaxdist.models.attention import (
    BLOCKWISE_MIN_SEQ,
    attention,
    attention_note,
    blockwise_attention,
    causal_attention,
    choose_attention,
)
from jaxdist.models.names import CHECKPOINT_NAMES
from jaxdist.models.transformer import block_forward_cached, create_abstract, rotary_tables
from jaxdist.parallel.mesh import build_mesh
from jaxdist.parallel.rules import DEFAULT_RULES, activation_sharding, logical_to_spec
from jaxdist.resolve import resolve
from jaxdist.train.step import loss_and_grads

GQA = ["model=tiny", "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=8", "model.attention_block=8"]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def assert_trees_close(a, b, tol=1e-5):
    fa, fb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        assert rel_err(x, y) < tol


def random_params(model_cfg, seed=0):
    """Weights std 0.1, norm scales 1, built with numpy (no compile)."""
    _, abstract, _ = create_abstract(model_cfg)
    rng = np.random.default_rng(seed)

    def leaf(path, a):
        if str(path[-1].key).endswith("norm"):
            return np.ones(a.shape, np.float32)
        return rng.normal(0.0, 0.1, a.shape).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


# --------------------------------------------------------------------------- the function itself


@pytest.mark.parametrize(
    "tq,tk,offset,block",
    [(16, 16, 0, 8), (13, 13, 0, 4), (5, 12, 7, 4), (3, 20, 17, 8), (7, 7, 0, 16)],
    ids=["multiple", "not-multiple", "chunk", "chunk-not-multiple", "one-block"],
)
def test_blockwise_equals_xla_value_and_gradients(tq, tk, offset, block):
    rng = np.random.default_rng(1)
    q, w = (jnp.asarray(rng.normal(size=(2, tq, 4, 8)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.normal(size=(2, tk, 2, 8)), jnp.float32) for _ in range(2))

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * w), (0, 1, 2)))(q, k, v)

    (ref, g_ref), (got, g) = (
        loss(lambda *a: causal_attention(*a, offset)),
        loss(lambda *a: blockwise_attention(*a, offset, block)),
    )
    assert rel_err(got, ref) < 1e-5
    assert_trees_close(g, g_ref)


def test_blockwise_gradient_holds_no_score_matrix():
    """Compiled value-and-gradient at T = 2048: xla's temporaries hold [H, T, T] float32 scores, blockwise's
    stay under a tenth of one such matrix (they grow with T, not T^2)."""
    t, h = 2048, 2
    q = jax.ShapeDtypeStruct((1, t, h, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((1, t, 1, 8), jnp.float32)

    def temp_bytes(fn):
        grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), (0, 1, 2))
        return jax.jit(grad).lower(q, k, k).compile().memory_analysis().temp_size_in_bytes

    scores = h * t * t * 4
    assert temp_bytes(causal_attention) >= scores
    assert temp_bytes(lambda q, k, v: blockwise_attention(q, k, v, 0, 128)) < scores / 10


def test_a_policy_keeping_the_context_does_not_run_the_forward_loop_again():
    """The saved output and log-sum-exp are tagged ``attn_context``: under ``save_only_these_names`` of the
    model's names the gradient has the forward's loop once (as without remat), under nothing_saveable twice."""
    q, k = jnp.ones((1, 32, 2, 8)), jnp.ones((1, 32, 1, 8))

    def loops(policy):
        f = lambda q, k, v: jnp.sum(jnp.sin(blockwise_attention(2 * q, k, v, 0, 8)))  # noqa: E731
        f = f if policy is None else jax.checkpoint(f, policy=policy)
        return str(jax.make_jaxpr(jax.grad(f, (0, 1, 2)))(q, k, k)).count("while[")

    names = jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES)
    assert loops(names) == loops(None) == 2  # the forward's key loop and the backward's query loop
    assert loops(jax.checkpoint_policies.nothing_saveable) == 3


# --------------------------------------------------------------------------- the model: loss and gradients


def _loss_and_grads(extra, tokens, params, mesh=None):
    cfg = load_config(None, GQA + extra)
    graphdef, _, names = create_abstract(cfg.model)
    fn = functools.partial(loss_and_grads, graphdef)
    if mesh is None:
        with jax.default_device(jax.devices()[0]):
            return jax.jit(fn)(params, tokens)
    mesh = build_mesh(load_config(None, ["model=tiny"] + mesh).mesh, jax.devices())
    shard = lambda n, a: NamedSharding(mesh, logical_to_spec(n, DEFAULT_RULES, mesh, a.shape))  # noqa: E731
    p_sh = jax.tree.map(shard, names, params, is_leaf=lambda x: isinstance(x, tuple))
    t_sh = shard(("batch", "seq"), tokens)
    jitted = jax.jit(fn, in_shardings=(p_sh, t_sh), out_shardings=(NamedSharding(mesh, PartitionSpec()), p_sh))
    with activation_sharding(mesh):
        return jitted(jax.device_put(params, p_sh), jax.device_put(tokens, t_sh))


@pytest.mark.parametrize("seq", [24, 21], ids=["multiple-of-block", "not-multiple"])
def test_model_loss_and_gradients_blockwise_equal_xla(seq):
    params = random_params(load_config(None, GQA).model)
    tokens = np.random.default_rng(2).integers(0, 260, (8, seq + 1), dtype=np.int32)
    loss_ref, g_ref = _loss_and_grads(["model.attention=xla"], tokens, params)
    loss, g = _loss_and_grads(["model.attention=blockwise"], tokens, params)
    assert rel_err(loss, loss_ref) < 1e-5
    assert_trees_close(g, g_ref)
    if seq == 21:  # sharded over data x fsdp x tensor (8 devices) against the one-device xla reference
        loss, g = _loss_and_grads(
            ["model.attention=blockwise"], tokens, params, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
        )
        assert rel_err(loss, loss_ref) < 1e-5
        assert_trees_close(g, g_ref)


def test_pipeline_chunks_blockwise_equal_xla():
    """block_forward_cached over chunks (queries at P..P+Tc-1 against keys 0..P+Tc-1), value and gradient."""
    base = load_config(None, GQA).model
    params = jax.tree.map(lambda a: a[0], random_params(base)["layers"])
    x = np.random.default_rng(3).normal(size=(2, 19, base.d_model)).astype(np.float32)
    cos, sin = rotary_tables(jnp.arange(19), base.head_dim, base.rope_theta)

    def run(cfg):
        def chunked(p, x):
            ks, vs, outs = None, None, []
            for a, e in ((0, 7), (7, 12), (12, 19)):  # chunk lengths and offsets off the 8-token block grid
                y, k, v = block_forward_cached(p, x[:, a:e], cos[a:e], sin[a:e], cfg, ks, vs)
                outs.append(y)
                ks = k if ks is None else jnp.concatenate([ks, k], 1)
                vs = v if vs is None else jnp.concatenate([vs, v], 1)
            return jnp.concatenate(outs, 1)

        def loss(p, x):
            y = chunked(p, x)
            return jnp.sum(y**2), y

        (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(params, x)
        return out, grads

    out_ref, g_ref = run(load_config(None, GQA + ["model.attention=xla"]).model)
    out, g = run(load_config(None, GQA + ["model.attention=blockwise"]).model)
    assert rel_err(out, out_ref) < 1e-5
    assert_trees_close(g, g_ref)


def test_sampler_cache_blockwise_equals_xla():
    from jaxdist.data.tokenizer import ByteTokenizer
    from jaxdist.parallel.layout import Parallelism
    from jaxdist.sample.sampler import Sampler

    prompts = [ByteTokenizer().encode(t).tolist() for t in ("Hello", "de", "import o")]
    logits = []
    for impl in ("xla", "blockwise"):
        cfg = load_config(None, ["model=tiny", "mesh.data=1", f"model.attention={impl}", "model.attention_block=4"])
        sampler = Sampler(cfg, random_params(cfg.model), Parallelism.build(cfg, jax.devices()[:1]))
        logits.append(sampler.decode(prompts, 4, stop_at_eos=False, keep_logits=True).logits)
    np.testing.assert_allclose(logits[1], logits[0], rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- choosing, and cudnn off a GPU


def test_auto_choice():
    cfg = load_config(None, ["model=tiny"]).model
    bf16 = load_config(None, ["model=tiny", "model.dtype=bfloat16"]).model
    assert choose_attention(cfg, BLOCKWISE_MIN_SEQ - 1, "cpu")[0] == "xla"
    assert choose_attention(cfg, BLOCKWISE_MIN_SEQ, "cpu")[0] == "blockwise"
    assert choose_attention(bf16, 128, "gpu", "9.0")[0] == "cudnn"
    assert choose_attention(bf16, 128, "gpu", "7.5")[0] == "xla"  # pre-Ampere: no cuDNN flash attention
    assert choose_attention(cfg, BLOCKWISE_MIN_SEQ, "gpu", "9.0")[0] == "blockwise"  # float32: not cuDNN's
    fixed = load_config(None, ["model=tiny", "model.attention=xla"]).model
    assert choose_attention(fixed, 10**6, "gpu", "9.0")[0] == "xla"
    long = load_config(None, ["model=tiny", "model.max_seq_len=8192"]).model
    assert attention_note(long, 8192, jax.devices()[0]) == "attention: blockwise (auto: seq 8192 >= 2048 on cpu)"
    # the model follows the choice: auto over a long sequence traces the blockwise loop
    q = jax.ShapeDtypeStruct((1, BLOCKWISE_MIN_SEQ, 4, 16), jnp.float32)
    k = jax.ShapeDtypeStruct((1, BLOCKWISE_MIN_SEQ, 2, 16), jnp.float32)
    short = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
    assert "custom_vjp" in str(jax.make_jaxpr(lambda q, k: attention(q, k, k, cfg))(q, k))
    q64 = jax.ShapeDtypeStruct((1, 64, 4, 16), jnp.float32)
    assert "custom_vjp" not in str(jax.make_jaxpr(lambda q, k: attention(q, k, k, cfg))(q64, short))


def test_cudnn_is_refused_off_a_gpu_and_unknown_names_at_load():
    cfg = load_config(None, ["model=tiny", "mesh.data=1", "model.attention=cudnn", "model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="model.attention=cudnn needs a CUDA GPU"):
        resolve(cfg, jax.devices()[:1])
    q = jnp.zeros((1, 8, 4, 16))
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        attention(q, q[:, :, :2], q[:, :, :2], cfg.model)
    with pytest.raises(ConfigError, match="model.attention='flash' is not supported"):
        load_config(None, ["model=tiny", "model.attention=flash"])
    with pytest.raises(ConfigError, match="model.attention=cudnn runs in bfloat16 only"):
        load_config(None, ["model=tiny", "model.attention=cudnn"])
    with pytest.raises(ConfigError, match="model.attention_block=0"):
        load_config(None, ["model=tiny", "model.attention_block=0"])

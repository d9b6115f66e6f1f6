"""Context parallelism (jaxdist/parallel/context.py): the ring against one device, the chunk order, refusals."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.config import load_config, validate
from jaxdist.errors import ConfigError
from jaxdist.models.transformer import create_abstract
from jaxdist.parallel.context import causal_work, chunk_order
from jaxdist.parallel.layout import Parallelism
from jaxdist.parallel.mesh import build_mesh, hybrid_shapes
from jaxdist.train.step import loss_and_grads

# GQA (8 query heads over 2 key/value heads), 64 tokens: 2 x context chunks of 8 (context=4) or 16 (context=2).
GQA = ["model=tiny", "model.n_heads=8", "model.n_kv_heads=2", "model.head_dim=8", "model.attention_block=8"]
SEQ = 64


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def random_params(model_cfg, seed=0):
    """Weights std 0.1, norm scales 1, built with numpy (no compile)."""
    _, abstract, _ = create_abstract(model_cfg)
    rng = np.random.default_rng(seed)

    def leaf(path, a):
        if str(path[-1].key).endswith("norm"):
            return np.ones(a.shape, np.float32)
        return rng.normal(0.0, 0.1, a.shape).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


def _loss_and_grads(overrides, tokens, params, devices):
    cfg = load_config(None, GQA + [f"train.seq_len={SEQ}"] + overrides)
    validate(cfg, len(devices))
    graphdef, _, names = create_abstract(cfg.model)
    par = Parallelism.build(cfg, devices)
    p_sh = par.param_shardings(names, params)
    jitted = jax.jit(
        par.bind(functools.partial(loss_and_grads, graphdef)),
        in_shardings=(p_sh, par.batch_sharding),
        out_shardings=(par.replicated, p_sh),
    )
    loss, grads = jitted(jax.device_put(params, p_sh), jax.device_put(tokens, par.batch_sharding))
    return loss, grads, jitted.lower(params, tokens).as_text()


@pytest.fixture(scope="module")
def reference():
    params = random_params(load_config(None, GQA).model)
    tokens = np.random.default_rng(3).integers(0, 260, (4, SEQ + 1), dtype=np.int32)
    loss, grads, _ = _loss_and_grads(["model.attention=xla", "mesh.data=1"], tokens, params, jax.devices()[:1])
    return params, tokens, loss, grads


@pytest.mark.parametrize(
    "mesh",
    [["mesh.context=4", "mesh.data=2"], ["mesh.context=2", "mesh.data=2", "mesh.tensor=2"]],
    ids=["context4-data2", "context2-data2-tensor2"],
)
def test_ring_attention_equals_one_device(reference, mesh):
    params, tokens, loss_ref, g_ref = reference
    loss, grads, text = _loss_and_grads(mesh, tokens, params, jax.devices())
    assert "collective_permute" in text or "ppermute" in text  # the ring really ran
    assert rel_err(loss, loss_ref) < 1e-5
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        ref = functools.reduce(lambda t, k: t[k.key], path, g_ref)
        assert rel_err(g, ref) < 1e-5, jax.tree_util.keystr(path)


def test_the_activations_are_split_over_context():
    cfg = load_config(None, GQA + [f"train.seq_len={SEQ}", "mesh.context=4", "mesh.data=2"])
    par = Parallelism.build(cfg, jax.devices())
    assert par.sharding(("batch", "seq", "embed"), (4, SEQ, 64)).spec == PartitionSpec("data", "context", None)
    assert isinstance(par.batch_sharding, NamedSharding) and par.batch_sharding.spec == PartitionSpec("data", None)
    assert build_mesh(cfg.mesh, jax.devices()).shape["context"] == 4


def test_context_stays_inside_a_node():
    sizes = dict(data=2, fsdp=1, context=4, tensor=1, expert=1, pipeline=1)
    assert hybrid_shapes(sizes, n_nodes=2, per_node=4) == ((1, 1, 4, 1, 1, 1), (2, 1, 1, 1, 1, 1))
    with pytest.raises(ConfigError, match=r"context\*tensor\*expert\*pipeline = 8 does not fit inside one node of 4"):
        hybrid_shapes(dict(sizes, data=1, context=8), n_nodes=2, per_node=4)


@pytest.mark.parametrize("context", [2, 4, 8])
def test_the_chunk_order_balances_causal_work(context):
    order = chunk_order(context)
    assert sorted(c for dev in order for c in dev) == list(range(2 * context))
    work = causal_work(order)
    assert len(set(work)) == 1  # every device the same
    n = 2 * context
    assert sum(work) == n * (n - 1) / 2 + n / 2  # the whole causal triangle, counted once
    plain = causal_work([(2 * i, 2 * i + 1) for i in range(context)])
    assert max(plain) / min(plain) > 2  # the contiguous order leaves the first device mostly idle


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["mesh.context=2", "mesh.pipeline=2", "model.n_layers=2"], "does not run with pipeline stages yet"),
        (["mesh.context=4", "train.seq_len=36"], "does not split into 2*mesh.context=8 equal chunks"),
    ],
)
def test_refusals(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        validate(load_config(None, ["model=tiny", "train.seq_len=64"] + overrides))

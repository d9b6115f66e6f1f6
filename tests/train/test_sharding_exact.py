"""Sharded loss and gradients equal the single-device result (fp32, 1e-5 relative)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxdist.config import load_config
from jaxdist.models import create_abstract, init_params
from jaxdist.parallel.mesh import build_mesh
from jaxdist.parallel.rules import DEFAULT_RULES, activation_sharding, logical_to_spec
from jaxdist.train.step import loss_and_grads
from tests.trees import leaf_pairs

BATCH, SEQ = 8, 32


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.fixture(scope="module")
def reference():
    cfg = load_config(None, ["model=tiny", "model.n_heads=8", "model.n_kv_heads=4", "model.head_dim=8"])
    graphdef, abstract, names = create_abstract(cfg.model)
    dev0 = jax.devices()[:1]
    with jax.default_device(dev0[0]):
        params = jax.jit(lambda: init_params(cfg.model, seed=3))()
        tokens = jax.random.randint(jax.random.key(5), (BATCH, SEQ + 1), 0, cfg.model.vocab_size)
        loss, grads = jax.jit(lambda p, t: loss_and_grads(graphdef, p, t))(params, tokens)
    return cfg, graphdef, names, params, tokens, loss, grads


def sharded_loss_and_grads(cfg, graphdef, names, params, tokens, mesh_overrides, microbatches=1):
    mcfg = load_config(None, ["model=tiny"] + mesh_overrides).mesh
    mesh = build_mesh(mcfg, jax.devices())
    shard = lambda n, a: NamedSharding(mesh, logical_to_spec(n, DEFAULT_RULES, mesh, a.shape))
    p_sh = jax.tree.map(shard, names, params, is_leaf=lambda x: isinstance(x, tuple))
    t_sh = shard(("batch", "seq"), tokens)
    p = jax.device_put(params, p_sh)
    t = jax.device_put(tokens, t_sh)
    fn = jax.jit(
        lambda p, t: loss_and_grads(graphdef, p, t, microbatches),
        in_shardings=(p_sh, t_sh),
        out_shardings=(NamedSharding(mesh, jax.sharding.PartitionSpec()), p_sh),
    )
    with activation_sharding(mesh):
        loss, grads = fn(p, t)
    return loss, grads, p_sh


@pytest.mark.parametrize(
    "mesh",
    [
        ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
        ["mesh.data=1", "mesh.fsdp=8"],
        ["mesh.data=2", "mesh.tensor=4"],
    ],
)
def test_sharded_equals_single_device(reference, mesh):
    cfg, graphdef, names, params, tokens, loss_ref, grads_ref = reference
    loss, grads, p_sh = sharded_loss_and_grads(cfg, graphdef, names, params, tokens, mesh)
    assert rel_err(loss, loss_ref) < 1e-5
    flat, flat_ref = jax.tree.leaves(grads), jax.tree.leaves(grads_ref)
    assert len(flat) == len(flat_ref)
    for g, r in zip(flat, flat_ref):
        assert rel_err(g, r) < 1e-5
    # the parameters really are split: something is sharded on every axis that is > 1
    specs = {str(s.spec) for s in jax.tree.leaves(p_sh)}
    for axis in ("fsdp", "tensor"):
        if any(f"mesh.{axis}=" in m and not m.endswith("=1") for m in mesh):
            assert any(axis in s for s in specs), (axis, specs)


def test_gradient_accumulation_equals_full_batch(reference):
    cfg, graphdef, names, params, tokens, loss_ref, grads_ref = reference
    loss, grads, _ = sharded_loss_and_grads(
        cfg, graphdef, names, params, tokens, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], microbatches=2
    )
    assert rel_err(loss, loss_ref) < 1e-5
    for g, r in leaf_pairs(grads, grads_ref):
        assert rel_err(g, r) < 1e-5

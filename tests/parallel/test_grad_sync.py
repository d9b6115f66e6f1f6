"""train.grad_sync=per_block (jaxdist.parallel.grad_sync): the same gradients as reducing at the end, and the
compiled program holds the planned collectives in the planned order and sizes."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdist.cluster import load_cluster
from jaxdist.config import load_config
from jaxdist.models import create_abstract, init_params
from jaxdist.parallel.comm import plan_for_config
from jaxdist.parallel.grad_sync import SCOPE, per_block_grads_fn
from jaxdist.parallel.hlo import parse_collectives
from jaxdist.parallel.layout import Parallelism
from jaxdist.train.step import loss_metrics_and_grads

MESHES = {
    "data8": ["mesh.data=8"],
    "data2-fsdp4": ["mesh.data=2", "mesh.fsdp=4"],
    "data2-fsdp2-tensor2": ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
}


def _setup(mesh: list[str], bucket: int = 1):
    cfg = load_config(
        None, ["model=tiny", "train.batch_size=16", "train.seq_len=16", f"train.grad_bucket_bytes={bucket}", *mesh]
    )
    par = Parallelism.build(cfg)
    graphdef, abstract, names = create_abstract(cfg.model)
    shardings = par.param_shardings(names, abstract)
    plan = plan_for_config(cfg, load_cluster("cpu-8"))
    return cfg, par, graphdef, abstract, shardings, plan


def _jit(par, fn, shardings):
    return jax.jit(
        par.bind(fn), in_shardings=(shardings, par.batch_sharding), out_shardings=(par.replicated, None, shardings)
    )


@pytest.mark.parametrize(
    "mesh", ["data8", pytest.param("data2-fsdp4", marks=pytest.mark.slow), "data2-fsdp2-tensor2"]
)  # data2-fsdp4 is slow-marked: data2-fsdp2-tensor2 covers fsdp's reduce-scatter path too
def test_per_block_gradients_bit_identical_to_end(mesh):
    cfg, par, graphdef, _, shardings, plan = _setup(MESHES[mesh])
    params = jax.jit(lambda: init_params(cfg.model, 0), out_shardings=shardings)()
    tokens = jax.random.randint(jax.random.key(1), (16, 17), 0, cfg.model.vocab_size)
    run = {
        mode: _jit(par, per_block_grads_fn(graphdef, cfg.model, par.mesh, par.rules, shardings, plan, mode), shardings)
        for mode in ("per_block", "end")
    }
    loss, _, grads = jax.device_get(run["per_block"](params, tokens))
    loss_end, _, grads_end = jax.device_get(run["end"](params, tokens))
    assert loss == loss_end
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_end)):
        np.testing.assert_array_equal(a, b)
    # Against automatic sharding's reduction at the end (train.grad_sync=end) the sums are grouped differently
    # (the tied embedding adds its lookup and head gradients before the all-reduce here, after it there):
    # rounding only (the note gives the measured differences).
    auto = _jit(par, lambda p, t: loss_metrics_and_grads(graphdef, p, t), shardings)
    _, _, grads_auto = jax.device_get(auto(params, tokens))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_auto)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-7)


def _synced(hlo: str):
    """The bucket collectives (reduce-scatter, all-reduce under the grad_sync scope) in program order."""
    return [c for c in parse_collectives(hlo) if SCOPE in c.op_name and c.kind in ("all-reduce", "reduce-scatter")]


@pytest.mark.parametrize(
    "mesh,bucket_layers",
    [("data8", 1), pytest.param("data2-fsdp4", 1, marks=pytest.mark.slow), ("data2-fsdp4", 2)],
)  # (data2-fsdp4, 1) is slow-marked: (data2-fsdp4, 2) checks the same fsdp path with two layers per bucket
def test_compiled_program_holds_the_planned_collectives(mesh, bucket_layers):
    mesh = [*MESHES[mesh], "model.n_layers=4"]  # k=2 leaves a scan of two steps
    probe = _setup(mesh)[-1].buckets[1]  # one layer's bucket
    cfg, par, graphdef, abstract, shardings, plan = _setup(mesh, probe.bytes * bucket_layers)
    assert plan.layers_per_bucket == bucket_layers
    fn = _jit(par, per_block_grads_fn(graphdef, cfg.model, par.mesh, par.rules, shardings, plan), shardings)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), abstract)
    hlo = fn.lower(shapes, jax.ShapeDtypeStruct((16, 17), np.int32)).compile().as_text()
    found = _synced(hlo)
    loop = [i for i, c in enumerate(found) if c.count > 1]
    assert loop == list(range(loop[0], loop[-1] + 1)), "a bucket's collectives interleave with another's"
    head, layers, embed = found[: loop[0]], found[loop[0] : loop[-1] + 1], found[loop[-1] + 1 :]

    def sums(cs):
        return {k: sum(c.bytes for c in cs if c.kind == k) for k in ("reduce-scatter", "all-reduce")}

    fsdp = dict(par.mesh.shape)["fsdp"] > 1
    norms = 2 * cfg.model.d_model * 4 * bucket_layers  # not fsdp-sharded: all-reduced whole
    b_head, b_layer, b_embed = plan.buckets[0], plan.buckets[1], plan.buckets[-1]
    assert len(plan.buckets) == 2 + cfg.model.n_layers // bucket_layers
    assert {c.count for c in layers} == {cfg.model.n_layers // bucket_layers}  # one bucket per scan step
    assert sums(layers) == {
        "reduce-scatter": b_layer.bytes - norms if fsdp else 0,
        "all-reduce": b_layer.reduced_bytes,
    }
    assert embed and sums(embed)["reduce-scatter"] == (b_embed.bytes if fsdp else 0)
    # The head bucket (the tied model's final norm, 256 B) may be merged by XLA's all-reduce combiner with the
    # embedding's at the end, and either with the loss's 4 bytes.
    outside = sums(head + embed)["all-reduce"] - b_head.reduced_bytes - b_embed.reduced_bytes
    assert outside in (0, 4), outside
    data = dict(par.mesh.shape)["data"]
    for bucket in (layers, embed):  # the all-reduce over data takes the scattered shards: after every scatter
        scatters = [i for i, c in enumerate(bucket) if c.kind == "reduce-scatter"]
        over_data = [i for i, c in enumerate(bucket) if c.kind == "all-reduce" and c.group == data]
        assert over_data and min(over_data) > max(scatters, default=-1), [(c.kind, c.group) for c in bucket]

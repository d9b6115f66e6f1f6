"""train.grad_sync=per_block with experts (jaxdist.parallel.grad_sync): each bucket's gradients reduced right
after its backward, the experts' over the axes that replicate them (data), the dense weights' over data x
expert, the planned expert dispatch running on each device's tokens inside the shard_map.

The reference is the same MoE model on one device (jaxdist.train.step.loss_metrics_and_grads) for dropless
dispatch; capacity dispatch drops by each device's token group, so its reference is ``train.grad_sync=end`` on
the same mesh (the same groups).  fp32 (moe-tiny's default), 1e-5 relative, as issue 36 asks."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from jaxdist.cluster import load_cluster
from jaxdist.config import load_config
from jaxdist.models import create_abstract, init_params
from jaxdist.models.moe import EXPERT_KEYS
from jaxdist.parallel.comm import plan_for_config
from jaxdist.parallel.grad_sync import SCOPE, per_block_grads_fn
from jaxdist.parallel.hlo import parse_collectives
from jaxdist.parallel.layout import Parallelism
from jaxdist.train.step import loss_metrics_and_grads
from tests.trees import leaf_pairs


def _setup(mesh: list[str], *over: str):
    """moe-tiny (fp32, 2 MoE blocks of 8 experts, top-2) under per_block on ``mesh``; the batch 16 x 16."""
    cfg = load_config(
        None, ["model=moe-tiny", "train.batch_size=16", "train.seq_len=16", "train.grad_sync=per_block", *mesh, *over]
    )
    par = Parallelism.build(cfg)
    graphdef, abstract, names = create_abstract(cfg.model)
    shardings = par.param_shardings(names, abstract)
    params = jax.jit(lambda: init_params(cfg.model, 0), out_shardings=shardings)()
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(1), (16, 17), 0, cfg.model.vocab_size), par.batch_sharding
    )
    return cfg, par, graphdef, abstract, shardings, params, tokens


def _jit(par, fn, shardings):
    return jax.jit(
        par.bind(fn),
        in_shardings=(shardings, par.batch_sharding),
        out_shardings=(par.replicated, par.replicated, shardings),
    )


def _close(got, want) -> None:
    """Every leaf of ``got`` within 1e-5 of ``want``, relative to the leaf's largest magnitude."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in leaf_pairs(got, want):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(b), initial=0.0)))


@pytest.mark.parametrize(
    "mesh",
    [["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"], ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2"]],
    ids=["data2-fsdp2-expert2", "data2-expert2-tensor2"],
)
def test_per_block_with_experts_equals_one_device(mesh):
    """The objective, every router figure (per block: the tokens per expert, the losses) and every gradient of
    per_block on the mesh equal one device's; the planned all-to-all runs; the experts' gradients are reduced
    over data alone and the dense weights' over data x expert."""
    cfg, par, graphdef, abstract, shardings, params, tokens = _setup(mesh)
    plan = plan_for_config(cfg, load_cluster("cpu-8"))
    fn = per_block_grads_fn(graphdef, cfg.model, par.mesh, par.rules, shardings, plan)
    compiled = _jit(par, fn, shardings).lower(params, tokens).compile()
    loss, metrics, grads = jax.device_get(compiled(params, tokens))
    one = jax.devices()[0]
    reference = jax.jit(lambda p, t: loss_metrics_and_grads(graphdef, p, t))
    loss1, metrics1, grads1 = jax.device_get(reference(*jax.device_put(jax.device_get((params, tokens)), one)))
    _close((loss, metrics, grads), (loss1, metrics1, grads1))
    assert len(metrics["moe_layers"]) == 2 and metrics["moe_layers"]["block1"]["tokens"].sum() == 16 * 16 * 2

    collectives = parse_collectives(compiled.as_text())
    assert any(c.kind == "all-to-all" and c.group == 2 for c in collectives)  # the dispatch over expert=2
    if "mesh.fsdp=2" in mesh:
        synced = [c for c in collectives if SCOPE in c.op_name and c.kind == "all-reduce"]
        layers = shardings["layers"]
        # The experts' gradients, reduce-scattered over fsdp, then all-reduced over data (2 devices) only.
        expert_bytes = sum(
            math.prod(layers[k].shard_shape(abstract["layers"][k].shape)) * 4 for k in EXPERT_KEYS
        )  # each device's shard: its experts, its fsdp part
        assert sum(c.bytes * c.count for c in synced if c.group == 2) == expert_bytes
        # The dense weights' (attention, router; the head's): over data x expert (4 devices).
        assert sum(c.bytes * c.count for c in synced if c.group == 4) > 0


def test_per_block_with_capacity_dispatch_equals_end():
    """Capacity dispatch drops by each device's token group: per_block's step equals ``end``'s on the same mesh
    (the same groups), with tokens dropped."""
    cfg, par, graphdef, abstract, shardings, params, tokens = _setup(
        ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"], "model.moe.dispatch=capacity"
    )
    plan = plan_for_config(cfg, load_cluster("cpu-8"))
    fn = per_block_grads_fn(graphdef, cfg.model, par.mesh, par.rules, shardings, plan)
    got = jax.device_get(_jit(par, fn, shardings)(params, tokens))
    want = jax.device_get(_jit(par, lambda p, t: loss_metrics_and_grads(graphdef, p, t), shardings)(params, tokens))
    _close(got, want)
    assert got[1]["moe_drop_rate"] > 0


def test_the_trainer_runs_per_block_with_experts(tmp_path):
    """``jaxdist train model=moe-tiny train.grad_sync=per_block`` on data=2 fsdp=2 expert=2 compiles the step
    with the plan's buckets (a bucket is k groups of moe.every layers) and the dispatch's all-to-all, and
    logs the router's figures."""
    from jaxdist.train.metrics import read_metrics
    from jaxdist.train.trainer import Trainer

    cfg = load_config(
        None,
        [
            "model=moe-tiny",
            "train.grad_sync=per_block",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.expert=2",
            "train.steps=2",
            "train.seq_len=32",
            "train.batch_size=8",
            "train.log_every=1",
            "train.progress=false",
            "train.tensorboard=false",
            "data.max_bytes=300000",
            "checkpoint.enabled=false",
            f"train.runs_dir={tmp_path}",
        ],
    )
    with Trainer(cfg) as t:
        assert t.comm_plan.layers_per_bucket % cfg.model.moe.every == 0
        assert "all-reduce(data, expert)" in t.comm_plan.table()
        hlo = t.compile_train_step().as_text()
        assert SCOPE in hlo and "all-to-all" in hlo
        t.fit()
    rows = read_metrics(tmp_path / cfg.train.name)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["moe/block1/tokens_mean"] == 8 * 32 * 2 / 8 for r in rows)  # top-2 of 256 tokens over 8 experts

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
from tests.trees import leaf_pairs

# the same bits from the per-block and end-of-step programs (tests/conftest.py)
pytestmark = pytest.mark.default_emitters

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


def _synced(hlo: str):
    """The bucket collectives (those under the grad_sync scope: the backward's) in program order."""
    return [c for c in parse_collectives(hlo) if SCOPE in c.op_name]


def check_planned_collectives(hlo: str, plan, cfg, sizes: dict) -> None:
    """``hlo`` (per_block's compiled step) holds ``plan``'s buckets in its order, with its bytes per device."""
    k = plan.layers_per_bucket
    found = _synced(hlo)
    loop = [i for i, c in enumerate(found) if c.count > 1]
    assert loop == list(range(loop[0], loop[-1] + 1)), "a bucket's collectives interleave with another's"
    head, layers, embed = found[: loop[0]], found[loop[0] : loop[-1] + 1], found[loop[-1] + 1 :]

    def sums(cs):
        return {
            kind: sum(c.bytes for c in cs if c.kind == kind) for kind in ("reduce-scatter", "all-reduce", "all-gather")
        }

    fsdp, data = sizes["fsdp"] > 1, sizes["data"]
    norm = cfg.model.d_model * 4
    norms = 2 * norm * k  # not fsdp-sharded: all-reduced whole
    b_head, b_layer, b_embed = plan.buckets[0], plan.buckets[1], plan.buckets[-1]
    assert len(plan.buckets) == 2 + cfg.model.n_layers // k
    assert {c.count for c in layers} == {cfg.model.n_layers // k}  # one bucket per scan step
    # Bytes per device on its tensor shard, as planned (tensor=2 moves half of a weight's bytes).
    assert sums(layers) == {
        "reduce-scatter": b_layer.bytes - norms if fsdp else 0,
        "all-reduce": b_layer.reduced_bytes,
        "all-gather": 0,
    }
    # The forward's gathers of one scan step: the bucket's weights, fsdp-gathered and tensor-split.
    gathers = [c for c in parse_collectives(hlo) if c.kind == "all-gather" and c.count > 1 and SCOPE not in c.op_name]
    assert sum(c.bytes for c in gathers) == (b_layer.bytes - norms if fsdp else 0)
    # The head bucket (the final norm and the tied table's head gradient) before the layers' backward (the loss's
    # 4 bytes may join its all-reduce); not merged into the embedding's at the end.
    assert sums(head)["reduce-scatter"] == (b_head.bytes - norm if fsdp else 0)
    assert sums(head)["all-reduce"] - b_head.reduced_bytes in (0, 4)
    # The lookup's gradient after the loop: one reduce-scatter over data x fsdp, then the shard's parts gathered.
    if fsdp:
        assert [(c.kind, c.group, c.bytes) for c in embed] == [
            ("reduce-scatter", data * sizes["fsdp"], b_embed.bytes),
            ("all-gather", data, b_embed.reduced_bytes),
        ]
    else:
        assert [(c.kind, c.bytes) for c in embed] == [("all-reduce", b_embed.reduced_bytes)]
    for bucket in (head, layers):  # the all-reduce over data takes the scattered shards: after every scatter
        scatters = [i for i, c in enumerate(bucket) if c.kind == "reduce-scatter"]
        over_data = [i for i, c in enumerate(bucket) if c.kind == "all-reduce" and c.group == data]
        assert over_data and min(over_data) > max(scatters, default=-1), [(c.kind, c.group) for c in bucket]


@pytest.mark.parametrize("mesh,bucket_layers", [("data8", 1), ("data2-fsdp4", 2), ("data2-fsdp2-tensor2", 1)])
def test_per_block_is_bit_identical_to_end_and_holds_the_planned_collectives(mesh, bucket_layers):
    """Against train.grad_sync=end as jaxdist train runs it (automatic sharding): the same bits in every leaf;
    and the compiled program's collectives are the plan's (one compile serves both)."""
    over = [*MESHES[mesh], "model.n_layers=4"]  # k=2 leaves a scan of two steps
    probe = _setup(over)[-1].buckets[1]  # one layer's bucket
    cfg, par, graphdef, abstract, shardings, plan = _setup(over, probe.bytes * bucket_layers)
    assert plan.layers_per_bucket == bucket_layers
    params = jax.jit(lambda: init_params(cfg.model, 0), out_shardings=shardings)()
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(1), (16, 17), 0, cfg.model.vocab_size), par.batch_sharding
    )
    fn = per_block_grads_fn(graphdef, cfg.model, par.mesh, par.rules, shardings, plan)
    per_block = _jit(par, fn, shardings).lower(params, tokens).compile()
    check_planned_collectives(per_block.as_text(), plan, cfg, dict(par.mesh.shape))
    end = _jit(par, lambda p, t: loss_metrics_and_grads(graphdef, p, t), shardings)
    loss, _, grads = jax.device_get(per_block(params, tokens))
    loss_end, _, grads_end = jax.device_get(end(params, tokens))
    assert loss == loss_end
    assert jax.tree.structure(grads) == jax.tree.structure(grads_end)
    for a, b in leaf_pairs(grads, grads_end):
        np.testing.assert_array_equal(a, b)

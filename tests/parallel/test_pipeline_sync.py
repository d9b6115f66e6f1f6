"""train.grad_sync=per_block with pipeline stages (jaxdist.parallel.pipeline_sync): each stage reduces its
blocks' gradients once, after its last backward; the same gradients as train.grad_sync=end's executor."""

from __future__ import annotations

import jax
import numpy as np

from jaxdist.cluster import load_cluster
from jaxdist.config import load_config
from jaxdist.models import create_abstract, init_params
from jaxdist.parallel.comm import plan_for_config
from jaxdist.parallel.grad_sync import SCOPE
from jaxdist.parallel.hlo import parse_collectives
from jaxdist.parallel.layout import Parallelism
from jaxdist.parallel.pipeline_sync import StageSync
from tests.trees import leaf_pairs

MESH = ["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2"]


def _compiled(over: list[str], options: dict | None = None):
    """(config, plan, {"end": compiled, "per_block": compiled}, params, tokens) of the tiny model, 4 layers."""
    cfg = load_config(None, ["model=tiny", "model.n_layers=4", "train.batch_size=16", "train.seq_len=16", *MESH, *over])
    par = Parallelism.build(cfg)
    graphdef, abstract, names = create_abstract(cfg.model)
    shardings = par.param_shardings(names, abstract)
    plan = plan_for_config(cfg, load_cluster("cpu-8"))
    specs = jax.tree.map(lambda s: s.spec, shardings)
    sync = StageSync(specs, dict(par.mesh.shape), plan.layers_per_bucket, cfg.model.tie_embeddings)
    params = jax.jit(lambda: init_params(cfg.model, 0), out_shardings=shardings)()
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(1), (16, 17), 0, cfg.model.vocab_size), par.batch_sharding
    )
    out = (par.replicated, None, shardings)
    fns = {"end": par.pipeline_grads_fn(cfg), "per_block": par.pipeline_grads_fn(cfg, sync)}
    compiled = {
        k: jax.jit(par.bind(f), in_shardings=(shardings, par.batch_sharding), out_shardings=out)
        .lower(params, tokens)
        .compile(options)
        for k, f in fns.items()
    }
    return cfg, plan, compiled, params, tokens


def _run(compiled, params, tokens):
    return {k: jax.device_get(c(params, tokens)) for k, c in compiled.items()}


def test_one_backward_per_stage_is_bit_identical_to_end_and_reduced_once():
    """gpipe with one microbatch: every stage runs one backward, so reducing once after it sums exactly what
    end's executor reduces after that backward: the same bits.  The program gathers each stage's weights
    once and reduces its layers once, in a conditional inside the tick loop, the plan's bytes."""
    cfg, plan, compiled, params, tokens = _compiled(["train.microbatches=1", "pipeline.schedule=gpipe",
                                                     "train.grad_bucket_bytes=1"])  # fmt: skip
    got = _run(compiled, params, tokens)
    assert got["per_block"][0] == got["end"][0]
    # The same sums: bit-identical, except that XLA:CPU may fuse a weight-gradient dot differently in the two
    # programs and round its vector-remainder rows in another order (seen on an AMD EPYC host: rows 126-127 of
    # w_down's 128, 406 of 32768 elements, 1.5e-7 of the array's largest value).  Anything else is a bug.
    pairs = leaf_pairs(got["per_block"][2], got["end"][2])
    same = sum(int((np.asarray(a) == np.asarray(b)).sum()) for a, b in pairs)
    assert same >= 0.98 * sum(np.asarray(b).size for _, b in pairs)
    for a, b in pairs:
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())

    hlo = parse_collectives(compiled["per_block"].as_text())
    stage_layers = cfg.model.n_layers // 2
    layer = plan.buckets[0]
    assert (
        plan.layers_per_bucket == 1
        and [b.issue_after for b in plan.buckets[: 2 * stage_layers]]
        == ["last backward of stage 1"] * stage_layers + ["last backward of stage 0"] * stage_layers
    )
    # The stage's reductions: in one conditional of the tick loop (its body counts once per tick).
    reduce = [c for c in hlo if SCOPE in c.op_name and c.kind in ("reduce-scatter", "all-reduce") and c.count > 1]
    assert len({c.computation for c in reduce}) == 1
    norms = 2 * cfg.model.d_model * 4
    assert sum(c.bytes for c in reduce if c.kind == "reduce-scatter") == stage_layers * (layer.bytes - norms)
    assert sum(c.bytes for c in reduce if c.kind == "all-reduce") == stage_layers * layer.reduced_bytes
    # No other reduction of a block's weights: end's executor reduces them in every backward unit.
    others = [c for c in hlo if c.kind in ("reduce-scatter", "all-reduce") and c not in reduce and c.count > 1]
    assert not others, others
    # The forward's gathers: each stage's weights once per step, outside the loop.
    gathers = [c for c in hlo if c.kind == "all-gather" and SCOPE not in c.op_name]
    assert {c.count for c in gathers} == {1}
    end = parse_collectives(compiled["end"].as_text())
    assert any(c.kind == "all-reduce" and c.count > 1 and c.bytes >= layer.bytes // 2 for c in end)


def test_microbatches_accumulate_before_the_one_reduction():
    """1f1b over 4 microbatches: each stage sums its microbatches' gradients, then reduces once.  End reduces
    each microbatch's and sums after: the same sum regrouped (rounding only)."""
    # Faster XLA:CPU compiles (both programs alike): the comparison is to a tolerance.
    fast = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
    _, _, compiled, params, tokens = _compiled(["train.microbatches=4", "pipeline.schedule=1f1b"], fast)
    got = _run(compiled, params, tokens)
    np.testing.assert_allclose(got["per_block"][0], got["end"][0], rtol=1e-6)
    for a, b in leaf_pairs(got["per_block"][2], got["end"][2]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6 * np.abs(b).max())

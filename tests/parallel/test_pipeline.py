"""The pipeline executor against the plain (unsharded, non-pipelined) model: loss and every gradient.

The matrix of the issue: p in {2, 4} stages, s in {1, 2, 4} chunks, m in {p, 2p}
microbatches, all three schedules, on 8 CPU devices (the rest of the mesh is
data parallel), plus a pipeline=2 x data=2 x tensor=2 mesh.  Schedules with the
same (p, m, s) share one compiled program: the executor takes the schedule's
tables as arguments (padded to common buffer sizes).  The remat policy and the
chunk boundaries vary between cases, so every policy and unequal chunks
(padded units) are covered without extra compiles.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdist.config import load_config
from jaxdist.models import create_abstract, init_params
from jaxdist.parallel.mesh import build_mesh
from jaxdist.parallel.pipeline import PipelinePlan, pipeline_loss_and_grads, plan_pipeline
from jaxdist.parallel.rules import activation_sharding
from jaxdist.parallel.schedule import build_schedule, executor_tables
from jaxdist.train.step import next_token_loss

BATCH, SEQ = 16, 8
RTOL = 1e-5
# Faster XLA:CPU compiles for tests; the numbers do not depend on it.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
REMATS = ("none", "full", "save:attn_context,mlp_out", "dots_saveable")


@pytest.fixture(scope="module")
def setup():
    cfg = load_config(None, ["model=tiny", "model.n_layers=4"])
    graphdef, _, _ = create_abstract(cfg.model)
    params = jax.jit(lambda: init_params(cfg.model))()
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, cfg.model.vocab_size)
    loss, grads = jax.jit(jax.value_and_grad(lambda p, t: next_token_loss(graphdef, p, t)))(params, tokens)
    return cfg, params, tokens, loss, grads


def shared_plan(model, p, m, s, kinds, bounds=None, seq=SEQ):
    """One plan whose buffers fit every kind's schedule; and each kind's tables, padded to it."""
    tabs = {k: executor_tables(build_schedule(p, m, s, k)) for k in kinds}
    size = [max(getattr(t, f) for t in tabs.values()) for f in ("slots", "act_buffers", "grad_buffers", "n_ticks")]
    tabs = {k: t.padded(*size) for k, t in tabs.items()}
    base = plan_pipeline(model, p, m, seq, kinds[-1], s, "equal")
    plan = PipelinePlan(base.schedule, next(iter(tabs.values())), bounds or base.bounds)
    return plan, tabs


def check_close(loss, grads, ref_loss, ref_grads):
    assert abs(float(loss) - float(ref_loss)) <= RTOL * abs(float(ref_loss))
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    rel = jax.tree.map(
        lambda g, r: float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / np.max(np.abs(np.asarray(r)))),
        grads,
        ref_grads,
    )
    bad = {jax.tree_util.keystr(k): e for k, e in jax.tree_util.tree_leaves_with_path(rel) if not e <= RTOL}
    assert not bad, bad


def run_cases(setup, mesh_overrides, p, m, s, remat, bounds=None):
    cfg, params, tokens, ref_loss, ref_grads = setup
    kinds = ("gpipe", "1f1b", "seq1f1b") if s == 1 else ("seq1f1b",)
    if m < p:
        kinds = tuple(k for k in kinds if k != "1f1b")
    plan, tabs = shared_plan(cfg.model, p, m, s, kinds, bounds)
    mesh_cfg = load_config(None, [f"mesh.pipeline={p}"] + mesh_overrides).mesh
    mesh = build_mesh(mesh_cfg, jax.devices())

    def step(params, tokens, table, unit_slot):
        return pipeline_loss_and_grads(
            params,
            tokens,
            model=cfg.model,
            mesh=mesh,
            plan=plan,
            remat=remat,
            with_trace=True,
            tables=(table, unit_slot),
        )

    table0 = tabs[kinds[0]]
    with activation_sharding(mesh):
        compiled = (
            jax.jit(step)
            .lower(params, tokens, table0.stacked(), table0.unit_slot.astype(np.int32))
            .compile(FAST_COMPILE)
        )
    for kind in kinds:
        tab = tabs[kind]
        loss, grads, trace = compiled(params, tokens, tab.stacked(), tab.unit_slot.astype(np.int32))
        check_close(loss, grads, ref_loss, ref_grads)
        # The executed timeline is the schedule's: same branches, same bubble.
        np.testing.assert_array_equal(np.asarray(trace), tab.branch.T)
        sch = build_schedule(p, m, s, kind)
        busy = np.asarray(trace)[:, : sch.n_ticks] != 0
        assert 1 - busy.mean() == pytest.approx(sch.bubble_fraction())
    return kinds


MATRIX = [(p, s, m) for p in (2, 4) for s in (1, 2, 4) for m in (p, 2 * p)]


@pytest.mark.parametrize("p,s,m", MATRIX, ids=[f"p{p}-s{s}-m{m}" for p, s, m in MATRIX])
def test_pipeline_equals_plain_model(setup, p, s, m):
    remat = REMATS[MATRIX.index((p, s, m)) % len(REMATS)]
    # Unequal chunks (units padded to the longest) when m = 2p.
    bounds = {2: (0, 5, 8), 4: (0, 3, 5, 7, 8)}.get(s) if m == 2 * p else None
    kinds = run_cases(setup, [], p, m, s, remat, bounds)
    assert len(kinds) == (3 if s == 1 else 1)


@pytest.mark.parametrize(
    "mesh,s,m",
    [
        (["mesh.data=2", "mesh.tensor=2"], 1, 2),
        (["mesh.data=2", "mesh.tensor=2"], 2, 4),
        (["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"], 2, 2),
    ],
    ids=["data2-tensor2-s1", "data2-tensor2-s2", "fsdp2-tensor2-s2"],
)
def test_pipeline_with_data_fsdp_tensor_axes(setup, mesh, s, m):
    run_cases(setup, mesh, 2, m, s, "none")


def test_plan_and_mesh_must_agree(setup):
    cfg, params, tokens, _, _ = setup
    mesh = build_mesh(load_config(None, ["mesh.pipeline=2"]).mesh, jax.devices())
    plan = plan_pipeline(cfg.model, 4, 4, SEQ, "1f1b")
    with pytest.raises(ValueError, match="the plan has 4 stages but the mesh's pipeline axis has 2"):
        pipeline_loss_and_grads(params, tokens, model=cfg.model, mesh=mesh, plan=plan)
    moe = load_config(None, ["model=moe-tiny", "model.moe.dispatch=capacity", "pipeline.schedule=1f1b"]).model
    with pytest.raises(ValueError, match="a sequence chunk would drop other tokens"):
        plan = plan_pipeline(cfg.model, 2, 2, SEQ, "seq1f1b", 2)
        pipeline_loss_and_grads(params, tokens, model=moe, mesh=mesh, plan=plan)

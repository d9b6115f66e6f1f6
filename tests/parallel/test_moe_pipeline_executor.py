"""An MoE model on the 1f1b and seq1f1b pipeline executor (jaxdist/parallel/pipeline.py, pipeline_stage.py):
the objective, every gradient and every router figure against the same model on one device running the same
microbatches one after the other (jaxdist.train.step.loss_metrics_and_grads), fp32, 1e-5 relative.

The router losses weigh 100x their defaults here (aux 1.0, z 0.1), so that a wrong share of them in the
gradients shows at 1e-5: the first test checks that they do.  A model of 4 blocks in groups of 2 (a dense block,
then an MoE block), so a stage holds one group of each kind.

Two ways to run a stage's experts are covered: XLA partitions them over the automatic axes inside the stage
(``pipeline_loss_and_grads`` as called here, and capacity dispatch), or the stage is manual over the axes the
planned dispatch splits the tokens and experts over (dropless dispatch in a Trainer, jaxdist.parallel.
pipeline_sync: the all-to-all over ``expert``, the gradients reduced once, after the stage's last backward)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdist.cluster import load_cluster
from jaxdist.config import ConfigError, load_config
from jaxdist.data.documents import pack
from jaxdist.models import create_abstract, init_params
from jaxdist.parallel.comm import plan_for_config
from jaxdist.parallel.grad_sync import SCOPE
from jaxdist.parallel.hlo import parse_collectives
from jaxdist.parallel.layout import Parallelism
from jaxdist.parallel.mesh import build_mesh
from jaxdist.parallel.pipeline import check_router_order, pipeline_loss_and_grads
from jaxdist.parallel.rules import activation_sharding
from jaxdist.parallel.schedule import build_schedule
from jaxdist.train.step import loss_metrics_and_grads
from tests.parallel.test_pipeline import FAST_COMPILE, shared_plan

BATCH, SEQ = 8, 16
MODEL = ["model=moe-tiny", "model.n_layers=4", "model.moe.every=2", "model.moe.aux_loss_coef=1.0",
         "model.moe.z_loss_coef=0.1"]  # fmt: skip


def reference(model, micro: int, tokens, packed: bool = False):
    """(params, (objective, metrics, grads)) of the model on one device, ``micro`` microbatches in turn."""
    graphdef, _, _ = create_abstract(model)
    params = jax.jit(lambda: init_params(model))()
    one = jax.devices()[0]
    fn = jax.jit(lambda p, t: loss_metrics_and_grads(graphdef, p, t, micro, packed))
    return params, fn(jax.device_put(params, one), jax.device_put(tokens, one))


def tokens_for(model):
    return jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, model.vocab_size)


def check(got, want) -> None:
    """(objective, metrics, grads) against the reference's: the objective, every router figure per block and
    every gradient leaf within 1e-5 relative (a leaf's error relative to its largest magnitude)."""
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = got, want
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert jax.tree.structure(metrics) == jax.tree.structure(ref_metrics)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(metrics), jax.tree.leaves(ref_metrics)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        a, b = np.asarray(a), np.asarray(b)
        err = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        assert err <= 1e-5, (jax.tree_util.keystr(path), err)


CASES = [
    # (schedules sharing one program, chunks, microbatches, mesh, extra model settings, remat)
    (("gpipe", "1f1b"), 1, 2, ["mesh.data=2", "mesh.expert=2"], [], "none"),
    (
        ("1f1b",),
        1,
        4,
        ["mesh.data=2", "mesh.expert=2"],
        ["model.moe.dispatch=capacity", "model.moe.capacity_factor=1.0"],
        "full",
    ),  # fmt: skip
    (
        ("seq1f1b",),
        2,
        2,
        ["mesh.fsdp=2", "mesh.tensor=2", "mesh.data=1"],
        ["model.moe.router=sigmoid", "model.moe.shared_d_ff=32"],
        "full",
    ),  # fmt: skip
    (("seq1f1b",), 4, 4, ["mesh.data=2", "mesh.expert=2"], [], "save:attn_context,mlp_out"),
]


@pytest.mark.parametrize("kinds,s,m,mesh,extra,remat", CASES, ids=["gpipe+1f1b", "1f1b-capacity", "seq1f1b-s2",
                                                                 "seq1f1b-s4"])  # fmt: skip
def test_moe_executor_equals_the_microbatched_model(kinds, s, m, mesh, extra, remat):
    """pipeline=2 with the experts left to XLA inside the stages: each schedule's objective, metrics and
    gradients against one device; capacity dispatch drops assignments in both alike."""
    schedule = [f"pipeline.schedule={kinds[-1]}", f"pipeline.chunks={s}", f"train.microbatches={m}"]
    cfg = load_config(None, [*MODEL, *extra, "mesh.pipeline=2", *mesh, *schedule])
    model = cfg.model
    tokens = tokens_for(model)
    params, want = reference(model, m, tokens)
    plan, tabs = shared_plan(model, 2, m, s, kinds, seq=SEQ)
    device_mesh = build_mesh(cfg.mesh, jax.devices())

    def step(params, tokens, table, unit_slot):
        loss, grads, metrics = pipeline_loss_and_grads(
            params, tokens, model=model, mesh=device_mesh, plan=plan, remat=remat, tables=(table, unit_slot),
            with_metrics=True,
        )  # fmt: skip
        return loss, metrics, grads

    first = tabs[kinds[0]]
    with activation_sharding(device_mesh):
        compiled = jax.jit(step).lower(params, tokens, first.stacked(), first.unit_slot.astype(np.int32))
        compiled = compiled.compile(FAST_COMPILE)
    for kind in kinds:
        check(compiled(params, tokens, tabs[kind].stacked(), tabs[kind].unit_slot.astype(np.int32)), want)
    if "model.moe.dispatch=capacity" in extra:
        assert float(want[1]["moe_drop_rate"]) > 0.05


def test_the_router_losses_weigh_in_the_gradients():
    """The router losses at this file's weights change the router's gradient by far more than the tests' 1e-5,
    so a wrong share of them (the counts of one chunk rather than of the microbatch, a missing 1/m) fails."""
    base = load_config(None, MODEL).model
    plain = load_config(None, [*MODEL, "model.moe.aux_loss_coef=0", "model.moe.z_loss_coef=0"]).model
    tokens = tokens_for(base)
    _, (_, _, with_losses) = reference(base, 2, tokens)
    _, (_, _, without) = reference(plain, 2, tokens)
    a, b = np.asarray(with_losses["layers"]["router"]), np.asarray(without["layers"]["router"])
    assert np.max(np.abs(a - b)) / np.max(np.abs(a)) > 1e-2


def test_a_backward_before_the_microbatchs_last_forward_is_refused():
    """The load-balancing loss needs a microbatch's counts whole by its first backward: every schedule the
    executor runs keeps that order, and one that would not is refused in one sentence."""
    for kind, s in (("gpipe", 1), ("1f1b", 1), ("seq1f1b", 2), ("seq1f1b", 4)):
        check_router_order(build_schedule(2, 4, s, kind))
    good = build_schedule(2, 2, 2, "seq1f1b")
    grid = [list(row) for row in good.grid]
    f1 = next(t for t, row in enumerate(grid) if row[1] is not None and row[1].op == "F" and row[1].chunk == 1)
    b0 = next(t for t, row in enumerate(grid) if row[1] is not None and row[1].op == "B")
    grid[f1][1], grid[b0][1] = grid[b0][1], grid[f1][1]  # stage 1: microbatch 0's backward before a forward
    bad = type(good)(good.kind, good.stages, good.microbatches, good.chunks, tuple(tuple(r) for r in grid))
    with pytest.raises(ValueError) as e:
        check_router_order(bad)
    msg = str(e.value)
    assert "runs a backward of microbatch 0 on stage 1 before its last forward there" in msg, msg
    assert msg.count(". ") == 0 and msg.endswith(".")


# --------------------------------------------------------------------------- the planned dispatch in the stages


def test_packed_documents_on_moe_stages_equal_one_device():
    """data.packing=documents on seq1f1b MoE stages (the planned dispatch inside, data=2 x expert=2): each
    chunk attends within its documents, the cross-entropy is the mean over the batch's targets, and the router
    losses are every microbatch's tokens' (the padding's too, as on one device)."""
    cfg = load_config(
        None,
        [*MODEL, "mesh.pipeline=2", "mesh.data=2", "mesh.expert=2", "pipeline.schedule=seq1f1b", "pipeline.chunks=2",
         "train.microbatches=2", f"train.batch_size={BATCH}", f"train.seq_len={SEQ}", "data.packing=documents"],
    )  # fmt: skip
    rng = np.random.default_rng(5)
    lengths = rng.integers(2, 12, 60)
    docs = [rng.integers(0, cfg.model.vocab_size, n).astype(np.int32) for n in lengths]
    packed = pack(np.concatenate([[0], np.cumsum(lengths)[:-1]]), int(lengths.sum()), SEQ)
    rows = packed.read(np.concatenate(docs).astype(np.uint16), np.arange(BATCH))
    params, want = reference(cfg.model, 2, rows, packed=True)
    par = Parallelism.build(cfg)
    graphdef, abstract, names = create_abstract(cfg.model)
    shardings = par.param_shardings(names, abstract)
    fn = par.grads_fn(cfg, graphdef, shardings, plan_for_config(cfg, load_cluster(cfg.mesh.cluster)))
    step = jax.jit(par.bind(fn), in_shardings=(shardings, par.batch_sharding),
                   out_shardings=(par.replicated, par.replicated, shardings))  # fmt: skip
    check(step(jax.device_put(params, shardings), jax.device_put(rows, par.batch_sharding)), want)


ROWS = [
    ("1f1b", 1, ["mesh.fsdp=2", "mesh.expert=2", "mesh.data=1"], "end"),
    ("seq1f1b", 2, ["mesh.data=2", "mesh.expert=2", "mesh.fsdp=1"], "end"),
    ("seq1f1b", 4, ["mesh.fsdp=2", "mesh.expert=2", "mesh.data=1"], "per_block"),
]


@pytest.mark.parametrize("kind,s,mesh,sync", ROWS, ids=["1f1b-fsdp2-expert2", "seq1f1b-data2-expert2",
                                                       "seq1f1b-fsdp2-expert2-per_block"])  # fmt: skip
def test_moe_stages_with_the_planned_dispatch_equal_one_device(kind, s, mesh, sync):
    """The Trainer's gradient path for pipeline=2 with dropless dispatch on data or fsdp x expert: manual over
    them inside the stages, the all-to-all over expert, the weights' gradients reduced once after the stage's
    last backward (outside the tick loop's trips), against one device."""
    cfg = load_config(
        None,
        [*MODEL, "mesh.pipeline=2", *mesh, f"pipeline.schedule={kind}", f"pipeline.chunks={s}",
         "train.microbatches=2", f"train.batch_size={BATCH}", f"train.seq_len={SEQ}", f"train.grad_sync={sync}"],
    )  # fmt: skip
    par = Parallelism.build(cfg)
    graphdef, abstract, names = create_abstract(cfg.model)
    shardings = par.param_shardings(names, abstract)
    fn = par.grads_fn(cfg, graphdef, shardings, plan_for_config(cfg, load_cluster(cfg.mesh.cluster)))
    tokens = tokens_for(cfg.model)
    params, want = reference(cfg.model, 2, tokens)
    step = jax.jit(
        par.bind(fn),
        in_shardings=(shardings, par.batch_sharding),
        out_shardings=(par.replicated, par.replicated, shardings),
    )
    lowered = step.lower(jax.device_put(params, shardings), jax.device_put(tokens, par.batch_sharding))
    compiled = lowered.compile(FAST_COMPILE)
    check(compiled(jax.device_put(params, shardings), jax.device_put(tokens, par.batch_sharding)), want)
    collectives = parse_collectives(compiled.as_text())
    assert any(c.kind == "all-to-all" for c in collectives)  # the planned dispatch, inside the stages
    # Inside the tick loop (count > 1: its trips) the weights' reductions sit in the grad_sync scope, under the
    # condition of the stage's last backward (once a step); besides them only the router's counts are
    # all-reduced, E floats per MoE block a forward.
    loop = [c for c in collectives if c.kind in ("all-reduce", "reduce-scatter") and c.count > 1]
    planned = [c for c in loop if SCOPE in c.op_name]
    assert planned and any(c.kind == "reduce-scatter" for c in planned) == ("mesh.fsdp=2" in mesh)
    others = [(c.kind, c.bytes) for c in loop if c not in planned]
    assert others and set(others) == {("all-reduce", 4 * cfg.model.moe.experts)}, others


def test_what_the_moe_stages_refuse():
    """Each in one sentence, before anything runs: capacity dispatch on sequence chunks (a chunk would drop other
    tokens than its microbatch), fsdp with expert where XLA partitions the experts (its partitioner aborts the
    process there), per_block on gpipe stages and with capacity dispatch."""
    cases = {
        "a sequence chunk would drop other tokens than its whole microbatch does": [
            "pipeline.schedule=seq1f1b", "pipeline.chunks=2", "model.moe.dispatch=capacity"],
        "whose partitioner fails on mesh.fsdp=2 with mesh.expert=2": [
            "pipeline.schedule=1f1b", "mesh.fsdp=2", "mesh.expert=2", "model.moe.dispatch=capacity"],
        "train.grad_sync=per_block does not run an MoE model's gpipe stages": [
            "pipeline.schedule=gpipe", "train.grad_sync=per_block"],
        "train.grad_sync=per_block runs an MoE model's pipeline stages with dropless dispatch only": [
            "pipeline.schedule=1f1b", "train.grad_sync=per_block", "model.moe.dispatch=capacity"],
    }  # fmt: skip
    for want, over in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(None, [*MODEL, "mesh.pipeline=2", "train.microbatches=2", *over])
        msg = str(e.value)
        assert want in msg, msg
        assert msg.count(". ") == 0 and msg.endswith(".")

"""Pipeline executor: one jitted program that runs a schedule over the ``pipeline`` mesh axis.

The stacked ``layers`` axis of the parameters is sharded over ``pipeline``
(logical ``layers`` -> mesh ``pipeline`` in DEFAULT_RULES), so stage k holds
blocks ``k*L/p .. (k+1)*L/p - 1``.  :func:`pipeline_loss_and_grads` runs
``shard_map`` manual over ``pipeline`` only: inside each stage the ``data``,
``fsdp`` and ``tensor`` axes stay automatic, so the model's logical sharding
(batch over data/fsdp, heads and MLP over tensor, weights over fsdp) applies
within the stage exactly as without a pipeline.

The program is a ``lax.scan`` over the ticks of a :class:`~jaxdist.parallel.
schedule.Schedule` (the per-stage body is :mod:`jaxdist.parallel.pipeline_stage`).
At each tick every stage first delivers the previous tick's output with
``ppermute`` (an activation to the next stage, a gradient to the previous one;
a receiving stage keeps it in a small receive buffer until its schedule
consumes it), then looks up its action in the :class:`~jaxdist.parallel.
schedule.ExecutorTables` and runs one branch of a ``lax.switch``: idle, forward
of chunk c, or backward of chunk c.

* Forward of a unit: each block runs :func:`~jaxdist.models.transformer.
  block_forward_cached` under ``jax.vjp`` with the remat policy, and the
  residuals the policy keeps are written to the unit's *stash slot*.  Residuals
  that are the weights themselves, the rotary tables, or earlier chunks'
  keys/values are not stored: the backward supplies them again.  Chunk c's
  rotated keys and values go to a key/value stash that later chunks of the
  same microbatch read (seq1f1b only).  The last stage also runs the model's
  head (final norm, output projection) and per-token cross-entropy
  (``jaxdist.models.transformer.head``, ``token_cross_entropy``), forward and
  backward, and keeps the gradient of its output for the unit's backward.
* Backward of a unit: the stored residuals are put back into the vjp and the
  blocks are run backward (reverse scan).  Gradients of earlier chunks'
  keys/values accumulate in a buffer that their own backwards (which come
  later: reverse chunk order) add to their keys'/values' cotangents.

What a unit stashes is what the remat policy saves (``none``: every tagged
intermediate; ``full``: each block's input), so activation memory is slots x
per-unit residuals: p microbatches on stage 0 for 1f1b, s+p-1 chunks for
seq1f1b.  Units are padded to the longest chunk so every slot has one shape.
The loss is the mean next-token cross-entropy over the global batch, and the
gradients equal the non-pipelined model's (tests compare to 1e-5).

An MoE model's blocks (groups of ``moe.every`` blocks, the last an MoE block; a stage holds whole groups) run
the same way; its experts are XLA's to partition over the automatic axes inside a stage.  The router's losses
are a microbatch's, as in ``jaxdist.train.step.loss_metrics_and_grads``: the mean over the microbatches of
``aux_loss_coef`` x load-balancing loss + ``z_loss_coef`` x z-loss, each a mean over the MoE blocks.  A sequence
chunk adds its router's sums (probabilities and assignments per expert, logsumexp squares) to its microbatch's;
the load-balancing loss E x sum_e share_e x P_e takes no gradient through share_e (the assignments' share), so a
chunk's backward needs only the microbatch's counts, which are whole by then: every stage runs all of a
microbatch's forwards before its first backward (:func:`check_router_order`).  The losses are then formed from
the microbatch's sums, equal to the unpipelined model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdist.config import MOE_CAPACITY_CHUNKS, ConfigError, ModelConfig, Remat
from jaxdist.models.moe import MOE_METRICS, summarize_microbatches
from jaxdist.models.packed import target_count
from jaxdist.parallel.chunks import chunk_boundaries, chunk_cost_model
from jaxdist.parallel.pipeline_stage import AXIS, run_stage, stage_remat_policy
from jaxdist.parallel.pipeline_sync import StageSync
from jaxdist.parallel.rules import DEFAULT_RULES, Rules, constrain
from jaxdist.parallel.schedule import ExecutorTables, Schedule, build_schedule, executor_tables


def check_router_order(schedule: Schedule) -> None:
    """ValueError unless every stage runs all of a microbatch's forwards before its first backward: an MoE
    block's load-balancing loss needs the microbatch's counts per expert (jaxdist.parallel.pipeline_stage)."""
    for k in range(schedule.stages):
        last_f, first_b = {}, {}
        for t, row in enumerate(schedule.grid):
            a = row[k]
            if a is not None:
                (last_f if a.op == "F" else first_b).setdefault(a.microbatch, []).append(t)
        for mb, ticks in first_b.items():
            if min(ticks) < max(last_f[mb]):
                raise ValueError(
                    f"the {schedule.kind} schedule runs a backward of microbatch {mb} on stage {k} before its last "
                    "forward there, which an MoE block's load-balancing loss cannot follow: use gpipe, 1f1b or seq1f1b."
                )


@dataclass(frozen=True)
class PipelinePlan:
    """A schedule, its executor tables and the chunk boundaries (token positions, ``chunks + 1``)."""

    schedule: Schedule
    tables: ExecutorTables
    bounds: tuple[int, ...]

    @property
    def chunk_lengths(self) -> tuple[int, ...]:
        """Tokens in each chunk."""
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))


def plan_pipeline(
    model: ModelConfig,
    stages: int,
    microbatches: int,
    seq_len: int,
    kind: str = "seq1f1b",
    chunks: int = 1,
    split: str = "cost",
) -> PipelinePlan:
    """Schedule, tables and chunk boundaries for a model on ``stages`` stages (ValueError if impossible)."""
    schedule = build_schedule(stages, microbatches, chunks, kind)
    bounds = chunk_boundaries(seq_len, chunks, chunk_cost_model(model), split)
    return PipelinePlan(schedule, executor_tables(schedule), bounds)


# --------------------------------------------------------------------------- executor


def pipeline_loss_and_grads(
    params: dict,
    tokens: jax.Array,
    *,
    model: ModelConfig,
    mesh,
    plan: PipelinePlan,
    remat: str | Remat = "none",
    rules: Rules = DEFAULT_RULES,
    with_trace: bool = False,
    tables: tuple[jax.Array, jax.Array] | None = None,
    sync: StageSync | None = None,
    packed: bool = False,
    with_metrics: bool = False,
):
    """(mean next-token loss, grads) of ``tokens`` [B, T+1], run as a pipeline over ``mesh``'s pipeline axis.

    ``params`` is the model's pure parameter dict (``init_params``); the grads
    have the same structure.  The batch is split into the plan's microbatches
    (microbatch i holds rows i, i+m, i+2m, ..., as in ``loss_and_grads``).
    With ``with_trace`` a third output [stages, ticks] int32 records the branch
    each stage executed at each tick (0 idle, 1+c forward of chunk c, 1+s+c
    backward of chunk c).  Call under ``jax.jit``.

    ``tables``: (``ExecutorTables.stacked()``, ``unit_slot``) as arrays, to run
    another schedule of the same stages, microbatches and chunks with this
    compiled program (pass them as jit arguments; their buffer sizes must be
    the plan's, see ``ExecutorTables.padded``).  By default the plan's tables
    are constants of the program.

    ``sync``: a :class:`~jaxdist.parallel.pipeline_sync.StageSync` (``train.grad_sync=per_block``, and an MoE
    model's stages with the planned dispatch inside): the stages run manual over its rows' axes (data, fsdp, and
    expert for an MoE model) too and reduce their gradients once, after their last backward.

    ``packed``: rows packed from documents (data.packing=documents, jaxdist.models.packed): the loss is the mean
    over their targets, and each chunk attends within its documents (the key/value cache of the earlier chunks
    carries their segments).

    An MoE model's loss is its objective: the cross-entropy plus the router losses (module docstring).
    ``with_metrics``: a last output, the metrics ``jaxdist.train.step.objective`` gives ({} for a dense model;
    for an MoE model the cross-entropy as ``loss``, the router's figures and ``moe_layers``).
    """
    sch = plan.schedule
    p, m = sch.stages, sch.microbatches
    if dict(mesh.shape).get(AXIS, 1) != p:
        raise ValueError(f"the plan has {p} stages but the mesh's pipeline axis has {dict(mesh.shape).get(AXIS, 1)}.")
    if model.moe.experts:
        check_router_order(sch)
        if sch.chunks > 1 and model.moe.dispatch == "capacity":
            raise ValueError(MOE_CAPACITY_CHUNKS)
    b, t1 = tokens.shape
    assert b % m == 0 and t1 - 1 == plan.bounds[-1], (tokens.shape, m, plan.bounds)
    mb_tokens = constrain(tokens.reshape(b // m, m, t1).swapaxes(0, 1), (None, "batch", "seq"))
    shared = {k: v for k, v in params.items() if k != "layers"}
    if tables is None:
        tables = (jnp.asarray(plan.tables.stacked()), jnp.asarray(plan.tables.unit_slot, jnp.int32))
    if sync is None:
        specs, manual = (P(AXIS), P(), P()), {AXIS}
    else:  # StageSync: its rows' axes manual too (the rules inside name only the automatic axes)
        specs, manual = sync.in_specs(), set(sync.manual)
        rules = tuple((name, tuple(a for a in axes if a not in manual)) for name, axes in rules)
    n_tokens = target_count(tokens) if packed else jnp.float32(b * (t1 - 1))
    body = partial(run_stage, model=model, plan=plan, remat=remat, rules=rules, packed=packed, sync=sync)
    out_specs = (P(), specs[0], specs[1], P(AXIS))
    if model.moe.experts:  # per microbatch and MoE block, the router's figures: [m, MoE blocks, ...]
        out_specs += (P(None, AXIS),)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(*specs, P(), P()),
        out_specs=out_specs,
        axis_names=manual,
        check_vma=False,
    )
    loss, g_layers, g_shared, trace, *router = fn(params["layers"], shared, mb_tokens, tables, n_tokens)
    grads = dict(g_shared, layers=g_layers)
    metrics = {}
    if router:  # the objective adds the router losses, as jaxdist.train.step.objective does
        aux = summarize_microbatches(router[0], model)
        metrics = {"loss": loss, **{k: aux[k] for k in MOE_METRICS}, "moe_layers": aux["moe_layers"]}
        loss = loss + aux["moe_loss"]
    out = (loss, grads, trace) if with_trace else (loss, grads)
    return (*out, metrics) if with_metrics else out


def pipeline_plan_for(config) -> PipelinePlan:
    """The plan of a whole Config (``mesh.pipeline`` stages, ``[pipeline]``, ``train.microbatches`` as
    pipeline microbatches, ``train.remat`` checked for the stages); ConfigError if it cannot run."""
    t = config.train
    p = config.pipeline
    chunks = p.chunks if p.schedule == "seq1f1b" else 1
    try:
        plan = plan_pipeline(
            config.model, config.mesh.pipeline, t.microbatches, t.seq_len, p.schedule, chunks, p.chunk_split
        )
        stage_remat_policy(t.remat_spec, chunks)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return plan


def pipeline_grads_fn(
    config, mesh, rules: Rules = DEFAULT_RULES, plan: PipelinePlan | None = None, sync: StageSync | None = None
) -> Callable:
    """``fn(params, tokens) -> (loss, {}, grads)`` for a whole Config with ``plan`` (default
    :func:`pipeline_plan_for`) and per_block's ``sync`` (or None); the Trainer uses it when mesh.pipeline > 1."""
    t = config.train
    plan = plan or pipeline_plan_for(config)

    def fn(params, tokens):
        loss, grads, metrics = pipeline_loss_and_grads(
            params,
            tokens,
            model=config.model,
            mesh=mesh,
            plan=plan,
            remat=t.remat_spec,
            rules=rules,
            sync=sync,
            packed=config.data.packing == "documents",
            with_metrics=True,
        )
        return loss, metrics, grads

    fn.plan = plan
    return fn

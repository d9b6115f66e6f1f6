"""One parallelism value: how a training job uses its devices.

:class:`Parallelism` holds the mesh, the logical-axis rules, the MoE expert
layout and the pipeline plan of one job, and answers the questions the Trainer
asks of them: the sharding of an array with logical axis names, the shardings
of the parameters and of a batch, and the step's gradient path (``train.grad_sync``, the pipeline).

It also applies itself to the model: :meth:`Parallelism.bind` wraps a pure
function so that, while it traces, the model's activations are constrained on
this mesh by these rules and its MoE layers dispatch their experts by this
layout (:mod:`jaxdist.models.hooks`).  The contexts are entered inside the
function that is jitted, so every trace of it sees them and no caller has to
hold a context around its calls::

    par = Parallelism.build(config, jax.devices())
    step = jax.jit(par.bind(train_step), in_shardings=(..., par.batch_sharding))
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.parallel.context import context_parallelism
from jaxdist.parallel.grad_sync import per_block_grads_fn
from jaxdist.parallel.mesh import build_mesh, mesh_devices
from jaxdist.parallel.moe import ExpertLayout, expert_layout, expert_parallelism, stage_row_axes
from jaxdist.parallel.ordered_sum import ordered_grads_fn
from jaxdist.parallel.pipeline import PipelinePlan, pipeline_grads_fn, pipeline_plan_for
from jaxdist.parallel.pipeline_sync import StageSync
from jaxdist.parallel.rules import DEFAULT_RULES, Rules, activation_sharding, logical_to_spec


@contextlib.contextmanager
def sharded_tracing(mesh: Mesh, rules: Rules = DEFAULT_RULES, layout: ExpertLayout | None = None) -> Iterator[None]:
    """Within this block, a model being traced constrains its activations on ``mesh`` by ``rules``, runs its
    attention as a ring when ``mesh`` has a context axis (jaxdist.parallel.context) and dispatches its MoE experts by ``layout`` (None: the default layout of ``mesh``, all of ``tensor`` per expert).

    For code that traces through another API (a profiler's ``trace_context``,
    ``jit(...).lower``); a jitted function should use :meth:`Parallelism.bind`.
    """
    with activation_sharding(mesh, rules), context_parallelism(mesh, rules), expert_parallelism(layout):
        yield


@dataclass(frozen=True)
class Parallelism:
    """Mesh, logical rules, expert layout and pipeline plan of one job.

    ``mesh``: the devices with axes data, fsdp, context, tensor, expert, pipeline;
    ``rules``: logical axis name -> mesh axes (jaxdist.parallel.rules);
    ``expert_layout``: where MoE experts live (jaxdist.parallel.moe);
    ``pipeline``: the stage schedule when mesh.pipeline > 1, else None.
    """

    mesh: Mesh
    rules: Rules
    expert_layout: ExpertLayout
    pipeline: PipelinePlan | None = None

    @classmethod
    def build(cls, config, devices: Sequence[Any] | None = None, own_model: bool = False) -> Parallelism:
        """The parallelism of a whole Config on ``devices`` (default all); ConfigError if the config cannot run.
        ``own_model``: a user's model, whose stages run its own stack (jaxdist.parallel.pipeline_blocks), so no
        plan of jaxdist's transformer's stages is made.  Where the stages run by autodiff (a user's model, an
        MoE model's gpipe stages), the layers outside the stack take their rows over the stages too (``batch``
        maps to ``pipeline`` as well), so no stage repeats them."""
        # A mesh smaller than the devices (every axis size given) runs on the first ones, as resolve() chose.
        mesh = build_mesh(config.mesh, mesh_devices(config.mesh, devices if devices is not None else jax.devices()))
        rules = DEFAULT_RULES
        by_autodiff = own_model or (config.model.moe.experts and config.pipeline.schedule == "gpipe")
        if config.mesh.pipeline > 1 and by_autodiff:
            rules = tuple((n, (*a, "pipeline") if n == "batch" else a) for n, a in rules)
        return cls.for_mesh(
            mesh,
            rules,
            config.mesh.expert_tensor,
            pipeline_plan_for(config) if config.mesh.pipeline > 1 and not own_model else None,
        )

    @classmethod
    def for_mesh(
        cls, mesh: Mesh, rules: Rules = DEFAULT_RULES, expert_tensor: int = 0, pipeline: PipelinePlan | None = None
    ) -> Parallelism:
        """The parallelism of an already built mesh, ``expert_tensor`` devices per expert (0: all of ``tensor``)."""
        return cls(mesh, rules, expert_layout(mesh, expert_tensor, rules), pipeline)

    # ------------------------------------------------------------------ shardings

    def sharding(self, logical: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
        """NamedSharding on the mesh for an array with these logical axis names (and this shape, if given)."""
        return NamedSharding(self.mesh, logical_to_spec(logical, self.rules, self.mesh, shape))

    def param_sharding(self, logical: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
        """Sharding of a parameter: on the expert view of the devices if it has an ``expert`` dimension."""
        return self.expert_layout.sharding(logical, shape, self.rules, self.mesh)

    def param_shardings(self, names: Any, abstract_params: Any) -> Any:
        """Shardings of a parameter tree from its logical names (``create_abstract``'s third output), same tree."""
        return jax.tree.map(
            lambda n, a: self.param_sharding(n, a.shape), names, abstract_params, is_leaf=lambda x: isinstance(x, tuple)
        )

    @property
    def batch_sharding(self) -> NamedSharding:
        """Sharding of a token batch [B, T+1]: examples over every data-parallel axis (T+1 tokens do not split
        over ``context``; the model's activations are split there)."""
        return self.sharding(("batch", None))

    @property
    def replicated(self) -> NamedSharding:
        """A full copy on every device (scalars, metrics)."""
        return NamedSharding(self.mesh, PartitionSpec())

    # ------------------------------------------------------------------ applying it

    def bind(self, fn: Callable) -> Callable:
        """``fn`` that traces with this parallelism applied to the model (see :func:`sharded_tracing`); jit the result."""

        @functools.wraps(fn)
        def bound(*args, **kwargs):
            with sharded_tracing(self.mesh, self.rules, self.expert_layout):
                return fn(*args, **kwargs)

        return bound

    def grads_fn(self, config, graphdef: Any, param_shardings: Any, comm_plan: Any) -> Callable | None:
        """The step's gradient path for ``config.train.grad_sync`` (None: the model's own value_and_grad, the
        collectives XLA places): ``ordered`` sums fixed units in one binary tree (jaxdist.parallel.ordered_sum);
        ``per_block`` reduces each block's gradients as its backward ends, by ``comm_plan``'s buckets (through
        the pipeline's stages when there is one, jaxdist.parallel.pipeline_sync; else
        jaxdist.parallel.grad_sync); with a pipeline, the pipeline executor."""
        t = config.train
        if t.grad_sync == "ordered":
            return ordered_grads_fn(graphdef, self.mesh, self.rules, param_shardings, t.grad_unit_rows)
        # Each stage reduces after its last backward: per_block's, and an MoE model's stages whose planned
        # dispatch runs inside them (manual over its axes, jaxdist.parallel.pipeline_sync) under either setting.
        moe_rows = self.pipeline is not None and bool(stage_row_axes(self.expert_layout, config.model))
        if self.pipeline is not None and (t.grad_sync == "per_block" or moe_rows):
            specs = jax.tree.map(lambda s: s.spec, param_shardings)
            model = config.model
            sync = StageSync(specs, dict(self.mesh.shape), comm_plan.layers_per_bucket, model.tie_embeddings, model)
            return self.pipeline_grads_fn(config, sync)
        if t.grad_sync == "per_block":
            return per_block_grads_fn(graphdef, config.model, self.mesh, self.rules, param_shardings, comm_plan)
        return self.pipeline_grads_fn(config)

    def pipeline_grads_fn(self, config, sync: StageSync | None = None) -> Callable | None:
        """With a pipeline, the executor's ``fn(params, tokens) -> (loss, metrics, grads)`` (``sync``: per_block's
        reductions, jaxdist.parallel.pipeline_sync); else None."""
        if self.pipeline is None:
            return None
        return pipeline_grads_fn(config, self.mesh, self.rules, self.pipeline, sync)

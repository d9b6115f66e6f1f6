"""The compile-time half of a training job: mesh, sharded abstract model, optimizer and the jitted init,
train and eval programs, built from a :class:`~jaxdist.train.resolved.Resolved`.

The Trainer is a Program with the run around it (data, checkpoints, metrics, the loop); ahead-of-time
compiles (:mod:`jaxdist.train.aot`: the remat selector's and the planner's closed loops) build the Program
alone, so what they compile is exactly what a run compiles.  Nothing here allocates device memory: the
programs compile on first use.
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdist.cluster import load_cluster
from jaxdist.models import create_abstract, init_params
from jaxdist.parallel.comm import plan_comm, xla_gpu_options
from jaxdist.parallel.layout import Parallelism
from jaxdist.parallel.moe import stage_row_axes
from jaxdist.parallel.pipeline_blocks import check_rows_over_stages, pipelined_scan
from jaxdist.remat.named import remat_policy
from jaxdist.train import custom
from jaxdist.train.faults import hooks_on, with_device_hang
from jaxdist.train.optimizer import make_optimizer
from jaxdist.train.programs import bf16_notice, executed_flops
from jaxdist.train.resolved import Resolved
from jaxdist.train.step import init_state, make_eval_step, make_train_step, staged_grads_fn


class Program:
    """Mesh, model and jitted programs of ``resolved`` (see the module docstring)."""

    def __init__(self, resolved: Resolved):
        self._build_parallelism(resolved)
        self._build_comm()  # the gradient collectives' plan and the XLA options that follow it
        self._build_model()  # remat policy, abstract sharded model, optimizer, state shardings
        self._build_programs()  # the jitted init, train and eval functions (compiled on first use)
        # compiled_train_step(): train.remat=auto's closed loop may have compiled it already, as this run will
        # (jaxdist.remat.verify.VerifiedChoice.compiled: off CPU, the same program and options)
        self._compiled_step = self._adopted_step()
        self.adopted_step = self._compiled_step is not None  # the loop's compile is run, none of its own
        self._hardware_flops: float | None = None  # hardware_flops_per_step()

    def _build_parallelism(self, resolved: Resolved) -> None:
        """The devices, the cluster, the mesh and logical rules."""
        self.resolved = resolved
        self.config = c = resolved.config
        self.devices = list(self.resolved.devices)
        self.cluster = load_cluster(c.mesh.cluster)
        # Mesh, logical rules, expert layout (MoE weights on the expert view, mesh.expert_tensor), pipeline plan.
        self.parallelism = Parallelism.build(c, self.devices, own_model=resolved.user is not None)
        self.mesh, self.rules = self.parallelism.mesh, self.parallelism.rules
        self.expert_layout = self.parallelism.expert_layout
        self.stage_rows: tuple[str, ...] = ()  # an MoE model's stages: the axes they hold manual for its dispatch

    def _build_comm(self) -> None:
        """The gradient collectives' buckets and issue points (jaxdist comm plan); per_block applies them, and on
        GPUs the XLA options (``xla_options``) follow them (under either train.grad_sync)."""
        c = self.config
        if self.resolved.user is not None:  # the plan follows jaxdist's own blocks; XLA places a user model's
            self.comm_plan, self.xla_options = None, {}
            return
        self.comm_plan = plan_comm(c.model, dict(self.mesh.shape), self.cluster, c.train.grad_bucket_bytes)
        gpu = self.devices[0].platform == "gpu" and not c.model.moe.experts  # measured for dense models only
        self.xla_options = xla_gpu_options(self.comm_plan) if gpu else {}

    def _adopted_step(self):
        """The train step ``train.remat=auto``'s closed loop compiled as this run runs it (its chosen candidate,
        for these devices with these options: jaxdist.train.aot.RunnableStep), or None (compiled on first use)."""
        step = self.resolved.program
        if step is None or step.devices != tuple(self.devices) or step.options != self.xla_options:
            return None
        return step.executable

    def _build_model(self) -> None:
        """The remat policy (``auto``: the plan resolve() selected), the abstract model, optimizer and shardings."""
        c = self.config
        remat = self.resolved.remat  # "auto" settled to the selector's plan by resolve()
        self.remat_policy = remat_policy(remat, own_model=self.resolved.user is not None)
        self.remat_plan = remat.plan
        self.user = user = self.resolved.user
        if user is None:
            self.graphdef, abstract_params, names = create_abstract(c.model, c.train.seed, self.remat_policy)
        else:  # the user's module: its names decide which mesh axes it can use (jaxdist.train.custom)
            self.graphdef, abstract_params, names = custom.abstract_module(user, c.train.seed)
            custom.check_user_config(c, None, names, abstract_params)
        self.abstract_params, self.param_names = abstract_params, names
        self.param_shardings = self.parallelism.param_shardings(names, abstract_params)
        # The schedule's length: train.schedule_steps, else train.steps; a resumed run keeps the recorded one.
        self.schedule_steps = c.train.schedule_steps or c.train.steps
        self._build_optimizer()
        self.state_shardings = self._state_shardings(abstract_params)
        self.batch_sharding = self.parallelism.batch_sharding
        if user is not None and user.data is not None:  # a Python dataset's batch: its rows split, one array per key
            rows = self.parallelism.sharding(("batch",))
            self.batch_sharding = {k: rows for k in user.data.spec}
        self.replicated = self.parallelism.replicated

    def _build_optimizer(self) -> None:
        """The optimizer and its learning-rate schedule: the user's optax transformation as given (no schedule
        jaxdist knows), else the [train] AdamW over ``schedule_steps``."""
        if self.user is not None and self.user.optimizer is not None:
            self.optimizer, self.schedule = self.user.optimizer, None
        else:
            self.optimizer, self.schedule = make_optimizer(self.config.train, self.schedule_steps)

    def _build_programs(self) -> None:
        """The jitted init, train and eval functions, the model's sharding bound inside each."""
        c = self.config
        seed = c.train.seed
        bind = self.parallelism.bind  # the model's sharding is entered inside each jitted function
        user = self.user
        make_params = (lambda: init_params(c.model, seed)) if user is None else (lambda: custom.init_params(user, seed))
        self._init_fn = jax.jit(
            bind(lambda: init_state(make_params(), self.optimizer, seed)),
            out_shardings=self.state_shardings,
        )
        packed = c.data.packing == "documents"  # rows packed from documents (jaxdist.data.documents)
        if user is not None:  # the user's loss over the user's module, microbatched (jaxdist.train.custom)
            self.traced = custom.check_loss(
                user, self.graphdef, self.remat_policy, self.abstract_params, self.abstract_batch()
            )
            custom.check_remat(self.resolved.remat, self.traced)
            custom.check_context(c, self.traced)
            custom.check_pipeline(c, self.traced, dict(self.mesh.shape))
            # Pipeline stages run its stack over train.microbatches microbatches (jaxdist.parallel.pipeline_blocks);
            # without them the microbatches are the gradient accumulation's.
            staged = c.mesh.pipeline > 1
            stacks = pipelined_scan(self.mesh, c.train.microbatches, self.rules) if staged else None
            objective = custom.objective(user, self.graphdef, self.remat_policy, stacks=stacks)
            micro = 1 if staged else c.train.microbatches
            grads, eval_step = custom.grads_fn(objective, micro), lambda p, b: objective(p, b)[0]
        else:
            grads, eval_step = self._grads_fn(), make_eval_step(self.graphdef, packed)
        train_step = make_train_step(
            self.graphdef,
            self.optimizer,
            self.schedule,
            c.train.microbatches,
            c.train.grad_clip,
            grads,
            packed=packed,
        )
        if hooks_on():  # test-only: a step whose device program can be made to hang
            train_step = with_device_hang(train_step, self.config.run_dir)
        self._train_step = jax.jit(
            bind(train_step),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=(0,),
        )
        self._eval_step = jax.jit(
            bind(eval_step),
            in_shardings=(self.state_shardings["params"], self.batch_sharding),
            out_shardings=self.replicated,
        )

    def _grads_fn(self):
        """The gradient path Parallelism chooses for train.grad_sync (None: the model's own); an MoE model's
        pipeline stages: gpipe by autodiff (jaxdist.parallel.pipeline_blocks), 1f1b and seq1f1b by the
        executor (jaxdist.parallel.pipeline)."""
        c = self.config
        if c.mesh.pipeline > 1 and c.model.moe.experts:
            # With dropless dispatch the planned dispatch runs inside the stages (manual over its axes too).
            self.stage_rows = stage_row_axes(self.expert_layout, c.model)
        if c.mesh.pipeline > 1 and c.model.moe.experts and c.pipeline.schedule == "gpipe":
            check_rows_over_stages(c.train.batch_size, dict(self.mesh.shape), "the embedding and head")
            specs = {  # each spec as long as its weight's dimensions
                k: P(*s.spec, *(None,) * (self.abstract_params["layers"][k].ndim - len(s.spec)))
                for k, s in self.param_shardings["layers"].items()
            }
            stages = pipelined_scan(self.mesh, c.train.microbatches, self.rules, self.stage_rows, specs)
            return staged_grads_fn(self.graphdef, stages, c.data.packing == "documents")
        return self.parallelism.grads_fn(c, self.graphdef, self.param_shardings, self.comm_plan)

    def sharding(self, logical: tuple[str | None, ...], shape: tuple[int, ...] | None = None) -> NamedSharding:
        """NamedSharding on this mesh for an array with these logical axis names."""
        return self.parallelism.sharding(logical, shape)

    def _state_shardings(self, abstract_params: dict) -> dict:
        abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
        opt_shardings = optax.tree_utils.tree_map_params(
            self.optimizer,
            lambda _, s: s,
            abstract_opt,
            self.param_shardings,
            transform_non_params=lambda _: self.parallelism.replicated,
        )
        rep = self.parallelism.replicated
        return {"step": rep, "params": self.param_shardings, "opt_state": opt_shardings, "rng": rep}

    def abstract_state(self) -> dict:
        """The train state's shapes, dtypes and target shardings (nothing allocated)."""
        shapes = jax.eval_shape(self._init_fn)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

    def train_step(self, state: dict, batch: jax.Array) -> tuple[dict, dict]:
        """One optimizer step, the compiled program ``fit`` runs (donates ``state``)."""
        return self.compiled_train_step()(state, batch)

    def compile_train_step(self):
        """The train step compiled ahead of time for this run's shapes (``jax.stages.Compiled``).

        Its ``memory_analysis()`` and ``cost_analysis()`` give bytes and FLOPs per device.
        """
        lowered = self._train_step.lower(self.abstract_state(), self.abstract_batch())
        return lowered.compile(compiler_options=self.xla_options) if self.xla_options else lowered.compile()

    def abstract_batch(self):
        """A training batch's shape, dtype and sharding: token rows [B, T+1], or a Python dataset's batch (a dict)."""
        t = self.config.train
        if self.user is not None and self.user.data is not None:
            return {
                k: jax.ShapeDtypeStruct((t.batch_size, *shape), dtype, sharding=self.batch_sharding[k])
                for k, (shape, dtype) in self.user.data.spec.items()
            }
        return jax.ShapeDtypeStruct((t.batch_size, t.seq_len + 1), jax.numpy.int32, sharding=self.batch_sharding)

    def compiled_train_step(self):
        """The train step compiled for this run's shapes, compiled once and reused (what ``fit`` calls)."""
        if self._compiled_step is None:
            self._compiled_step = self.compile_train_step()
        return self._compiled_step

    def hardware_flops_per_step(self) -> float | None:
        """FLOPs the compiled train step executes on all devices (programs.executed_flops), computed once."""
        if self._hardware_flops is None:
            self._hardware_flops = executed_flops(self.compiled_train_step(), len(self.devices))
        return self._hardware_flops

    def bf16_notice(self) -> str | None:
        """One sentence when ``model.dtype=bfloat16`` but the compiled step multiplies mostly in float32
        (jaxdist.train.programs.bf16_notice)."""
        if self.config.model.dtype != "bfloat16":
            return None
        return bf16_notice(self.config.model.dtype, self.compiled_train_step().as_text(), self.devices[0].platform)

    def set_schedule_steps(self, steps: int) -> None:
        """Rebuild the optimizer and the train step for a learning-rate schedule of ``steps`` steps (the optimizer
        state is the same for any length; the step compiles again on first use)."""
        self.schedule_steps = steps
        self._build_optimizer()
        self._build_programs()
        self._compiled_step = None

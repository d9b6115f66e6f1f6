"""The train step compiled ahead of time, without running it: its peak memory per device and its FLOPs.

    peak = compiled_peak(config, jax.devices())
    peak.peak_bytes        # arguments + outputs + temp - aliased (compiled.memory_analysis()), bytes per device

This is the number ``train.memory_budget_bytes`` bounds.  The remat selector's closed loop
(:mod:`jaxdist.remat.verify`, wired by :func:`jaxdist.resolve.resolve` and ``jaxdist remat``) and the planner's
(:mod:`jaxdist.planner.verify`, ``jaxdist plan --verify``) call it on the few candidates they would choose.

The program is the Trainer's own train step (:class:`~jaxdist.train.program.Program`, the compile-time half
the Trainer is built on: mesh, model, optimizer and jitted step, no data), lowered against abstract
arguments, so nothing is allocated on the devices and nothing runs.
On CPU the backend's LLVM optimisation level is 0 (the buffer assignment, hence the peak, is the same).
The devices only give the compiler its target: on CPU the simulated ones; on GPUs the job's own devices
(``jaxdist train`` resolves on them), which is the topology the step will run on.  Off CPU the program is
compiled with the Trainer's own options, so it is the one the run executes: ``keep`` (the default there)
hands it back (:class:`RunnableStep`), and the Trainer built from the resolved config runs it instead of
compiling again.  On CPU the level-0 program is not kept (it runs 2-3x slower): the Trainer compiles its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist.config import Config
from jaxdist.models.transformer import block_forward, create_abstract
from jaxdist.parallel.layout import sharded_tracing
from jaxdist.parallel.mesh import build_mesh
from jaxdist.parallel.rules import DEFAULT_RULES, logical_to_spec
from jaxdist.remat.profile import scan_unit
from jaxdist.train.program import Program
from jaxdist.train.programs import executed_flops
from jaxdist.train.resolved import Resolved, settle


@dataclass(frozen=True)
class RunnableStep:
    """A train step compiled as the run will run it: the ``jax.stages.Compiled``, its devices and XLA options."""

    executable: Any
    devices: tuple
    options: dict


@dataclass(frozen=True)
class CompiledPeak:
    """What XLA's compiled train step reports, per device: bytes, FLOPs and the compile's seconds."""

    peak_bytes: int  # arguments + outputs + temp - aliased
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    flops: float | None  # executed FLOPs per device (loop trips multiplied in), None when XLA gives no count
    seconds: float  # lowering and compiling
    runnable: RunnableStep | None = field(default=None, repr=False, compare=False)  # kept (``keep``) or None


def peak_of(compiled: Any) -> tuple[int, int, int, int, int]:
    """(peak, temp, arguments, outputs, aliased) bytes per device of a ``jax.stages.Compiled``."""
    ma = compiled.memory_analysis()
    arg, out, tmp, alias = (
        int(ma.argument_size_in_bytes),
        int(ma.output_size_in_bytes),
        int(ma.temp_size_in_bytes),
        int(ma.alias_size_in_bytes),
    )
    return arg + out + tmp - alias, tmp, arg, out, alias


def compiled_peak(
    config: Config | Resolved, devices: Sequence[Any] | None = None, keep: bool | None = None
) -> CompiledPeak:
    """Compile ``config``'s train step for ``devices`` (default: all JAX sees) and read its peak and FLOPs.

    ``config``: a :class:`~jaxdist.train.resolved.Resolved` (its devices and remat are the ones compiled), or a
    Config that leaves nothing to choose (``train.remat`` not ``auto``, no ``mesh=auto``).
    ``keep`` (default: off CPU) compiles with the Trainer's options and returns the program (``runnable``);
    otherwise CPU compiles at LLVM level 0.
    """
    t0 = time.perf_counter()
    trainer = Program(settle(config, devices))
    lowered = trainer._train_step.lower(trainer.abstract_state(), trainer.abstract_batch())
    # XLA:CPU assigns buffers before LLVM runs, so its optimisation level leaves the peak as it is (checked:
    # the same bytes to the byte) and level 0 compiles 2-3x faster; other backends compile as the job will.
    cpu = trainer.devices[0].platform == "cpu"
    keep = not cpu if keep is None else keep
    options = {"xla_backend_optimization_level": 0} if cpu and not keep else dict(trainer.xla_options)
    compiled = lowered.compile(compiler_options=options or None)
    peak, tmp, arg, out, alias = peak_of(compiled)
    flops = executed_flops(compiled, 1)
    runnable = RunnableStep(compiled, tuple(trainer.devices), dict(trainer.xla_options)) if keep else None
    return CompiledPeak(peak, tmp, arg, out, alias, flops, time.perf_counter() - t0, runnable)


# Scan steps the working-space probe compiles: one step's backward runs while the other's residuals are held,
# as inside the model's layer scan.
PROBE_STEPS = 2


def block_working(config: Config, devices: Sequence[Any], policy: Any, saved_bytes_per_step: float) -> float:
    """XLA's working space of one layer-scan step's backward under ``policy``, bytes per device: the temp of a
    compiled forward and backward of a :data:`PROBE_STEPS`-step scan of the model's block (the run's microbatch,
    mesh and activation shardings) less the residuals it holds (``saved_bytes_per_step`` each step).

    What the remat loop (:mod:`jaxdist.remat.verify`) reads beside its whole-step compiles: the step's working
    space moves with the policy, and this probe follows it for a fraction of a whole-step compile.  ``policy``: None (save everything), "full" or a jax.checkpoint policy.
    """
    jnp = jax.numpy
    m, t = config.model, config.train
    mesh = build_mesh(config.mesh, list(devices))
    _, abstract, names = create_abstract(m)
    fn, layer, layer_names = scan_unit(m, abstract["layers"], names["layers"], block_forward)
    n = PROBE_STEPS
    stacked = {k: jax.ShapeDtypeStruct((n, *v.shape), v.dtype) for k, v in layer.items()}
    p_shard = {
        k: NamedSharding(mesh, PartitionSpec(None, *logical_to_spec(layer_names[k], DEFAULT_RULES, mesh, v.shape)))
        for k, v in layer.items()
    }
    dt = jnp.bfloat16 if m.dtype == "bfloat16" else jnp.float32
    x = jax.ShapeDtypeStruct((t.batch_size // t.microbatches, t.seq_len, m.d_model), dt)
    x_shard = NamedSharding(mesh, logical_to_spec(("batch", "seq", "embed"), DEFAULT_RULES, mesh, x.shape))
    table = jax.ShapeDtypeStruct((t.seq_len, m.head_dim // 2), jnp.float32)
    replicated = NamedSharding(mesh, PartitionSpec())

    def one(p, h, cos, sin):
        out = fn(p, h, cos, sin)
        return out[0] if isinstance(out, tuple) else out

    if policy == "full":
        one = jax.checkpoint(one)
    elif policy is not None:
        one = jax.checkpoint(one, policy=policy)

    def loss(params, h, cos, sin):
        y, _ = jax.lax.scan(lambda c, p: (one(p, c, cos, sin), None), h, params)
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=(p_shard, x_shard, replicated, replicated))
    with sharded_tracing(mesh, DEFAULT_RULES):
        lowered = grad.lower(stacked, x, table, table)
    cpu = devices[0].platform == "cpu"
    compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": 0} if cpu else None)
    return float(compiled.memory_analysis().temp_size_in_bytes) - n * float(saved_bytes_per_step)

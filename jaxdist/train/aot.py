"""The train step compiled ahead of time, without running it: its peak memory per device and its FLOPs.

    peak = compiled_peak(config, jax.devices())
    peak.peak_bytes        # arguments + outputs + temp - aliased (compiled.memory_analysis()), bytes per device

This is the number ``train.memory_budget_bytes`` bounds.  The remat selector's closed loop
(:mod:`jaxdist.remat.verify`, wired by :func:`jaxdist.resolve.resolve` and ``jaxdist remat``) and the planner's
(:mod:`jaxdist.planner.verify`, ``jaxdist plan --verify``) call it on the few candidates they would choose.

The program is the Trainer's own train step (:meth:`Trainer.for_compiling`: mesh, model, optimizer and jitted
step, no data), lowered against abstract arguments, so nothing is allocated on the devices and nothing runs.
On CPU the backend's LLVM optimisation level is 0 (the buffer assignment, hence the peak, is the same).
The devices only give the compiler its target: on CPU the simulated ones; on GPUs the job's own devices
(``jaxdist train`` resolves on them), which is the topology the step will run on.  Off CPU the program is
compiled with the Trainer's own options, so it is the one the run executes: ``keep`` (the default there)
hands it back (:class:`RunnableStep`), and the Trainer built from the resolved config runs it instead of
compiling again.  On CPU the level-0 program is not kept (it runs 2-3x slower): the Trainer compiles its own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax

from jaxdist.config import Config
from jaxdist.train.programs import executed_flops
from jaxdist.train.trainer import Trainer


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


def compiled_peak(config: Config, devices: Sequence[Any] | None = None, keep: bool | None = None) -> CompiledPeak:
    """Compile ``config``'s train step for ``devices`` (default: all JAX sees) and read its peak and FLOPs.

    ``config`` must be resolved (``train.remat`` not ``auto``, no ``mesh=auto``): its remat is the one compiled.
    ``keep`` (default: off CPU) compiles with the Trainer's options and returns the program (``runnable``);
    otherwise CPU compiles at LLVM level 0.
    """
    t0 = time.perf_counter()
    trainer = Trainer.for_compiling(config, list(devices) if devices is not None else jax.devices())
    batch = jax.ShapeDtypeStruct(
        (config.train.batch_size, config.train.seq_len + 1), jax.numpy.int32, sharding=trainer.batch_sharding
    )
    lowered = trainer._train_step.lower(trainer.abstract_state(), batch)
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

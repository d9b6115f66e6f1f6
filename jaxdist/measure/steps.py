"""Measure what the planner predicts, on the real Trainer's jitted step.

For a config, :func:`measure_step` builds a :class:`~jaxdist.train.trainer.Trainer`,
compiles its train step ahead of time and reads

* memory per device: ``compiled.memory_analysis()``, arguments + outputs +
  temporaries - aliased (bytes);
* collective bytes per step: the collectives of ``compiled.as_text()``
  (:mod:`jaxdist.parallel.hlo`), loop trips multiplied in;
* optionally the step time: the fastest of several timed rounds of the
  compiled step on random tokens, after ``warmup`` calls (seconds);
  :func:`measure_strategies` times several configs round-robin.

Used by the tests, ``benchmarks/planner.py`` and ``jaxdist calibrate``; it sits above ``train/``
(it builds Trainers), the planner below it only reads what it measured.
"""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
import time
from dataclasses import dataclass

import jax
import numpy as np

from jaxdist.config import Config, load_config
from jaxdist.parallel.hlo import collective_bytes
from jaxdist.train.trainer import Trainer


@dataclass(frozen=True)
class StepMeasurement:
    """Measured figures of one compiled train step (bytes per device, seconds)."""

    memory_bytes: int
    temp_bytes: int
    argument_bytes: int
    collective_bytes: dict
    step_time: float | None = None


# The strategies whose measured step times the planner must rank (tests/planner, benchmarks/planner.py):
# the tiny model at batch 64 x 32 tokens on 8 devices.
RANKING_MODEL = ["model=tiny", "train.batch_size=64", "train.seq_len=32"]
RANKING_STRATEGIES = [
    ["mesh.data=8", "train.microbatches=4"],
    ["mesh.data=1", "mesh.fsdp=8"],
    ["mesh.data=1", "mesh.fsdp=8", "train.microbatches=8"],
    ["mesh.data=4", "mesh.tensor=2"],
    ["mesh.data=4", "mesh.tensor=2", "train.microbatches=8"],
    ["mesh.data=2", "mesh.fsdp=4", "train.microbatches=2"],
    ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.microbatches=4"],
    ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2", "train.microbatches=8"],
]
# One pair of the small preset the memory and collective checks add to those.
SMALL_CHECK = [
    "model=small",
    "train.batch_size=32",
    "train.seq_len=64",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
    "train.remat=full",
]

_RUNS = itertools.count()  # one run directory per measured config: each keeps its own batch list


def measurement_config(overrides: list[str], runs_dir: str | None = None) -> Config:
    """A config for measuring: no checkpoints, no progress bar, no TensorBoard, little data, runs in a temp dir."""
    runs_dir = runs_dir or tempfile.mkdtemp(prefix="jaxdist-measure-")
    base = [
        "data.max_bytes=200000",
        "train.progress=false",
        "train.tensorboard=false",
        "checkpoint.enabled=false",
        f"train.runs_dir={runs_dir}",
        f"train.name=measure-{next(_RUNS)}",
    ]
    return load_config(None, base + list(overrides))


def _compile(trainer):
    return trainer.compile_train_step()


def measure_step(cfg: Config, devices: list | None = None, steps: int = 0, warmup: int = 2) -> StepMeasurement:
    """Compile the Trainer's step for ``cfg`` on ``devices`` (default all) and measure it.

    With ``steps`` > 0 it also runs the step: ``warmup`` untimed calls, then
    ``steps`` timed ones; ``step_time`` is the fastest of them.
    """
    return measure_strategies([cfg], devices, rounds=steps, steps_per_round=1, warmup=warmup)[0]


def _zero_state(trainer) -> dict:
    """A train state of zeros with the step's shardings: same cost per step as a trained one, no init compile."""
    return jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), trainer.abstract_state())


def measure_strategies(
    cfgs: list[Config], devices: list | None = None, rounds: int = 5, steps_per_round: int = 3, warmup: int = 2
) -> list[StepMeasurement]:
    """Memory, collectives and seconds per step of each config's compiled Trainer step, timed round-robin.

    All configs are compiled and initialised first; then each round runs
    ``steps_per_round`` steps of every config in turn, so a change in the
    machine's load during the measurement hits all of them alike.
    ``step_time`` is, per config, the fastest round's time per step.
    """
    devices = list(devices if devices is not None else jax.devices())
    runs, found = [], []
    for cfg in cfgs:
        trainer = Trainer(cfg, devices)
        compiled = _compile(trainer)
        ma = compiled.memory_analysis()
        found.append(
            StepMeasurement(
                memory_bytes=int(
                    ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes - ma.alias_size_in_bytes
                ),
                temp_bytes=int(ma.temp_size_in_bytes),
                argument_bytes=int(ma.argument_size_in_bytes),
                collective_bytes=collective_bytes(compiled.as_text(), len(devices)),
            )
        )
        if rounds <= 0:
            trainer.close()
            continue
        state = _zero_state(trainer)
        tokens = np.random.default_rng(0).integers(
            0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), dtype=np.int32
        )
        batch = jax.device_put(tokens, trainer.batch_sharding)
        for _ in range(warmup):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(state)
        runs.append([trainer, compiled, state, batch])
    if rounds <= 0:
        return found
    best = [float("inf")] * len(runs)
    for _ in range(rounds):
        for i, run in enumerate(runs):
            trainer, compiled, state, batch = run
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                state, metrics = compiled(state, batch)
            jax.block_until_ready((state, metrics))
            best[i] = min(best[i], (time.perf_counter() - t0) / steps_per_round)
            run[2] = state
    for trainer, *_ in runs:
        trainer.close()
    return [dataclasses.replace(m, step_time=t) for m, t in zip(found, best)]

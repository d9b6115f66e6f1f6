"""The train step compiled ahead of time (jaxdist/train/aot.py): what train.remat=auto's loop compiled as the
run will run it is the program the Trainer runs, not compiled again."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.config import load_config
from jaxdist.resolve import verified_remat
from jaxdist.train.aot import compiled_peak
from jaxdist.train.resolved import Resolved
from jaxdist.train.trainer import Trainer


def test_the_trainer_runs_the_program_the_remat_loop_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_CALIBRATION_DIR", str(tmp_path))
    cfg = load_config(
        None,
        ["model=tiny", "mesh.cluster=cpu-1", "train.batch_size=4", "train.seq_len=32", "train.remat=auto"]
        + ["train.memory_budget_bytes=1000000000"],  # everything fits: no remat, one compile
    )
    devices = jax.devices()[:1]
    # keep=True: compiled as the run compiles it (the default off CPU; on CPU the loop compiles at level 0)
    choice = verified_remat(cfg, devices, compile_peak=lambda c: compiled_peak(c, devices, keep=True))
    assert len(choice.trials) == 1 and choice.chosen.recompute_flops == 0
    assert choice.runnable is not None and choice.runnable.devices == tuple(devices)
    base = Resolved(cfg, tuple(devices), cfg.train.remat_spec)
    resolved = base.with_remat(choice)
    trainer = Trainer.for_compiling(resolved)
    assert trainer.compiled_train_step() is choice.runnable.executable  # adopted, not compiled again
    other = dataclasses.replace(choice, runnable=dataclasses.replace(choice.runnable, options={"other": "1"}))
    assert Trainer.for_compiling(base.with_remat(other))._compiled_step is None
    # The kept program takes this run's state and batch (a program of another config would refuse them) and
    # trains: the loss on a repeated batch falls (the first step's learning rate is 0: warmup).
    batch = jax.device_put(
        jax.random.randint(jax.random.key(0), (4, 33), 0, cfg.model.vocab_size, jnp.int32), trainer.batch_sharding
    )
    state, first = trainer.train_step(trainer._init_fn(), batch)
    for _ in range(2):
        state, last = trainer.train_step(state, batch)
    assert int(state["step"]) == 3 and np.isfinite(float(first["loss"])) and float(last["loss"]) < float(first["loss"])

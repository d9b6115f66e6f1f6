"""``jaxdist convert``: a Hugging Face directory to a jaxdist run directory (step-0 checkpoint) and back.

:func:`hf_to_run`: a Trainer whose ``model.init_from`` is the Hugging Face
directory loads the weights into their shards (``Trainer.init_state``) and
saves them as step 0 of the run, so ``jaxdist train`` in that run directory
resumes from them.  :func:`run_to_hf`: the run's newest (or a given)
checkpoint restored onto the mesh of its config, written by
:func:`jaxdist.hf.export.export_params`.  The configs come from
:mod:`jaxdist.convert_config` (no JAX).
"""

from __future__ import annotations

from pathlib import Path

import jax

from jaxdist.config import Config
from jaxdist.errors import ConfigError
from jaxdist.hf.export import DEFAULT_SHARD_BYTES, export_params
from jaxdist.config_hf import read_hf_config
from jaxdist.resolve import resolve
from jaxdist.train.trainer import Trainer


def hf_to_run(cfg: Config) -> int:
    """Write ``cfg``'s run directory (config.json + checkpoint step 0) from ``model.init_from``; returns the
    checkpoint's bytes.  ConfigError if the run already has a checkpoint.  Call on every process."""
    if not cfg.model.init_from:
        raise ConfigError("model.init_from is empty: name the Hugging Face directory to convert.")
    if not cfg.checkpoint.enabled:
        raise ConfigError("checkpoint.enabled=false leaves nothing to convert into: drop that override.")
    with Trainer(resolve(cfg, jax.devices())) as trainer:
        if trainer.checkpointer.latest_step() is not None:
            raise ConfigError(f"{trainer.checkpointer.directory} already holds checkpoints: convert into a new run.")
        trainer.init_state()
        trainer.save(0)
        trainer.checkpointer.wait()
        return sum(a.nbytes for a in jax.tree.leaves(trainer.state["params"]))


def run_to_hf(
    cfg: Config,
    hf_dir: str | Path,
    step: int | None = None,
    torch_dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write the parameters of checkpoint ``step`` (default: newest) of ``cfg``'s run as a Hugging Face checkpoint.

    config.json's other keys (token ids, ...) come from the model's ``init_from`` directory when it still
    exists.  Call on every process.
    """
    with Trainer(resolve(cfg, jax.devices())) as trainer:
        ck = trainer.checkpointer
        if ck is None or ck.latest_step() is None:
            raise ConfigError(f"{cfg.run_dir} has no checkpoint to export: train it or convert into it first.")
        if step is not None and step not in ck.all_steps():
            raise ConfigError(f"{cfg.run_dir} has no checkpoint of step {step}: choose one of {ck.all_steps()}.")
        state, _ = ck.restore(trainer.abstract_state(), step)
    base = None
    if cfg.model.init_from and (Path(cfg.model.init_from) / "config.json").is_file():
        base = read_hf_config(cfg.model.init_from)
    return export_params(state["params"], cfg.model, hf_dir, torch_dtype, max_shard_bytes, base)

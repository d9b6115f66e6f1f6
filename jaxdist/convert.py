"""``jaxdist convert``: a Hugging Face directory to a jaxdist run directory (step-0 checkpoint) and back.

:func:`hf_to_run`: a Trainer whose ``model.init_from`` is the Hugging Face
directory loads the weights into their shards (``Trainer.init_state``) and
saves them as step 0 of the run, so ``jaxdist train`` in that run directory
resumes from them; the directory's tokenizer (with its settings and chat
template) is copied into ``<run>/tokenizer/`` and recorded as the run's
``data.tokenizer``, so ``jaxdist sample`` decodes with it.  A conversion that
fails leaves no run directory behind (unless it existed before).
:func:`run_to_hf`: the run's newest (or a given) checkpoint restored onto the
mesh of its config, written by :func:`jaxdist.hf.export.export_params`,
with the run's tokenizer files beside it.  The configs come from
:mod:`jaxdist.convert_config` (no JAX).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax

from jaxdist.config import Config
from jaxdist.config.hf import read_hf_config
from jaxdist.config.hf_dir import RUN_TOKENIZER_DIR, TOKENIZER_FILES, copy_tokenizer
from jaxdist.data.tokenizer import load_tokenizer
from jaxdist.errors import ConfigError
from jaxdist.hf.export import DEFAULT_SHARD_BYTES, export_params
from jaxdist.resolve import resolve
from jaxdist.train.trainer import Trainer


def hf_to_run(cfg: Config, tokenizer: str | Path | None = None) -> int:
    """Write ``cfg``'s run directory (config.json + checkpoint step 0) from ``model.init_from``; returns the
    checkpoint's bytes.  ``tokenizer``: the tokenizer file the run gets (copied into ``<run>/tokenizer/``);
    None keeps ``cfg.data.tokenizer``.  ConfigError if the run already has a checkpoint; on any ConfigError a
    run directory this call created is removed.  Call on every process."""
    if not cfg.model.init_from:
        raise ConfigError("model.init_from is empty: name the Hugging Face directory to convert.")
    if not cfg.checkpoint.enabled:
        raise ConfigError("checkpoint.enabled=false leaves nothing to convert into: drop that override.")
    if tokenizer is not None:
        load_tokenizer(str(tokenizer))  # an unreadable tokenizer is refused before anything is written
    run_dir, existed = cfg.run_dir, cfg.run_dir.exists()
    try:
        with Trainer(resolve(cfg, jax.devices())) as trainer:
            if trainer.checkpointer.latest_step() is not None:
                existed = True  # not ours to remove
                raise ConfigError(
                    f"{trainer.checkpointer.directory} already holds checkpoints: convert into a new run."
                )
            trainer.init_state()
            trainer.save(0)
            trainer.checkpointer.wait()
            nbytes = sum(a.nbytes for a in jax.tree.leaves(trainer.state["params"]))
    except ConfigError:
        if not existed and jax.process_index() == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    if tokenizer is not None and jax.process_index() == 0:
        record_tokenizer(run_dir, tokenizer)
    return nbytes


def record_tokenizer(run_dir: Path, tokenizer: str | Path) -> Path:
    """Copy ``tokenizer`` (and its settings files) into ``run_dir/tokenizer/`` and make that copy the
    ``data.tokenizer`` of the run's config.json; returns the copy."""
    copy = copy_tokenizer(tokenizer, run_dir / RUN_TOKENIZER_DIR)
    stored = run_dir / "config.json"
    recorded = json.loads(stored.read_text())
    recorded["data"]["tokenizer"] = str(copy)
    stored.write_text(json.dumps(recorded, indent=2))
    return copy


def run_to_hf(
    cfg: Config,
    hf_dir: str | Path,
    step: int | None = None,
    torch_dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write the parameters of checkpoint ``step`` (default: newest) of ``cfg``'s run as a Hugging Face checkpoint.

    config.json's other keys (token ids, ...) come from the model's ``init_from`` directory when it still
    exists, else the token ids from the run's tokenizer, whose files (``data.tokenizer`` and its settings,
    chat template) are written beside the weights.  Call on every process.
    """
    tok = load_tokenizer(cfg.data.tokenizer) if cfg.data.tokenizer != "bytes" else None
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
    if tok is not None:
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
        base = {**{k: v for k, v in ids.items() if v is not None}, **(base or {})}
    written = export_params(state["params"], cfg.model, hf_dir, torch_dtype, max_shard_bytes, base)
    if tok is not None and jax.process_index() == 0:
        copy_tokenizer(cfg.data.tokenizer, hf_dir)
        written += [Path(hf_dir) / name for name in sorted(TOKENIZER_FILES) if (Path(hf_dir) / name).is_file()]
    return written

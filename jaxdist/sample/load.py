"""A run's checkpointed parameters, restored directly sharded onto a sampling mesh, reading only.

The checkpoints are the Trainer's (``<run>/checkpoints/<step>/``, written by
:class:`jaxdist.checkpoint.RunCheckpointer`): only committed steps count (the
commit marker of :mod:`jaxdist.checkpoint.integrity`), their files are
checked against the marker's checksums first, and a damaged newest step
falls back to the previous good one with a warning.

Why not ``RunCheckpointer.restore``: it restores the whole train state
(optimizer moments too, three times the parameters' memory), and opening a
RunCheckpointer tidies the folder (it removes unfinished saves and sets
uncommitted steps aside), which would break the save of a trainer that is
still running on the same run.  Sampling must be safe beside training, so
it only reads: the same marker and checksums, and an orbax partial restore
of the ``params`` subtree, each array laid out as the target sharding says
(any mesh, any process count).
"""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxdist.checkpoint import integrity
from jaxdist.errors import ConfigError

log = logging.getLogger(__name__)


def restore_params(run_dir: str | Path, abstract_params: dict, step: int | None = None) -> tuple[dict, int]:
    """(params, step): the parameters of ``step`` (default: the newest good one) laid out like ``abstract_params``.

    ``abstract_params``: ``jax.ShapeDtypeStruct`` leaves with ``sharding`` set.
    ConfigError (one sentence) when the run has no usable checkpoint, the
    step does not exist or is damaged, or the checkpoint does not fit the model.
    """
    ckdir = (Path(run_dir) / "checkpoints").absolute()  # orbax wants absolute paths
    folders = [f for f in integrity.scan(ckdir) if f.state == "committed"]
    if not folders:
        raise ConfigError(f"run '{run_dir}' has no committed checkpoint in {ckdir}: train it first (jaxdist train).")
    if step is not None:
        steps = [f.step for f in folders]
        folders = [f for f in folders if f.step == step]
        if not folders:
            raise ConfigError(f"run '{run_dir}' has no checkpoint of step {step}: choose one of {steps}.")
    target = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(
        target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
    )
    reader = ocp.PyTreeCheckpointHandler()  # <step>/state, the train state (its params only)
    try:
        for folder in reversed(folders):
            problems = integrity.verify_files(folder.path, folder.marker["files"])
            if problems:
                msg = f"checkpoint {folder.path} is damaged ({problems[0]})"
                if step is not None:
                    raise ConfigError(f"{msg}: choose another step (see `jaxdist ckpt list`).")
                log.warning("%s; trying the previous checkpoint", msg)
                continue
            try:
                restored = reader.restore(epath.Path(folder.path / "state"), args=args)
            except (ValueError, KeyError) as e:
                raise ConfigError(
                    f"the checkpoint {folder.path} does not fit the run's model ({e}): sample with the config it was trained with."
                ) from None
            return restored["params"], folder.step
    finally:
        reader.close()
    raise ConfigError(f"every checkpoint in {ckdir} is damaged: check them with `jaxdist ckpt verify`.")


def abstract_params(abstract: dict, shardings: dict) -> dict:
    """``jax.ShapeDtypeStruct`` leaves of ``abstract`` (``create_abstract``'s params) with ``shardings`` set."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

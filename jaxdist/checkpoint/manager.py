"""Checkpoints of a run: orbax CheckpointManager around the train state.

A checkpoint holds two items: ``state`` (params, optimizer state, step, RNG,
as a pytree of sharded arrays) and ``meta`` (JSON: step, data position,
config).  Saves are asynchronous: ``save`` returns once the arrays are copied
to host memory and the files are written in the background.  Restore takes an
abstract state whose leaves carry the target shardings, so a checkpoint is
read directly onto the current mesh, each process reading what it needs.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class RunCheckpointer:
    """Save and restore train states under ``directory`` (one sub-folder per step)."""

    def __init__(self, directory: str | Path, keep: int = 3, asynchronous: bool = True):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=True, enable_async_checkpointing=asynchronous,
            # Async saves of orbax already refuse to overlap; we report a pending one.
            enable_should_save_is_saving_in_progress_check=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        """Newest committed step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Start saving ``state`` and ``meta`` as ``step``; returns False if the step already exists."""
        if step in self._manager.all_steps():
            return False
        return self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """(state, meta) of ``step`` (default newest) laid out like ``abstract_state``.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with ``sharding`` set.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["meta"])

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON metadata of ``step`` (default newest)."""
        step = self.latest_step() if step is None else step
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def wait(self) -> None:
        """Block until the background save (if any) has committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs with the shardings of a live state (restore target)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)

"""Checkpoints of a run: balanced, asynchronous, committed, verified, restorable anywhere.

A checkpoint ``<dir>/<step>/`` holds ``state`` (params, optimizer state,
step, RNG: an orbax checkpoint of a pytree of sharded arrays) and
``meta/metadata`` (JSON: step, data position, config).  :class:`RunCheckpointer`

* writes each array as :func:`~jaxdist.checkpoint.plan.plan_writes` says, so
  every process writes about the same number of bytes;
* returns from :meth:`~RunCheckpointer.save` once the arrays are on the host;
  the files, their checksums and the commit marker are written by a
  background thread while training goes on.  A save that is still running
  when the next is due is waited for (reported in the log and in
  :attr:`~RunCheckpointer.stats`), never queued behind it;
* counts a step only once ``jaxdist_commit.json`` exists (see
  :mod:`~jaxdist.checkpoint.integrity`), sets the leftovers of interrupted
  saves aside when it starts (``<step>.incomplete``; a marker that does not
  parse or does not match is damage: ``<step>.damaged``; orbax's temporary
  folders, and unfinished folders older than the newest committed step, are
  removed), and keeps the newest ``keep`` committed steps (older
  ones are deleted only after a newer one committed);
* restores onto any mesh and process count (each process reads what its
  devices need), verifying the files' checksums while orbax reads them (each
  process an even share of the bytes) and falling back to
  the newest good step, with a warning naming each damaged one (set aside as
  ``<step>.damaged``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from jaxdist.checkpoint import integrity, writer
from jaxdist.checkpoint.background import BackgroundWriter
from jaxdist.checkpoint.plan import WritePlan, assign_bytes, layout_from_spec, plan_writes

log = logging.getLogger(__name__)

STATE, META, META_FILE = "state", "meta", "metadata"  # <step>/state: orbax's pytree; <step>/meta/metadata: JSON

# Seconds a process waits at a checkpoint barrier for its peers.
BARRIER_TIMEOUT_S = 600


@dataclasses.dataclass
class SaveStats:
    """One save: seconds the caller was blocked (``blocked_s``: device-to-host copy and
    orbax bookkeeping; ``waited_s``: for the previous save still running), seconds the
    background part took (``background_s``, once committed) and bytes per process
    (``planned_bytes``: uncompressed array bytes; ``written_bytes``: file bytes, on process 0)."""

    step: int
    blocked_s: float
    waited_s: float
    planned_bytes: list[int]
    background_s: float | None = None
    written_bytes: list[int] | None = None


class RunCheckpointer:
    """Save and restore train states under ``directory`` (one sub-folder per step).

    ``strategy``: ``"balanced"`` (default) or ``"replica0"`` (the naive
    baseline, for benchmarks).  ``verify``: check file checksums before a restore.
    Every process of a job must construct it and call save/restore/wait together.
    """

    def __init__(
        self,
        directory: str | Path,
        keep: int = 3,
        asynchronous: bool = True,
        strategy: str = "balanced",
        verify: bool = True,
    ):
        if keep < 1:
            raise ValueError("checkpoint.keep must be at least 1")
        self.directory = Path(directory).absolute()
        self.keep, self.asynchronous, self.strategy, self.verify = keep, asynchronous, strategy, verify
        self.process, self.num_processes = jax.process_index(), jax.process_count()
        self.stats: list[SaveStats] = []
        # The state alone goes through orbax (to <step>/state); the JSON meta is written by process 0 in the
        # background commit (to <step>/meta/metadata, where orbax's JsonCheckpointHandler put it). A composite of
        # the two items cost every save one more barrier among the processes inside the blocked part.
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=writer.type_registry(strategy))
        self._handler = handler
        self._orbax = ocp.AsyncCheckpointer(handler) if asynchronous else ocp.Checkpointer(handler)
        self._sync = ocp.multihost.get_barrier_sync_fn()
        self._seq = 0
        self._writer = BackgroundWriter(f"a checkpoint save in {self.directory}")
        self._plans: dict[Any, tuple[WritePlan, dict]] = {}
        if self.process == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_unfinished()
        self._barrier("init")

    @property
    def busy_saves(self) -> int:
        """Saves that found the previous one still being written (and waited for it)."""
        return self._writer.busy_waits

    # ------------------------------------------------------------------ steps

    def _barrier(self, phase: str, step: int = -1, seq: int | None = None) -> None:
        """Wait for every process (a no-op on one); keys are unique per phase, step and save."""
        if self.num_processes > 1:
            seq = self._seq if seq is None else seq
            self._sync(key=f"jaxdist_ckpt:{self.directory}:{phase}:{step}:{seq}", timeout_ms=BARRIER_TIMEOUT_S * 1000)

    def _remove_unfinished(self) -> None:
        folders = integrity.scan(self.directory)
        newest = max((f.step for f in folders if f.state == "committed"), default=None)
        for f in folders:
            if f.state == "temporary":  # orbax never finished these
                log.warning("removing %s: a checkpoint save that never completed", f.path)
                shutil.rmtree(f.path, ignore_errors=True)
            elif f.state in ("incomplete", "abandoned") and newest is not None and f.step < newest:
                # Older than a committed step: a save that never finished, or a deletion a kill cut short
                # (_collect_garbage removes the marker first); no save of a step this old can still be running.
                log.warning("removing %s: an unfinished checkpoint older than the committed step %d", f.path, newest)
                shutil.rmtree(f.path, ignore_errors=True)
            elif f.state == "bad-marker":  # damage, never an unfinished save: the restore uses the step before
                aside = integrity.set_aside(f.path, "damaged")
                log.warning("checkpoint %s is damaged: %s; moved to %s", f.path, f.problem, aside.name)
            elif f.state == "incomplete":  # kept: it may also be a checkpoint of an older jaxdist
                aside = integrity.set_aside(f.path, "incomplete")
                log.warning(
                    "ignoring %s: no commit marker (a save that never completed, or one written before "
                    "jaxdist recorded checksums); moved to %s",
                    f.path,
                    aside.name,
                )

    def damaged_steps(self) -> list[int]:
        """Steps set aside as damaged (``<step>.damaged``) by a restore, oldest first."""
        return [f.step for f in integrity.scan(self.directory) if f.state == "damaged"]

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return [f.step for f in integrity.scan(self.directory) if f.state == "committed"]

    def latest_step(self) -> int | None:
        """Newest committed step (its files are verified only on restore), or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save

    def plan(self, state: Any) -> WritePlan:
        """The write plan of ``state`` (cached per shapes and shardings)."""
        return self._plan_and_layout(_arrays(state))[0]

    def _plan_and_layout(self, named: list[tuple[str, jax.Array]]) -> tuple[WritePlan, dict]:
        key = tuple((n, a.shape, str(a.dtype), a.sharding) for n, a in named)
        if key not in self._plans:
            layouts = writer.layouts_from_arrays(named)
            self._plans[key] = (plan_writes(layouts, self.num_processes, self.strategy), describe_layout(named))
        return self._plans[key]

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> bool:
        """Start saving ``state`` and ``meta`` as ``step``; False if that step is already committed.

        Blocks for the device-to-host copy (and for the previous save, if it
        is still running); the rest happens in the background.
        """
        waited = self._finish_previous(step)
        if integrity.read_commit(self.directory / str(step)) is not None:  # this step's marker only: the others'
            return False  # (keep of them, each a JSON parse and a CRC) are not the training loop's to wait for
        t1 = time.perf_counter()
        named = _arrays(state)
        plan, layout = self._plan_and_layout(named)
        step_dir = self.directory / str(step)
        self._seq += 1
        with writer.following(plan, named):
            self._orbax.save(step_dir / STATE, args=ocp.args.PyTreeSave(state))
        stats = SaveStats(step, time.perf_counter() - t1, waited, plan.bytes_per_process())
        self.stats.append(stats)
        info = {
            "step": step,
            "time": time.time(),
            "strategy": self.strategy,
            "planned_bytes_per_process": stats.planned_bytes,
            "layout": layout,
            "versions": {"jax": jax.__version__, "orbax": ocp.__version__},
        }
        meta = json.dumps(meta)  # now: a value that cannot be written fails the save here, not in the background
        if self.asynchronous:
            self._writer.submit(self._commit, step_dir, stats, info, meta, self._seq, t1, name=f"jaxdist-ckpt-{step}")
        else:
            self._writer.run(self._commit, step_dir, stats, info, meta, self._seq, t1)
        return True

    def _commit(self, step_dir: Path, stats: SaveStats, info: dict, meta: str, seq: int, t_start: float) -> None:
        try:
            if self.asynchronous:
                self._orbax.wait_until_finished()
            if self.process == 0:  # before the checksums, which cover it
                (step_dir / META).mkdir(exist_ok=True)
                (step_dir / META / META_FILE).write_text(meta)
            integrity.record_own_checksums(step_dir, self.process)
            self._barrier("checksums", stats.step, seq)
            failed = None
            if self.process == 0:
                try:  # the marker: only now does the step count
                    marker = integrity.commit(step_dir, self.num_processes, info)
                    stats.written_bytes = marker["bytes_written_per_process"]
                except Exception as e:  # still meet the others at the barrier, then report
                    failed = e
            self._barrier("committed", stats.step, seq)
            if failed is not None:
                raise failed
            stats.background_s = time.perf_counter() - t_start - stats.blocked_s
            if self.process == 0:  # after the step counts: deleting old steps does not delay it
                self._collect_garbage()
        except BaseException as e:  # the writer re-raises it at the next save/wait on the main thread
            log.error("checkpoint of step %d in %s failed: %s", stats.step, self.directory, e)
            raise

    def _collect_garbage(self) -> None:
        committed = [f for f in integrity.scan(self.directory) if f.state == "committed"]
        for f in committed[: -self.keep]:
            # The marker first: a kill mid-deletion leaves an uncommitted folder, removed at the next start.
            (f.path / integrity.COMMIT_FILE).unlink(missing_ok=True)
            shutil.rmtree(f.path, ignore_errors=True)

    def _finish_previous(self, due: int | None = None) -> float:
        """Wait for the running background save (reporting it if ``due`` is a step waiting for it); seconds waited."""

        def report_busy() -> None:
            log.warning(
                "checkpoint of step %d is still being written when step %d is due: waiting for it "
                "(saves are not stacked); consider a larger checkpoint.every",
                self.stats[-1].step,
                due,
            )

        return self._writer.wait(on_busy=report_busy if due is not None else None)

    def wait(self) -> None:
        """Block until the background save (if any) has committed; raises if it failed."""
        self._finish_previous()

    def close(self) -> None:
        """Wait for the running save and release orbax's resources."""
        try:
            self._writer.close()
        finally:
            self._orbax.close()

    # ------------------------------------------------------------------ restore

    def _check_share(self, folder: integrity.StepFolder) -> tuple[list[str], integrity.ChecksumUnavailable | None]:
        """Problems with this process's even share of ``folder``'s file bytes (every file on one process)."""
        files = folder.marker["files"]
        mine = list(files)
        if self.num_processes > 1:
            share = assign_bytes({k: v["size"] for k, v in files.items()}, self.num_processes)
            mine = [k for k in files if share[k] == self.process]
        try:
            return integrity.verify_files(folder.path, files, mine), None
        except integrity.ChecksumUnavailable as e:  # on several processes, still meet the others, then all raise
            if self.num_processes == 1:
                raise
            return [], e

    def _agree(
        self, folder: Path, mine: list[str], unavailable: Exception | None, read_failed: bool
    ) -> tuple[list[str], bool]:
        """(every process's problems as this one reports them, whether any read failed): one allgather, which
        every process reaches whatever its read did, so none waits for a peer that gave up."""
        if self.num_processes == 1:
            return mine, read_failed
        counts, lacking, failed = np.asarray(
            multihost_utils.process_allgather(np.array([len(mine), unavailable is not None, read_failed], np.int32))
        ).T
        if lacking.any():
            if unavailable is not None:
                raise unavailable
            first = int(np.nonzero(lacking)[0][0])
            raise integrity.ChecksumUnavailable(
                f"process {first} cannot check {folder}'s CRC-32C checksums (no crc32c there): "
                "install crc32c on every host (pip install crc32c)."
            )
        if counts.sum() and not mine:
            first = int(np.nonzero(counts)[0][0])
            mine = [f"{int(counts.sum())} files do not match their checksums (see process {first}'s log)"]
        return mine, bool(failed.any())

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """(state, meta) of ``step`` (default: the newest good one) laid out like ``abstract_state``.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with
        ``sharding`` set (any mesh, any process count).  A damaged checkpoint
        is skipped with a warning and set aside; with an explicit ``step`` it
        raises :class:`~jaxdist.checkpoint.integrity.CheckpointDamaged`.
        """
        self._finish_previous()
        if self.asynchronous:
            self._orbax.wait_until_finished()  # what orbax's own restore waits for (a no-op after the line above)
        folders = [f for f in integrity.scan(self.directory) if f.state == "committed"]
        if step is not None:
            folders = [f for f in folders if f.step == step]
            if not folders:
                raise FileNotFoundError(f"no committed checkpoint of step {step} in {self.directory}")
        for folder in reversed(folders):
            restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)
            args = ocp.args.PyTreeRestore(abstract_state, restore_args=restore_args)
            # The files are checked while orbax reads them (one pass through the page cache instead of two in a
            # row; each process its share of the bytes), and what orbax read is used only if they match.  The read
            # goes through the handler (orbax's public CheckpointHandler.restore), not the checkpointer, whose
            # closing barrier would hold every process whose read succeeded while a peer whose read failed on a
            # damaged file gave up: here every process meets the others at one allgather, whatever its read did.
            restored, error = None, None
            checking = ThreadPoolExecutor(1, thread_name_prefix="jaxdist-verify") if self.verify else None
            with checking or contextlib.nullcontext():
                check = checking.submit(self._check_share, folder) if checking is not None else None
                try:
                    restored = self._handler.restore(epath.Path(folder.path / STATE), args=args)
                except Exception as e:  # damage or not: decided by the checksums below
                    error = e
                mine, unavailable = check.result() if check is not None else ([], None)
            problems, read_failed = self._agree(folder.path, mine, unavailable, error is not None)
            if problems:
                more = f" and {len(problems) - 1} more problems" if len(problems) > 1 else ""
                msg = f"checkpoint {folder.path} is damaged: {problems[0]}{more}"
                self._seq += 1
                if self.process == 0:
                    aside = integrity.set_aside(folder.path)
                    msg += f"; moved to {aside.name}"
                self._barrier("set-aside", folder.step)
                if step is not None:
                    raise integrity.CheckpointDamaged(msg + "; restore another step or rewrite it.")
                log.warning("%s; trying the previous checkpoint", msg)
                continue
            if error is not None:
                raise error
            if read_failed:
                raise RuntimeError(
                    f"another process could not read checkpoint {folder.path} (its files match their checksums): "
                    "see that process's log"
                )
            return restored, self._read_meta(folder.path)
        raise FileNotFoundError(f"no good checkpoint in {self.directory}")

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON metadata of ``step`` (default newest committed)."""
        self._finish_previous()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return self._read_meta(self.directory / str(step))

    @staticmethod
    def _read_meta(step_dir: Path) -> dict[str, Any]:
        return dict(json.loads((step_dir / META / META_FILE).read_text()))


def _arrays(state: Any) -> list[tuple[str, jax.Array]]:
    return [(n, a) for n, a in writer.named_leaves(state) if isinstance(a, jax.Array)]


def describe_layout(named: list[tuple[str, jax.Array]]) -> dict[str, Any]:
    """JSON description of the arrays' shapes and shardings (meshes, device ids, processes), for ``ckpt plan``."""
    meshes: list[dict] = []
    keys: dict[Any, int] = {}
    arrays = []
    for name, a in named:
        entry = {
            "name": name,
            "shape": list(a.shape),
            "dtype": str(a.dtype),
            "itemsize": int(np.dtype(a.dtype).itemsize),
        }
        sh = a.sharding
        if isinstance(sh, jax.sharding.NamedSharding):
            mesh = sh.mesh
            ids = np.vectorize(lambda d: d.id, otypes=[np.int64])(mesh.devices)
            key = (tuple(mesh.axis_names), ids.tobytes(), ids.shape)
            if key not in keys:
                keys[key] = len(meshes)
                procs = np.vectorize(lambda d: d.process_index, otypes=[np.int64])(mesh.devices)
                meshes.append(
                    {"axis_names": list(mesh.axis_names), "devices": ids.tolist(), "processes": procs.tolist()}
                )
            entry["mesh"] = keys[key]
            entry["spec"] = [e if e is None or isinstance(e, str) else list(e) for e in sh.spec]
        arrays.append(entry)
    return {"meshes": meshes, "arrays": arrays}


def plan_from_layout(layout: dict[str, Any], num_processes: int, strategy: str = "balanced") -> WritePlan:
    """Recompute a checkpoint's write plan from the layout its commit marker records (no devices needed)."""

    meshes = layout["meshes"]
    lays = []
    for a in layout["arrays"]:
        if "mesh" not in a:
            continue
        m = meshes[a["mesh"]]
        procs = dict(zip(np.ravel(m["devices"]).tolist(), np.ravel(m["processes"]).tolist()))
        spec = [e if e is None or isinstance(e, str) else tuple(e) for e in a["spec"]]
        lays.append(layout_from_spec(a["name"], a["shape"], a["itemsize"], spec, m["axis_names"], m["devices"], procs))
    return plan_writes(lays, num_processes, strategy)


def abstract_like(state: Any) -> Any:
    """ShapeDtypeStructs with the shardings of a live state (restore target)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)

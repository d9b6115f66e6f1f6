"""The fast tier: a checkpoint every step on node-local disk, replicated to one peer node.

Writing the whole train state to shared storage every step is too slow for a
large job; losing up to ``checkpoint.every`` steps on every failure is too
costly.  :class:`LocalTier` sits between: every ``checkpoint.local_every``
steps each process

* copies the shards its devices hold (each distinct piece once) to the host
  and packs them, with the step's metadata, into one payload;
* sends that payload to the process ``shift`` ranks on, which runs on another
  node (a collective-permute over one device per process: the job's own
  interconnect, no extra service), and receives the payload of the process
  ``shift`` ranks back.  Pieces the receiver holds itself (parameters
  replicated over a ``data`` axis that crosses the nodes) are not sent: its
  own file of the same step has them;
* writes both to its node-local directory in a background thread
  (``<dir>/<step>/r<data rank>.w<writer rank>.bin`` and a ``.json`` marker
  with size, CRC-32 and the layout's signature, written last, atomically).

So after a node is lost, its ranks' shards still exist on the next node.  A
restore (collective, all processes) agrees on the newest step that every rank
can get -- from its own node, or from the peer holding its replica, which
sends it back the same way -- and rebuilds the arrays on the same mesh and
process layout.  When the layout changed (the group shrank or grew: another
mesh, another process count), the newest step whose files the new group's
nodes hold between them is resharded onto the new layout
(:mod:`jaxdist.checkpoint.local_reshard`).  Two neighbouring nodes lost
together, a damaged file or files left on nodes outside the new group make
that step unavailable, and the Trainer falls back to the persistent
checkpoint.  Steps newer than the one restored are deleted: they belong to a
future the job abandoned.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdist.checkpoint.background import BackgroundWriter
from jaxdist.checkpoint.local_payload import Index, build_state, held_pieces, index_of, pack, signature, unpack
from jaxdist.checkpoint.local_reshard import drop_newer, entries_record, global_signature, restore_resharded
from jaxdist.checkpoint.writer import named_leaves

log = logging.getLogger(__name__)

FORMAT = "jaxdist-local-v1"
MAX_STEPS = 16  # newest local steps a process reports when the group agrees on a restore step
CHUNK_BYTES = 256 * 2**20  # largest block sent in one collective
_ALIGN = 64 * 2**10  # payload lengths are rounded up to this, so a few compiled shapes serve every step


def node_name() -> str:
    """This node's name: ``$JAXDIST_NODE`` (set by the node agent), else the host name."""
    return os.environ.get("JAXDIST_NODE") or socket.gethostname()


def resolve_dir(template: str, run_name: str) -> Path:
    """``checkpoint.local_dir`` with ``{node}`` replaced, plus the run's own sub-folder."""
    return Path(template.replace("{node}", node_name())).expanduser().absolute() / run_name


AUTO = "auto"


def auto_dir(abstract_state: Any, keep: int) -> str:
    """What ``checkpoint.local_dir=auto`` means here (collective in a multi-process job): the system temporary
    directory's ``jaxdist-local/{node}`` when this process runs under a node agent (``$JAXDIST_NODE``: a job of
    ``jaxdist launch``) and every process's disk there has room for ``2 x (keep + 1)`` times its shards (its own
    and a replica, the steps kept plus the one being written); else '' (off, and the log says why)."""
    if not os.environ.get("JAXDIST_NODE"):
        return ""  # jaxdist train: a crash is resumed by hand, from the persistent checkpoint
    base = Path(tempfile.gettempdir()) / "jaxdist-local"
    need = 2 * (keep + 1) * sum(e.nbytes for e in held_pieces(abstract_state))
    probe = base if base.exists() else base.parent
    free = shutil.disk_usage(probe).free
    ok = np.array([int(free >= need)], np.int32)
    if jax.process_count() > 1:
        ok = np.asarray(multihost_utils.process_allgather(ok)).reshape(-1)
    if not ok.all():
        log.warning(
            "checkpoint.local_dir=auto: the local tier is off: %s lacks the %.1f GB it needs on %d of %d processes' "
            "nodes (free here: %.1f GB); set checkpoint.local_dir to a node-local path with room",
            probe,
            need / 1e9,
            int((ok == 0).sum()),
            ok.size,
            free / 1e9,
        )
        return ""
    return str(base / "{node}")


def run_tier(
    local_dir: str, keep: int, run_dir: Path, name: str, abstract_state: Any, not_before: float
) -> LocalTier | None:
    """The run's tier for ``checkpoint.local_dir`` (``auto`` resolved by :func:`auto_dir` from
    ``abstract_state()``), or None when off; a hash of the run directory keeps runs of one name apart."""
    if local_dir == AUTO:
        local_dir = auto_dir(abstract_state(), keep)
    if not local_dir:
        return None
    return LocalTier(resolve_dir(local_dir, run_folder(name, run_dir)), keep, not_before=not_before)


def run_folder(name: str, run_dir: Path) -> str:
    """The run's folder in a node's local directory: its name and a hash of its run directory's absolute path,
    so two runs of one name (in different runs directories) never share local steps."""
    tag = hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:8]
    return f"{name}-{tag}"


@dataclasses.dataclass
class LocalStats:
    """One local save: seconds the caller was blocked (host copy + replication), bytes sent, background seconds."""

    step: int
    blocked_s: float
    replicate_s: float
    payload_bytes: int
    sent_bytes: int = 0
    background_s: float | None = None


class LocalTier:
    """Per-node checkpoints of one run under ``directory`` (node-local); all processes call save/restore together.

    ``keep``: newest steps kept on disk per process (at least 1).  Replication
    needs processes on at least two nodes; on one node the tier still saves
    (a restarted process finds its files) but a lost node loses them.
    """

    def __init__(self, directory: str | Path, keep: int = 2, not_before: float = 0.0):
        if keep < 1:
            raise ValueError("checkpoint.local_keep must be at least 1")
        self.directory, self.keep = Path(directory), keep
        self.not_before = not_before  # seconds since the epoch: files older belong to a history set aside
        self.rank, self.num = jax.process_index(), jax.process_count()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shift = self._peer_shift()
        self.stats: list[LocalStats] = []
        self._writer = BackgroundWriter(f"a local checkpoint save in {self.directory}")
        self._mesh_sharding = None
        self._roll_fns: dict[int, Any] = {}
        self._compiled: set[tuple[int, int]] = set()
        self._shared: dict[tuple[str, Any], Any] = {}

    # ------------------------------------------------------------------ peers

    def _peer_shift(self) -> int:
        """Smallest k >= 1 with rank r+k on another node than r for every r (0: all on one node)."""
        if self.num == 1:
            return 0
        mine = np.frombuffer(hashlib.sha256(node_name().encode()).digest()[:8], np.int64)
        nodes = self._allgather(mine).reshape(-1)
        for k in range(1, self.num):
            if all(nodes[r] != nodes[(r + k) % self.num] for r in range(self.num)):
                return k
        return 0

    def _shared_with_holder(self, tree: Any, sig: str, rank: int) -> set[tuple[str, Index]]:
        """Pieces of ``rank`` that the holder of its replica (rank + shift) holds too: never sent."""
        if (sig, rank) not in self._shared:
            mine = {(e.name, e.index) for e in held_pieces(tree, rank)}
            theirs = {(e.name, e.index) for e in held_pieces(tree, (rank + self.shift) % self.num)}
            self._shared[(sig, rank)] = mine & theirs
        return self._shared[(sig, rank)]

    @property
    def source(self) -> int | None:
        """The rank whose replica this process keeps (None without replication)."""
        return (self.rank - self.shift) % self.num if self.shift else None

    def _roll(self, payload: np.ndarray, shift: int, full: int = 0) -> np.ndarray:
        """Send ``payload`` to rank+shift; return what rank-shift sent (collective: every process calls it).

        ``full`` (saves): this process's whole payload size (a save sends less when the peer holds
        pieces itself); the way back, which a restore takes with whole payloads, is compiled for it
        now, so that a recovering job finds it in the compilation cache.
        """

        if self._mesh_sharding is None:
            firsts = [
                min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(self.num)
            ]
            self._mesh_sharding = NamedSharding(Mesh(np.array(firsts), ("process",)), P("process"))
        sh = self._mesh_sharding
        for s in (shift, -shift):
            if s not in self._roll_fns:
                self._roll_fns[s] = jax.jit(lambda x, s=s: jax.numpy.roll(x, s, axis=0), out_shardings=sh)
        roll = self._roll_fns[shift]
        sizes = self._allgather(np.array([payload.size, max(full, payload.size)], np.int64))
        length, total = int(sizes[(self.rank - shift) % self.num, 0]), int(sizes[:, 0].max())  # one shape everywhere
        width = _width(total)
        back = _width(int(sizes[:, 1].max()))
        if full and (-shift, back) not in self._compiled:
            self._compiled.add((-shift, back))
            self._roll_fns[-shift].lower(jax.ShapeDtypeStruct((self.num, back), np.uint8, sharding=sh)).compile()
        out = np.empty(-(-total // width) * width, np.uint8)
        for off in range(0, out.size, width):
            block = np.zeros((1, width), np.uint8)
            part = payload[off : off + width]
            block[0, : part.size] = part
            arr = jax.make_array_from_process_local_data(sh, block, (self.num, width))
            out[off : off + width] = np.asarray(roll(arr).addressable_shards[0].data)[0]
        return out[:length]

    def _allgather(self, values: np.ndarray) -> np.ndarray:
        """Every process's int64 ``values`` (at most ``2 * MAX_STEPS``).

        Sent as bytes (without jax_enable_x64 JAX would narrow int64) in one
        fixed-size block, so a single compiled program serves every call: the
        one a restore makes after a failure is already in the compilation cache.
        """

        flat = np.ascontiguousarray(values, np.int64).reshape(-1)
        block = np.zeros(2 * MAX_STEPS, np.int64)
        block[: flat.size] = flat
        got = np.asarray(multihost_utils.process_allgather(block.view(np.uint8))).reshape(self.num, -1)
        got = np.ascontiguousarray(got).view(np.int64)[:, : flat.size]
        return got.reshape(self.num, *values.shape)

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Copy ``state`` to the host, replicate it to the peer and write both in the background."""
        self._finish_previous()
        t0 = time.perf_counter()
        entries = held_pieces(state)
        named = dict(named_leaves(state))
        pieces = {
            (n, index_of(s.index, named[n].shape)): s.data for n, a in named.items() for s in a.addressable_shards
        }
        host = jax.device_get([pieces[(e.name, e.index)] for e in entries])
        sig = signature(state)
        payload = pack(meta, host)
        t1 = time.perf_counter()
        replica, t2, sent = None, t1, 0
        if self.shift:
            shared = self._shared_with_holder(state, sig, self.rank)
            send = (
                payload
                if not shared
                else pack(meta, [a for e, a in zip(entries, host) if (e.name, e.index) not in shared])
            )
            replica = self._roll(send, self.shift, full=int(payload.size))
            t2, sent = time.perf_counter(), int(send.size)
        stats = LocalStats(step, t2 - t0, t2 - t1, int(payload.size), sent)
        self.stats.append(stats)
        files = [(self.rank, payload, entries_record(entries))]
        if replica is not None:
            files.append((self.source, replica, self._replica_record(state, sig)))
        layout = {"global": global_signature(state), "num": self.num}
        self._writer.submit(self._write, step, sig, files, stats, t0, layout, name=f"jaxdist-local-{step}")

    def _replica_record(self, tree: Any, sig: str) -> list[list[Any]]:
        """The pieces of the replica file this process keeps (its source's, less those it holds itself)."""
        if (sig, "record") not in self._shared:
            shared = self._shared_with_holder(tree, sig, self.source)
            theirs = [e for e in held_pieces(tree, self.source) if (e.name, e.index) not in shared]
            self._shared[(sig, "record")] = entries_record(theirs)
        return self._shared[(sig, "record")]

    def _write(
        self,
        step: int,
        sig: str,
        files: list[tuple[int, np.ndarray, list]],
        stats: LocalStats,
        t0: float,
        layout: dict[str, Any],
    ) -> None:
        try:
            folder = self.directory / str(step)
            folder.mkdir(parents=True, exist_ok=True)
            for data_rank, payload, record in files:
                stem = f"r{data_rank}.w{self.rank}"
                _write_atomic(folder / f"{stem}.bin", payload)
                marker = {
                    "format": FORMAT,
                    "step": step,
                    "rank": data_rank,
                    "writer": self.rank,
                    "signature": sig,
                    "bytes": int(payload.size),
                    "crc32": zlib.crc32(payload),
                    **layout,
                    "entries": record,  # what a restore onto another layout reads (local_reshard)
                }
                _write_atomic(folder / f"{stem}.json", json.dumps(marker).encode())
            self._collect_garbage()
            stats.background_s = time.perf_counter() - t0 - stats.blocked_s
        except BaseException as e:  # the writer re-raises it at the next save/wait on the main thread
            log.error("local checkpoint of step %d in %s failed: %s", step, self.directory, e)
            raise

    def _collect_garbage(self) -> None:
        steps = sorted(self._own_steps())
        for s in steps[: -self.keep]:
            self._remove_step(s)

    def _own_steps(self) -> set[int]:
        return {
            int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and any(p.glob(f"r*.w{self.rank}.json"))
        }

    def _remove_step(self, step: int) -> None:
        folder = self.directory / str(step)
        for f in folder.glob(f"r*.w{self.rank}.*"):
            f.unlink(missing_ok=True)
        try:
            folder.rmdir()  # only once no other writer's files are left in it
        except OSError:
            pass

    def _finish_previous(self) -> None:
        self._writer.wait()

    def wait(self) -> None:
        """Block until the background write has finished; raises if it failed."""
        self._finish_previous()

    def close(self) -> None:
        self._writer.close()

    # ------------------------------------------------------------------ restore

    def _available(self, sig: str) -> dict[int, dict[int, Path]]:
        """{data rank: {step: .bin path}} of this process's good files (own rank and its replica's source)."""
        found: dict[int, dict[int, Path]] = {}
        wanted = {self.rank, self.source}
        for marker in self.directory.glob("*/r*.w*.json"):
            try:
                m = json.loads(marker.read_bytes().decode())
                step, rank, writer = int(m["step"]), int(m["rank"]), int(m["writer"])
                good = m["format"] == FORMAT and marker.name == f"r{rank}.w{writer}.json"
                good &= marker.parent.name == str(step)
            except (OSError, ValueError, KeyError, TypeError):
                good = False
            if not good:  # damage, not a save in progress (the marker is written last, atomically)
                log.warning("local checkpoint marker %s does not parse or match its file; not using it", marker)
                continue
            if m.get("signature") != sig or rank not in wanted:
                continue
            if self.not_before and marker.stat().st_mtime < self.not_before:
                log.info("local checkpoint %s predates the run's fresh start; not using it", marker)
                continue
            data = marker.with_name(marker.name[: -len(".json")] + ".bin")
            try:
                ok = data.stat().st_size == m["bytes"] and zlib.crc32(data.read_bytes()) == m["crc32"]
            except OSError:
                ok = False
            if not ok:
                log.warning("local checkpoint file %s does not match its size or checksum; not using it", data)
                continue
            found.setdefault(rank, {})[step] = data
        return found

    def restore(self, abstract_state: Any, newer_than: int = -1) -> tuple[Any, dict[str, Any]] | None:
        """(state, meta) of the newest step every rank can get, if newer than ``newer_than``; else None.

        Collective.  ``abstract_state``: ShapeDtypeStructs with shardings, as
        :meth:`~jaxdist.train.trainer.Trainer.abstract_state` gives.
        """
        self._finish_previous()
        sig = signature(abstract_state)
        avail = self._available(sig)
        own = sorted(avail.get(self.rank, {}), reverse=True)[:MAX_STEPS]
        rep = sorted(avail.get(self.source, {}), reverse=True)[:MAX_STEPS] if self.source is not None else []
        table = np.full((2, MAX_STEPS), -1, np.int64)
        table[0, : len(own)], table[1, : len(rep)] = own, rep
        everyone = self._allgather(table) if self.num > 1 else table[None]
        has_own = [set(everyone[r, 0]) - {-1} for r in range(self.num)]
        has_rep = []  # rank r's replica is held by rank r + shift; shared pieces are in that rank's own file
        for r in range(self.num):
            holder = (r + self.shift) % self.num
            steps = set(everyone[holder, 1]) - {-1} if self.shift else set()
            if steps and self._shared_with_holder(abstract_state, sig, r):
                steps &= has_own[holder]
            has_rep.append(steps)
        feasible = [
            s
            for s in set().union(*has_own, *has_rep)
            if s > newer_than and all(s in has_own[r] or s in has_rep[r] for r in range(self.num))
        ]
        if not feasible:  # maybe a step of another layout (the group shrank or grew): reshard it
            restored = restore_resharded(self, abstract_state, newer_than)
            if restored is not None:
                drop_newer(self.directory, int(restored[1]["step"]))
            return restored
        step = max(feasible)
        need = [step not in has_own[r] for r in range(self.num)]
        t0 = time.perf_counter()
        payload = None if need[self.rank] else np.fromfile(avail[self.rank][step], np.uint8)
        if any(need):  # the holders send replicas back to the ranks that lost theirs
            send = np.zeros(0, np.uint8)
            if self.source is not None and need[self.source]:
                send = self._replica_payload(abstract_state, sig, avail, step)
            got = self._roll(send, -self.shift)
            if need[self.rank]:
                payload = got
        meta, arrays = unpack(payload, held_pieces(abstract_state))
        state = build_state(abstract_state, arrays)
        self.discard_after(step)
        log.info(
            "restored step %d from the local tier in %s (%.2f s; from peers: ranks %s)",
            step,
            self.directory,
            time.perf_counter() - t0,
            [r for r in range(self.num) if need[r]] or "none",
        )
        return state, meta

    def _replica_payload(self, abstract_state: Any, sig: str, avail: dict, step: int) -> np.ndarray:
        """The whole payload of ``self.source`` at ``step``: its replica file plus the pieces shared with this rank."""
        stored = np.fromfile(avail[self.source][step], np.uint8)
        shared = self._shared_with_holder(abstract_state, sig, self.source)
        if not shared:
            return stored
        theirs = held_pieces(abstract_state, self.source)
        meta, sent = unpack(stored, [e for e in theirs if (e.name, e.index) not in shared])
        _, mine = unpack(np.fromfile(avail[self.rank][step], np.uint8), held_pieces(abstract_state))
        return pack(meta, [sent[k] if k in sent else mine[k] for k in ((e.name, e.index) for e in theirs)])

    def discard_after(self, step: int) -> None:
        """Delete this process's files of steps after ``step`` (the job resumed from ``step``)."""
        self._finish_previous()
        for s in self._own_steps():
            if s > step:
                self._remove_step(s)

    def clear(self, remove_dir: bool = False) -> None:
        """Delete this process's files (a run that starts over must not restore an older run's steps);
        ``remove_dir``: then the run's directory too, once no other process's files are left in it."""
        self._finish_previous()
        for s in self._own_steps():
            self._remove_step(s)
        if remove_dir:
            try:
                self.directory.rmdir()
            except OSError:
                pass  # another process's files (or a step of another layout) are still there


def _width(total: int) -> int:
    """Bytes per collective block for a payload of ``total`` bytes: rounded up, so few shapes are compiled."""
    return min(CHUNK_BYTES, -(-max(total, 1) // _ALIGN) * _ALIGN)


def _write_atomic(path: Path, data: bytes | np.ndarray) -> None:
    """Write under a temporary name, then rename.  No fsync: a crashed process leaves the page cache
    intact, a crashed node is replaced (its data comes from the peer), and a file torn by a reboot
    fails its CRC-32 and is not used."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)

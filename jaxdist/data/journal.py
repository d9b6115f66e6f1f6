"""The batch-list journal of a run: ``<run>/batchlist/``.

* ``v000001.json``, ``v000002.json``, ...: one file per version
  (:func:`~jaxdist.data.batchlist.encode`: a whole order, or the change from
  the version before, which loading applies to that one's order), never rewritten, written to a
  temporary file, fsync'ed and renamed, carrying a SHA-256 checksum of its
  content: a crash never leaves a half-written version, and a truncated or
  altered file is refused with the way back to the previous version;
* ``requests/``: additions waiting for the trainer (``applied/`` and
  ``rejected/`` keep the settled ones);
* ``cursor.json``: version and cursor of the newest checkpoint save.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
import zlib
from pathlib import Path
from typing import Any

from jaxdist.data.batchlist import (
    FORMAT,
    BatchList,
    BatchListError,
    SourceEntry,
    Stored,
    canonical_json,
    decode,
    encode,
)

log = logging.getLogger(__name__)
_VERSION_RE = re.compile(r"^v(\d{6})\.json$")


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename (and fsync the directory)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def append_lines(path: Path, data: bytes, fsync: bool = False) -> None:
    """Append whole lines (``data`` ends with a newline) to ``path``; a torn last line is closed first.

    A kill mid-append leaves a last line without its newline; the next append starts on a fresh line, so
    the torn record stays one line a reader names and skips instead of swallowing the next record.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end:
            f.seek(end - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


class Journal:
    """The batch-list files of one run, under ``<run_dir>/batchlist/``."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "batchlist"
        self.requests_dir = self.dir / "requests"

    def path(self, version: int) -> Path:
        return self.dir / f"v{version:06d}.json"

    def versions(self) -> list[int]:
        """Versions on disk, oldest first (damaged ones included)."""
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _VERSION_RE.match(p.name)))

    def latest(self) -> int | None:
        vs = self.versions()
        return vs[-1] if vs else None

    def _newest(self) -> int:
        version = self.latest()
        if version is None:
            raise BatchListError(
                f"{self.run_dir} has no batch list ({self.dir} is empty or missing): "
                "start training once with `jaxdist train` to create it."
            )
        return version

    def read(self, version: int | None = None, orders: bool = True) -> Stored:
        """The file of ``version`` (default: the newest), checksum checked, its order not rebuilt (a delta's
        needs its parents: :meth:`load`; ``orders=False``: nor unpacked); BatchListError if it is missing or
        damaged."""
        version = self._newest() if version is None else version
        path = self.path(version)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BatchListError(
                f"batch list version {version} does not exist in {self.dir} (versions: {self.versions() or 'none'})."
            ) from None
        try:
            stored = decode(data, str(path), orders)
            if stored.version != version:
                raise ValueError(f"it holds version {stored.version}")
            if stored.depth and stored.parent != version - 1:
                raise ValueError(f"it changes version {stored.parent}, not the version before it")
        except (ValueError, KeyError, TypeError, zlib.error) as e:
            err = BatchListError(
                f"batch list version {version} ({path}) is damaged: {e}; {self._fallback_hint(version)}"
            )
            err.reason = str(e)
            raise err from None
        return stored

    def copy_of(self, version: int, orders: bool = True) -> Stored | None:
        """Version ``version`` as the next version's file keeps it (its operation, change and added sources), or
        None where that file is missing, damaged or keeps no copy (after version 1, and format /1)."""
        if not self.path(version + 1).exists():
            return None
        try:
            nxt = self.read(version + 1, orders)
        except BatchListError:
            return None
        return nxt.previous if nxt.previous is not None and nxt.previous.version == version else None

    def _read_or_copy(self, version: int, orders: bool = True) -> Stored:
        """:meth:`read`, or where the file is damaged or missing, the copy the next version keeps (warned)."""
        try:
            return self.read(version, orders)
        except BatchListError as damaged:
            copy = self.copy_of(version, orders)
            if copy is None:
                raise
            log.warning(
                "batch list version %d (%s) is unreadable (%s): its change is read from the copy in version %d "
                "(`jaxdist data verify` lists it)",
                version,
                self.path(version),
                getattr(damaged, "reason", "missing"),
                version + 1,
            )
            return copy

    def head(self, version: int | None = None) -> Stored:
        """Version ``version`` (default: the newest) without its order: its operation, shapes, length and every
        source (the files back to its last whole order read for their sources, none of their orders unpacked).
        ``sources`` holds every source of the version here; ``order`` and ``delta`` are None."""
        version = self._newest() if version is None else version
        chain = [self._read_or_copy(version, orders=False)]
        while chain[-1].depth:
            chain.append(self._read_below(version, chain[-1].parent, orders=False))
        sources: tuple[SourceEntry, ...] | None = None
        try:
            for stored in reversed(chain):
                sources = stored.all_sources(sources)
        except ValueError as e:
            raise BatchListError(
                f"batch list version {stored.version} ({self.path(stored.version)}) is damaged: {e}; "
                f"{self._fallback_hint(stored.version)}"
            ) from None
        assert sources is not None
        return dataclasses.replace(chain[0], sources=sources, depth=0)

    def _read_below(self, version: int, below: int | None, orders: bool = True) -> Stored:
        assert below is not None
        try:
            return self._read_or_copy(below, orders)
        except BatchListError as e:
            raise BatchListError(
                f"batch list version {version} is built from version {below}'s order (its file holds only "
                f"the changes), which cannot be read: {e}"
            ) from None

    def load(self, version: int | None = None, known: BatchList | None = None) -> BatchList:
        """Version ``version`` (default: the newest) with its whole order; BatchListError if it, or a version
        its order is built on, is missing or damaged.

        A version stored as a delta is built from the newest whole order before it and the deltas since, or
        from ``known`` (a version already in memory, such as the one a trainer is reading) when that is on the
        way: then adopting the next version costs one delta, not the chain.  The SHA-256 each file records of
        its whole order is compared with the order built, so ``known`` is held to the files too (if it differs,
        the chain is read instead).
        """
        version = self._newest() if version is None else version
        chain = [self._read_or_copy(version)]
        base: BatchList | None = None
        while chain[-1].depth:
            if known is not None and known.version == chain[-1].parent:
                base = known
                break
            chain.append(self._read_below(version, chain[-1].parent))
        # Each file's checksum holds; the order's SHA-256 is compared once, at the end, over the whole chain (and
        # step by step only to name the version at fault when it differs).
        for check in (False, True):
            bl = base
            for k, stored in enumerate(reversed(chain)):
                try:
                    bl = stored.resolve(bl, check=check or k == len(chain) - 1)
                except ValueError as e:
                    if base is not None:  # ``known`` is not the order on disk
                        return self.load(version)
                    if not check:
                        break
                    path = self.path(stored.version)
                    raise BatchListError(
                        f"batch list version {stored.version} ({path}) is damaged: {e}; "
                        f"{self._fallback_hint(stored.version)}"
                    ) from None
            else:
                assert bl is not None
                return bl
        raise AssertionError("a chain whose end differs has a step that differs")

    def _fallback_hint(self, version: int) -> str:
        versions = self.versions()
        older = [v for v in versions if v < version]
        newer = [v for v in versions if v > version]
        what = f"the files of versions {version} to {newer[-1]}" if newer else "that file"
        if older:
            return (
                f"move {what} aside to continue from version {older[-1]}, which stays usable "
                "(`jaxdist data verify` checks every version)."
            )
        return "delete the batchlist folder to rebuild version 1 from the config."

    def write(self, bl: BatchList) -> BatchList:
        """Append ``bl`` (its version must be new) and return it with its checksum set."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(bl.version)
        assert not path.exists(), f"batch list version {bl.version} already exists: versions are never rewritten"
        data, checksum = encode(bl)
        atomic_write(path, data)
        return dataclasses.replace(bl, checksum=checksum)

    # ------------------------------------------------------------------ requests

    def submit(self, request: dict[str, Any]) -> str:
        """Queue an addition for the trainer; returns the request's file name."""
        self.requests_dir.mkdir(parents=True, exist_ok=True)
        name = f"r{time.time_ns():020d}-{os.getpid()}.json"
        body = {**request, "format": FORMAT + "/request"}
        doc = {**body, "checksum": hashlib.sha256(canonical_json(body)).hexdigest()}
        atomic_write(self.requests_dir / name, json.dumps(doc, sort_keys=True).encode("utf-8") + b"\n")
        return name

    def pending(self) -> list[tuple[str, dict[str, Any] | None]]:
        """Requests waiting, oldest first: (name, request or None if the file is damaged)."""
        try:
            names = sorted(n for n in os.listdir(self.requests_dir) if n.startswith("r") and n.endswith(".json"))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            try:
                doc = json.loads((self.requests_dir / name).read_text())
                checksum = doc.pop("checksum")
                out.append((name, doc if checksum == hashlib.sha256(canonical_json(doc)).hexdigest() else None))
            except (OSError, ValueError, KeyError):
                out.append((name, None))
        return out

    def settle(self, name: str, outcome: str) -> None:
        """Move a request to ``requests/applied/`` or ``requests/rejected/`` (kept for the record)."""
        dest = self.requests_dir / outcome
        dest.mkdir(exist_ok=True)
        os.replace(self.requests_dir / name, dest / name)

    def applied_requests(self) -> set[str]:
        """Names of the requests a version applied that were not yet moved to ``requests/applied/`` (a crash
        between writing the version and moving the request).

        Reads versions from the newest back to the newest addition whose request was already moved: additions
        are applied one at a time, each moved before the next is written, so every older one was moved too.
        The cost is the versions since the last moved addition (one or two), not the whole journal
        (every version read at every addition made 1,000 additions to a long run quadratic).
        """
        try:
            moved = set(os.listdir(self.requests_dir / "applied"))
        except FileNotFoundError:
            moved = set()
        out: set[str] = set()
        for v in reversed(self.versions()):
            try:
                name = self.read(v, orders=False).op.get("request")
            except BatchListError:
                continue
            if name is None:
                continue
            if name in moved:
                break
            out.add(name)
        return out

    # ------------------------------------------------------------------ cursor

    def write_cursor(self, version: int, cursor: int) -> None:
        """Record the version and cursor of the newest checkpoint save (for ``jaxdist data show``)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(
            self.dir / "cursor.json",
            json.dumps({"version": version, "cursor": cursor, "time": time.time()}).encode() + b"\n",
        )

    def read_cursor(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / "cursor.json").read_text())
        except (OSError, ValueError):
            return None

"""Cached cluster setup: what it takes to form the same cluster again, kept under a key.

An entry (``<root>/layout/<digest>/entry.json``) records, for one
:class:`SetupKey` (hosts in rank order, devices per host, device kind, the
resolved mesh, library versions):

* the rank -> host assignment and each host's devices, and the coordinator endpoint;
* the mesh's device order (global device ids, as ``build_mesh`` laid them out);
* the XLA persistent compilation cache directory (``<root>/xla/<digest>``;
  its key leaves the host names out, because compiled programs do not depend
  on them, so a group with a swapped-in standby still finds its executables);
* on GPUs, each rank's NCCL topology and graph files: dumped by the first run
  (``NCCL_TOPO_DUMP_FILE``, ``NCCL_GRAPH_DUMP_FILE``) and given to later ones
  (``NCCL_TOPO_FILE``, ``NCCL_GRAPH_FILE``).  On CPU there are none.

A resubmitted job with the same key reuses the entry; a different key is a
different entry (built from scratch).  An entry is used only when it is
complete (its first generation made a step), its stored key equals the key
asked for field by field, and every file it lists is present with its size;
anything else is *stale*: it is removed and rebuilt, never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import shutil
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SetupKey:
    """What a cluster setup depends on.  ``mesh``: resolved axis sizes; ``versions``: name -> version."""

    hosts: tuple[str, ...]
    devices_per_host: int
    device_kind: str
    mesh: tuple[tuple[str, int], ...]
    versions: tuple[tuple[str, str], ...]

    @staticmethod
    def make(
        hosts, devices_per_host: int, device_kind: str, mesh: dict[str, int], versions: dict[str, str]
    ) -> SetupKey:
        return SetupKey(
            tuple(hosts),
            int(devices_per_host),
            str(device_kind).lower(),
            tuple(sorted((k, int(v)) for k, v in mesh.items())),
            tuple(sorted(versions.items())),
        )

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def digest(self) -> str:
        """16 hex digits identifying the whole key."""
        return _digest(self.to_dict())

    def compile_digest(self) -> str:
        """16 hex digits of the parts compiled programs depend on (everything but host names)."""
        d = self.to_dict()
        d["hosts"] = len(self.hosts)
        return _digest(d)

    @property
    def gpu(self) -> bool:
        return self.device_kind not in ("cpu",) and not self.device_kind.startswith("cpu")


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class SetupEntry:
    """One cached setup (see the module docstring); ``fresh``: built by this job, nothing to reuse yet."""

    path: Path
    key: SetupKey
    compile_cache: Path
    coordinator: str = ""
    mesh_device_order: list[int] | None = None
    complete: bool = False
    fresh: bool = True
    files: dict[str, int] = dataclasses.field(default_factory=dict)
    created: float = dataclasses.field(default_factory=time.time)

    @property
    def rank_hosts(self) -> list[str]:
        return list(self.key.hosts)

    def nccl_files(self, rank: int) -> tuple[Path, Path]:
        return self.path / f"nccl_topo.{rank}.xml", self.path / f"nccl_graph.{rank}.xml"

    def worker_env(self, rank: int) -> dict[str, str]:
        """Environment for rank ``rank``'s process: its compilation cache and (GPU) NCCL topology files."""
        env = {"JAXDIST_COMPILE_CACHE": str(self.compile_cache)}
        if self.key.gpu:
            topo, graph = self.nccl_files(rank)
            if not self.fresh and topo.name in self.files and graph.name in self.files:
                env.update(NCCL_TOPO_FILE=str(topo), NCCL_GRAPH_FILE=str(graph))
            else:
                env.update(NCCL_TOPO_DUMP_FILE=str(topo), NCCL_GRAPH_DUMP_FILE=str(graph))
        return env

    def save(self) -> None:
        data = {
            "key": self.key.to_dict(),
            "coordinator": self.coordinator,
            "complete": self.complete,
            "mesh_device_order": self.mesh_device_order,
            "files": self.files,
            "created": self.created,
            "compile_cache": str(self.compile_cache),
        }
        tmp = self.path / "entry.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path / "entry.json")

    def mark_started(self, mesh_device_order: list[int] | None) -> bool:
        """Record the first generation's mesh order and the files it dumped.

        Returns False (nothing recorded) if the order contradicts the one the entry holds.
        """
        order = None if mesh_device_order is None else [int(i) for i in mesh_device_order]
        if self.mesh_device_order is not None and order is not None and order != self.mesh_device_order:
            return False
        if order is not None:
            self.mesh_device_order = order
        if self.key.gpu:
            for rank in range(len(self.key.hosts)):
                for f in self.nccl_files(rank):
                    if f.is_file():
                        self.files[f.name] = f.stat().st_size
        self.complete = True
        self.save()
        return True


class SetupCache:
    """Entries under ``root``: ``layout/<key digest>/`` and ``xla/<compile digest>/``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.stale_removed: list[str] = []

    def _dir(self, key: SetupKey) -> Path:
        return self.root / "layout" / key.digest()

    def lookup(self, key: SetupKey) -> SetupEntry | None:
        """The complete, consistent entry for ``key``, or None.

        A stale entry is removed (and its directory name listed in ``stale_removed``).
        """
        d = self._dir(key)
        f = d / "entry.json"
        if not f.is_file():
            return None
        problem = None
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            data, problem = {}, f"unreadable entry.json ({e})"
        if problem is None:
            problem = self._problem(key, d, data)
        if problem is not None:
            log.warning("setup cache entry %s is stale (%s): rebuilding it", d, problem)
            self.stale_removed.append(d.name)
            shutil.rmtree(d, ignore_errors=True)
            return None
        return SetupEntry(
            d,
            key,
            Path(data["compile_cache"]),
            data.get("coordinator", ""),
            data.get("mesh_device_order"),
            True,
            False,
            dict(data.get("files", {})),
            data.get("created", 0.0),
        )

    @staticmethod
    def _problem(key: SetupKey, d: Path, data: dict) -> str | None:
        if data.get("key") != key.to_dict():
            return "its key differs from the one asked for"
        if not data.get("complete"):
            return "its first run never made a step"
        for name, size in data.get("files", {}).items():
            p = d / name
            if not p.is_file() or p.stat().st_size != size:
                return f"{name} is missing or changed"
        if not Path(data.get("compile_cache", "")).is_dir():
            return "its compilation cache directory is gone"
        return None

    def get_or_create(self, key: SetupKey, coordinator: str = "") -> SetupEntry:
        """The entry for ``key``: reused if valid, else a fresh one (``fresh=True``)."""
        entry = self.lookup(key)
        if entry is not None:
            return entry
        d = self._dir(key)
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        xla = self.root / "xla" / key.compile_digest()
        xla.mkdir(parents=True, exist_ok=True)
        entry = SetupEntry(d, key, xla, coordinator)
        entry.save()
        return entry

    def invalidate(self, key: SetupKey) -> None:
        """Remove the entry for ``key`` (e.g. when a run found it contradicted)."""
        shutil.rmtree(self._dir(key), ignore_errors=True)

    def layouts(self, **fixed: Any) -> list[SetupKey]:
        """Keys of complete entries whose non-host fields equal ``fixed`` (to reuse a rank -> host assignment)."""
        out = []
        for f in sorted((self.root / "layout").glob("*/entry.json")):
            try:
                data = json.loads(f.read_text())
                k = data["key"]
                key = SetupKey(
                    tuple(k["hosts"]),
                    k["devices_per_host"],
                    k["device_kind"],
                    tuple(tuple(x) for x in k["mesh"]),
                    tuple(tuple(x) for x in k["versions"]),
                )
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if data.get("complete") and all(getattr(key, name) == value for name, value in fixed.items()):
                out.append(key)
        return out


def library_versions() -> dict[str, str]:
    """Versions of python, jax, jaxlib, flax, optax, orbax and jaxdist, read without importing them."""
    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "jaxdist"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "none"
    return out

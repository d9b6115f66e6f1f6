"""When a checkpoint counts: per-file checksums and the commit marker.

A step folder ``<dir>/<step>/`` holds orbax's files.  After orbax has
finished (all processes wrote, orbax renamed the temporary folder), each
process records the size and CRC-32 of the files it wrote in
``jaxdist_checksums/process_<i>.json``; once every process has done so,
process 0 merges them into ``jaxdist_commit.json``, written atomically
(temporary file, fsync, rename).  Only a step folder with that marker is a
checkpoint; a folder without it is an incomplete save and is ignored.

Which process wrote a file follows orbax's layout: ``state/ocdbt.process_<i>/``
and ``*/array_metadatas/process_<i>`` are process i's, the rest process 0's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any, Iterable

COMMIT_FILE = "jaxdist_commit.json"
CHECKSUM_DIR = "jaxdist_checksums"
FORMAT = "jaxdist-checkpoint-v1"
_CHUNK = 4 * 2**20  # bytes read at a time while checksumming
_PROCESS_PART = re.compile(r"(?:^|/)(?:ocdbt\.process_|array_metadatas/process_)(\d+)(?:/|$)")


class CheckpointDamaged(Exception):
    """A checkpoint's files do not match its recorded checksums (or are missing)."""


def writer_of(relpath: str) -> int:
    """The process that wrote ``relpath`` (a path inside a step folder, '/'-separated)."""
    m = _PROCESS_PART.search(relpath)
    return int(m.group(1)) if m else 0


def file_crc32(path: Path) -> tuple[int, str]:
    """(size in bytes, CRC-32 as 8 hex digits) of a file, read in 4 MiB chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, f"{crc:08x}"


def data_files(step_dir: Path) -> list[str]:
    """Relative paths of the files orbax wrote in ``step_dir`` (jaxdist's own files excluded), sorted."""
    out = []
    for root, _, files in os.walk(step_dir):
        rel_root = Path(root).relative_to(step_dir)
        if rel_root.parts and rel_root.parts[0] == CHECKSUM_DIR:
            continue
        for name in files:
            rel = (rel_root / name).as_posix()
            if rel != COMMIT_FILE and not rel.endswith(".tmp"):
                out.append(rel)
    return sorted(out)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON so that a reader sees the old file, no file, or the whole new one."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def record_own_checksums(step_dir: Path, process: int) -> dict[str, dict[str, Any]]:
    """Checksum the files ``process`` wrote and save them as ``jaxdist_checksums/process_<i>.json``."""
    files = {
        rel: dict(zip(("size", "crc32"), file_crc32(step_dir / rel)), process=process)
        for rel in data_files(step_dir)
        if writer_of(rel) == process
    }
    (step_dir / CHECKSUM_DIR).mkdir(exist_ok=True)
    write_json_atomic(step_dir / CHECKSUM_DIR / f"process_{process}.json", files)
    return files


def commit(step_dir: Path, num_processes: int, info: dict[str, Any]) -> dict[str, Any]:
    """Merge every process's checksums and write the commit marker (process 0, after all recorded).

    Raises RuntimeError if a process's checksums are missing or a file on disk
    is not covered by any of them.
    """
    files: dict[str, dict[str, Any]] = {}
    for p in range(num_processes):
        part = step_dir / CHECKSUM_DIR / f"process_{p}.json"
        if not part.exists():
            raise RuntimeError(f"process {p} recorded no checksums in {step_dir}")
        files.update(json.loads(part.read_text()))
    missing = sorted(set(data_files(step_dir)) - set(files))
    if missing:
        raise RuntimeError(f"{len(missing)} files of {step_dir} have no checksum, e.g. {missing[0]}")
    written = [0] * num_processes
    for f in files.values():
        written[f["process"]] += f["size"]
    marker = {
        "format": FORMAT,
        "algorithm": "crc32",
        "num_processes": num_processes,
        "bytes_written_per_process": written,
        "files": files,
        **info,
    }
    write_json_atomic(step_dir / COMMIT_FILE, marker)
    return marker


def read_commit(step_dir: Path) -> dict[str, Any] | None:
    """The commit marker of ``step_dir``, or None if the save never completed (or the marker is unreadable)."""
    try:
        marker = json.loads((Path(step_dir) / COMMIT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("format") == FORMAT else None


def verify_files(step_dir: Path, files: dict[str, dict[str, Any]], names: Iterable[str] | None = None) -> list[str]:
    """Problems (one sentence each) with the recorded ``files`` of ``step_dir``; [] if all match.

    ``names`` restricts the check to some of them (a process's share).
    """
    problems = []
    for rel in sorted(files if names is None else names):
        want = files[rel]
        path = Path(step_dir) / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
            continue
        size, crc = file_crc32(path)
        if size != want["size"]:
            problems.append(f"{rel} has {size} bytes, {want['size']} were written")
        elif crc != want["crc32"]:
            problems.append(f"{rel} has CRC-32 {crc}, {want['crc32']} was written")
    return problems


@dataclasses.dataclass(frozen=True)
class StepFolder:
    """A folder of the checkpoint directory: ``step``, ``path``, ``state`` and the marker if committed.

    ``state``: "committed", "incomplete" (no marker: a save that did not
    finish, or one written before jaxdist recorded checksums), "abandoned"
    (an incomplete one set aside as ``<step>.incomplete``), "damaged" (set
    aside after a failed verification: ``<step>.damaged``) or "temporary"
    (orbax's unfinished ``<step>.orbax-checkpoint-tmp*``).
    """

    step: int
    path: Path
    state: str
    marker: dict[str, Any] | None = None


_ASIDE = re.compile(r"^(\d+)\.(damaged|incomplete)(?:-\d+)?$")
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


def scan(directory: Path) -> list[StepFolder]:
    """Every step-like folder of ``directory``, sorted by step then name."""
    out = []
    if not Path(directory).is_dir():
        return out
    for p in Path(directory).iterdir():
        if not p.is_dir():
            continue
        if p.name.isdigit():
            marker = read_commit(p)
            out.append(StepFolder(int(p.name), p, "committed" if marker else "incomplete", marker))
        elif m := _ASIDE.match(p.name):
            out.append(StepFolder(int(m.group(1)), p, "damaged" if m.group(2) == "damaged" else "abandoned"))
        elif m := _TMP.match(p.name):
            out.append(StepFolder(int(m.group(1)), p, "temporary"))
    return sorted(out, key=lambda s: (s.step, s.path.name))


def set_aside(step_dir: Path, why: str = "damaged") -> Path:
    """Rename a step folder to ``<step>.<why>`` (``-2``, ``-3``... if taken); returns the new path."""
    target = step_dir.with_name(f"{step_dir.name}.{why}")
    n = 2
    while target.exists():
        target = step_dir.with_name(f"{step_dir.name}.{why}-{n}")
        n += 1
    os.replace(step_dir, target)
    return target

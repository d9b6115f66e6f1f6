"""When a checkpoint counts: per-file checksums and the commit marker.

A step folder ``<dir>/<step>/`` holds orbax's files.  After orbax has
finished (all processes wrote, orbax renamed the temporary folder), each
process records the size and checksum of the files it wrote in
``jaxdist_checksums/process_<i>.json``; once every process has done so,
process 0 merges them into ``jaxdist_commit.json``, written atomically
(temporary file, fsync, rename).  Only a step folder with that marker is a
checkpoint; a folder without it is an incomplete save and is ignored.  A
marker that exists but does not parse, or does not match what it describes
(its own CRC-32, its step, its byte counts), is damage, not an unfinished
save: :func:`marker_problem` names it and the folder is a "bad-marker" one.

Checksums are CRC-32C (the ``crc32c`` package, computed with the CPU's CRC instruction: about twice zlib's
CRC-32) over each file mapped into memory, so the page cache's pages are checksummed where they lie instead of
copied out first (the copy cost about as much as the CRC); a process without ``crc32c``, or on a CPU without the
instruction, records CRC-32 (zlib) instead.  Like any checksum tool that maps files (``b3sum``), a process whose mapped file
is cut short by another process, or whose disk fails to return a mapped page, is stopped by SIGBUS rather than
getting an error it could report.  Each file's entry names its algorithm by its key (``crc32c`` or ``crc32``),
so markers of either, or of processes that differed, are read alike.

Which process wrote a file follows orbax's layout: ``state/ocdbt.process_<i>/``
and ``*/array_metadatas/process_<i>`` are process i's, the rest process 0's.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import stat
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jaxdist.checkpoint.crc import combine
from jaxdist.errors import ConfigError

COMMIT_FILE = "jaxdist_commit.json"
CHECKSUM_DIR = "jaxdist_checksums"
FORMAT = "jaxdist-checkpoint-v3"  # v3: files checksummed with CRC-32C (key ``crc32c``) or CRC-32 (key ``crc32``)
# v1 markers (no CRC-32 of their own) and v2 (every file CRC-32) are still read
FORMATS = ("jaxdist-checkpoint-v1", "jaxdist-checkpoint-v2", FORMAT)
ALGORITHMS = ("crc32c", "crc32")  # a file entry's checksum keys
_THREADS = 4  # pieces checksummed at once
_PIECE = 32 * 2**20  # bytes of a file one thread checksums; their CRCs are joined
_PROCESS_PART = re.compile(r"(?:^|/)(?:ocdbt\.process_|array_metadatas/process_)(\d+)(?:/|$)")


class CheckpointDamaged(Exception):
    """A checkpoint's files do not match its recorded checksums (or are missing)."""


class ChecksumUnavailable(ConfigError):
    """A checkpoint's files are checksummed with CRC-32C and this Python lacks ``crc32c`` to check them."""


def _crc32c_module() -> Any:
    """The ``crc32c`` package, or None if it is not installed."""
    try:
        import crc32c  # optional at run time: a --no-deps install may lack it (then CRC-32)
    except ImportError:
        return None
    return crc32c


def save_algorithm() -> str:
    """The checksum a save records here: ``crc32c`` where ``crc32c`` uses the CPU's CRC instruction, else ``crc32``
    (zlib)."""
    mod = _crc32c_module()
    return "crc32c" if mod is not None and mod.hardware_based else "crc32"


def writer_of(relpath: str) -> int:
    """The process that wrote ``relpath`` (a path inside a step folder, '/'-separated)."""
    m = _PROCESS_PART.search(relpath)
    return int(m.group(1)) if m else 0


def _mapped(path: Path, start: int, length: int | None, crc: Callable[[memoryview], int]) -> tuple[int, str]:
    """(bytes, ``crc`` of them as 8 hex digits) of a file's ``length`` bytes from ``start`` (None: to its end),
    mapped into memory: the CRC reads the page cache's pages, nothing is copied."""
    with open(path, "rb") as f:
        end = os.fstat(f.fileno()).st_size
        end = end if length is None else min(end, start + length)
        if end <= start:
            return 0, f"{crc(memoryview(b'')):08x}"
        with mmap.mmap(f.fileno(), end, access=mmap.ACCESS_READ) as m, memoryview(m) as whole:
            with whole[start:end] as piece:
                return end - start, f"{crc(piece):08x}"


def file_crc32(path: Path, start: int = 0, length: int | None = None) -> tuple[int, str]:
    """(bytes, CRC-32 as 8 hex digits) of a file, or of its ``length`` bytes from ``start`` (None: to its end)."""
    return _mapped(path, start, length, zlib.crc32)


def file_crc32c(path: Path, start: int = 0, length: int | None = None) -> tuple[int, str]:
    """(bytes, CRC-32C as 8 hex digits) of a file, or of its ``length`` bytes from ``start`` (None: to its end).

    Raises :class:`ChecksumUnavailable` without the ``crc32c`` package.
    """
    mod = _crc32c_module()
    if mod is None:
        raise ChecksumUnavailable(
            f"{path} is checksummed with CRC-32C and this Python lacks the crc32c package to check it: "
            "install it (pip install crc32c)."
        )
    return _mapped(path, start, length, mod.crc32c)


_FILE_SUM = {"crc32c": file_crc32c, "crc32": file_crc32}


def files_checksums(
    step_dir: Path, rels: Iterable[str], algorithm: str | dict[str, str]
) -> dict[str, tuple[int, str] | None]:
    """(size, checksum) of each ``rels`` path of ``step_dir`` (None: not a file), several pieces at a time.

    ``algorithm``: ``crc32c`` or ``crc32`` for all, or one per path.  A file is read in pieces of ``_PIECE``
    bytes on up to ``_THREADS`` threads (both checksums release the GIL), whose CRCs are then
    joined (:func:`jaxdist.checkpoint.crc.combine`): most of a step's bytes are in one data file per process,
    which a thread per file would read alone.  The last piece reads to the file's end, and pieces past a
    shortened file's end read nothing, so the size is what was read: a file that grew or shrank meanwhile does
    not match its record.
    """
    rels = list(rels)
    algorithms = {rel: algorithm if isinstance(algorithm, str) else algorithm[rel] for rel in rels}
    pieces: list[tuple[str, int, int | None]] = []  # (path, start, length; None: to the end)
    for rel in rels:
        try:
            st = (Path(step_dir) / rel).stat()
        except (FileNotFoundError, NotADirectoryError):
            continue
        if stat.S_ISREG(st.st_mode):
            n = max(1, -(-st.st_size // _PIECE))
            pieces += [(rel, i * _PIECE, _PIECE if i < n - 1 else None) for i in range(n)]

    def one(piece: tuple[str, int, int | None]) -> tuple[int, str] | None:
        rel, start, length = piece
        try:
            return _FILE_SUM[algorithms[rel]](Path(step_dir) / rel, start, length)
        except FileNotFoundError:  # removed since it was listed
            return None

    if len(pieces) <= 1:
        sums = [one(p) for p in pieces]
    else:
        with ThreadPoolExecutor(min(_THREADS, len(pieces)), thread_name_prefix="jaxdist-crc") as pool:
            sums = list(pool.map(one, pieces))
    joined: dict[str, tuple[int, int] | None] = {}  # rel -> (bytes so far, their CRC); None: gone
    for (rel, _, _), got in zip(pieces, sums):
        if got is None or (rel in joined and joined[rel] is None):
            joined[rel] = None
            continue
        (size, crc), (n, hexcrc) = joined.get(rel) or (0, 0), got
        joined[rel] = (size + n, combine(crc, int(hexcrc, 16), n, algorithms[rel]))
    out: dict[str, tuple[int, str] | None] = dict.fromkeys(rels)
    for rel, sofar in joined.items():
        out[rel] = None if sofar is None else (sofar[0], f"{sofar[1]:08x}")
    return out


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


def record_own_checksums(step_dir: Path, process: int, algorithm: str | None = None) -> dict[str, dict[str, Any]]:
    """Checksum the files ``process`` wrote and save them as ``jaxdist_checksums/process_<i>.json``.

    ``algorithm``: ``crc32c`` or ``crc32``; default :func:`save_algorithm`.
    """
    algorithm = algorithm or save_algorithm()
    sums = files_checksums(step_dir, [rel for rel in data_files(step_dir) if writer_of(rel) == process], algorithm)
    gone = sorted(rel for rel, got in sums.items() if got is None)
    if gone:
        raise FileNotFoundError(f"{step_dir / gone[0]} disappeared while its checksum was being recorded")
    files = {rel: {"size": got[0], algorithm: got[1], "process": process} for rel, got in sums.items() if got}
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
        "algorithm": "+".join(a for a in ALGORITHMS if any(a in f for f in files.values())),
        "num_processes": num_processes,
        "bytes_written_per_process": written,
        "files": files,
        **info,
    }
    marker["marker_crc32"] = marker_crc32(marker)
    write_json_atomic(step_dir / COMMIT_FILE, marker)
    return marker


def marker_crc32(marker: dict[str, Any]) -> str:
    """CRC-32 (8 hex digits) of a marker's canonical JSON without its ``marker_crc32`` field."""
    body = {k: v for k, v in marker.items() if k != "marker_crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"


def marker_problem(step_dir: Path, marker: Any) -> str | None:
    """Why a parsed commit marker of ``step_dir`` does not describe it (one phrase), or None if it does.

    Checks what needs no data read: the format, the marker's own CRC-32 (v2), the step against the folder's
    name, the files' entries and the bytes per process against them.
    """
    if not isinstance(marker, dict):
        return f"the commit marker is a JSON {type(marker).__name__}, not an object"
    if marker.get("format") not in FORMATS:
        return f"the commit marker has format {str(marker.get('format'))[:40]!r}, not one of {', '.join(FORMATS)}"
    if marker["format"] == FORMAT and marker.get("marker_crc32") != marker_crc32(marker):
        return (
            f"the commit marker's CRC-32 is {marker_crc32(marker)}, {str(marker.get('marker_crc32'))[:12]} was written"
        )
    files, procs, written = marker.get("files"), marker.get("num_processes"), marker.get("bytes_written_per_process")
    if not isinstance(files, dict) or not isinstance(procs, int) or not isinstance(written, list):
        return "the commit marker lacks its files, num_processes or bytes_written_per_process"
    if str(marker.get("step")) != Path(step_dir).name:
        return f"the commit marker is of step {str(marker.get('step'))[:20]}, not {Path(step_dir).name}"
    per_process = [0] * max(procs, 0)
    for rel, f in files.items():
        ok = isinstance(f, dict) and isinstance(f.get("size"), int) and _algorithm_of(f) is not None
        if not ok or not isinstance(f.get("process"), int) or not 0 <= f["process"] < procs:
            return f"the commit marker's entry of {str(rel)[:80]} is malformed"
        per_process[f["process"]] += f["size"]
    if per_process != written:
        return f"the commit marker records {written} bytes per process, its files sum to {per_process}"
    return None


def _algorithm_of(entry: dict[str, Any]) -> str | None:
    """The checksum key of a marker's file entry: the one of :data:`ALGORITHMS` it holds as a string, else None."""
    keys = [a for a in ALGORITHMS if isinstance(entry.get(a), str)]
    return keys[0] if len(keys) == 1 else None


def read_marker(step_dir: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(marker, None) for a good commit marker of ``step_dir``; (None, None) if there is none (an unfinished
    save); (None, problem) if one exists but does not parse or does not match (damage)."""
    path = Path(step_dir) / COMMIT_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"the commit marker cannot be read ({e.strerror})"
    try:
        marker = json.loads(raw.decode())
    except ValueError as e:  # also UnicodeDecodeError
        return None, f"the commit marker {COMMIT_FILE} does not parse ({str(e)[:80]})"
    problem = marker_problem(step_dir, marker)
    return (None, problem) if problem else (marker, None)


def read_commit(step_dir: Path) -> dict[str, Any] | None:
    """The commit marker of ``step_dir``, or None if there is none or it is damaged (see :func:`read_marker`)."""
    return read_marker(step_dir)[0]


def verify_files(step_dir: Path, files: dict[str, dict[str, Any]], names: Iterable[str] | None = None) -> list[str]:
    """Problems (one sentence each) with the recorded ``files`` of ``step_dir``; [] if all match.

    ``names`` restricts the check to some of them (a process's share).  Each file is checked with the algorithm
    its entry names (``files`` passed :func:`marker_problem`: each entry names one); raises
    :class:`ChecksumUnavailable` naming the first CRC-32C file if ``crc32c`` is not installed.
    """
    rels = list(files if names is None else names)
    algorithms = {rel: _algorithm_of(files[rel]) for rel in rels}
    problems = []
    for rel, got in sorted(files_checksums(step_dir, rels, algorithms).items()):
        want, algorithm = files[rel], algorithms[rel]
        if got is None:
            problems.append(f"{rel} is missing")
            continue
        size, crc = got
        if size != want["size"]:
            problems.append(f"{rel} has {size} bytes, {want['size']} were written")
        elif crc != want[algorithm]:
            problems.append(f"{rel} has {_NAMES[algorithm]} {crc}, {want[algorithm]} was written")
    return problems


_NAMES = {"crc32c": "CRC-32C", "crc32": "CRC-32"}


@dataclasses.dataclass(frozen=True)
class StepFolder:
    """A folder of the checkpoint directory: ``step``, ``path``, ``state`` and the marker if committed.

    ``state``: "committed", "incomplete" (no marker: a save that did not
    finish, or one written before jaxdist recorded checksums), "bad-marker"
    (a marker that does not parse or does not match: damage, ``problem`` says
    which), "abandoned"
    (an incomplete one set aside as ``<step>.incomplete``), "damaged" (set
    aside after a failed verification: ``<step>.damaged``) or "temporary"
    (orbax's unfinished ``<step>.orbax-checkpoint-tmp*``, or a ``<step>`` holding only an unfinished
    ``state.orbax-checkpoint-tmp*``).
    """

    step: int
    path: Path
    state: str
    marker: dict[str, Any] | None = None
    problem: str | None = None


_ASIDE = re.compile(r"^(\d+)\.(damaged|incomplete)(?:-\d+)?$")
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")  # a step folder orbax had begun (a composite save)
_ITEM_TMP = re.compile(r"^state\.orbax-checkpoint-tmp")  # <step>/state begun by orbax, not finished


def _orbax_unfinished(step_dir: Path) -> bool:
    """True if ``step_dir`` (no marker) holds only what orbax had begun: its temporary ``state`` folder, no
    finished item (a save cut short while orbax wrote, now that orbax writes ``<step>/state`` itself)."""
    names = [c.name for c in step_dir.iterdir()]
    return all(_ITEM_TMP.match(n) for n in names)  # (empty: orbax had only made the folder)


def scan(directory: Path) -> list[StepFolder]:
    """Every step-like folder of ``directory``, sorted by step then name."""
    out = []
    if not Path(directory).is_dir():
        return out
    for p in Path(directory).iterdir():
        if not p.is_dir():
            continue
        if p.name.isdigit():
            marker, problem = read_marker(p)
            state = "committed" if marker else "bad-marker" if problem else "incomplete"
            if state == "incomplete" and _orbax_unfinished(p):
                state = "temporary"
            out.append(StepFolder(int(p.name), p, state, marker, problem))
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

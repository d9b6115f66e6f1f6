"""Who owns a run directory, and what a fresh start does with the history already in it.

A run directory is written by one job at a time: :class:`RunLock` is an
exclusive ``flock`` on ``<run>/.jaxdist.lock`` taken by ``jaxdist train``'s
process 0 (or by the controller of a launched job, whose workers then write
under it) and refused to a second writer with one sentence naming the holder.
The kernel drops the lock when its process dies, so a crashed run never leaves
it stuck.  Within one process the lock is re-entrant (a notebook may open two
Trainers of one run in turn without closing the first).

:func:`set_aside_history` is what ``checkpoint.resume=false`` does to a run
that already trained: the checkpoints, batch list and metrics move together to
``<run>/set_aside/<UTC time>/``, so nothing a later command could resume from
is left beside the new run's history (and nothing is deleted).  Under a launched
job the controller does it once, when the job starts, and its workers resume
the job's own history from then on.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from jaxdist.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_NAME = ".jaxdist.lock"
# A worker started by a launched job's node agent writes under the controller's lock (jaxdist.controller.agent).
JOB_ENV = "JAXDIST_CONTROLLER"
# What a fresh start moves aside: everything a later command would resume from or audit.
# A run trained on a user's own model (jaxdist.train.custom) holds this file beside config.json: the config does
# not describe that model, so a command that would build jaxdist's transformer from it refuses the run.
OWN_MODEL_FILE = "own_model.json"
HISTORY = ("checkpoints", "batchlist", "metrics.jsonl", "tb", OWN_MODEL_FILE)
SET_ASIDE = "set_aside"
# Under a job that set the history aside (checkpoint.resume=false): when, in seconds since the epoch; node-local
# checkpoint files older than that belong to the earlier history (jaxdist.checkpoint.local.LocalTier).
HISTORY_SINCE_ENV = "JAXDIST_HISTORY_SINCE"

_held: dict[str, list] = {}  # real path of the lock file -> [file descriptor, holders in this process]


def under_job(env: dict[str, str] | None = None) -> bool:
    """True in a worker of a launched job: its controller holds the run's lock."""
    return bool((os.environ if env is None else env).get(JOB_ENV))


def history_since(env: dict[str, str] | None = None) -> float:
    """When this job set the run's earlier history aside (seconds since the epoch), 0.0 if it did not."""
    try:
        return float((os.environ if env is None else env).get(HISTORY_SINCE_ENV, "0") or 0.0)
    except ValueError:
        return 0.0


class RunLock:
    """The exclusive right to write ``run_dir`` (see the module docstring); ``what`` names the holder's
    command in the refusal a second writer gets (e.g. ``"jaxdist train"``)."""

    def __init__(self, run_dir: str | Path, what: str):
        self.run_dir = Path(run_dir)
        self.what = what
        self.path = self.run_dir / LOCK_NAME
        self._key: str | None = None

    def acquire(self) -> RunLock:
        """Take the lock; ConfigError naming the holder if another process has it."""
        if self._key is not None:
            return self
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"cannot create the run directory {self.run_dir} ({e.strerror}): choose a writable train.runs_dir."
            ) from None
        key = os.path.realpath(self.path)
        if key in _held:
            _held[key][1] += 1
            self._key = key
            return self
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                # A file system without locks (some network mounts): say so once, and go on unguarded.
                log.warning("cannot lock %s (%s): a second writer of this run would not be refused", self.path, e)
                os.close(fd)
                self._key = None
                return self
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"the run {self.run_dir} is in use by {holder}: wait for it to end or stop it, or write to "
                "another run (train.name)."
            ) from None
        os.ftruncate(fd, 0)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "what": self.what, "since": time.time()}
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        _held[key] = [fd, 1]
        self._key = key
        return self

    def release(self) -> None:
        """Give the lock back (the last holder in this process unlocks the file)."""
        if self._key is None:
            return
        key, self._key = self._key, None
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[key]
            fcntl.flock(entry[0], fcntl.LOCK_UN)
            os.close(entry[0])

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """'jaxdist train (pid 123 on host h, since 09:12:03 UTC)' from the lock file, or a plain 'another process'."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(info["since"])))
        return f"{info['what']} (pid {int(info['pid'])} on host {info['host']}, since {since})"
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another process"


def history_present(run_dir: str | Path) -> list[str]:
    """The names of :data:`HISTORY` that ``run_dir`` holds (non-empty folders, files)."""
    run = Path(run_dir)
    out = []
    for name in HISTORY:
        p = run / name
        if p.is_dir() and any(p.iterdir()) or p.is_file():
            out.append(name)
    return out


def set_aside_history(run_dir: str | Path) -> Path | None:
    """Move the run's checkpoints, batch list and metrics to ``<run>/set_aside/<UTC time>/``; that folder, or
    None when the run holds no history.  Call with the run's lock held."""
    run = Path(run_dir)
    names = history_present(run)
    if not names:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = run / SET_ASIDE / stamp
    n = 1
    while dest.exists():  # two fresh starts within a second
        n += 1
        dest = run / SET_ASIDE / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for name in names:
        os.replace(run / name, dest / name)
    return dest


def check_overwrite(path: str | Path, written_by_us, force: bool, inputs: tuple = ()) -> None:
    """Refuse (ConfigError) to write ``path`` when it is one of the command's ``inputs``, not a file, or a file
    that ``written_by_us(text)`` does not recognise as this command's own output, unless ``force``."""
    p = Path(path)
    for i in inputs:
        if i and p.resolve() == Path(i).resolve():
            raise ConfigError(f"--out {path} is this command's input: write the result to another file.")
    if not p.exists():
        return
    if not p.is_file():
        raise ConfigError(f"--out {path} is not a file: name a file to write.")
    try:
        ours = written_by_us(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        ours = False
    if not ours and not force:
        raise ConfigError(
            f"--out {path} exists and is not this command's earlier output: name another file, or pass --force to "
            "replace it."
        )


def check_not_own_model(run_dir: str | Path, command: str, remedy: str = "") -> None:
    """ConfigError (one sentence) when ``run_dir`` trained a user's own model: ``command`` builds jaxdist's
    transformer from the run's config.json, which would be the wrong model."""
    path = Path(run_dir) / OWN_MODEL_FILE
    if not path.is_file():
        return
    try:
        build = json.loads(path.read_text()).get("build") or "your code"
    except (OSError, ValueError, AttributeError):
        build = "your code"
    remedy = remedy or "restore its checkpoint with your model's code, Trainer(config, model=...).init_state()"
    raise ConfigError(
        f"'{run_dir}' trained your own model ({build}), not jaxdist's transformer, which {command} builds: {remedy}."
    )

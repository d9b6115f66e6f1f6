"""A generation job's tasks: the sample set cut into fixed chunks, and who holds which.

**Samples.** ``gen.samples`` names a file or a directory:

* ``*.jsonl``: one JSON object per line; the sample is its ``prompt`` field
  (or ``text``), or the line itself when it is a JSON string;
* a directory: every file under it (sorted by relative path) is one raw
  sample, its whole text;
* any other file: one sample per non-empty line.

**Tasks.** Task ``i`` is samples ``[i * task_size, (i + 1) * task_size)``. Its
key, ``<job>:<sample-set digest>:<task_size>:<i>``, names the same work in
every run of the job, so the receiver recognises a task delivered before (by
this run, or by an earlier run of the same job) and adds it once.

**Board.** :class:`TaskBoard` hands out pending tasks, takes each back when
its worker dies or its lease expires (it is handed out again), and records
finished tasks in ``<state_dir>/tasks.jsonl`` (appended, flushed): a restarted
job hands out only what is not finished.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxdist.config import ConfigError
from jaxdist.data.journal import append_lines

log = logging.getLogger(__name__)


def load_samples(path: str | Path) -> list[str]:
    """The samples of a sample set (see the module docstring); ConfigError naming the path for a bad one."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"the sample set '{p}' does not exist: set gen.samples to a file or a directory.")
    try:
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            samples = [f.read_text() for f in files]
        elif p.suffix == ".jsonl":
            samples = []
            for n, line in enumerate(p.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise ConfigError(f"{p} line {n} is not JSON: write one JSON object per line.") from None
                if isinstance(obj, str):
                    samples.append(obj)
                elif isinstance(obj, dict) and isinstance(obj.get("prompt", obj.get("text")), str):
                    samples.append(obj.get("prompt", obj.get("text")))
                else:
                    raise ConfigError(f'{p} line {n} has no "prompt" or "text" string: add one.')
        else:
            samples = [line for line in p.read_text().splitlines() if line.strip()]
    except UnicodeDecodeError:
        raise ConfigError(f"the sample set '{p}' is not UTF-8 text: convert it, or name the text files.") from None
    if not samples:
        raise ConfigError(f"the sample set '{p}' holds no samples: add some.")
    return samples


def sample_digest(samples: list[str]) -> str:
    h = hashlib.sha256()
    for s in samples:
        b = s.encode()
        h.update(len(b).to_bytes(8, "little") + b)
    return h.hexdigest()[:12]


@dataclass
class Task:
    index: int
    key: str
    samples: list[str]


def make_tasks(job: str, samples: list[str], task_size: int) -> list[Task]:
    d = sample_digest(samples)
    return [
        Task(i, f"{job}:{d}:{task_size}:{i}", samples[s : s + task_size])
        for i, s in enumerate(range(0, len(samples), task_size))
    ]


@dataclass
class TaskBoard:
    """Task states: pending, running (worker, lease deadline) or finished (delivered / refused)."""

    tasks: list[Task]
    state_path: Path
    lease_s: float = 600.0
    running: dict[int, tuple[str, float]] = field(default_factory=dict)
    finished: dict[int, dict[str, Any]] = field(default_factory=dict)
    handed_out: int = 0
    reassigned: int = 0

    def __post_init__(self) -> None:
        self._stored: dict[str, dict[str, Any]] = {}  # finished records by key, of this and earlier runs
        if self.state_path.exists():
            for line in self.state_path.read_bytes().splitlines():
                try:
                    rec = json.loads(line)
                    self._stored[rec["key"]] = rec
                except (ValueError, KeyError, TypeError):
                    log.warning("%s: a torn line (a kill mid-write) skipped; its task runs again", self.state_path)
        for t in self.tasks:
            if t.key in self._stored:
                self.finished[t.index] = self._stored[t.key]

    def add(self, samples: list[str], key: str) -> Task:
        """A new task (a chain's later stage: made from an earlier stage's outputs); finished already if an
        earlier run of the job finished it."""
        task = Task(len(self.tasks), key, samples)
        self.tasks.append(task)
        if key in self._stored:
            self.finished[task.index] = self._stored[key]
        return task

    @property
    def pending(self) -> list[int]:
        return [t.index for t in self.tasks if t.index not in self.finished and t.index not in self.running]

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.tasks)

    def take(self, worker: str) -> Task | None:
        """The next pending task for ``worker`` (leased for ``lease_s``), or None."""
        self.expire()
        pending = self.pending
        if not pending:
            return None
        i = pending[0]
        self.running[i] = (worker, time.monotonic() + self.lease_s)
        self.handed_out += 1
        return self.tasks[i]

    def finish(self, index: int, worker: str, outcome: dict[str, Any]) -> None:
        """Record a task's outcome (``delivered`` or ``refused``); a second report of it is ignored."""
        self.running.pop(index, None)
        if index in self.finished:
            return
        rec = {"key": self.tasks[index].key, "task": index, "worker": worker, "time": time.time(), **outcome}
        append_lines(self.state_path, json.dumps(rec, sort_keys=True).encode() + b"\n", fsync=True)
        self.finished[index] = rec

    def release(self, worker: str) -> list[int]:
        """Take back every task ``worker`` holds (it died): they are pending again."""
        back = [i for i, (w, _) in self.running.items() if w == worker]
        for i in back:
            del self.running[i]
            log.warning("task %d of %s is handed out again (its worker is gone)", i, worker)
        self.reassigned += len(back)
        return back

    def expire(self) -> list[int]:
        now = time.monotonic()
        late = [i for i, (_, deadline) in self.running.items() if deadline < now]
        for i in late:
            log.warning("task %d: the lease of %s expired; handed out again", i, self.running.pop(i)[0])
        self.reassigned += len(late)
        return late

    def counts(self) -> dict[str, int]:
        outcomes = [r.get("outcome") for r in self.finished.values()]
        return {
            "tasks": len(self.tasks),
            "pending": len(self.pending),
            "running": len(self.running),
            "delivered": outcomes.count("delivered"),
            "refused": outcomes.count("refused"),
            "reassigned": self.reassigned,
        }

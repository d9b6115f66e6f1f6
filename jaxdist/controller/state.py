"""What the controller knows: the persisted job state, the event timeline and the live views.

:class:`JobState` (``<run>/controller/state.json``) is everything a restarted
controller needs to re-attach to a running job: the generation, its members
(rank -> node, pid), the coordinator, failure counts and banned nodes, the
last step seen and the last committed checkpoint step.  It is rewritten
atomically on every change.  :class:`EventLog` (``events.jsonl``) is the
timeline: one JSON object per event with its wall-clock time ``time``
(seconds since the epoch).  :class:`NodeView` and :class:`WorkerView` are
rebuilt from heartbeats and never persisted.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Generation:
    """One formation of the training group: from its assignment to its end (seconds since the epoch)."""

    gen: int
    members: dict[int, str]
    coordinator: str
    assigned_at: float
    first_step_at: float | None = None
    resume_step: int | None = None
    last_step: int = 0
    ended_at: float | None = None
    end: str = ""  # done | failed: <reason>


@dataclass
class JobState:
    """The persisted state (see the module docstring); ``phase``: waiting, starting, running, recovering, done,
    failed; ``standbys``: ready nodes outside the group (warm process waiting); ``warm_nodes``: nodes with a
    warm process (a restart now would wait for no import)."""

    job: str
    phase: str = "waiting"
    generation: int = -1
    members: dict[int, str] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)
    coordinator: str = ""
    failures: dict[str, int] = field(default_factory=dict)  # per node: lost, or failed while its agent was
    process_failures: dict[str, int] = field(default_factory=dict)  # per node: processes failed, agent healthy
    process_failure_log: list[list] = field(default_factory=list)  # [rank, node] per process failure, in order
    group_size: int = 0  # nodes the job started training on: a recovery keeps it, never grows past it (0: not yet)
    banned: list[str] = field(default_factory=list)
    banned_until: dict[str, float] = field(default_factory=dict)  # per banned node: when (wall clock) it may return
    bans: dict[str, int] = field(default_factory=dict)  # per node: how often it was banned (each doubles the cool-down)
    last_failed: list[str] = field(default_factory=list)
    standbys: list[str] = field(default_factory=list)
    warm_nodes: list[str] = field(default_factory=list)
    last_step: int = 0
    last_good_step: int = 0
    restarts: int = 0
    rejected_messages: int = 0  # refused: forged, malformed, replayed, a connection without the token
    stale_messages: int = 0  # the job's own agents' messages to an earlier controller start, dropped
    controller_starts: list[str] = field(default_factory=list)  # the controller's sid at its latest starts
    setup_key: str = ""
    allocation: str = ""  # the scheduler's allocation the job runs in (Slurm: JOBID.RESTARTS), '' if none
    history_since: float = 0.0  # checkpoint.resume=false: when the job set the run's earlier history aside
    history: list[Generation] = field(default_factory=list)
    controller_load: dict[str, float] = field(default_factory=dict)  # its own (LoadMeter.snapshot)
    updated: float = 0.0

    def in_new_allocation(self) -> JobState:
        """This job in a new allocation (a Slurm requeue): no member, node or process of the old one is
        left; the generation count, history, restarts and step carry on (the run resumes from its checkpoints)."""
        g = self.current
        if g is not None and g.ended_at is None:
            g.ended_at, g.end = time.time(), "failed: the allocation ended"
        return dataclasses.replace(
            self,
            phase="waiting",
            members={},
            pids={},
            coordinator="",
            failures={},
            process_failures={},
            process_failure_log=[],
            group_size=0,
            banned=[],
            banned_until={},
            bans={},
            last_failed=[],
            standbys=[],
            warm_nodes=[],
            setup_key="",
            controller_starts=[],
        )

    def save(self, path: Path) -> None:
        self.updated = time.time()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        # Compact, field by field (no deep copy): written 4 times a second, at 1,024 nodes an indented dump of
        # dataclasses.asdict took ~60 ms (Python's pure encoder), this a few.
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["history"] = [{f.name: getattr(g, f.name) for f in dataclasses.fields(g)} for g in self.history]
        tmp.write_text(json.dumps(d, separators=(",", ":")))
        os.replace(tmp, path)

    @staticmethod
    def load(path: Path) -> JobState | None:
        if not path.is_file():
            return None
        d = json.loads(path.read_text())
        d["members"] = {int(k): v for k, v in d["members"].items()}
        d["pids"] = {int(k): v for k, v in d["pids"].items()}
        hist = []
        for g in d.pop("history"):
            g["members"] = {int(k): v for k, v in g["members"].items()}
            hist.append(Generation(**g))
        return JobState(**d, history=hist)

    @property
    def current(self) -> Generation | None:
        return self.history[-1] if self.history and self.history[-1].gen == self.generation else None


class LoadMeter:
    """The controller's own load, over windows of at least WINDOW_S seconds: messages a second, the share of
    its loop's time not spent waiting for a message (``busy``), and over the newest SAMPLES messages the time
    to handle one (p50/p99, microseconds) and how late it was read (now - when it was signed, p50/p99, ms):
    a lag that grows is a controller falling behind its heartbeats."""

    WINDOW_S = 5.0
    SAMPLES = 4096

    def __init__(self) -> None:
        self.handle_s: collections.deque[float] = collections.deque(maxlen=self.SAMPLES)
        self.lag_s: collections.deque[float] = collections.deque(maxlen=self.SAMPLES)
        self.count, self.since, self.waited_since = 0, time.monotonic(), 0.0
        self.last: dict[str, float] = {}

    def message(self, seconds: float, signed_at: Any) -> None:
        """One message handled in ``seconds``, signed at ``signed_at`` (time.time() of its sender)."""
        self.count += 1
        self.handle_s.append(seconds)
        if isinstance(signed_at, (int, float)):
            self.lag_s.append(time.time() - signed_at)

    def snapshot(self, waited_s: float) -> dict[str, float]:
        """The figures of the window that ends now (the last window's until WINDOW_S have passed); ``waited_s``:
        the loop's total seconds waiting for messages so far."""
        span = time.monotonic() - self.since
        if span < self.WINDOW_S:
            return self.last
        handle, lag = sorted(self.handle_s), sorted(self.lag_s)

        def q(xs: list[float], p: float, scale: float) -> float:
            return round(xs[min(len(xs) - 1, int(p * len(xs)))] * scale, 2) if xs else 0.0

        self.last = {
            "messages_per_s": round(self.count / span, 1),
            "busy": round(max(0.0, 1.0 - (waited_s - self.waited_since) / span), 3),
            "handle_us_p50": q(handle, 0.5, 1e6),
            "handle_us_p99": q(handle, 0.99, 1e6),
            "lag_ms_p50": q(lag, 0.5, 1e3),
            "lag_ms_p99": q(lag, 0.99, 1e3),
        }
        self.count, self.since, self.waited_since = 0, time.monotonic(), waited_s
        return self.last


EVENTS_KEPT = 1000  # events an EventLog keeps in memory (the file keeps every one)


class EventLog:
    """Appends events to ``events.jsonl`` and keeps the newest :data:`EVENTS_KEPT` in memory (a long job's
    history stays on disk, not in the controller); ``echo``: also one line each on stderr."""

    def __init__(self, path: Path, echo: bool = False):
        self.path, self.echo = path, echo
        path.parent.mkdir(parents=True, exist_ok=True)
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=EVENTS_KEPT)

    def add(self, kind: str, **fields: Any) -> dict[str, Any]:
        e = {"time": time.time(), "event": kind, **fields}
        self.events.append(e)
        with open(self.path, "a") as f:
            f.write(json.dumps(e) + "\n")
        if self.echo:
            print(f"[controller {time.strftime('%H:%M:%S')}] {format_event(e)}", file=sys.stderr, flush=True)
        return e


def format_event(e: dict[str, Any]) -> str:
    """One readable line for an event."""
    rest = {k: v for k, v in e.items() if k not in ("time", "event")}
    return e["event"] + " " + " ".join(f"{k}={v}" for k, v in rest.items())


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The events of a controller's ``events.jsonl`` (empty if there is none)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(l) for l in p.read_text().splitlines() if l.strip()]


@dataclass
class NodeView:
    """A node agent as its heartbeats describe it; times are the controller's ``time.monotonic()``."""

    name: str
    host: str = ""
    last_heartbeat: float = 0.0
    checks: dict[str, Any] = field(default_factory=dict)
    probe: str = ""
    free_port: int = 0
    procs: list[dict[str, Any]] = field(default_factory=list)
    welcomed: bool = False
    link_ok: bool = False
    probing: bool = False
    ready_at: float | None = None
    lost: bool = False
    agent_silent_at: float | None = None  # the agent fell silent while the node's workers were still heard
    stall_at: float | None = None  # the agent's last reported loop stall (its wall clock), to report each once


@dataclass
class WorkerInfo:
    """A worker process as its heartbeats (and its node's exit reports) describe it."""

    identity: str
    node: str
    pid: int
    last_heartbeat: float
    state: str = "warming"
    gen: int = -1
    rank: int = -1
    step: int = 0
    resume_step: int | None = None
    tokens_per_s: float = 0.0
    exit_code: int | None = None
    exited_at: float | None = None
    assigned: bool = False
    warm_at: float | None = None
    disconnected_at: float | None = None
    direct: bool = False  # heard on its own connection since that last dropped (an assignment must reach it)
    beat: int = 0  # the newest numbered heartbeat handled (a relaying worker's come by two paths) ...
    sent: float = 0.0  # ... and when its worker sent it (time.time())
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    @property
    def warm(self) -> bool:
        """Ready for an assignment: warmed up, never assigned, still running, and connected (a spare whose
        connection dropped without a message since is gone with its agent, even when the node's new agent came
        back too soon for the node to count as lost; a live spare's next heartbeat reconnects it), and heard on
        its own connection (one whose heartbeats only its node agent relays may have none that works yet: its
        assignment would be lost, and the new group would wait for it until start_timeout)."""
        return (
            self.alive
            and self.state == "warm"
            and not self.assigned
            and self.gen < 0
            and self.disconnected_at is None
            and self.direct
        )

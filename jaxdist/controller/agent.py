"""The worker agent: lives inside each training process started by a node agent.

    agent = agent_from_env()            # None unless JAXDIST_CONTROLLER is set
    if agent is not None:
        agent.wait_for_rank(warm)       # heartbeats now; warm up; wait for a rank (sets JAX_* env)
    ... jax.distributed.initialize, Trainer ...
    agent.attach(trainer)               # a loop callback reports progress, never waiting for the device
    agent.finished()

A background thread owns the socket: it sends a heartbeat every
``JAXDIST_HEARTBEAT_INTERVAL`` seconds (default 0.25) carrying the state
(warming, warm, joining, restoring, training, done), the generation and rank,
the last completed step, its tokens/s and step time, the step the process
resumed from, and its compilation-cache hits and misses.  Being a thread, it
keeps beating while the main thread imports, compiles or waits in a
collective -- as long as the main thread lets go of the GIL.  Compiling on an
overloaded host may hold it for seconds, so the connection also carries
ZeroMQ's own heartbeats (``JAXDIST_LIVENESS_TIMEOUT``), answered by ZeroMQ's
I/O thread without the GIL: the controller tells a busy process (connection
alive, heartbeats late) from a stopped or crashed one (connection dropped).

A warm process (a standby) has done everything that can come before
``jax.distributed.initialize``: JAX and the trainer imported, data loaded,
the compilation cache configured.  It cannot do more: a JAX process joins
exactly one distributed group, with a rank fixed at ``initialize``, and the
group's programs are compiled for that group's device assignment.  On its
assignment it initializes, builds the mesh and loads the train step from the
persistent compilation cache (filled by the group's first generation) rather
than compiling it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxdist.controller.protocol import START_ENV, TOKEN_ENV, Peer
from jaxdist.controller.relay import RELAY_ENV, RelayClient, goes_direct
from jaxdist.controller.setup_cache import library_versions

log = logging.getLogger(__name__)

CONTROLLER_ENV = "JAXDIST_CONTROLLER"
PERIOD_BEATS = 8  # heartbeats that carry each efficiency record (those queued: a dropped one does not count)


@dataclass
class Assignment:
    """A place in a generation: ``rank`` of ``num_processes``, the ``coordinator`` (host:port), extra ``env``."""

    generation: int
    rank: int
    num_processes: int
    coordinator: str
    env: dict[str, str] = field(default_factory=dict)

    def process_env(self) -> dict[str, str]:
        """The variables :func:`jaxdist.train.distributed.initialize_from_env` reads, plus ``env``."""
        return {
            "JAX_COORDINATOR_ADDRESS": self.coordinator,
            "JAX_NUM_PROCESSES": str(self.num_processes),
            "JAX_PROCESS_ID": str(self.rank),
            **self.env,
        }


def first_heartbeat() -> dict[str, Any]:
    """What a worker's heartbeat says before the worker has warmed up, been assigned or trained."""
    return {
        "state": "warming",
        "gen": -1,
        "rank": -1,
        "step": 0,
        "resume_step": None,
        "tokens_per_s": 0.0,
        "step_time": 0.0,
        "cache_hits": 0,
        "cache_misses": 0,
    }


class WorkerAgent:
    """Heartbeats and assignments of one worker process (see the module docstring)."""

    def __init__(
        self, controller: str, token: str, node: str, interval: float = 0.25, liveness: float = 1.0, relay: str = ""
    ):
        self.node, self.pid, self.interval = node, os.getpid(), interval
        self.identity = f"w:{node}:{self.pid}"
        self._peer = Peer(token, controller, self.identity, interval, liveness, os.environ.get(START_ENV, ""))
        # ``relay``: the node agent's socket (jaxdist.controller.relay); heartbeats go there, few go directly
        self._relay = RelayClient(self._peer.ctx, relay, self.identity) if relay else None
        self._beats = 0
        self._lock = threading.Lock()
        self._info: dict[str, Any] = first_heartbeat()
        self._assigned = threading.Event()
        self._assignment: Assignment | None = None
        self._stop = threading.Event()
        self._beat_now, self._beat_sent = threading.Event(), threading.Event()
        self._first_step = True
        self._clock: Any = None  # the attached trainer's LoopClock (jaxdist.train.efficiency)
        self._periods: list[list[Any]] = []  # [efficiency record, heartbeats left to carry it]
        self._index = 0  # efficiency records sent (a process trains in one generation)
        self._probe: tuple[int, list[str]] = (0, [])  # the newest device probe requested: id, node names by rank
        self._thread = threading.Thread(target=self._run, name="jaxdist-agent", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ thread

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_beat or self._beat_now.is_set():
                self._beat_now.clear()
                self._beat()
                self._beat_sent.set()
                next_beat = now + self.interval
            msg = self._peer.recv(max(0.0, min(0.05, next_beat - time.monotonic())))
            if msg is not None:
                self._handle(msg)
        self._beat()  # the final state
        time.sleep(0.05)  # let the last heartbeat leave (the socket does not linger)
        if self._relay is not None:
            self._relay.close()
        self._peer.close()

    def _beat(self) -> None:
        with self._lock:
            info = dict(self._info)
            carried = list(self._periods)
        clock = self._clock
        if clock is not None:  # where the loop is: plain reads of another thread's attributes, no lock needed
            info["loop"] = {"phase": clock.phase, "dispatched": clock.dispatched, "since": clock.since}
        if carried:
            info["periods"] = [record for record, _ in carried]
        self._beats += 1
        msg = {"t": "hb", "node": self.node, "pid": self.pid, **info, "beat": self._beats, "sent": time.time()}
        relay = self._relay
        sent = relay is not None and relay.send(msg)
        if relay is None or goes_direct(self._beats, relay.since_ack(), self.interval, str(info.get("state"))):
            sent = self._peer.send(msg) or sent
        if sent and carried:
            with self._lock:
                for p in carried:
                    p[1] -= 1
                self._periods = [p for p in self._periods if p[1] > 0]

    def _handle(self, msg: dict[str, Any]) -> None:
        if msg.get("t") == "assign" and self._assignment is None:
            self._assignment = Assignment(
                int(msg["gen"]),
                int(msg["rank"]),
                int(msg["num_processes"]),
                str(msg["coordinator"]),
                dict(msg.get("env", {})),
            )
            self.update(state="joining", gen=self._assignment.generation, rank=self._assignment.rank)
            self._assigned.set()
        elif msg.get("t") == "probe_devices" and int(msg["id"]) > self._probe[0]:
            self._probe = (int(msg["id"]), [str(n) for n in msg["nodes"]])  # one tuple: read whole, no lock

    # ------------------------------------------------------------------ main thread

    def update(self, **info: Any) -> None:
        """Set fields of the next heartbeat (thread-safe)."""
        with self._lock:
            self._info.update(info)

    def wait_for_rank(
        self,
        warm: Callable[[], None] | None = None,
        timeout: float | None = None,
        configure_cache: Callable[[str, Callable[..., None]], None] | None = None,
    ) -> Assignment:
        """Run ``warm()``, report "warm", block until the controller assigns a rank; export its environment.

        Then ``configure_cache(directory, count_event)`` points the compilation
        cache at ``JAXDIST_COMPILE_CACHE`` (of the assignment or of the process)
        before returning, so the first compile already reads it; the worker
        passes jaxdist.train.compile_cache.configure_compile_cache (this module
        never imports JAX) and ``count_event`` counts its hits and misses.
        """
        self.update(versions=_versions())
        if warm is not None:
            warm()
        self.update(state="warm")
        if not self._assigned.wait(timeout):
            raise TimeoutError(f"no assignment from the controller within {timeout} s")
        a = self._assignment
        assert a is not None
        os.environ.update(a.process_env())
        cache = os.environ.get("JAXDIST_COMPILE_CACHE")
        if cache and configure_cache is not None:
            configure_cache(cache, self.count_cache_event)
        return a

    def attach(self, trainer: Any) -> None:
        """Report the progress of ``trainer`` (a loop callback that never waits for the device) and its mesh's
        device order."""
        trainer.add_callback(_ProgressReport(self, trainer.config.controller.health_every))
        order = [int(d.id) for d in trainer.mesh.devices.flat]
        self.update(state="restoring", mesh_device_order=order)

    def on_step(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """A step is complete, with its metrics: report it and record it."""
        now = time.time()
        self.progress(trainer, step, metrics, now)
        self.record(trainer, step, metrics, now)

    def record(self, trainer: Any, step: int, metrics: dict[str, float], now: float | None = None) -> None:
        """Rank 0 appends ``{time, gen, step, loss}`` to ``<run>/controller/trained.jsonl``: which
        generation trained which step, the ground truth behind lineage checks and timelines."""
        if trainer is not None and self._info["rank"] == 0:
            record_step(trainer.run_dir, self._info["gen"], int(step), metrics.get("loss"), now)

    def progress(
        self,
        trainer: Any,
        step: int,
        metrics: dict[str, float] | None,
        now: float | None = None,
        start: int | None = None,
    ) -> None:
        """Step ``step`` finished on the device (``metrics``: the newest on the host, maybe of an earlier step;
        ``start``: the step this process resumed from, default ``step - 1``)."""
        now = time.time() if now is None else now
        metrics = metrics or {}
        info: dict[str, Any] = {"step": int(step), "step_at": now}
        if "tokens_per_s" in metrics:
            info.update(tokens_per_s=float(metrics["tokens_per_s"]), step_time=float(metrics["step_time"]))
        if self._first_step:  # the first step this process finished
            source = getattr(trainer, "resumed_from", None)  # ("local" | "persistent", step) or None
            info.update(
                state="training",
                resume_step=int(step) - 1 if start is None else int(start),
                resumed_from=source[0] if source else "init",
            )
            self._first_step = False
        self.update(**info)

    def watch_loop(self, clock: Any) -> None:
        """Report where the training loop is with every heartbeat (a ``jaxdist.train.efficiency.LoopClock``)."""
        self._clock = clock

    def close_period(self, clock: Any, step: int) -> None:
        """Send the efficiency record of ``clock`` up to ``step`` (a ``health.Period``) with the next heartbeats.

        Each rides on the next PERIOD_BEATS heartbeats that leave (2 s at the default interval): a lost
        heartbeat loses none, the controller skips the copies it has (by generation, rank and index) without
        reading them, and a heartbeat does not carry every record of the last minute (at 1,024 nodes, reading
        those copies was a quarter of the controller's time).
        """
        record = {"gen": self._info["gen"], "rank": self._info["rank"], "node": self.node, "index": self._index}
        record.update(clock.take_period(step))
        self._index += 1
        with self._lock:
            self._periods.append([record, PERIOD_BEATS])

    def probe_requested(self) -> int:
        """The id of the newest device probe the controller asked for (0: none)."""
        return self._probe[0]

    def probe_nodes(self) -> list[str]:
        """The generation's node names by rank, as the newest probe request gave them."""
        return self._probe[1]

    def probe_report(self, probe_id: int, record: dict[str, Any]) -> None:
        """Send the device probe's result (rank 0's; every rank holds the same gathered record)."""
        if self._info["rank"] == 0:
            self.update(probe={"id": probe_id, **record})

    def finished(self, final_step: int | None = None) -> None:
        """Report "done".  Heartbeats go on until the process exits: JAX's shutdown barrier
        may still hold it for a while, and a silent worker would be declared failed."""
        self.update(state="done", **({} if final_step is None else {"step": int(final_step)}))
        self._beat_sent.clear()
        self._beat_now.set()  # now: the process may exit before the next beat is due
        self._beat_sent.wait(timeout=2.0)

    def count_cache_event(self, event: str, **_: Any) -> None:
        """A jax.monitoring event listener: counts persistent compilation-cache hits and misses."""
        key = {
            "/jax/compilation_cache/cache_hits": "cache_hits",
            "/jax/compilation_cache/cache_misses": "cache_misses",
        }.get(event)
        if key is not None:
            with self._lock:
                self._info[key] += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class _ProgressReport:
    """The agent's loop callback (jaxdist.train.callbacks protocol, duck-typed: no JAX import here).

    Runs every step without syncing: it reports the newest step the device has
    finished (``ctx.completed_step()`` asks the arrays, it does not wait) and,
    at steps where the loop flushed metrics anyway, records each flushed step.
    """

    syncs = False

    def __init__(self, agent: WorkerAgent, health_every: int = 0):
        self.agent = agent
        self.health_every = health_every  # steps per efficiency record (0: none)
        self.reported = -1  # newest step recorded with its metrics
        self.progressed = -1  # newest step reported finished

    def due(self, step: int, last: bool) -> bool:
        return True

    def __call__(self, ctx: Any) -> None:
        now = time.time()
        clock = ctx.window.clock
        self.agent.watch_loop(clock)
        flushed_now = bool(ctx.window.flushed) and ctx.window.flushed[-1]["step"] == ctx.step
        # A period closes at a flush (the window's honest time is known there), the same step on every rank.
        if flushed_now and self.health_every > 0 and ctx.step - clock.first_step + 1 >= self.health_every:
            self.agent.close_period(clock, ctx.step)
        for r in ctx.window.flushed:
            if r["step"] > self.reported:
                self.agent.record(ctx.trainer, int(r["step"]), r, now)
                self.reported = int(r["step"])
        done = max(ctx.completed_step() or -1, self.reported)
        if done > self.progressed:
            self.agent.progress(ctx.trainer, done, ctx.latest(), now, start=ctx.start)
            self.progressed = done


def record_step(run_dir: Any, gen: int, step: int, loss: float | None, when: float | None = None) -> None:
    """Append one trained step to ``<run_dir>/controller/trained.jsonl`` (seconds since the epoch)."""
    path = Path(run_dir) / "controller" / "trained.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {
                    "time": time.time() if when is None else when,
                    "gen": gen,
                    "step": step,
                    "loss": None if loss is None else float(loss),
                }
            )
            + "\n"
        )


def _versions() -> dict[str, str]:
    return library_versions()


def agent_from_env(env: dict[str, str] | None = None) -> WorkerAgent | None:
    """A running WorkerAgent if ``JAXDIST_CONTROLLER`` (host:port) is set, else None."""
    env = os.environ if env is None else env
    where = env.get(CONTROLLER_ENV)
    if not where:
        return None
    token = env.get(TOKEN_ENV)
    if not token:
        raise RuntimeError(
            f"{CONTROLLER_ENV} is set but {TOKEN_ENV} is not: the worker cannot authenticate; "
            "start workers through `jaxdist launch` or a node agent."
        )
    return WorkerAgent(
        where,
        token,
        env.get("JAXDIST_NODE", "local"),
        float(env.get("JAXDIST_HEARTBEAT_INTERVAL", "0.25")),
        float(env.get("JAXDIST_LIVENESS_TIMEOUT", "1.0")),
        env.get(RELAY_ENV, ""),
    )

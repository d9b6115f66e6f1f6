"""The controller process (``jaxdist controller``): keeps one training job alive.

It listens on one authenticated endpoint (loopback unless configured), welcomes
node agents, has each one checked (disk, devices, a signed ping to itself and
to its neighbours among the nodes: ``policy.probe_peers``), and starts generation 0 once all
``max_nodes`` are ready, or ``start_grace`` after ``min_nodes`` were, on the
largest group of the ready ones the mesh allows (later nodes become standbys;
a recovery keeps that size while the nodes exist).  Then it watches every member:
a worker that exits, falls silent for ``heartbeat_timeout`` or a group that
stops making steps ends the generation.  Recovery (``controller.recovery``):

* ``standby`` (the path tested on CPU): kill the group (SIGKILL through the node
  agents), give the failed rank to a warm standby, the other ranks to their
  nodes' warm spares, and assign the new generation at once; the Trainer
  restores the newest committed checkpoint and continues at its data position.
* ``requeue``: the baseline a scheduler requeue gives: every process killed and
  started cold.

Replacing only the failed process while the others keep running (JAX's
``jax_enable_recoverability`` on GPUs) would plug in at :meth:`Controller._fail`;
it is not implemented here because CPU JAX cannot do it.

The controller never imports JAX or model code.  Its state
(``<run>/controller/state.json``) lets a restarted controller re-attach to the
running job: workers and node agents keep going without it and reconnect to the
same endpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxdist.cluster import load_cluster
from jaxdist.config import Config, ConfigError
from jaxdist.controller import policy
from jaxdist.controller.generations import GenerationLifecycle
from jaxdist.controller.health import HealthHistory, Period, Thresholds, job_step_s
from jaxdist.controller.health_actions import HealthActions
from jaxdist.controller.messages import message_problem
from jaxdist.controller.protocol import Endpoint, load_or_create_token
from jaxdist.controller.setup_cache import SetupCache, SetupEntry
from jaxdist.controller.state import EventLog, Generation, JobState, LoadMeter, NodeView, WorkerInfo
from jaxdist.run_owner import HISTORY_SINCE_ENV, RunLock, set_aside_history

log = logging.getLogger("jaxdist.controller")

TICK_S = 0.05  # seconds between two judgments of the job (tick): timeouts are seconds, floods of heartbeats frequent
ATTACH_MAX_S = 30.0  # a restarted controller waits at most this long to hear every member node before judging
SPARE_FAILURES_TO_BAN = 3  # warm processes of one node that crashed before an assignment: the node is not used


def cluster_shape(cfg: Config) -> tuple[int, int, str]:
    """(nodes, devices per node, device kind) of the config's cluster description, read without JAX.

    Raises ConfigError (from :func:`~jaxdist.cluster.load_cluster`) when the description cannot be read.
    """
    spec = load_cluster(cfg.mesh.cluster)
    return spec.nodes, spec.devices_per_node, spec.device_kind


KEEP_STARTS = 4  # earlier starts whose agents' queued messages count as stale, not as attacks
NOT_BEFORE_SLACK_S = 1.0  # clock skew allowed between hosts for "signed before this controller started"


def _read_marks(path: Path) -> dict[str, int]:
    try:
        return {str(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _write_marks(path: Path, marks: dict[str, int]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(marks))
    os.replace(tmp, path)


def _agent_report(msg: dict[str, Any]) -> dict[str, Any]:
    """What a node agent's heartbeat says of its own silence: connection drops and its longest loop stall."""
    return {k: msg[k] for k in ("reconnects", "stall") if msg.get(k)}


def controller_dir(cfg: Config) -> Path:
    """Where a job's controller keeps its token, endpoint, state, events and worker logs."""
    return (cfg.run_dir / "controller").absolute()


class Controller(GenerationLifecycle, HealthActions):
    """One job's controller; :meth:`run` until the job is done (0) or cannot continue (1)."""

    def __init__(self, cfg: Config, config_args: list[str], echo: bool = False, allocation: str = ""):
        cc = self.cc = cfg.controller
        self.cfg = cfg
        # The job's workers write the run under this lock (jaxdist.run_owner); a second job or `jaxdist train`
        # on the same run is refused, and the lock goes with this process.
        self.run_lock = RunLock(cfg.run_dir, "the controller of a launched job").acquire()
        self.dir = controller_dir(cfg)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.token = load_or_create_token(self.dir / "token")
        prev = JobState.load(self.dir / "state.json")
        if prev is not None and prev.phase in ("done", "failed"):
            prev = None
        new_allocation = prev is not None and bool(allocation) and prev.allocation != allocation
        if new_allocation:  # a requeued (or resubmitted) job: none of the old processes is left
            prev = prev.in_new_allocation()
        port = cc.port
        if not port and prev is not None and not new_allocation and (self.dir / "endpoint").is_file():
            port = int((self.dir / "endpoint").read_text().strip().rsplit(":", 1)[1])  # re-attach where workers look
        self.liveness_s = max(2 * cc.heartbeat_interval, cc.heartbeat_timeout - 2 * cc.heartbeat_interval)
        self.endpoint = Endpoint(self.token, cc.bind, port, cc.allow_remote, cc.heartbeat_interval, self.liveness_s)
        # No replay across a restart: nothing signed before this start, no (sid, seq) seen by the last controller.
        self.endpoint.verifier.not_before = time.time() - NOT_BEFORE_SLACK_S
        if prev is not None and not new_allocation:
            self.endpoint.verifier.restore(_read_marks(self.dir / "replay.json"))
            # what its agents queued for those starts is not an attack: counted apart (stale), never accepted
            self.endpoint.verifier.previous_starts = frozenset(prev.controller_starts)
        (self.dir / "endpoint").write_text(self.endpoint.address)
        self.attaching = prev is not None and prev.phase != "waiting"
        self.state = prev or JobState(job=uuid.uuid4().hex[:12])
        self.state.allocation = allocation
        self.state.controller_starts = [*self.state.controller_starts, self.endpoint.signer.sid][-KEEP_STARTS:]
        self.events = EventLog(self.dir / "events.jsonl", echo)
        if new_allocation:
            self.events.add("new_allocation", allocation=allocation, gen=self.state.generation)
        self.rejected_before, self.stale_before = self.state.rejected_messages, self.state.stale_messages
        self.malformed, self.malformed_seen = 0, set()  # authentic messages refused by message_problem
        if not cfg.checkpoint.resume:
            config_args = self._start_over(cfg, config_args, fresh=prev is None)
        self.nodes: dict[str, NodeView] = {}
        self.workers: dict[str, WorkerInfo] = {}
        # The live workers by node (dead ones pile up with the generations) and all by (generation, rank): a lookup
        # costs the node's (or the rank's) few processes, not every worker (each tick's loops stay linear in N).
        self.node_workers: dict[str, dict[str, WorkerInfo]] = {}
        self.rank_workers: dict[tuple[int, int], dict[str, WorkerInfo]] = {}
        self.cluster_nodes, self.per_node, self.device_kind = cluster_shape(cfg)
        self.max_nodes = cc.max_nodes or self.cluster_nodes
        self.valid_sizes = policy.valid_group_sizes(cfg, self.per_node, self.max_nodes)
        problem = policy.group_size_problem(cfg, cc.min_nodes, self.max_nodes, self.per_node, self.valid_sizes)
        if problem:
            raise ConfigError(problem)
        base = shlex.split(cc.worker_command) or ["{python}", "-m", "jaxdist.cli", "train"]
        self.argv = base + list(config_args)
        self.setup = SetupCache(cc.setup_cache or Path(cfg.train.runs_dir).absolute() / ".setup_cache")
        self.entry: SetupEntry | None = None
        self.t0 = time.monotonic()
        self.gen_started = self.t0
        self.progress_at: float | None = None
        self.done_since: float | None = None
        self.plan: dict[int, str] | None = None
        self.killed: dict[tuple[str, int], float] = {}
        self.kill_sent_at = 0.0
        self.health: HealthHistory | None = None  # this generation's efficiency records, by rounds
        self.thresholds = Thresholds(cc.health_z, cc.health_min_change, cc.health_min_share, cc.health_min_ratio)
        self.rtt: dict[tuple[str, str], float] = {}
        self.anomaly_probe: set[str] = set()
        self.start_failures = 0
        self.waiting_since: float | None = None  # recovering with no group to form, since (monotonic)
        self.enough_since: float | None = None  # when min_nodes were first ready (monotonic), for start_grace
        self.blame: dict[str, float] = {}  # nodes blamed for the last failure, not yet settled (monotonic time)
        self.blame_rank: dict[str, int] = {}  # the rank each blamed node ran
        self.failed_nodes: set[str] = set()  # nodes the last settled blame found failed (lost, or silent)
        self.spare_failures: dict[str, int] = {}
        self.last_save = self.last_watch = 0.0
        self.judge_at = 0.0  # when the running generation is judged next (monotonic; see tick)
        self.load = LoadMeter()  # in state.json: messages/s, handling and lag p50/p99, busy share
        self.ready: list[NodeView] = []  # the ready nodes at the last judgment, oldest first
        self.running = True

    # ------------------------------------------------------------------ messages

    def handle(self, ident: str, msg: dict[str, Any]) -> None:
        now = time.monotonic()
        t = msg.get("t")
        problem = message_problem(msg)
        if problem is not None:  # signed by the job's token, but not a message this controller can read
            self.malformed += 1
            if problem not in self.malformed_seen:
                self.malformed_seen.add(problem)
                log.warning("refused a message from %s: %s (counted with the rejected messages)", ident, problem)
            return
        if t == "node_hb":
            self._on_node_hb(msg, now)
        elif t == "hb":
            self._on_worker_hb(ident, msg, now)
        elif t == "exit":
            self._on_exit(str(msg["node"]), int(msg["pid"]), int(msg["rc"]), now)
        elif t == "probe_result":
            self._on_probe(str(msg["node"]), msg.get("rtt", {}))

    def _on_node_hb(self, msg: dict[str, Any], now: float) -> None:
        name = str(msg["node"])
        v = self.nodes.get(name)
        if first := v is None:
            v = self.nodes[name] = NodeView(name)
            self.events.add("node_registered", node=name)
            # First heard as a member (by a restarted controller): the job ran on it, so its links work
            v.link_ok = name in self.state.members.values()
        back = v.lost
        if v.lost:
            v.lost = False
            self.events.add("node_back", node=name, silent_s=round(now - v.last_heartbeat, 2))
        elif v.agent_silent_at is not None:
            self.events.add("agent_back", node=name, silent_s=round(now - v.agent_silent_at, 2), **_agent_report(msg))
            v.agent_silent_at = None
        stall = msg.get("stall")  # resent for a while: one event per stall
        if stall and stall.get("at") != v.stall_at and float(stall.get("s", 0)) > self.cc.heartbeat_timeout:
            v.stall_at = stall.get("at")
            self.events.add("agent_stall", node=name, seconds=stall.get("s"), doing=stall.get("in"))
        v.last_heartbeat, v.host, v.checks = now, str(msg.get("host", "")), dict(msg.get("checks", {}))
        v.probe, v.free_port, v.procs = str(msg.get("probe", "")), int(msg.get("free_port", 0)), list(msg["procs"])
        if not msg.get("welcomed"):
            self._welcome(v)
        for hb in msg.get("workers", ()):  # relayed: heard by the agent ``age`` seconds ago
            self._on_worker_hb(f"w:{name}:{hb['pid']}", hb, now - min(max(float(hb.get("age", 0)), 0.0), 60.0), True)
        for p in v.procs:
            if p.get("rc") is not None and not (first and self._history(v, p, now)):
                self._on_exit(name, int(p["pid"]), int(p["rc"]), now)
        if back:
            self._retire_written_off(v)
        if v.checks.get("ok") and not v.link_ok and not v.probing:
            self._probe(v, [n.name for n in self.nodes.values() if n.checks.get("ok") and not n.lost])

    def _start_over(self, cfg: Config, config_args: list[str], fresh: bool) -> list[str]:
        """``checkpoint.resume=false`` under a job: the run's earlier history is set aside once, when the job
        starts (not when a restarted controller attaches), and every generation resumes the job's own history."""
        if fresh:
            self.state.history_since = time.time()
            moved = set_aside_history(cfg.run_dir)
            if moved is not None:
                self.events.add("history_set_aside", to=str(moved), moved=sorted(p.name for p in moved.iterdir()))
        return [*config_args, "checkpoint.resume=true"]

    def _welcome(self, v: NodeView) -> None:
        env = {"JAX_PLATFORMS": "cpu"} if self.device_kind.lower().startswith("cpu") else {}
        if self.state.history_since:  # local-tier steps written before the job set the history aside are not its own
            env[HISTORY_SINCE_ENV] = repr(self.state.history_since)
        self.endpoint.send(
            f"n:{v.name}",
            {
                "t": "welcome",
                "argv": self.argv,
                "env": env,
                "spares": self.cc.warm_spares,
                "liveness_s": self.liveness_s,
                "log_dir": str(self.dir / "logs"),
                "cwd": os.getcwd(),
                "work_dir": str(self.cfg.run_dir.absolute()),
                "devices": self.per_node,
                "device_kind": self.device_kind,
            },
        )

    def _probe(self, v: NodeView, ring: list[str]) -> None:
        """Have ``v`` ping itself and its neighbours before it in ``ring`` (node names, policy.probe_peers)."""
        v.probing = True
        peers = {p: self.nodes[p].probe for p in policy.probe_peers(ring, v.name)}
        self.endpoint.send(f"n:{v.name}", {"t": "probe", "peers": peers, "bytes": 65536})

    def _on_probe(self, name: str, rtt: dict[str, float | None]) -> None:
        v = self.nodes.get(name)
        if v is None:
            return
        v.probing = False
        for peer, t in rtt.items():
            if t is not None:
                self.rtt[(name, peer)] = float(t)
        unreachable = sorted(p for p, t in rtt.items() if t is None)
        if unreachable:
            self.events.add("link_failed", node=name, unreachable=unreachable)
        elif not v.link_ok:
            v.link_ok = True
            self.events.add("node_checked", node=name, checks=v.checks, peers=sorted(rtt))
        if name in self.anomaly_probe:
            self.anomaly_probe.discard(name)
            if not self.anomaly_probe:
                self.events.add(
                    "probe",
                    slow_nodes=policy.slow_nodes(self.rtt),
                    rtt={f"{a}>{b}": t for (a, b), t in self.rtt.items()},
                )

    def _on_worker_hb(self, ident: str, msg: dict[str, Any], now: float, relayed: bool = False) -> None:
        """A worker's heartbeat, sent at ``now`` (monotonic): directly, or ``relayed`` by its node agent."""
        w = self.workers.get(ident) or self._new_worker(ident, str(msg["node"]), int(msg["pid"]), now)
        if not relayed:  # a message on its own connection: the connection is up
            w.disconnected_at, w.direct = None, True
        beat, sent = msg.get("beat"), msg.get("sent")
        if isinstance(beat, int) and isinstance(sent, (int, float)):  # numbered: a worker that relays
            if beat <= w.beat and sent <= w.sent:
                return  # the same heartbeat by both paths, or an older one (a process reusing a pid sends later)
            w.beat, w.sent = beat, float(sent)
        w.last_heartbeat = max(w.last_heartbeat, now)
        if msg["state"] == "warm" and w.warm_at is None:
            w.warm_at = now
        if (int(msg["gen"]), int(msg["rank"])) != (w.gen, w.rank):
            self._place(w, int(msg["gen"]), int(msg["rank"]))
        w.state, w.step = str(msg["state"]), int(msg["step"])
        w.resume_step, w.tokens_per_s = msg.get("resume_step"), float(msg.get("tokens_per_s", 0.0))
        for k in ("versions", "cache_hits", "cache_misses", "mesh_device_order", "step_time", "resumed_from", "loop"):
            if k in msg:
                w.info[k] = msg[k]
        s = self.state
        if 0 <= w.gen < s.generation and w.alive:
            self._kill(w.node, [w.pid])  # a process of an ended generation (e.g. woken from SIGSTOP)
        if w.gen != s.generation or s.phase not in ("starting", "running") or s.members.get(w.rank) != w.node:
            return
        g = s.current
        if g is not None and w.step > g.last_step:
            g.last_step = s.last_step = w.step
            self.progress_at = now
        periods = msg.get("periods")
        if periods:
            health = self._health()
            for record in periods:  # each rides on a few heartbeats: the copies already here are skipped unread
                if health.is_next(record):
                    self._on_period(Period.from_dict(record))
        if "probe" in msg:
            self._on_device_probe(msg["probe"])
        if g is not None and g.first_step_at is None and w.state == "training":
            self._first_step(g, w)

    def _first_step(self, g: Generation, w: WorkerInfo) -> None:
        g.first_step_at = time.time()
        g.resume_step = int(w.resume_step or 0)
        self.state.phase = "running"
        self.start_failures = 0
        members = [self._member_worker(r) for r in self.state.members]
        self.events.add(
            "first_step",
            gen=g.gen,
            step=w.step,
            resume_step=g.resume_step,
            resumed_from=w.info.get("resumed_from"),
            since_assign_s=g.first_step_at - g.assigned_at,
            cache_hits=[m.info.get("cache_hits") if m else None for m in members],
            cache_misses=[m.info.get("cache_misses") if m else None for m in members],
        )
        for v in self._live_nodes():  # now, not before: warming spares would slow the restart
            self.endpoint.send(f"n:{v.name}", {"t": "replenish"})
        if self.entry is not None:
            rank0 = self._member_worker(0)
            order = rank0.info.get("mesh_device_order") if rank0 else None
            if not self.entry.mark_started(order):
                self.events.add("setup_stale", key=self.entry.key.digest(), why="mesh device order changed")
                self.setup.invalidate(self.entry.key)
        self._save(force=True)

    def _health(self) -> HealthHistory:
        """This generation's efficiency records (a new history at a new generation)."""
        s = self.state
        if self.health is None or self.health.gen != s.generation:
            self.health = HealthHistory(s.generation, len(s.members))
        return self.health

    def _on_period(self, p: Period) -> None:
        """A member's efficiency record: keep it, and judge each round every member has now reported."""
        s = self.state
        if not self._health().add(p):
            return  # resent, or of an ended generation
        with open(self.dir / "health.jsonl", "a") as f:
            f.write(json.dumps({"record": "period", **p.to_dict()}) + "\n")
            for r, periods, found, alarms in self.health.complete_rounds(self.thresholds):
                f.write(
                    json.dumps(
                        {
                            "record": "round",
                            "gen": s.generation,
                            "round": r,
                            "step_s": job_step_s(periods),
                            "last_step": periods[0].last_step,
                            "findings": [x.to_dict() for x in found],
                        }
                    )
                    + "\n"
                )
                for x in alarms:
                    d = x.to_dict()
                    self.events.add("health", gen=s.generation, finding=d.pop("kind"), **d)
                # A job-wide slowdown no rank's data or saves explain: are the links between the nodes slow?
                if any(x.rank is None and x.kind in ("slowdown", "compute") for x in alarms) and not self.anomaly_probe:
                    self._probe_links()
                self._on_alarms(alarms)  # the device probe, an eviction (health_actions.py)

    def _probe_links(self) -> None:
        """Have every live node ping its neighbours (TCP, policy.probe_peers), naming a node whose links are all
        slow."""
        live = self._live_nodes()
        self.anomaly_probe = {v.name for v in live}
        for v in live:
            self._probe(v, [n.name for n in live])

    def _on_exit(self, node: str, pid: int, rc: int, now: float) -> None:
        ident = f"w:{node}:{pid}"
        w = self.workers.get(ident) or self._new_worker(ident, node, pid, now)
        if w.exit_code is not None:
            return
        self._exited(w, rc, now)
        self.killed.pop((node, pid), None)
        self._judge_by(now)
        s = self.state
        if w.gen < 0:  # its heartbeats since the assignment are not in yet (they may come through its node agent)
            r = next((r for r, p in s.pids.items() if p == pid and s.members.get(r) == node), None)
            if r is not None:
                self._place(w, s.generation, r)
        member = w.gen == s.generation and s.members.get(w.rank) == node
        self.events.add("worker_exit", node=node, pid=pid, rc=rc, gen=w.gen, rank=w.rank, member=member)
        if member and rc == 2 and self.state.phase in ("starting", "running"):
            # Exit code 2: the worker refused its config or data, or its run could only produce nonsense (a NaN
            # loss, ids outside the vocabulary). Every restart would stop the same way: end the job, say why.
            return self._give_up(
                f"rank {w.rank} on {node} stopped with exit code 2 (a config, data or non-finite-loss error; its "
                f"last lines are in the worker log under {self.dir / 'logs'}): fix the cause and run the job "
                "again, it resumes from its newest checkpoint"
            )
        if not member and w.gen < 0 and rc not in (0, -9):
            n = self.spare_failures[node] = self.spare_failures.get(node, 0) + 1
            if n >= SPARE_FAILURES_TO_BAN and node not in self.state.banned:
                self._ban(node, f"{n} warm processes exited with errors (see {self.dir / 'logs'})")

    # ------------------------------------------------------------------ views

    def _new_worker(self, ident: str, node: str, pid: int, now: float) -> WorkerInfo:
        w = self.workers[ident] = WorkerInfo(ident, node, pid, now)
        self.node_workers.setdefault(node, {})[ident] = w
        self.rank_workers.setdefault((w.gen, w.rank), {})[ident] = w
        return w

    def _exited(self, w: WorkerInfo, rc: int, now: float) -> None:
        """``w`` exited with ``rc`` (reported, or written off): it leaves its node's live workers."""
        w.exit_code, w.exited_at = rc, now
        self.node_workers.get(w.node, {}).pop(w.identity, None)

    def _place(self, w: WorkerInfo, gen: int, rank: int) -> None:
        """``w`` is rank ``rank`` of generation ``gen`` now (its entry in the per-rank index moves with it)."""
        self.rank_workers.get((w.gen, w.rank), {}).pop(w.identity, None)
        w.gen, w.rank = gen, rank
        self.rank_workers.setdefault((gen, rank), {})[w.identity] = w

    def _workers_on(self, node: str) -> list[WorkerInfo]:  # its live workers (no exit known)
        return list(self.node_workers.get(node, {}).values())

    def _heard_workers(self, node: str, now: float) -> list[int]:
        """Pids of the live worker processes on ``node`` heard within ``heartbeat_timeout``."""
        return sorted(
            w.pid
            for w in self._workers_on(node)
            if w.exit_code is None and now - w.last_heartbeat <= self.cc.heartbeat_timeout
        )

    def _live_nodes(self) -> list[NodeView]:
        return [v for v in self.nodes.values() if not v.lost]

    def _warm_worker(self, node: str) -> WorkerInfo | None:
        warm = [w for w in self._workers_on(node) if w.warm]
        return min(warm, key=lambda w: w.pid) if warm else None

    def _ready_nodes(self) -> list[NodeView]:
        ready = []
        for v in self._live_nodes():
            ok = (
                v.checks.get("ok")
                and v.link_ok
                and v.name not in self.state.banned
                and self._warm_worker(v.name) is not None
            )
            if ok and v.ready_at is None:
                v.ready_at = time.monotonic()
                self.events.add("node_ready", node=v.name)
            if ok:
                ready.append(v)
        return sorted(ready, key=lambda v: v.ready_at)

    def _member_worker(self, rank: int) -> WorkerInfo | None:
        s = self.state
        ws = [w for w in self.rank_workers.get((s.generation, rank), {}).values() if w.node == s.members.get(rank)]
        return max(ws, key=lambda w: w.last_heartbeat) if ws else None

    # ------------------------------------------------------------------ decisions

    def _judge_by(self, t: float) -> None:
        """Judge the running generation again no later than ``t`` (monotonic): something happened to it."""
        self.judge_at = min(self.judge_at, t)

    def tick(self, now: float) -> None:
        """Judge the job: every tick while it starts no generation (waiting, recovering), else every heartbeat
        interval and soon after an exit or a dropped connection (each judgment is O(nodes): at 1,024 nodes, every
        tick's was half the controller's time, and a silence is only measured to a heartbeat interval)."""
        # Heartbeats that wait unread (this process stalled) are no silence: none is judged before they are read.
        backlog = (since := self.endpoint.backlog_since) is not None and now - since < self.cc.heartbeat_timeout
        if self.state.phase in ("starting", "running") and (now < self.judge_at or backlog) and not self.attaching:
            return self._save()  # (a restarted controller saves nothing until it has heard the job: below)
        self.judge_at = now + self.cc.heartbeat_interval - TICK_S / 2  # the tick nearest one interval on
        for v in [] if backlog else self._live_nodes():
            silent = now - v.last_heartbeat
            if silent <= 2 * self.cc.heartbeat_timeout:
                continue
            heard = self._heard_workers(v.name, now)
            if heard:
                # The host works: its workers' heartbeats arrive. Only the agent's messages do not (a stalled
                # agent loop, a dropped connection): say so, but do not take a live node for a lost one.
                if v.agent_silent_at is None:
                    v.agent_silent_at = v.last_heartbeat
                    self.events.add("agent_silent", node=v.name, silent_s=round(silent, 2), workers=heard)
                continue
            v.lost, v.ready_at, v.link_ok = True, None, False
            self.events.add("node_lost", node=v.name, silent_s=round(silent, 2))
            for w in self._workers_on(v.name):  # its spare processes went with it: never assign one if it is back
                if w.warm:
                    self._exited(w, -int(signal.SIGKILL), now)
        if self.attaching:
            waited = now - self.t0
            unheard = any(n not in self.nodes for n in self.state.members.values())
            if waited < 2 * self.cc.heartbeat_timeout + 1.0 or (unheard and waited < ATTACH_MAX_S):
                return  # collect the running job's heartbeats first: a member not heard yet has not failed
            self.attaching = False
            self.gen_started = self.progress_at = now
            self.events.add(
                "attached",
                gen=self.state.generation,
                phase=self.state.phase,
                members=self.state.members,
                step=self.state.last_step,
            )
        self._lift_bans(time.time())
        ready = self.ready = self._ready_nodes()  # also records when each node became ready (standbys too)
        phase = self.state.phase
        if phase == "waiting":
            self._try_start(ready)
        elif phase in ("starting", "running"):
            self._check_generation(now)
        elif phase == "recovering":
            self._try_assign(now)
        self._save()

    def _save(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_save > 0.25:
            ep = self.endpoint
            self.state.rejected_messages = (
                self.rejected_before + ep.verifier.rejected + ep.gate.refused + self.malformed
            )
            self.state.stale_messages = self.stale_before + ep.verifier.stale
            self.state.controller_load = self.load.snapshot(ep.waited_s)
            _write_marks(self.dir / "replay.json", ep.verifier.marks())
            members = set(self.state.members.values())
            self.state.standbys = [v.name for v in self.ready if v.name not in members]  # as of the last judgment
            self.state.warm_nodes = sorted(v.name for v in self._live_nodes() if self._warm_worker(v.name))
            self.state.save(self.dir / "state.json")
            self.last_save = now

    # ------------------------------------------------------------------ loop

    def run(self, watch: Callable[[], str | None] | None = None) -> int:
        """Serve until the job is done (returns 0) or given up / stopped (1).

        ``watch()``, called about once a second, may return a reason to give up (e.g. every launched
        node agent exited)."""
        self.events.add(
            "controller_start",
            endpoint=self.endpoint.bound_endpoint(),
            attach=self.attaching,
            gen=self.state.generation,
            job=self.state.job,
        )
        stop = lambda *_: setattr(self, "running", False)  # noqa: E731  (the job goes on without us)
        signal.signal(signal.SIGTERM, stop)
        last_tick = 0.0
        try:
            while self.running:
                for got in self.endpoint.recv_batch(TICK_S):
                    t = time.perf_counter()
                    self.handle(*got)
                    self.load.message(time.perf_counter() - t, got[1].get("ts"))
                for ident, t in self.endpoint.take_disconnects():
                    if ident in self.workers:
                        self.workers[ident].disconnected_at = t
                        self._judge_by(t + self.cc.heartbeat_interval + TICK_S)  # find_failures' disconnect grace
                if time.monotonic() - last_tick >= TICK_S:  # O(nodes) each: not after every message of a flood
                    last_tick = time.monotonic()
                    self.tick(last_tick)
                if watch is not None and time.monotonic() - self.last_watch > 1.0:
                    self.last_watch = time.monotonic()
                    why = watch()
                    if why:
                        self._give_up(why)
        finally:
            self._save(force=True)
            time.sleep(0.1)  # let the stop messages leave
            self.endpoint.close()
        return 0 if self.state.phase == "done" else 1

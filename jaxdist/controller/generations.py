"""The life of a generation (one formation of the training group): start, watch, fail, recover, finish.

Mixed into :class:`~jaxdist.controller.controller.Controller`, which owns the
state these methods read and change; the decisions themselves are the pure
functions of :mod:`~jaxdist.controller.policy`.
"""

from __future__ import annotations

import glob
import logging
import time
from pathlib import Path
from typing import Any

from jaxdist.controller import policy
from jaxdist.controller.health import LoopPosition, stuck_ranks
from jaxdist.controller.ports import port_is_free
from jaxdist.controller.setup_cache import SetupEntry, SetupKey
from jaxdist.controller.state import Generation, NodeView, WorkerInfo

log = logging.getLogger("jaxdist.controller")

KILL_CONFIRM_S = 5.0  # seconds to wait for a killed generation's exits before starting the next one
DONE_GRACE_S = 60.0  # seconds a group that finished training may take to exit
START_FAILURES_TO_GIVE_UP = 3  # generations in a row that fail before their first step: the job cannot run


def last_committed_step(run_dir: Path) -> int:
    """Newest checkpoint step with a commit marker under ``run_dir/checkpoints`` (0 if none)."""
    steps = [
        int(Path(p).parent.name)
        for p in glob.glob(str(run_dir / "checkpoints" / "*" / "jaxdist_commit.json"))
        if Path(p).parent.name.isdigit()
    ]
    return max(steps, default=0)


class GenerationLifecycle:
    """Starting, checking, failing, recovering and finishing generations (see the module docstring)."""

    def _try_start(self, ready: list[NodeView]) -> None:
        n = policy.choose_group_size(len(ready), self.cc.min_nodes, self.max_nodes, self.valid_sizes)
        if n is None:
            self.enough_since = None
            return
        now = time.monotonic()
        self.enough_since = self.enough_since or now
        if len(ready) < self.max_nodes and now - self.enough_since < self.cc.start_grace:
            return  # min_nodes are ready: give the others start_grace seconds to join
        names = [v.name for v in ready]
        members = dict(enumerate(names[:n]))
        w0 = self._warm_worker(names[0])
        fixed = dict(
            devices_per_host=self.per_node,
            device_kind=self.device_kind.lower(),
            mesh=SetupKey.make([], 0, "", self.cfg.mesh.resolved(n * self.per_node), {}).mesh,
            versions=tuple(sorted((w0.info.get("versions") or {}).items())),
        )
        for key in self.setup.layouts(**fixed):  # a cached rank -> host assignment over ready nodes
            if len(key.hosts) == n and set(key.hosts) <= set(names):
                members = dict(enumerate(key.hosts))
                break
        self.state.group_size = n  # a recovery keeps this size while the nodes for it exist
        self._start_generation(members, "elastic start", ready=len(ready))

    def _start_generation(self, members: dict[int, str], cause: str, **extra: Any) -> None:
        s = self.state
        n = len(members)
        workers = {r: self._warm_worker(node) for r, node in members.items()}
        assert all(workers.values())
        versions = workers[0].info.get("versions") or {}
        key = SetupKey.make(
            [members[r] for r in range(n)],
            self.per_node,
            self.device_kind,
            self.cfg.mesh.resolved(n * self.per_node),
            versions,
        )
        self.entry = self.setup.get_or_create(key)
        coordinator = self._coordinator(self.nodes[members[0]], self.entry)
        s.generation += 1
        s.members, s.coordinator, s.setup_key, s.phase = dict(members), coordinator, key.digest(), "starting"
        s.pids = {r: w.pid for r, w in workers.items()}
        now = time.time()
        s.history.append(Generation(s.generation, dict(members), coordinator, now))
        self.gen_started, self.progress_at, self.plan, self.done_since = time.monotonic(), None, None, None
        if not self.entry.fresh or not self.entry.coordinator:
            self.entry.coordinator = coordinator
            self.entry.save()
        jax_env = {
            "JAXDIST_HEARTBEAT_TIMEOUT": str(max(10, int(8 * self.cc.heartbeat_timeout))),
            "JAXDIST_SHUTDOWN_TIMEOUT": "30",
        }
        if coordinator.startswith("127."):  # keep JAX's coordination service on loopback too
            jax_env["JAX_COORDINATOR_BIND_ADDRESS"] = coordinator
        warm_for = {r: round(time.monotonic() - (w.warm_at or time.monotonic()), 3) for r, w in workers.items()}
        for r, w in workers.items():
            w.assigned = True
            env = {**jax_env, **self.entry.worker_env(r)}
            self.endpoint.send(
                w.identity,
                {
                    "t": "assign",
                    "gen": s.generation,
                    "rank": r,
                    "num_processes": n,
                    "coordinator": coordinator,
                    "env": env,
                },
            )
            self.endpoint.send(f"n:{w.node}", {"t": "assigned", "pid": w.pid, "gen": s.generation, "rank": r})
        self.events.add(
            "start",
            gen=s.generation,
            cause=cause,
            members=members,
            pids=s.pids,
            coordinator=coordinator,
            setup="reused" if not self.entry.fresh else "built",
            setup_key=key.digest(),
            warm_for_s=warm_for,
            **extra,
        )
        self._save(force=True)

    def _coordinator(self, node: NodeView, entry: SetupEntry) -> str:
        """host:port for process 0's coordination service: the cached one if its port is free, else a fresh one."""
        host = node.host or "127.0.0.1"
        if entry.coordinator and not entry.fresh and entry.coordinator.rsplit(":", 1)[0] == host:
            port = int(entry.coordinator.rsplit(":", 1)[1])
            if not host.startswith("127.") or port_is_free(port, host):
                return entry.coordinator
        return f"{host}:{node.free_port}"

    def _check_generation(self, now: float) -> None:
        s = self.state
        views = []
        for r, node in s.members.items():
            w = self._member_worker(r) or self.workers.get(f"w:{node}:{s.pids.get(r)}")
            if w is None:
                views.append(policy.WorkerView(r, node, self.gen_started))
                continue
            connected, dropped = self._connected(w, now), w.disconnected_at
            if (
                dropped is not None
                and dropped < w.last_heartbeat
                and now - w.last_heartbeat <= self.cc.heartbeat_timeout
            ):
                # Heard through its node agent after its own connection dropped (its ZeroMQ pings went unanswered:
                # a starved host): the process lives, and ZeroMQ reconnects it. A hung one relays nothing, and once
                # the relayed heartbeats stop for heartbeat_timeout the dropped connection counts again.
                connected, dropped = True, None
            views.append(
                policy.WorkerView(
                    r,
                    node,
                    max(w.last_heartbeat, self.gen_started),
                    w.step,
                    w.state,
                    w.exit_code,
                    w.exited_at,
                    connected,
                    dropped,
                )
            )
        finished = [v for v in views if v.exit_code == 0 or v.state == "done"]
        if views and len(finished) == len(views):
            if all(v.exit_code is not None for v in views):
                return self._finish()
            self.done_since = self.done_since or now
            if now - self.done_since > DONE_GRACE_S:  # trained and checkpointed, but stuck in JAX's shutdown
                self.events.add("shutdown_stuck", ranks=[v.rank for v in views if v.exit_code is None])
                return self._finish()
        failures = policy.find_failures(
            now,
            views,
            started_at=self.gen_started,
            progress_at=self.progress_at,
            heartbeat_timeout=self.cc.heartbeat_timeout,
            progress_timeout=self.cc.progress_timeout,
            start_timeout=self.cc.start_timeout,
            heartbeat_grace=self.cc.heartbeat_grace,
            disconnect_grace=policy.disconnect_grace(now, views, self.cc.heartbeat_interval, self.cc.heartbeat_timeout),
        )
        if not failures and s.phase == "running":
            failures = self._stuck(now)
        if failures:
            self._fail(failures, now)

    def _connected(self, w: WorkerInfo, now: float) -> bool | None:
        """Whether member ``w``'s own connection is up, as far as the judgment needs to know: asked of the socket
        (Endpoint.routable) for a worker silent for ``heartbeat_timeout`` or said to be disconnected for longer
        than the grace -- a disconnect it contradicts named the wrong peer, and is forgotten."""
        if w.exit_code is not None:
            return False
        late = w.disconnected_at is not None and now - w.disconnected_at > self.cc.heartbeat_interval
        if not late and now - w.last_heartbeat <= self.cc.heartbeat_timeout:
            return self.endpoint.connected.get(w.identity)
        if self.endpoint.routable(w.identity):
            w.disconnected_at = None
            return True
        return False  # gone (an event named it, or named another peer by the descriptor it reused)

    def _stuck(self, now: float) -> list[policy.Failure]:
        """A member alive and heartbeating whose step does not finish while the others wait (health.stuck_ranks)."""
        s, positions = self.state, []
        if self.progress_at is None:
            return []
        for r, node in s.members.items():
            w = self._member_worker(r)
            loop = w.info.get("loop") if w is not None else None
            if not loop:
                return []  # a worker that does not report its loop (or not yet): judged by the timeouts alone
            if now - w.last_heartbeat > 4 * self.cc.heartbeat_interval:
                return []  # not heartbeating (stopped, dying): that is find_failures' "silent", not stuck
            positions.append(
                LoopPosition(r, node, str(loop["phase"]), int(loop["dispatched"]), time.time() - float(loop["since"]))
            )
        typical = self.health.typical_step_s() if self.health is not None and self.health.gen == s.generation else None
        rank0 = self._member_worker(0)
        step_s = typical or (float(rank0.info.get("step_time") or 0) if rank0 else 0.0)
        found = stuck_ranks(
            now - self.progress_at, positions, step_s, self.cc.heartbeat_timeout, step_s * self.cfg.train.log_every
        )
        if found is None:
            return []
        ranks, why = found
        if len(ranks) == len(positions):
            return [policy.Failure("stuck", None, None, why)]
        return [policy.Failure("stuck", s.members[r], r, why) for r in ranks]

    def _fail(self, failures: list[policy.Failure], now: float) -> None:
        s = self.state
        g = s.current
        blamed = {f.node for f in failures if f.node}
        first_step = g is not None and g.first_step_at is not None
        s.last_good_step = last_committed_step(self.cfg.run_dir.absolute())
        if g is not None:
            g.ended_at, g.end = time.time(), "failed: " + "; ".join(f.detail for f in failures)
        self.events.add(
            "failure",
            gen=s.generation,
            kinds=sorted({f.kind for f in failures}),
            nodes=sorted(blamed),
            ranks=sorted(f.rank for f in failures if f.rank is not None),
            detail="; ".join(f.detail for f in failures),
            last_step=s.last_step,
            last_good_step=s.last_good_step,
            after_first_step=first_step,
        )
        # Whose failure it was (the process's, or its node's) is settled once the node agent speaks again
        # or stays silent: see _settle_blame, before the next generation is planned.
        self.blame = {node: now for node in blamed}
        self.blame_rank = {f.node: f.rank for f in failures if f.node and f.rank is not None}
        # The whole generation goes: on CPU no process survives the loss of a peer.
        for r, node in s.members.items():
            for w in self._workers_on(node):
                if w.gen == s.generation and w.alive:
                    self._kill(node, [w.pid])
            if s.pids.get(r):
                self._kill(node, [s.pids[r]])
        if self.cc.recovery == "requeue":  # nothing warm survives a requeue
            for v in self._live_nodes():
                self._kill(v.name, [w.pid for w in self._workers_on(v.name) if w.alive])
                self.endpoint.send(f"n:{v.name}", {"t": "replenish", "at_least": 1})
        self.start_failures = 0 if first_step else self.start_failures + 1
        s.restarts += 1
        if self.start_failures >= START_FAILURES_TO_GIVE_UP:
            return self._give_up(
                f"{self.start_failures} generations in a row failed before their first step "
                f"(see the worker logs in {self.dir / 'logs'})"
            )
        s.phase = "recovering"
        self.plan, s.last_failed = None, sorted(blamed)
        self._save(force=True)

    def _candidates(self) -> list[str]:
        """Standby nodes, warm ones first."""
        s = self.state
        others = [v for v in self._live_nodes() if v.name not in s.members.values() and v.checks.get("ok")]
        return [v.name for v in sorted(others, key=lambda v: (self._warm_worker(v.name) is None, v.ready_at or 1e18))]

    def _settle_blame(self, now: float) -> bool:
        """Decide, per blamed node, whether its process or the node failed; False while it cannot be told yet.

        A node agent that reports after the failure is healthy: the process failed (counted in
        ``process_failures``; with crashed_rank=same_node the rank stays on the node, where its local-tier files
        are, until policy.process_failure_verdict moves it once, bans the node or stops the job). An agent
        silent for ``heartbeat_timeout`` after it (or lost), or whose own connection is gone (the socket cannot
        route to it: its machine closed it, or ZeroMQ's pings found it dead): the node failed (``failures``).
        """
        s = self.state
        scope = {}
        for node, t in self.blame.items():
            v = self.nodes.get(node)
            if v is not None and not v.lost and v.last_heartbeat > t:
                scope[node] = "process"
            elif v is None or v.lost or now - t > self.cc.heartbeat_timeout or not self.endpoint.routable(f"n:{node}"):
                scope[node] = "node"
            else:
                return False
        # Members lost with the blamed ones (a rack, a switch) whose silence was judged a tick after the failure:
        # their agents silent for heartbeat_timeout and no process of theirs heard.  Otherwise the next group would
        # be planned on them and fail at once.
        for node in sorted(set(s.members.values()) - set(scope)):
            v = self.nodes.get(node)
            silent = v is not None and (v.lost or now - v.last_heartbeat > self.cc.heartbeat_timeout)
            if silent and not self._heard_workers(node, now):
                scope[node] = "node"
                s.last_failed = sorted({*s.last_failed, node})
        self.blame = {}
        self.failed_nodes = {node for node, kind in scope.items() if kind == "node"}
        moved = set()
        for node, kind in sorted(scope.items()):
            if kind == "node":
                s.failures[node] = s.failures.get(node, 0) + 1
                if s.failures[node] >= self.cc.max_failures and node not in s.banned:
                    self._ban(node, f"it failed {s.failures[node]} times")
                continue
            s.process_failures[node] = s.process_failures.get(node, 0) + 1
            s.process_failure_log.append([self.blame_rank.get(node, -1), node])
            verdict = policy.process_failure_verdict(
                [(r, n) for r, n in s.process_failure_log], self.cc.max_process_failures
            )
            if verdict.action == "ban" and node not in s.banned:
                self._ban(node, verdict.why)
            elif verdict.action == "move":
                moved.add(node)
                self.events.add("rank_moved", node=node, rank=self.blame_rank.get(node), why=verdict.why)
            elif verdict.action == "give_up":
                self._give_up(verdict.why)
        stay = (
            {n for n, kind in scope.items() if kind == "process"} - moved
            if self.cc.crashed_rank == "same_node"
            else set()
        )
        s.last_failed = sorted(set(s.last_failed) - stay)
        if scope:
            self.events.add("blame", gen=s.generation, scope=scope, moved=s.last_failed)
        return True

    def _try_assign(self, now: float) -> None:
        s = self.state
        if self.blame and not self._settle_blame(now):
            return
        if not self.running:
            return  # every node banned: given up
        if self.plan is not None and any(self.nodes[n].lost for n in self.plan.values() if n in self.nodes):
            self.plan = None  # a node of the plan was lost meanwhile: plan again
        if self.plan is None:
            live = {v.name for v in self._live_nodes()}
            failed = set(s.last_failed) | {n for n in s.members.values() if n not in live or n in s.banned}
            self.plan = policy.plan_replacement(s.members, failed, self._candidates(), set(s.banned) | (failed - live))
            if self.plan is None:
                self.plan = self._smaller_group(failed - live)
            if self.plan is None:
                self.waiting_since = self.waiting_since or now
                if now - self.waiting_since > self.cc.start_timeout:
                    usable = len(self._usable_nodes(failed - live))
                    return self._give_up(
                        f"only {usable} usable node(s) are left (banned: {', '.join(s.banned) or 'none'}) and no "
                        f"group of at least controller.min_nodes={self.cc.min_nodes} of them fits the mesh and "
                        f"batch; the run resumes from its checkpoint at step "
                        f"{last_committed_step(self.cfg.run_dir.absolute())}"
                        " when you run the job again with more nodes (or a lower controller.min_nodes)"
                    )
                if now - self.kill_sent_at > 30:
                    self.kill_sent_at = now
                    self.events.add("waiting_for_nodes", members=s.members, banned=s.banned)
                return
            self.waiting_since = None
            standbys = [v.name for v in self._ready_nodes() if v.name not in failed]  # not a node just blamed
            upto = min(self.max_nodes, s.group_size or self.max_nodes)  # the size the job started with
            grown = policy.grown_plan(self.plan, standbys, self.cc.min_nodes, upto, self.valid_sizes)
            if len(grown) > len(self.plan):  # the restart is also the moment to use the standbys beyond the group
                self.events.add("grow", gen=s.generation + 1, members=grown, before=len(self.plan))
                self.plan = grown
            self.events.add(
                "replacement",
                gen=s.generation + 1,
                members=self.plan,
                swapped={r: n for r, n in self.plan.items() if s.members.get(r) != n},
            )
            self.kill_sent_at = 0.0  # a new plan: its nodes without a warm spare are asked for one at once
        if self._blame_late(now):
            return  # planned again at the next tick, without them
        if now - self.kill_sent_at > 5 and any(self._warm_worker(n) is None for n in self.plan.values()):
            # Asked while the old processes' exits are awaited: a loss right after a recovery finds the new members'
            # spares not started yet (they start at the first step), and waiting 5 s to ask made its group wait.
            self.kill_sent_at = now
            for n in self.plan.values():
                if self._warm_worker(n) is None and not (n in self.nodes and self._retire_written_off(self.nodes[n])):
                    self.endpoint.send(f"n:{n}", {"t": "replenish", "at_least": 1})
        # The old generation's processes must be gone before the new one touches the checkpoints: wait (at most
        # KILL_CONFIRM_S) for each kill's exit report, except from a node that cannot send one (lost, or found
        # failed when the blame settled): waiting for it would delay every recovery from a lost node by the whole
        # wait and make nothing safer, since its processes' peers of the old generation are confirmed gone.  A
        # node that is only slow to answer (a loaded host) is waited for.
        pending = [
            (node, pid)
            for (node, pid), t in self.killed.items()
            if now - t < KILL_CONFIRM_S and not self._cannot_confirm(node)
        ]
        if pending:
            return
        if all(self._warm_worker(n) is not None for n in self.plan.values()):
            self._start_generation(self.plan, "recovery")

    def _blame_late(self, now: float) -> bool:
        """Blame as nodes the failed group's members of the plan lost with the blamed ones but found only after the
        blame settled, and plan again without them; True if there were any (a second ``blame`` event names them).

        A rack or a switch takes its nodes' connections down over a fraction of a second (at 1,024 simulated
        nodes, 11 lost "at once" closed theirs over up to half a second), and the blame settles as soon as the
        first failed node's agent connection is gone: without this the group would be planned on the others and
        fail at its start.  Such a member's agent connection is gone and its agent silent for two heartbeat
        intervals (a reconnecting agent is heard again within one).  Not when that many went at once
        (policy.disconnect_grace's bulk: a stall drops connections in bulk and ZeroMQ reconnects them)."""
        s = self.state
        gone = sorted(
            n
            for n in set(self.plan.values()) & set(s.members.values())
            if n in self.nodes
            and now - self.nodes[n].last_heartbeat > 2 * self.cc.heartbeat_interval
            and not self.endpoint.routable(f"n:{n}")
        )
        if not gone or policy.in_bulk(len(gone), len(s.members)):
            return False  # (that many at once: a stall of this host or the network; the lost-node sweep decides)
        for n in gone:
            s.failures[n] = s.failures.get(n, 0) + 1
            if s.failures[n] >= self.cc.max_failures and n not in s.banned:
                self._ban(n, f"it failed {s.failures[n]} times")
        s.last_failed = sorted({*s.last_failed, *gone})
        self.failed_nodes |= set(gone)
        self.events.add("blame", gen=s.generation, scope=dict.fromkeys(gone, "node"), moved=s.last_failed, late=True)
        self.plan = None
        return True

    def _retire_written_off(self, v: NodeView) -> bool:
        """Kill the processes of ``v`` that the controller wrote off (its spares, when the node counted as lost)
        but that its agent reports still running, and have it start new spares; True if there were any.

        A node silent for 2 x heartbeat_timeout that comes back (a partition, a starved host) still runs the
        spares the controller gave up on, and counts them: without this it never starts new ones, and a recovery
        whose plan takes that node waits for a warm spare that never comes (seen at 1,024 simulated nodes)."""
        stale = [
            int(p["pid"])
            for p in v.procs
            if p.get("rc") is None
            and (w := self.workers.get(f"w:{v.name}:{p['pid']}")) is not None
            and w.exit_code is not None
        ]
        if stale:
            self.endpoint.send(f"n:{v.name}", {"t": "kill", "pids": stale})
            self.endpoint.send(f"n:{v.name}", {"t": "replenish", "at_least": 1})
        return bool(stale)

    def _history(self, v: NodeView, proc: dict[str, Any], now: float) -> bool:
        """True for a dead process that ``v``'s first heartbeat to this controller lists, of an older generation
        or a spare, and that this controller never heard: its exit was judged before (a restarted controller) and
        is recorded quietly, not as an event (at 1,024 nodes a restart met ~7,000 such exits at once: writing and
        judging each kept the controller too busy to admit the nodes' reconnections for 30 s)."""
        ident = f"w:{v.name}:{proc['pid']}"
        if ident in self.workers or int(proc.get("gen", -1)) >= self.state.generation:
            return False
        self._exited(self._new_worker(ident, v.name, int(proc["pid"]), now), int(proc["rc"]), now)
        return True

    def _cannot_confirm(self, node: str) -> bool:
        """True when ``node`` cannot report a killed process's exit: unknown, lost, or found failed (its agent
        silent for ``heartbeat_timeout``) when the last blame settled."""
        v = self.nodes.get(node)
        return v is None or v.lost or node in self.failed_nodes

    def _usable_nodes(self, gone: set[str]) -> list[str]:
        """Live, checked, not banned nodes: the current members first (in rank order), then the standbys."""
        s = self.state
        live = {v.name: v for v in self._live_nodes() if v.checks.get("ok") and v.name not in s.banned}
        members = [n for _, n in sorted(s.members.items()) if n in live and n not in gone]
        return members + [n for n in self._candidates() if n in live and n not in members]

    def _smaller_group(self, gone: set[str]) -> dict[int, str] | None:
        """A smaller group of the usable nodes when the same size cannot be formed (the elastic rule of the
        start: the largest size that fits the mesh and batch, at least controller.min_nodes), or None."""
        usable = self._usable_nodes(gone)
        n = policy.choose_group_size(len(usable), self.cc.min_nodes, self.max_nodes, self.valid_sizes)
        if n is None or n >= len(self.state.members):
            return None
        plan = dict(enumerate(policy.covering_group(self.state.members, usable, n)))  # keeps the local tier whole
        self.events.add("shrink", gen=self.state.generation + 1, members=plan, before=len(self.state.members))
        return plan

    def _kill(self, node: str, pids: list[int]) -> None:
        if not pids:
            return
        self.endpoint.send(f"n:{node}", {"t": "kill", "pids": pids})
        now = time.monotonic()
        for pid in pids:
            w = self.workers.get(f"w:{node}:{pid}")
            if w is None or w.alive:
                self.killed.setdefault((node, pid), now)

    def _ban(self, node: str, why: str) -> None:
        s = self.state
        s.banned.append(node)
        s.bans[node] = s.bans.get(node, 0) + 1
        until = policy.ban_ends(time.time(), self.cc.ban_cooldown, s.bans[node])
        if until is not None:
            s.banned_until[node] = until
        self.events.add("banned", node=node, why=why, until=until, ban=s.bans[node])
        live = [v for v in self._live_nodes() if v.name not in self.state.banned]
        if not live:
            self._give_up("every node is banned")

    def _lift_bans(self, now: float) -> None:
        """Nodes whose ban cooled down (controller.ban_cooldown) are usable again, their failure counts cleared:
        ready, they wait as standbys until a recovery needs them."""
        s = self.state
        for node in policy.bans_over(s.banned, s.banned_until, now):
            s.banned.remove(node)
            del s.banned_until[node]
            s.failures.pop(node, None)
            s.process_failures.pop(node, None)
            s.process_failure_log = [x for x in s.process_failure_log if x[1] != node]
            self.events.add("unbanned", node=node, ban=s.bans.get(node, 1))

    def _finish(self) -> None:
        s = self.state
        g = s.current
        if g is not None:
            g.ended_at, g.end = time.time(), "done"
        for r, node in s.members.items():
            w = self._member_worker(r)
            if w is not None and w.alive:
                self._kill(node, [w.pid])
        s.phase = "done"
        s.last_good_step = last_committed_step(self.cfg.run_dir.absolute())
        s.last_step = max(s.last_step, s.last_good_step)  # the final heartbeats may not have arrived
        self.events.add("done", gen=s.generation, step=s.last_step, restarts=s.restarts)
        self._stop_nodes()

    def _give_up(self, why: str) -> None:
        self.state.phase = "failed"
        self.events.add("gave_up", why=why)
        log.error("giving up: %s", why)
        self._stop_nodes()

    def _stop_nodes(self) -> None:
        for v in self.nodes.values():
            self.endpoint.send(f"n:{v.name}", {"t": "stop"})
        self._save(force=True)
        self.running = False

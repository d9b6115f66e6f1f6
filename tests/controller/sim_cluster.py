"""A simulated cluster: many node agents and their workers in a few processes, against the real controller.

Each simulated host process (``python sim_cluster.py host ...``) runs K simulated nodes in one thread on one
ZeroMQ context.  They speak the real protocol (``jaxdist.controller.protocol``: CURVE-encrypted connections
admitted by the job token, HMAC-signed messages, the real ``Peer``) at the configured heartbeat interval:

* a **node** registers with heartbeats (``node_hb``), runs the real ``self_check`` when welcomed, keeps
  ``warm_spares`` simulated worker processes (fake pids), answers and sends link probes (signed pings over
  CURVE), kills the workers the controller names and reports each exit;
* a **worker** heartbeats (``hb``) as ``jaxdist.controller.agent.WorkerAgent`` does: warming, warm, joining,
  restoring, training, done, its step, where its loop is and its efficiency periods (a real ``LoopClock``),
  through its node's relay (``jaxdist.controller.relay``'s ``RelayBuffer`` and ``goes_direct``, in memory
  instead of the Unix socket: the node carries them in its ``node_hb``) and directly when those rules say so;
  assigned a rank, it "trains" the stub workers' hash chain (``stub_worker.advance``): the ranks of a
  generation wait for each other at every step (one file per host and step: a rank that died or stopped
  makes the others wait, as a collective does), and rank 0 commits a checkpoint every step.  The final
  state is ``stub_worker.expected_final(steps)`` exactly when every batch was trained once, in order.

Faults come as commands (``SimCluster.command``, one JSON line in the host's command file): ``lose`` (nodes
stop at once, sockets closed, nothing said: a lost machine), ``crash`` (a rank's worker exits -9, reported
by its node), ``stop`` (a rank stops stepping and heartbeating but its connection stays: a hang), ``stuck``
(a rank stops stepping but heartbeats, held in its loop's data phase: a stuck rank), ``slow`` (a rank's steps
take longer: it dispatches for that much longer while the others, on its host too, wait in the step).

Each host counts what it did (pings sent and answered, messages by kind) in ``<sim>/host<i>.json`` when it
stops.  Used by tests/controller/test_sim_cluster.py (small N) and benchmarks/scale.py (N = 64..1,024).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq

from jaxdist.controller.agent import PERIOD_BEATS, first_heartbeat, record_step
from jaxdist.controller.local import LocalJob, write_cpu_cluster
from jaxdist.controller.node import self_check
from jaxdist.controller.ports import free_port
from jaxdist.controller.protocol import TOKEN_ENV, Gate, Peer, Signer, Verifier, curve_client
from jaxdist.controller.relay import RelayBuffer, goes_direct
from jaxdist.train.efficiency import LoopClock

sys.path.insert(0, str(Path(__file__).parent))
from stub_worker import GENESIS, advance  # noqa: E402

PROBE_TIMEOUT_S = 5.0
TURN_S = 0.01  # the host loop's poll: every socket of every simulated node and worker
# The most time one turn spends on messages before the heartbeats: a real node handles its own welcome (the
# self-check) and starts its spares in a process of its own, but a host here handles the welcomes of its 128
# nodes in one loop; read in one turn, they held every heartbeat of the host for up to 2.8 s at the start of
# 1,024 nodes (and past 3 s, the controller's lost-node sweep took a whole host for lost).
HANDLE_S = 0.1


class SimWorker:
    """One simulated worker process (see the module docstring)."""

    def __init__(self, host: SimHost, node: SimNode, pid: int):
        self.host, self.node, self.pid = host, node, pid
        self.peer = Peer(
            host.token,
            host.controller,
            f"w:{node.name}:{pid}",
            host.interval,
            node.liveness,
            node.peer.verifier.last_sid,
            ctx=host.ctx,
        )
        self.info: dict[str, Any] = first_heartbeat()
        self.warm_at = time.monotonic() + host.warm_s
        self.next_beat = 0.0
        self.role, self.exit_code, self.reported, self.killed = "spare", None, False, False
        self.beating = True  # False: stopped (SIGSTOP), neither beating nor stepping
        self.beats = 0
        self.last_ack: float | None = None  # when the node agent last carried a heartbeat of this worker
        self.stepping = True  # False: stuck (beats, does not step)
        self.clock: LoopClock | None = None
        self.periods: list[list[Any]] = []  # [efficiency record, heartbeats left to carry it]
        self.index = 0
        host.poller.register(self.peer.sock, zmq.POLLIN)
        host.socks[self.peer.sock] = self._on_message

    @property
    def alive(self) -> bool:
        return self.exit_code is None

    def beat(self, now: float) -> None:
        if not self.alive or not self.beating or now < self.next_beat:
            return
        self.next_beat = now + self.host.interval
        info = dict(self.info)
        if self.clock is not None:
            c = self.clock
            info["loop"] = {"phase": c.phase, "dispatched": c.dispatched, "since": c.since}
        if self.periods:  # each record on the next PERIOD_BEATS heartbeats queued, as WorkerAgent sends them
            info["periods"] = [record for record, _ in self.periods]
        self.beats += 1
        msg = {"t": "hb", "node": self.node.name, "pid": self.pid, **info, "beat": self.beats, "sent": time.time()}
        # To the node agent (its relay: jaxdist.controller.relay, in memory here), and directly when the relay's
        # rules say so, as WorkerAgent does.
        self.node.relay.add(str(self.pid), msg)
        since_ack = None if self.last_ack is None else now - self.last_ack
        if goes_direct(self.beats, since_ack, self.host.interval, str(info.get("state"))):
            self.peer.send(msg)
            self.host.count("hb_direct")
        if self.periods:  # the relay took it
            for p in self.periods:
                p[1] -= 1
            self.periods = [p for p in self.periods if p[1] > 0]
        self.host.count("hb")

    def _on_message(self) -> None:
        msg = self.peer.verifier.check(self.peer.sock.recv_multipart(), peer="controller")
        if msg is None or not self.alive or not self.beating:
            return
        if msg.get("t") == "assign" and self.info["gen"] < 0:
            self.info.update(state="joining", gen=int(msg["gen"]), rank=int(msg["rank"]))
            self.host.join(self, int(msg["gen"]), int(msg["rank"]), int(msg["num_processes"]))

    def tick(self, now: float) -> None:
        if self.alive and self.info["state"] == "warming" and now >= self.warm_at:
            self.info["state"] = "warm"

    def exit(self, rc: int) -> None:
        if self.exit_code is None:
            self.exit_code = rc
            self.close()

    def close(self) -> None:
        if self.peer.sock in self.host.socks:
            self.host.poller.unregister(self.peer.sock)
            del self.host.socks[self.peer.sock]
            self.peer.close()


class SimNode:
    """One simulated node agent (see the module docstring)."""

    def __init__(self, host: SimHost, name: str):
        self.host, self.name = host, name
        self.peer = Peer(host.token, host.controller, f"n:{name}", host.interval, ctx=host.ctx)
        self.probe_sock = host.ctx.socket(zmq.ROUTER)
        self.probe_sock.setsockopt(zmq.LINGER, 0)
        host.gate.serve(self.probe_sock)
        self.probe_port = self.probe_sock.bind_to_random_port("tcp://127.0.0.1")
        self.probe_signer, self.probe_verifier = Signer(host.token, f"p:{name}"), Verifier(host.token)
        self.procs: dict[int, SimWorker] = {}
        self.welcome: dict[str, Any] | None = None
        self.checks: dict[str, Any] = {}
        self.liveness = 1.0
        self.next_beat = 0.0
        self.probing: dict[Any, tuple[str, float]] = {}  # socket -> (peer, sent at)
        self.rtt: dict[str, float | None] = {}
        self.probe_result: dict[str, Any] | None = None
        self.lost = False
        self.relay = RelayBuffer()  # its workers' heartbeats, by pid
        for sock, fn in ((self.peer.sock, self._on_message), (self.probe_sock, self._answer_probe)):
            host.poller.register(sock, zmq.POLLIN)
            host.socks[sock] = fn

    def beat(self, now: float) -> None:
        if now < self.next_beat:
            return
        self.next_beat = now + self.host.interval
        procs = [
            {"pid": pid, "role": w.role, "gen": w.info["gen"], "rank": w.info["rank"], "rc": w.exit_code}
            for pid, w in self.procs.items()
        ]
        workers = self.relay.entries()
        sent = self.peer.send(
            {
                "t": "node_hb",
                "node": self.name,
                "host": "127.0.0.1",
                "checks": self.checks,
                "probe": f"127.0.0.1:{self.probe_port}",
                "free_port": self.host.port,
                "procs": procs,
                "welcomed": self.welcome is not None,
                "reconnects": 0,
                **({"workers": workers} if workers else {}),
            }
        )
        if sent and workers:
            for pid in self.relay.carried():  # the acks
                w = self.procs.get(int(pid))
                if w is not None:
                    w.last_ack = now
        self.host.count("node_hb")
        if self.probe_result is not None:
            self.peer.send({"t": "probe_result", "node": self.name, **self.probe_result})
            self.probe_result = None

    def report_exits(self) -> None:
        for pid, w in self.procs.items():
            if w.exit_code is not None and not w.reported:
                w.reported = True
                msg = {"t": "exit", "node": self.name, "pid": pid, "rc": w.exit_code}
                self.peer.send({**msg, "gen": w.info["gen"], "rank": w.info["rank"], "role": w.role})

    def spawn(self) -> None:
        pid = self.host.new_pid()
        self.procs[pid] = SimWorker(self.host, self, pid)

    def replenish(self, at_least: int = 0) -> None:
        if self.welcome is None:
            return
        spares = [w for w in self.procs.values() if w.role == "spare" and w.alive and not w.killed]
        for _ in range(max(int(self.welcome.get("spares", 1)), at_least) - len(spares)):
            self.spawn()

    def _on_message(self) -> None:
        msg = self.peer.verifier.check(self.peer.sock.recv_multipart(), peer="controller")
        if msg is None:
            return
        t = msg.get("t")
        self.host.count(f"got_{t}")
        if t == "welcome":
            first = self.welcome is None
            self.welcome = msg
            self.liveness = float(msg.get("liveness_s", 1.0))
            if first:
                self.checks = self_check(self.host.work_dir, int(msg.get("devices", 1)), "cpu")
                self.replenish(at_least=1)
        elif t == "replenish":
            self.replenish(int(msg.get("at_least", 0)))
        elif t == "assigned":
            w = self.procs.get(int(msg["pid"]))
            if w is not None:
                w.role = "active"
        elif t == "kill":
            for pid, w in self.procs.items():
                if w.alive and (msg.get("pids") is None or pid in msg["pids"]):
                    w.killed = True
                    self.host.leave(w)
                    w.exit(-9)
        elif t == "probe":
            self._start_probe(dict(msg["peers"]), int(msg.get("bytes", 1024)))
        elif t == "stop":
            for w in self.procs.values():
                self.host.leave(w)
                w.exit(-9)

    def _start_probe(self, peers: dict[str, str], nbytes: int) -> None:
        """Ping every peer's probe socket at once (the real agent pings them one after another)."""
        self.rtt = {}
        signer = Signer(self.host.token, f"q:{self.name}")
        pad = "x" * nbytes
        for name, where in peers.items():
            s = self.host.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            curve_client(s, self.host.token)
            s.connect(f"tcp://{where}")
            s.send_multipart(signer.frames({"t": "ping", "pad": pad}))
            self.probing[s] = (name, time.perf_counter())
            self.host.poller.register(s, zmq.POLLIN)
            self.host.socks[s] = lambda s=s: self._on_pong(s)
            self.host.count("ping_sent")
        self._probe_done_if_complete()

    def _on_pong(self, s: Any) -> None:
        name, t0 = self.probing[s]
        ok = Verifier(self.host.token).check(s.recv_multipart(), peer=name)
        self._end_ping(s, time.perf_counter() - t0 if ok else None)

    def _end_ping(self, s: Any, rtt: float | None) -> None:
        name, _ = self.probing.pop(s)
        self.rtt[name] = rtt
        self.host.poller.unregister(s)
        del self.host.socks[s]
        s.close(0)
        self._probe_done_if_complete()

    def expire_pings(self) -> None:
        now = time.perf_counter()
        for s, (_, t0) in list(self.probing.items()):
            if now - t0 > PROBE_TIMEOUT_S:
                self._end_ping(s, None)

    def _probe_done_if_complete(self) -> None:
        if not self.probing:
            self.probe_result = {"rtt": dict(self.rtt)}

    def _answer_probe(self) -> None:
        frames = self.probe_sock.recv_multipart()
        msg = self.probe_verifier.check(frames[1:], peer="probe")
        if msg is not None and msg.get("t") == "ping":
            self.probe_sock.send_multipart([frames[0], *self.probe_signer.frames({"t": "pong"})])
            self.host.count("ping_answered")

    def lose(self) -> None:
        """The machine is gone: every socket closed, nothing said."""
        self.lost = True
        for w in self.procs.values():
            self.host.leave(w)
            w.exit_code = -9
            w.close()
        for s in [self.peer.sock, self.probe_sock, *self.probing]:
            if s in self.host.socks:
                self.host.poller.unregister(s)
                del self.host.socks[s]
        for s in self.probing:
            s.close(0)
        self.probe_sock.close(0)
        self.peer.close()


class HostGen:
    """This host's ranks of one generation: they step together, waiting for the other hosts at each step."""

    def __init__(self, host: SimHost, gen: int, n: int):
        self.host, self.gen, self.n = host, gen, n
        self.ranks: dict[int, SimWorker] = {}
        self.dir = host.run_dir / "sim" / f"gen{gen}"
        self.dir.mkdir(parents=True, exist_ok=True)
        ckpt = host.run_dir / "checkpoints"
        steps = sorted(int(p.parent.name) for p in ckpt.glob("*/jaxdist_commit.json"))
        self.start = steps[-1] if steps else 0
        self.state = json.loads((ckpt / str(self.start) / "state.json").read_text())["state"] if steps else GENESIS
        self.step = self.start  # the newest step this host's ranks finished
        self.waiting: int | None = self.start  # the step whose barrier they wait at (start: everyone joined)
        self.written: tuple[int, tuple[int, ...]] | None = None
        self.due = 0.0
        self.late: dict[int, float] = {}  # slow ranks still dispatching this step: until when
        self.t0 = time.perf_counter()

    def alive_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for r, w in self.ranks.items() if w.alive and w.beating and w.stepping))

    def tick(self, now: float) -> None:
        if self.waiting is None:
            if now < self.due or not self.ranks:
                return
            self.step += 1
            self.state = advance(self.state, self.step)
            self.waiting = self.step
            for r, w in self.ranks.items():
                if (extra := self.host.slow.get(r, 0.0)) > 0:  # a slow rank dispatches longer; its host's others not
                    self.late[r] = now + extra
                elif w.clock is not None and w.stepping:
                    w.clock.enter("blocked", self.step)
        for r in [r for r, t in self.late.items() if now >= t]:
            del self.late[r]
            if (w := self.ranks.get(r)) is not None and w.clock is not None and w.stepping:
                w.clock.enter("blocked", self.step)
        mine = tuple(r for r in self.alive_ranks() if r not in self.late)
        if self.written != (self.waiting, mine):
            tmp = self.dir / f".{self.waiting}.{self.host.index}.tmp"
            tmp.write_text(json.dumps(mine))
            os.replace(tmp, self.dir / f"{self.waiting}.{self.host.index}")
            self.written = (self.waiting, mine)
        there: set[int] = set()
        for p in self.dir.glob(f"{self.waiting}.*"):
            try:
                there.update(json.loads(p.read_text()))
            except (OSError, ValueError):
                return
        if len(there) < self.n:
            return
        self._passed(now, self.waiting)

    def _passed(self, now: float, step: int) -> None:
        self.waiting = None
        self.due = now + self.host.step_s
        if step == self.start:  # everyone joined: restore, then train
            for w in self.ranks.values():
                w.info["state"] = "restoring"
                w.clock = LoopClock(1, self.start + 1)
                w.clock.enter("dispatch", self.start + 1)
            return
        dt = time.perf_counter() - self.t0
        self.t0 = time.perf_counter()
        if 0 in self.ranks and self.ranks[0].alive:
            run = self.host.run_dir
            record_step(run, self.gen, step, None)
            d = run / "checkpoints" / str(step)
            d.mkdir(parents=True, exist_ok=True)
            (d / "state.json").write_text(json.dumps({"step": step, "state": self.state}))
            (d / "jaxdist_commit.json").write_text("{}")
            old = run / "checkpoints" / str(step - 4)
            if old.is_dir():
                for f in old.iterdir():
                    f.unlink()
                old.rmdir()
        last = step >= self.host.steps
        for r, w in self.ranks.items():
            if not w.alive:
                continue
            info = {"step": step, "step_at": time.time(), "tokens_per_s": 1.0 / dt, "step_time": dt}
            if w.info["state"] != "training":
                info.update(state="training", resume_step=step - 1, resumed_from="init")
            w.info.update(info)
            c = w.clock
            if c is not None:
                c.add_window(1, dt)
                c.enter("dispatch", step + 1)
                if self.host.health_every and step - c.first_step + 1 >= self.host.health_every:
                    record = {"gen": self.gen, "rank": r, "node": w.node.name, "index": w.index}
                    record.update(c.take_period(step))
                    w.index += 1
                    w.periods.append([record, PERIOD_BEATS])
            if last:
                w.info["state"] = "done"
                w.next_beat = 0.0
        if last:
            if 0 in self.ranks:
                (self.host.run_dir / "stub").mkdir(exist_ok=True)
                final = {"step": step, "state": self.state}
                (self.host.run_dir / "stub" / "final.json").write_text(json.dumps(final))
            self.host.exits.append((time.monotonic() + 0.3, list(self.ranks.values())))
            self.ranks = {}


class SimHost:
    """K simulated nodes in this process (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, token: str):
        self.token, self.controller, self.interval = token, args.controller, args.interval
        self.index, self.run_dir, self.steps = args.index, Path(args.run_dir), args.steps
        self.work_dir = self.run_dir
        self.step_s, self.warm_s, self.health_every = args.step_s, args.warm_s, args.health_every
        self.ctx = zmq.Context(io_threads=2)
        self.ctx.set(zmq.MAX_SOCKETS, 65536)  # 3 and more per node (agent, probe server, workers, pings)
        self.gate = Gate(self.ctx, token)
        self.poller = zmq.Poller()
        self.socks: dict[Any, Any] = {}
        self.port = free_port()
        self._pid = 1_000_000 * (args.index + 1)
        self.gens: dict[int, HostGen] = {}
        self.exits: list[tuple[float, list[SimWorker]]] = []
        self.slow: dict[int, float] = {}
        self.counts: dict[str, int] = {}
        self.cmd_path = Path(args.sim_dir) / f"cmd{args.index}.jsonl"
        self.cmd_pos = 0
        self.out = Path(args.sim_dir) / f"host{args.index}.json"
        self.running = True
        self.nodes = {name: SimNode(self, name) for name in args.nodes.split(",")}

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n

    def new_pid(self) -> int:
        self._pid += 1
        return self._pid

    def join(self, w: SimWorker, gen: int, rank: int, n: int) -> None:
        g = self.gens.get(gen)
        if g is None:
            g = self.gens[gen] = HostGen(self, gen, n)
            for old in [k for k in self.gens if k < gen]:
                del self.gens[old]
        g.ranks[rank] = w

    def leave(self, w: SimWorker) -> None:
        g = self.gens.get(w.info["gen"])
        if g is not None and g.ranks.get(w.info["rank"]) is w:
            del g.ranks[w.info["rank"]]

    def _worker(self, rank: int) -> SimWorker | None:
        for g in self.gens.values():
            if rank in g.ranks and g.ranks[rank].alive:
                return g.ranks[rank]
        return None

    def _commands(self) -> None:
        try:
            with open(self.cmd_path) as f:
                f.seek(self.cmd_pos)
                lines = f.readlines()
                self.cmd_pos = f.tell()
        except OSError:
            return
        for line in lines:
            cmd = json.loads(line)
            self.count(f"cmd_{cmd['do']}")
            if cmd["do"] == "lose":
                for name in cmd["nodes"]:
                    if name in self.nodes and not self.nodes[name].lost:
                        self.nodes[name].lose()
            elif cmd["do"] == "quit":
                self.running = False
            elif (w := self._worker(int(cmd["rank"]))) is not None:
                if cmd["do"] == "crash":
                    self.leave(w)
                    w.exit(-9)
                elif cmd["do"] == "stop":
                    w.beating = w.stepping = False
                elif cmd["do"] == "stuck":  # held in its host's own work (the data phase), as stub_worker's is
                    w.stepping = False
                    if w.clock is not None:
                        w.clock.enter("data")
                elif cmd["do"] == "slow":
                    self.slow[int(cmd["rank"])] = float(cmd["s"])

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "running", False))
        next_cmd = 0.0
        try:
            while self.running:
                turn = time.monotonic()
                for sock, _ in self.poller.poll(int(TURN_S * 1000)):
                    if time.monotonic() - turn > HANDLE_S:  # the rest next turn: the heartbeats go first
                        break
                    fn = self.socks.get(sock)
                    if fn is not None:
                        fn()
                now = time.monotonic()
                for node in self.nodes.values():
                    if node.lost:
                        continue
                    node.beat(now)
                    node.expire_pings()
                    for w in list(node.procs.values()):
                        w.tick(now)
                        w.beat(now)
                    node.report_exits()
                for g in list(self.gens.values()):
                    g.tick(now)
                while self.exits and self.exits[0][0] <= now:
                    for w in self.exits.pop(0)[1]:
                        w.exit(0)
                if now >= next_cmd:
                    next_cmd = now + 0.1
                    self._commands()
        finally:
            self.out.write_text(json.dumps({"counts": self.counts, "nodes": len(self.nodes)}))
            self.gate.stop()


class SimCluster(LocalJob):
    """The real controller process and ``nodes`` simulated nodes in ``hosts`` processes; ``group`` of them train.

    The controller's settings are its defaults unless ``extra`` (more config arguments) says otherwise;
    ``step_s``: seconds per simulated step; ``env``: for the controller.
    """

    def __init__(
        self,
        nodes: int,
        group: int,
        hosts: int,
        cwd: Path,
        steps: int,
        extra: list[str] | None = None,
        step_s: float = 0.5,
        env: dict[str, str] | None = None,
    ):
        cwd = Path(cwd)
        cluster = write_cpu_cluster(cwd / "meshes" / f"sim{group}.toml", group, 1)
        args = [
            "model=tiny",
            f"mesh.cluster={cluster}",
            f"train.batch_size={group}",
            "train.seq_len=32",
            f"train.steps={steps}",
            "train.runs_dir=runs",
            "train.name=sim",
            f"controller.max_nodes={group}",
            "controller.worker_command={python} -c pass",  # never started: the simulated nodes fake their workers
            *(extra or []),
        ]
        super().__init__(args, nodes=0, cwd=cwd, env=env)
        self.names = [f"sim-{i:04d}" for i in range(nodes)]
        self.n_hosts, self.steps, self.step_s = hosts, steps, step_s
        self.sim_dir = cwd / "sim"
        self.hosts: list[subprocess.Popen] = []

    def host_of(self, node: str) -> int:
        return self.names.index(node) % self.n_hosts

    def start(self, timeout: float = 600.0) -> None:  # noqa: ARG002  (LocalJob's signature)
        self.start_controller()
        self.sim_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.n_hosts):
            names = [n for n in self.names if self.host_of(n) == i]
            argv = [
                sys.executable,
                str(Path(__file__)),
                "--controller",
                self.endpoint(),
                "--nodes",
                ",".join(names),
                "--index",
                str(i),
                "--run-dir",
                str(self.run_dir.absolute()),
                "--sim-dir",
                str(self.sim_dir),
                "--steps",
                str(self.steps),
                "--interval",
                str(self.cfg.controller.heartbeat_interval),
                "--step-s",
                str(self.step_s),
                "--health-every",
                str(self.cfg.controller.health_every),  # the periods a worker sends, as the config says
            ]
            with open(self.sim_dir / f"host{i}.log", "w") as out:
                self.hosts.append(
                    subprocess.Popen(argv, cwd=self.cwd, env=self._env(), stdout=out, stderr=subprocess.STDOUT)
                )

    def command(self, host: int, do: str, **what: Any) -> None:
        """One command to simulated host ``host`` (see the module docstring); recorded as an injection."""
        with open(self.sim_dir / f"cmd{host}.jsonl", "a") as f:
            f.write(json.dumps({"do": do, **what}) + "\n")
        self.record_injection(signal=do, **what)

    def rank_host(self, rank: int) -> tuple[str, int]:
        """(node, host index) of ``rank`` in the current generation."""
        node = self.state()["members"][str(rank)]
        return node, self.host_of(node)

    def host_counts(self) -> dict[str, int]:
        """What the hosts counted (pings, messages), summed; read once they stopped."""
        total: dict[str, int] = {}
        for p in self.sim_dir.glob("host*.json"):
            for k, v in json.loads(p.read_text())["counts"].items():
                total[k] = total.get(k, 0) + v
        return total

    def close(self) -> None:
        self.kill_controller()
        for i, h in enumerate(self.hosts):
            if h.poll() is None:
                with open(self.sim_dir / f"cmd{i}.jsonl", "a") as f:
                    f.write(json.dumps({"do": "quit"}) + "\n")
        for h in self.hosts:
            try:
                h.wait(timeout=10)
            except subprocess.TimeoutExpired:
                h.kill()
                h.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="simulated node agents and workers (tests/controller/sim_cluster.py)")
    p.add_argument("--controller", required=True)
    p.add_argument("--nodes", required=True, help="comma-separated node names")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--sim-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--interval", type=float, default=0.25)
    p.add_argument("--step-s", type=float, default=0.5)
    p.add_argument("--warm-s", type=float, default=0.2)
    p.add_argument("--health-every", type=int, default=0)
    args = p.parse_args(argv)
    random.seed(args.index)
    SimHost(args, os.environ[TOKEN_ENV]).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

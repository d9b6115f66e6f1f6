"""The node agent: one per host, no JAX.  ``python -m jaxdist.controller.node --controller HOST:PORT --node NAME``.

It registers with the controller after a self-check (the job directory is
writable, the devices are visible), answers link probes from the other nodes
(a signed ping/pong over TCP: reachability and round-trip time), and runs the
worker processes of its host: it keeps ``spares`` warm ones ready (started
with the job's worker command, they import JAX and wait for a rank), reports
each exit the moment it happens, and kills the processes the controller names
with SIGKILL (JAX's preemption notifier swallows SIGTERM).

The job token comes from ``$JAXDIST_JOB_TOKEN`` (never from the command line,
which other users can read).
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from jaxdist.controller.ports import free_port
from jaxdist.controller.protocol import START_ENV, TOKEN_ENV, Gate, Peer, Signer, Verifier, curve_client
from jaxdist.controller.relay import RELAY_ENV, RelayServer

log = logging.getLogger("jaxdist.controller.node")

PROBE_TIMEOUT_S = 5  # a peer that does not answer a ping within this many seconds is unreachable
STALL_S = 1.0  # a loop turn longer than this (and than 4 heartbeat intervals) is reported as a stall
STALL_KEEP_S = 30.0  # the worst recent stall rides on the heartbeats this long (a heartbeat may be lost)


@dataclass
class _Proc:
    popen: subprocess.Popen
    started: float
    role: str = "spare"  # spare | active
    gen: int = -1
    rank: int = -1
    exit_code: int | None = None
    reported: bool = False
    killed: bool = False


def self_check(work_dir: Path, expected_devices: int, device_kind: str) -> dict[str, Any]:
    """Local checks: ``disk`` ("ok" or the error), ``devices`` (count visible), ``free_bytes`` (bytes)."""
    out: dict[str, Any] = {}
    try:
        work_dir.mkdir(parents=True, exist_ok=True)
        probe = work_dir / f".selfcheck.{socket.gethostname()}.{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"jaxdist" * 128)
            f.flush()
            os.fsync(f.fileno())
        ok = probe.read_bytes() == b"jaxdist" * 128
        probe.unlink()
        out["disk"] = "ok" if ok else "read back different bytes"
        out["free_bytes"] = shutil.disk_usage(work_dir).free
    except OSError as e:
        out["disk"] = f"{type(e).__name__}: {e}"
    if device_kind.lower().startswith("cpu"):
        out["devices"] = expected_devices  # simulated by XLA in each worker: always there
    else:  # GPUs: device files, without starting a CUDA context in this process
        out["devices"] = len(glob.glob("/dev/nvidia[0-9]*"))
    out["ok"] = out["disk"] == "ok" and out["devices"] >= expected_devices
    return out


def worker_environ(env: dict[str, str]) -> dict[str, str]:
    """The agent's environment as its workers get it: without ``SLURM_*`` variables.  The controller gives each
    worker its rank, process count and coordinator; left in, Slurm's step variables would make JAX detect a
    one-task Slurm job and pin the process to one GPU (``SLURM_LOCALID``).  ``CUDA_VISIBLE_DEVICES`` (the
    step's GPUs) and ``SLURMD_NODENAME`` stay."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_")}


# A node agent that dies takes its workers along, as a host failure would: each worker is started through this
# tether, which asks the kernel to SIGKILL it when its parent (the agent) dies, checks the agent is still its
# parent (it may have died first), then becomes the worker (exec: same pid). Not subprocess's preexec_fn: that
# runs Python between fork and exec in a process with threads (ZeroMQ's, the probe's), which Python documents as
# able to deadlock the child -- and the agent's Popen, waiting for the exec, with it.
TETHER = (
    "import ctypes,os,signal,sys\n"
    "try: ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL)\n"  # PR_SET_PDEATHSIG
    "except (OSError,AttributeError): pass\n"
    "if os.getppid()!=int(sys.argv[1]): sys.exit(75)\n"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)


def tethered(argv: list[str]) -> list[str]:
    """``argv`` run so that the process dies with this one (see TETHER)."""
    return [sys.executable, "-I", "-S", "-c", TETHER, str(os.getpid()), *argv]


class NodeAgent:
    """See the module docstring.  ``host``: the address other nodes and the coordinator reach this host at."""

    def __init__(
        self,
        controller: str,
        token: str,
        node: str,
        host: str,
        work_dir: Path,
        interval: float = 0.25,
        orphan_timeout: float = 600.0,
    ):
        self.node, self.host, self.work_dir = node, host, Path(work_dir)
        self.controller, self.token, self.interval = controller, token, interval
        self.orphan_timeout = orphan_timeout
        self.peer = Peer(token, controller, f"n:{node}")
        self.probe_gate = Gate(self.peer.ctx, token)
        self.probe_sock = self.peer.ctx.socket(zmq.ROUTER)
        self.probe_sock.setsockopt(zmq.LINGER, 0)
        self.probe_gate.serve(self.probe_sock)
        self.probe_port = self.probe_sock.bind_to_random_port(f"tcp://{host}")
        self.probe_signer, self.probe_verifier = Signer(token, f"p:{node}"), Verifier(token)
        self.procs: dict[int, _Proc] = {}
        self.welcome: dict[str, Any] | None = None
        self.checks: dict[str, Any] = {}
        self.last_contact = time.monotonic()
        self.probe_result: dict[str, Any] | None = None
        self.running = True
        # Why an agent falls silent, told by the agent once it speaks again: its loop stalled (in what), or its
        # connection to the controller dropped (ZeroMQ's own heartbeats timed out) and was made again.
        self.doing = "start"
        self.stall: dict[str, Any] | None = None
        self.reconnects = 0
        self.monitor = self.peer.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.relay = RelayServer(self.peer.ctx)  # the workers' heartbeats, carried in this agent's own

    # ------------------------------------------------------------------ processes

    def spawn(self) -> int:
        w = self.welcome
        assert w is not None
        argv = [sys.executable if a == "{python}" else a for a in w["argv"]]
        env = {
            **worker_environ(os.environ),
            **w.get("env", {}),
            "JAXDIST_CONTROLLER": self.controller,
            TOKEN_ENV: self.token,
            START_ENV: self.peer.verifier.last_sid,
            "JAXDIST_NODE": self.node,
            "JAXDIST_HEARTBEAT_INTERVAL": str(self.interval),
            "JAXDIST_LIVENESS_TIMEOUT": str(w.get("liveness_s", 1.0)),
            RELAY_ENV: self.relay.address,
            "PYTHONUNBUFFERED": "1",
        }
        logs = Path(w.get("log_dir") or self.work_dir)
        logs.mkdir(parents=True, exist_ok=True)
        out = open(logs / f"{self.node}.{time.strftime('%H%M%S')}.{len(self.procs)}.log", "w")
        p = subprocess.Popen(
            tethered(argv),
            cwd=w.get("cwd") or None,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self.procs[p.pid] = _Proc(p, time.time())
        log.info("%s: started worker pid %d", self.node, p.pid)
        return p.pid

    def replenish(self, at_least: int = 0) -> None:
        """Start warm processes up to the job's ``spares`` (at least ``at_least``: a start or restart needs one)."""
        if self.welcome is None:
            return
        live_spares = [p for p in self.procs.values() if p.role == "spare" and p.exit_code is None and not p.killed]
        for _ in range(max(int(self.welcome.get("spares", 1)), at_least) - len(live_spares)):
            self.spawn()

    def kill(self, pids: list[int] | None) -> None:
        for pid, p in self.procs.items():
            if p.exit_code is None and (pids is None or pid in pids):
                p.killed = True
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def reap(self) -> None:
        for pid, p in self.procs.items():
            if p.exit_code is None:
                rc = p.popen.poll()
                if rc is not None:
                    p.exit_code = rc
            if p.exit_code is not None and not p.reported:
                self.peer.send(
                    {
                        "t": "exit",
                        "node": self.node,
                        "pid": pid,
                        "rc": p.exit_code,
                        "gen": p.gen,
                        "rank": p.rank,
                        "role": p.role,
                    }
                )
                p.reported = True
        done = [pid for pid, p in self.procs.items() if p.reported and time.time() - p.started > 3600]
        for pid in done:
            del self.procs[pid]

    # ------------------------------------------------------------------ messages

    def heartbeat(self) -> None:
        procs = [
            {"pid": pid, "role": p.role, "gen": p.gen, "rank": p.rank, "rc": p.exit_code}
            for pid, p in self.procs.items()
        ]
        self.relay.take()
        workers = self.relay.entries()
        sent = self.peer.send(
            {
                "t": "node_hb",
                "node": self.node,
                "host": self.host,
                "checks": self.checks,
                "probe": f"{self.host}:{self.probe_port}",
                "free_port": free_port(self.host),
                "procs": procs,
                "welcomed": self.welcome is not None,
                "reconnects": self.reconnects,
                **({"stall": self.stall} if self.stall else {}),
                **({"workers": workers} if workers else {}),
            }
        )
        if sent and workers:  # else they go with the next heartbeat (merged with newer ones)
            self.relay.ack(self.relay.carried())
        if self.stall and time.time() - self.stall["at"] > STALL_KEEP_S:
            self.stall = None
        if self.probe_result is not None:
            self.peer.send({"t": "probe_result", "node": self.node, **self.probe_result})
            self.probe_result = None

    def handle(self, msg: dict[str, Any]) -> None:
        self.last_contact = time.monotonic()
        t = msg.get("t")
        if t == "welcome":
            first = self.welcome is None
            self.welcome = msg
            self.checks = self_check(
                Path(msg.get("work_dir") or self.work_dir),
                int(msg.get("devices", 1)),
                str(msg.get("device_kind", "cpu")),
            )
            if first and self.checks["ok"]:
                self.replenish(at_least=1)
        elif t == "replenish":
            self.replenish(int(msg.get("at_least", 0)))
        elif t == "assigned":
            p = self.procs.get(int(msg["pid"]))
            if p is not None:
                p.role, p.gen, p.rank = "active", int(msg["gen"]), int(msg["rank"])
        elif t == "kill":
            self.kill(msg.get("pids"))
        elif t == "probe":
            threading.Thread(
                target=self._probe, args=(dict(msg["peers"]), int(msg.get("bytes", 1024))), daemon=True
            ).start()
        elif t == "stop":
            self.kill(None)
            self.running = False

    def _probe(self, peers: dict[str, str], nbytes: int) -> None:
        """Ping every peer's probe socket; record round-trip seconds (None: no answer within 2 s)."""
        ctx = self.peer.ctx
        rtt: dict[str, float | None] = {}
        signer, verifier = Signer(self.token, f"q:{self.node}"), Verifier(self.token)
        for name, where in peers.items():
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            curve_client(s, self.token)
            s.connect(f"tcp://{where}")
            t0 = time.perf_counter()
            s.send_multipart(signer.frames({"t": "ping", "pad": "x" * nbytes}))
            answered = s.poll(PROBE_TIMEOUT_S * 1000) and verifier.check(s.recv_multipart(), peer=name)
            rtt[name] = time.perf_counter() - t0 if answered else None
            s.close(0)
        self.probe_result = {"rtt": rtt}

    def _note_stall(self, turn_s: float) -> None:
        """Keep (and log) a loop turn of ``turn_s`` seconds that kept the heartbeats from leaving."""
        if turn_s <= max(STALL_S, 4 * self.interval):
            return
        log.warning(
            "%s: the agent loop stalled %.1f s while %s (no heartbeat left meanwhile)", self.node, turn_s, self.doing
        )
        if self.stall is None or turn_s >= self.stall["s"] or time.time() - self.stall["at"] > STALL_KEEP_S:
            self.stall = {"s": round(turn_s, 2), "in": self.doing, "at": time.time()}

    def _on_monitor(self) -> None:
        ev = recv_monitor_message(self.monitor)
        if ev["event"] == zmq.EVENT_DISCONNECTED:
            self.reconnects += 1
            log.warning(
                "%s: the connection to the controller dropped (%d so far); ZeroMQ reconnects",
                self.node,
                self.reconnects,
            )

    def answer_probe(self) -> None:
        frames = self.probe_sock.recv_multipart()
        msg = self.probe_verifier.check(frames[1:], peer="probe")
        if msg is not None and msg.get("t") == "ping":
            delay = float(os.environ.get("JAXDIST_FAULT_PROBE_DELAY", "0"))  # fault injection: a slow link
            if delay:
                time.sleep(delay)
            self.probe_sock.send_multipart([frames[0], *self.probe_signer.frames({"t": "pong"})])

    # ------------------------------------------------------------------ loop

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.peer.sock, zmq.POLLIN)
        poller.register(self.probe_sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        next_beat, turn = 0.0, time.monotonic()
        try:
            while self.running:
                now = time.monotonic()
                self._note_stall(now - turn)
                turn = now
                if now >= next_beat:
                    self.doing = "heartbeat"
                    self.heartbeat()
                    next_beat = now + self.interval
                self.doing = "poll"
                events = dict(poller.poll(50))
                if self.monitor in events:
                    self._on_monitor()
                if self.peer.sock in events:
                    msg = self.peer.verifier.check(self.peer.sock.recv_multipart(), peer="controller")
                    if msg is not None:
                        self.doing = f"handling '{msg.get('t')}'"
                        self.handle(msg)
                if self.probe_sock in events:
                    self.doing = "answering a probe"
                    self.answer_probe()
                self.doing = "reaping"
                self.reap()
                training = any(p.role == "active" and p.exit_code is None for p in self.procs.values())
                if not training and time.monotonic() - self.last_contact > self.orphan_timeout:
                    # A running job goes on without its controller; an idle node does not wait forever.
                    log.warning(
                        "%s: no word from the controller for %.0f s and no training process: stopping",
                        self.node,
                        self.orphan_timeout,
                    )
                    self.kill(None)
                    break
        finally:
            self.reap()
            self.heartbeat()
            time.sleep(0.05)
            self.probe_sock.close(0)
            self.peer.sock.disable_monitor()
            self.monitor.close(0)
            self.probe_gate.stop()
            self.relay.close()
            self.peer.close()
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxdist.controller.node", description=__doc__.split("\n")[0])
    p.add_argument("--controller", required=True, help="host:port of the controller")
    p.add_argument("--node", default=socket.gethostname(), help="this node's name (default: the host name)")
    p.add_argument("--host", default="127.0.0.1", help="address peers reach this host at")
    p.add_argument("--work-dir", default=".", help="directory checked for writing (default: the current one)")
    p.add_argument("--interval", type=float, default=0.25, help="heartbeat interval (s)")
    p.add_argument(
        "--orphan-timeout",
        type=float,
        default=600.0,
        help="stop after this long without the controller and without a training process (s)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token = os.environ.get(TOKEN_ENV)
    if not token:
        print(f"node agent: set {TOKEN_ENV} to the job token (see <run>/controller/token)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: setattr(agent, "running", False))
    agent = NodeAgent(
        args.controller, token, args.node, args.host, Path(args.work_dir), args.interval, args.orphan_timeout
    )
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())

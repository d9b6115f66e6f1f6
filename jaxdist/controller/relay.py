"""A node's relay of its workers' heartbeats: one message to the controller per node and heartbeat interval.

At 1,024 nodes, the node agents' and their workers' own heartbeats were 12 signed messages per node and
second into the controller's one Python thread; each costs it the same poll, MAC, parse and bookkeeping
whatever it carries.  So the workers of a node send their heartbeats to its node agent instead, over a Unix
socket in a folder only the job's user can enter (``JAXDIST_RELAY``: local, so neither encrypted nor
signed), and the agent puts the newest of each into its own heartbeat (``workers``, each with its ``age``
in seconds) and answers each worker it carried with an ack.

Nothing is lost by the hop:

* a worker whose last ack is older than :data:`TRUST_BEATS` heartbeats (its agent stalled, stopped or died)
  sends its heartbeats to the controller directly, as it did before the relay: a node whose agent is
  silent but whose workers are heard is still not a lost node;
* every :data:`DIRECT_EVERY` heartbeats a worker sends one directly all the same, so that the controller
  knows its connection (whose drop, seen by ZeroMQ's own heartbeats, is how a stopped process is found);
* the efficiency records a heartbeat carries are merged, never replaced, while they wait in the agent;
* each heartbeat is numbered (``beat``): the controller skips one older than what it has, from either path.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

RELAY_ENV = "JAXDIST_RELAY"
TRUST_BEATS = 3  # heartbeats without an ack from the node agent after which a worker sends directly
DIRECT_EVERY = 40  # a worker's every n-th heartbeat goes to the controller directly even so (10 s by default)
MAX_RELAY_BYTES = 1 << 20  # a larger message on the relay socket is not a heartbeat: dropped


def merge(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """The newer of two heartbeats of one worker (by ``beat``), carrying the efficiency records of both."""
    if old is None:
        return new
    newer, older = (new, old) if int(new.get("beat", 0)) >= int(old.get("beat", 0)) else (old, new)
    periods = {
        p["index"]: p
        for hb in (older, newer)
        for p in hb.get("periods", ())
        if isinstance(p, dict) and isinstance(p.get("index"), int)
    }
    out = dict(newer)
    if periods:
        out["periods"] = [periods[i] for i in sorted(periods)]
    return out


def goes_direct(beat: int, since_ack_s: float | None, interval_s: float, state: str = "") -> bool:
    """Whether a relaying worker's ``beat``-th heartbeat also goes to the controller directly: its first, every
    DIRECT_EVERY-th, each while its node agent has not acked for TRUST_BEATS heartbeats (None: never), and
    each once it is ``done`` (its last efficiency records must not wait in the agent while its exit, which the
    agent reports at once, ends the job)."""
    return beat % DIRECT_EVERY == 1 or since_ack_s is None or since_ack_s > TRUST_BEATS * interval_s or state == "done"


class RelayBuffer:
    """The heartbeats a node agent has received and not yet carried: the newest per worker (see :func:`merge`)."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[dict[str, Any], float]] = {}  # worker -> (heartbeat, time.time() received)

    def add(self, worker: str, hb: dict[str, Any], at: float | None = None) -> None:
        old = self.pending.get(worker)
        self.pending[worker] = (merge(old[0] if old else None, hb), time.time() if at is None else at)

    def entries(self, now: float | None = None) -> list[dict[str, Any]]:
        """The heartbeats to carry, each with its ``age`` (seconds since its worker sent it)."""
        now = time.time() if now is None else now
        out = []
        for hb, received in self.pending.values():
            sent = hb.get("sent")
            at = float(sent) if isinstance(sent, (int, float)) and sent <= now else received
            out.append({**hb, "age": round(max(0.0, now - at), 3)})
        return out

    def carried(self) -> list[str]:
        """Forget the pending heartbeats (they left with the agent's own); the workers to ack."""
        workers = list(self.pending)
        self.pending.clear()
        return workers


class RelayServer(RelayBuffer):
    """The node agent's end: a ROUTER socket on ``ipc://<private folder>/relay``; :attr:`address` goes to the
    workers in ``JAXDIST_RELAY``."""

    def __init__(self, ctx: zmq.Context):
        super().__init__()
        # mode 0700: only this user connects; a Unix socket's path must stay short (108 bytes on Linux)
        base = None if len(tempfile.gettempdir()) <= 64 else "/tmp"
        self.dir = Path(tempfile.mkdtemp(prefix="jaxdist-relay-", dir=base))
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_RELAY_BYTES)
        self.address = f"ipc://{self.dir / 'relay'}"
        self.sock.bind(self.address)

    def take(self) -> int:
        """Read every heartbeat waiting on the socket; how many."""
        n = 0
        while True:
            try:
                ident, body = self.sock.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                return n
            except ValueError:
                continue  # a message without a body
            try:
                hb = json.loads(body)
            except ValueError:
                continue
            if isinstance(hb, dict) and isinstance(hb.get("pid"), int):
                self.add(ident.decode(errors="replace"), hb)
                n += 1

    def ack(self, workers: list[str]) -> None:
        for w in workers:
            try:
                self.sock.send_multipart([w.encode(), b"ok"], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the worker is gone: its next heartbeat, if any, goes directly

    def close(self) -> None:
        self.sock.close(0)
        shutil.rmtree(self.dir, ignore_errors=True)


class RelayClient:
    """A worker's end: sends each heartbeat to the node agent and reads its acks."""

    def __init__(self, ctx: zmq.Context, address: str, identity: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 8)
        self.sock.connect(address)
        self.last_ack: float | None = None  # time.monotonic() of the newest ack

    def send(self, hb: dict[str, Any]) -> bool:
        try:
            self.sock.send(json.dumps(hb, separators=(",", ":")).encode(), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def since_ack(self) -> float | None:
        """Seconds since the node agent's newest ack (None: none yet), after reading the acks waiting."""
        while True:
            try:
                self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.last_ack = time.monotonic()
        return None if self.last_ack is None else time.monotonic() - self.last_ack

    def close(self) -> None:
        self.sock.close(0)

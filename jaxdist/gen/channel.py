"""The generation cluster's network channel: ZeroMQ with CURVE encryption and peer authentication.

Generation workers talk to two servers: the dispatcher of their generation
job (tasks out, outcomes back) and the receiver of the training run (shards
in, acknowledgements back). Both servers are a :class:`Server` (one ROUTER
socket), the workers' side is a :class:`Client` (a DEALER socket per server).

Two layers keep strangers out:

* **CURVE** (ZeroMQ's own elliptic-curve handshake and encryption), as on
  the controller's channel. The server's and the clients' key pairs are
  derived from the job token (:func:`jaxdist.controller.protocol.curve_keys`),
  and the server's ZAP handler admits only the client
  public key derived from that token. A process without the token cannot
  finish the handshake, so it can neither send anything nor take a worker's
  routing identity (a connection that fails the handshake never reaches the
  ROUTER socket): identities cannot be squatted.
* **Signed messages**, as on the controller's channel
  (:class:`jaxdist.controller.protocol.Signer`): the body names its sender
  and carries an HMAC under the token, a timestamp and a per-process sequence
  number, so a stale or replayed message is refused too. A message is
  ``[body, mac, *payload]``; a payload (a shard) is covered by the SHA-256
  the signed body names, which the receiver checks before anything is
  written.

A request is answered by one reply carrying the request's ``rid``; the client
retries (a fresh socket each time, so a reply to an abandoned try is never
mistaken for the answer) until an answer or its deadline. Every handler is
therefore written to be idempotent: a retried delivery is recognised and
acknowledged again, never applied twice.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from jaxdist.config import ConfigError
from jaxdist.controller.protocol import (
    HANDSHAKE_FAILED,
    Gate,
    Signer,
    Verifier,
    check_bind,
    curve_client,
    fields_problem,
)

log = logging.getLogger(__name__)


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (or ``tcp://host:port``) -> (host, port); ConfigError naming the address otherwise."""
    text = address[len("tcp://") :] if address.startswith("tcp://") else address
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"'{address}' is not an address: write it as host:port, e.g. 127.0.0.1:5601.")
    return host.strip("[]"), int(port)


class Server:
    """A ROUTER socket behind CURVE; :meth:`serve_once` hands each authentic request to ``handle``.

    ``handle(sender, msg, payload) -> reply`` returns a dict; the server adds
    the request's ``rid`` and signs it. A request that fails the signature,
    the age or the replay check is dropped with a logged reason (the sender
    retries or gives up; nothing was applied).  ``fields``: the fields each
    kind of request must and may carry, with their types: an authentic
    request that does not match is refused in one phrase before ``handle``.
    """

    def __init__(
        self,
        token: str,
        name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        allow_remote: bool = False,
        fields: dict[str, tuple[dict[str, Any], dict[str, Any]]] | None = None,
    ):
        check_bind(host, allow_remote)
        self.fields = fields or {}  # the requests ``handle`` reads (jaxdist.controller.protocol.fields_problem)
        self.unreadable: set[str] = set()  # the kinds of unreadable request seen, each logged once
        self.ctx = zmq.Context()
        self.gate = Gate(self.ctx, token)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client's retry on a new socket takes its identity over
        self.gate.serve(self.sock)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 31)
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
        host_part = f"[{host}]" if ":" in host else host
        if port:
            try:
                self.sock.bind(f"tcp://{host_part}:{port}")
            except zmq.ZMQError as e:
                self.close()
                raise ConfigError(f"cannot listen on {host}:{port} ({e}): choose another port.") from None
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host_part}")
        self.host, self.port = host, port
        self.signer = Signer(token, name)
        self.verifier = Verifier(token)
        # A handshake that fails (no CURVE, or keys not from the token) never reaches the socket: count it here.
        self.monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def serve_once(self, handle: Callable[[str, dict, bytes | None], dict], timeout_s: float) -> bool:
        """Answer at most one request within ``timeout_s``; True if one was answered."""
        events = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.monitor in events:
            recv_monitor_message(self.monitor)
            self.gate.handshake_failed()
        if self.sock not in events:
            return False
        frames = self.sock.recv_multipart()
        ident, rest = frames[0], frames[1:]
        peer = ident.decode(errors="replace")
        msg = self.verifier.check(rest[:2], peer=peer)
        if msg is None:
            return False
        if msg.get("sender") != peer:  # the signed name must be the identity it routes under
            log.warning("rejected a message from %s: it is signed as %r", peer, msg.get("sender"))
            return False
        payload = rest[2] if len(rest) > 2 else None
        problem = fields_problem(msg, self.fields)
        if problem is not None:  # authentic but unreadable (a peer of another version, a bug in one): refused here
            if problem not in self.unreadable:
                self.unreadable.add(problem)
                log.warning("refused a request from %s: %s", peer, problem)
            reply = {"ok": False, "refused": problem}
        else:
            try:
                reply = handle(peer, msg, payload)
            except ConfigError as e:
                reply = {"ok": False, "refused": str(e)}
        self.sock.send_multipart([ident, *self.signer.frames({**reply, "rid": msg.get("rid")})])
        return True

    def close(self) -> None:
        if getattr(self, "monitor", None) is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        if getattr(self, "sock", None) is not None:
            self.sock.close(0)
        self.gate.stop()
        self.ctx.term()


class Client:
    """Requests to one :class:`Server`, under the routing identity ``name`` (retried to a deadline)."""

    def __init__(self, token: str, name: str, address: str):
        self.host, self.port = split_address(address)
        self.token, self.name = token, name
        self.ctx = zmq.Context()
        self.signer = Signer(token, name)
        self.verifier = Verifier(token)
        self._rids = itertools.count(1)
        self._nonce = secrets.token_hex(4)
        self.sock: zmq.Socket | None = None

    def _connect(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, self.name.encode())
        curve_client(s, self.token)
        host = f"[{self.host}]" if ":" in self.host else self.host
        if ":" in self.host:
            s.setsockopt(zmq.IPV6, 1)
        s.connect(f"tcp://{host}:{self.port}")
        return s

    def request(
        self, msg: dict[str, Any], payload: bytes | None = None, deadline_s: float = 60.0, try_s: float = 5.0
    ) -> dict[str, Any] | None:
        """Send ``msg`` (and ``payload``) until a reply comes; the reply, or None at the deadline."""
        rid = f"{self._nonce}-{next(self._rids)}"
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.sock is None:
                self.sock = self._connect()
            frames = self.signer.frames({**msg, "rid": rid})
            self.sock.send_multipart(frames + ([payload] if payload is not None else []))
            wait_until = min(end, time.monotonic() + try_s)
            while (left := wait_until - time.monotonic()) > 0:
                if not self.sock.poll(int(left * 1000)):
                    break
                reply = self.verifier.check(self.sock.recv_multipart()[:2], peer="server")
                if reply is not None and reply.get("rid") == rid:
                    return reply
            self.sock.close(0)  # a reply to this try, if late, lands on a closed socket
            self.sock = None
        return None

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(0)
        self.ctx.term()


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))

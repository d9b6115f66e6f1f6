"""The controller's network channel: ZeroMQ over TCP, every message signed with the job token.

The controller binds one ROUTER socket; node agents and worker agents connect
DEALER sockets to it, each with a stable identity (``n:<node>`` or
``w:<node>:<pid>``), so a restarted controller on the same endpoint reaches
them again as soon as they send their next heartbeat (ZeroMQ reconnects by
itself).

Every socket speaks CURVE (ZeroMQ's encrypted, authenticated handshake) with
key pairs derived from the job token (:func:`curve_keys`); the listening side
admits only the token's client key (:class:`Gate`). A process without the
token never completes a handshake, so it cannot send anything nor take an
agent's routing identity (``n:<node>``) away from it, not even while the
controller restarts; refused handshakes are counted and logged, rate-limited.

A message is two frames: the JSON body and its HMAC-SHA256 (hex) under the
job token.  The body carries ``sender``, ``sid`` (a random id per sending
process), ``seq`` (counting up per sid) and ``ts`` (seconds since the epoch).
:class:`Verifier` rejects a wrong or missing MAC, a body older than
``max_age_s`` and a replayed ``(sid, seq)``; every rejection is counted and
logged (the first few one by one, then a summary line at most every
``LOG_EVERY_S`` seconds, so a flood cannot fill the disk). A restarted
controller keeps refusing replays: the highest ``seq`` per ``sid`` is saved
with its state and restored (:meth:`Verifier.marks`), and messages signed
before it started are refused (``not_before``).  Its own agents' messages
queued while it was away are refused too, but not counted as attacks: an
agent's message names the controller start it last heard from (``ctl``: that
start's ``sid``; a worker that has not heard from it yet, the one its node
agent last heard from, ``$JAXDIST_CONTROLLER_START``), and a message signed before this start (or too old) that
names an earlier start of the same job (``previous_starts``) and carries a
``seq`` never seen is dropped silently into :attr:`Verifier.stale`.  Sent
again, it is a replay and counted.  Nothing here listens beyond loopback unless the caller says so
(:func:`check_bind`).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from jaxdist.config import ConfigError, is_loopback

log = logging.getLogger(__name__)

# Seconds a signed message stays acceptable (clock skew between hosts plus queueing).
MAX_AGE_S = 60.0
TOKEN_ENV = "JAXDIST_JOB_TOKEN"
START_ENV = "JAXDIST_CONTROLLER_START"  # a worker's first ``ctl``: the start its node agent last heard from
ZAP_DOMAIN = "jaxdist"
LOG_FIRST, LOG_EVERY_S = 5, 10.0  # rejections logged one by one, then one summary line per LOG_EVERY_S


def new_token() -> str:
    """A fresh job token: 32 random bytes, hex."""
    return secrets.token_hex(32)


def load_or_create_token(path: Path) -> str:
    """The token in ``$JAXDIST_JOB_TOKEN``, else in ``path``, else a new one written there (mode 0600)."""
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def curve_keys(token: str, role: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys of ``role`` ("server" or "client") derived from the job token."""
    seed = hmac.new(token.encode(), f"jaxdist-curve/{role}".encode(), hashlib.sha256).digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def curve_client(sock: zmq.Socket, token: str) -> None:
    """Make ``sock`` (not yet connected) a CURVE client holding the token's client keys."""
    sock.curve_serverkey = curve_keys(token, "server")[0]
    sock.curve_publickey, sock.curve_secretkey = curve_keys(token, "client")


LISTEN_BACKLOG = 8192  # the controller's listen queue (connections not yet accepted): Endpoint


class _RateLimitedLog:
    """Warnings of refused traffic: the first ``LOG_FIRST`` one by one, then a count every ``LOG_EVERY_S``."""

    def __init__(self, what: str):
        self.what, self.count, self._logged, self._quiet, self._window = what, 0, 0, 0, 0.0

    def __call__(self, text: str) -> None:
        self.count += 1
        now = time.monotonic()
        if self._logged < LOG_FIRST:
            self._logged += 1
            log.warning("%s %s", self.what, text)
            self._window = now
            return
        self._quiet += 1
        if now - self._window >= LOG_EVERY_S:
            log.warning(
                "%s %d more in the last %.0f s (the latest: %s)", self.what, self._quiet, now - self._window, text
            )
            self._quiet, self._window = 0, now


class Gate:
    """The ZAP handler of one ZeroMQ context: CURVE servers on it admit only the token's client key."""

    def __init__(self, ctx: zmq.Context, token: str):
        self.token = token
        self._allowed = curve_keys(token, "client")[0]
        self.refusals = _RateLimitedLog("refused a connection:")
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)

    @property
    def refused(self) -> int:
        return self.refusals.count

    def callback(self, domain: str, key: bytes) -> bool:  # called by the ZAP thread for each CURVE handshake
        if hmac.compare_digest(key, self._allowed):
            return True
        self.refusals("its CURVE key is not the job token's")
        return False

    def handshake_failed(self) -> None:
        self.refusals("its handshake failed (no CURVE, or keys not from the job token)")

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (not yet bound) a CURVE server behind this gate."""
        public, secret = curve_keys(self.token, "server")
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.zap_domain = ZAP_DOMAIN.encode()

    def stop(self) -> None:
        self.auth.stop()


HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def check_bind(host: str, allow_remote: bool) -> None:
    """Refuse (ConfigError) to listen beyond loopback unless ``allow_remote``."""
    if not is_loopback(host) and not allow_remote:
        raise ConfigError(
            f"refusing to listen on '{host}', which is not loopback: set controller.allow_remote=true "
            "to accept connections from other machines."
        )


def _mac(token: str, body: bytes) -> bytes:
    return hmac.new(token.encode(), body, hashlib.sha256).hexdigest().encode()


class Signer:
    """Signs the messages of one process (one ``sid``)."""

    def __init__(self, token: str, sender: str):
        self.token, self.sender = token, sender
        self.sid = secrets.token_hex(8)
        self.seq = 0

    def frames(self, msg: dict[str, Any]) -> list[bytes]:
        """[body, mac] for ``msg`` (a dict with at least ``t``, the message type)."""
        self.seq += 1
        body = json.dumps(
            {**msg, "sender": self.sender, "sid": self.sid, "seq": self.seq, "ts": time.time()}, separators=(",", ":")
        ).encode()
        return [body, _mac(self.token, body)]


_STALE = "stale"  # _reason's answer for a message of our own from before this start (dropped, not logged)


@dataclass
class Verifier:
    """Checks [body, mac] frames; remembers the highest ``seq`` per ``sid`` to refuse replays.

    ``not_before``: messages signed (``ts``) before this time are refused: a restarted controller sets it to
    its start, so nothing captured before the restart is accepted after it. ``marks``: the highest ``seq`` per
    ``sid`` seen so far (what a restarted process restores with :meth:`restore`). ``previous_starts``: the
    ``sid`` of earlier starts of this controller; ``stale``: messages of its own agents to those, dropped
    uncounted by :attr:`rejected` (see the module docstring); ``last_sid``: of the last message accepted.
    """

    token: str
    max_age_s: float = MAX_AGE_S
    not_before: float = 0.0
    previous_starts: frozenset[str] = frozenset()
    stale: int = 0
    last_sid: str = ""
    _last_seq: dict[str, int] = field(default_factory=dict)
    _log: _RateLimitedLog = field(default_factory=lambda: _RateLimitedLog("rejected a message from"))

    @property
    def rejected(self) -> int:
        """Messages refused as attacks or faults (wrong MAC, malformed, replayed, too old and not ours)."""
        return self._log.count

    def marks(self) -> dict[str, int]:
        return dict(self._last_seq)

    def restore(self, marks: dict[str, int]) -> None:
        for sid, seq in marks.items():
            self._last_seq[str(sid)] = max(int(seq), self._last_seq.get(str(sid), 0))

    def check(self, frames: list[bytes], peer: str = "?") -> dict[str, Any] | None:
        """The message, or None (logged, rate-limited) when it is not authentic, too old or replayed."""
        reason = self._reason(frames)
        if isinstance(reason, dict):
            self.last_sid = str(reason["sid"])
            return reason
        if reason is not _STALE:
            self._log(f"{peer}: {reason}")
        return None

    def _ours_from_before(self, msg: dict[str, Any], sid: str, seq: int) -> bool:
        """An authentic message an agent signed for an earlier start of this controller, never delivered:
        counted in ``stale`` and remembered, so the same message sent again is a replay."""
        if msg.get("ctl") not in self.previous_starts:
            return False
        self._last_seq[sid] = seq
        self.stale += 1
        return True

    def _reason(self, frames: list[bytes]) -> dict[str, Any] | str:
        if len(frames) != 2:
            return f"expected 2 frames (body, mac), got {len(frames)}"
        body, mac = frames
        if not hmac.compare_digest(_mac(self.token, body), mac):
            return "bad signature (wrong job token?)"
        try:
            msg = json.loads(body)
            sid, seq, ts = str(msg["sid"]), int(msg["seq"]), float(msg["ts"])
        except (ValueError, KeyError, TypeError):
            return "malformed body"
        if seq <= self._last_seq.get(sid, 0):
            return f"replayed message (seq {seq} from {sid})"
        too_old, before = abs(time.time() - ts) > self.max_age_s, ts < self.not_before
        if (too_old or before) and self._ours_from_before(msg, sid, seq):
            return _STALE
        if too_old:
            return f"stale message ({time.time() - ts:.0f} s old)"
        if before:
            return f"signed {self.not_before - ts:.1f} s before this process started (a replay?)"
        self._last_seq[sid] = seq
        return msg


RECV_BATCH = 256  # messages read after one poll of the controller's socket (then the monitor and the tick get a turn)
PEER_PING_FACTOR = 8  # a peer's ZMTP pings to the controller, this many heartbeat intervals apart (2 s)
PING_SPACING = 0.75  # the controller pings each connection every liveness_s x this ...
PONG_WAIT = 0.75  # ... and drops one silent for liveness_s x this after a ping: 1.5 x liveness_s after it stopped


def _zmq_heartbeats(sock: zmq.Socket, interval_s: float, timeout_s: float, ttl_s: float) -> None:
    # ZMTP heartbeats: sent and answered by ZeroMQ's I/O thread, without the Python GIL, so a
    # process busy compiling still answers; a stopped or frozen one does not, and is disconnected.
    # ZeroMQ pings every interval_s whatever else flows, drops the connection when nothing came
    # timeout_s after a ping, and asks the other side to drop it when nothing comes ttl_s after one.
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(interval_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(timeout_s * 1000)))
    sock.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(ttl_s * 1000)))


class Endpoint:
    """The controller's listening socket (ROUTER): ``recv`` -> (identity, message), ``send`` to an identity.

    ``liveness_s``: peers whose connection answers no ZeroMQ heartbeat for this long (seconds) are
    disconnected; :meth:`take_disconnects` lists them (identity, ``time.monotonic()``), and
    :attr:`connected` tells which identities have a live connection now (from each message's source
    socket, ``ZMQ_SRCFD``; without it, nothing is known and the caller relies on its own heartbeats).
    """

    def __init__(
        self,
        token: str,
        host: str,
        port: int,
        allow_remote: bool = False,
        interval_s: float = 0.25,
        liveness_s: float = 1.0,
    ):
        check_bind(host, allow_remote)
        self.ctx = zmq.Context()
        self.gate = Gate(self.ctx, token)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # unknown identities: drop silently
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # an agent reconnecting takes its identity back at once
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        # Every node connects three times (its agent, its worker and its warm spare), all at once when the controller
        # starts or restarts: with ZeroMQ's default listen backlog of 100 the kernel dropped the rest, and TCP sent
        # them again 1, 3, 7, 15 and 31 s later (a restarted controller heard its last members 33 s on at 1,024
        # simulated nodes).  The kernel caps it at net.core.somaxconn.
        self.sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
        # A ping every 0.75 x liveness_s, answered within as long: each ping and its answer are two CURVE frames for
        # the I/O thread, 3 connections a node (its agent, its worker and warm spare, whose heartbeats its agent
        # relays), most of that thread's work at 1,024 simulated nodes.  A stopped process is dropped within
        # 1.5 x liveness_s of its last message (1.5 s at the defaults), as when it was pinged every liveness_s / 2
        # and had liveness_s to answer, with a third fewer pings (the controller's CPU 0.418 of a core against
        # 0.476 at 1,024 simulated nodes).  A peer drops the controller's connection when nothing comes
        # 2 x liveness_s after a ping (the controller's next ping comes well before).
        _zmq_heartbeats(self.sock, max(interval_s, PING_SPACING * liveness_s), PONG_WAIT * liveness_s, 2 * liveness_s)
        self.gate.serve(self.sock)
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)
        self._fd_ident: dict[int, str] = {}
        self.connected: dict[str, bool] = {}
        self._disconnects: list[tuple[str, float]] = []
        self.waited_s = 0.0  # seconds spent waiting in recv_batch for a message (the rest is work)
        self.backlog_since: float | None = None  # since when recv_batch has found more messages than it read
        self._pending: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()
        host = host.strip("[]")  # controller.bind=[::1] is written as in a URL: the brackets are added below
        host_part = f"[{host}]" if ":" in host else host
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
        if port:
            self.sock.bind(f"tcp://{host_part}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host_part}")
        self.host, self.port = host, port
        self.signer = Signer(token, "controller")
        self.verifier = Verifier(token)

    @property
    def address(self) -> str:
        """host:port peers connect to."""
        return f"{self.host}:{self.port}"

    def bound_endpoint(self) -> str:
        """The address the socket really listens on (``tcp://127.0.0.1:PORT``), as the OS reports it."""
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        """One authentic message within ``timeout_s``, or None (timeout, rejected messages, a disconnect)."""
        if not self._pending:
            self._pending.extend(self.recv_batch(timeout_s))
        return self._pending.popleft() if self._pending else None

    def recv_batch(self, timeout_s: float, most: int = RECV_BATCH) -> list[tuple[str, dict[str, Any]]]:
        """The authentic messages that arrived, at most ``most``, after one wait of up to ``timeout_s``.

        One poll serves the whole batch: under a flood of heartbeats a poll per message was a fifth of the
        controller's time (256 simulated nodes).  The monitor's disconnects are read before the messages.
        ``backlog_since``: since when every batch was full (None once one emptied the socket)."""
        t = time.monotonic()
        events = dict(self.poller.poll(int(timeout_s * 1000)))
        self.waited_s += time.monotonic() - t
        if self.monitor in events:
            self._read_monitor()
        out: list[tuple[str, dict[str, Any]]] = []
        if self.sock not in events:
            self.backlog_since = None
            return out
        for _ in range(most):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.backlog_since = None
                break
            got = self._check(frames)
            if got is not None:
                out.append(got)
        else:
            self.backlog_since = self.backlog_since or time.monotonic()
        return out

    def _read_monitor(self) -> None:
        while True:
            try:
                ev = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if ev["event"] & HANDSHAKE_FAILED:
                self.gate.handshake_failed()
                continue
            ident = self._fd_ident.pop(int(ev["value"]), None)
            if ident is not None and ev["event"] == zmq.EVENT_DISCONNECTED:
                self.connected[ident] = False
                self._disconnects.append((ident, time.monotonic()))

    def _check(self, frames: list[zmq.Frame]) -> tuple[str, dict[str, Any]] | None:
        ident = frames[0].bytes.decode(errors="replace")
        msg = self.verifier.check([f.bytes for f in frames[1:]], peer=ident)
        if msg is None:
            return None
        try:
            fd = int(frames[1].get(zmq.SRCFD))
        except (zmq.ZMQError, AttributeError, TypeError, ValueError, IndexError):
            fd = -1  # libzmq without ZMQ_SRCFD: no connection tracking
        if fd >= 0:
            self._fd_ident[fd] = ident
            self.connected[ident] = True
        return ident, msg

    def routable(self, ident: str) -> bool:
        """Whether ``ident`` has a connection now, asked of the socket itself (a ping it may ignore is sent).

        The monitor's disconnects name a connection by its file descriptor, mapped to an identity by the
        messages read from it: when a new connection reuses a closed one's descriptor before the old one's
        event is read, the event names the wrong peer.  A peer that sends few messages of its own (a worker
        whose node agent relays its heartbeats) keeps a wrong mapping long, so a disconnect is believed only
        once this says so too."""
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.sock.send_multipart([ident.encode(), *self.signer.frames({"t": "ping"})], zmq.NOBLOCK)
            return True
        except zmq.Again:
            return True  # routed; its queue is full
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise
        finally:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)

    def take_disconnects(self) -> list[tuple[str, float]]:
        """Identities whose connection dropped since the last call, with when (``time.monotonic()``)."""
        out, self._disconnects = self._disconnects, []
        return out

    def send(self, ident: str, msg: dict[str, Any]) -> None:
        try:
            self.sock.send_multipart([ident.encode(), *self.signer.frames(msg)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("dropped a %s message to %s (queue full)", msg.get("t"), ident)

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.gate.stop()
        self.ctx.term()


class Peer:
    """A node or worker agent's socket to the controller (DEALER with a fixed identity).

    Not thread-safe: one thread owns it.  Sends never block: while the
    controller is away, messages beyond a small queue are dropped (heartbeats
    are only worth their newest value).
    """

    def __init__(
        self,
        token: str,
        controller: str,
        identity: str,
        interval_s: float = 0.25,
        liveness_s: float = 1.0,
        start: str = "",
        ctx: zmq.Context | None = None,
    ):
        self._own_ctx = ctx is None  # a process hosting many agents (a simulated cluster) shares one context
        self.ctx = zmq.Context() if ctx is None else ctx
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        # The controller pings every peer every 0.75 x ``liveness_s`` and drops one that does not answer within as
        # long (PING_SPACING, PONG_WAIT); the peer answers those pings, and pings the controller only every PEER_PING_FACTOR
        # intervals (to find a controller whose host died without closing the connection).  Each ping is a CURVE
        # frame the controller's I/O thread decrypts and answers: at the controller's own rate, from every peer,
        # they were half of that thread's work.  The time to live it asks of the controller (2 x liveness_s)
        # outlasts the controller's own ping spacing: a peer that sends nothing else still answers within it.
        _zmq_heartbeats(self.sock, PEER_PING_FACTOR * interval_s, liveness_s, 2 * liveness_s)
        self.sock.setsockopt(zmq.SNDHWM, 50)
        self.sock.setsockopt(zmq.RCVHWM, 1000)
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if controller.startswith("["):
            self.sock.setsockopt(zmq.IPV6, 1)
        curve_client(self.sock, token)
        self.sock.connect(f"tcp://{controller}")
        self.identity = identity
        self.signer = Signer(token, identity)
        self.verifier = Verifier(token, last_sid=start)  # ``start``: the controller start to name until one answers

    def send(self, msg: dict[str, Any]) -> bool:
        """Queue ``msg``, naming the controller start last heard from (``ctl``); False if the queue is full."""
        if self.verifier.last_sid:
            msg = {**msg, "ctl": self.verifier.last_sid}
        try:
            self.sock.send_multipart(self.signer.frames(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def recv(self, timeout_s: float) -> dict[str, Any] | None:
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.verifier.check(self.sock.recv_multipart(), peer="controller")

    def close(self) -> None:
        self.sock.close(0)
        if self._own_ctx:
            self.ctx.term()


NONE, NUMBER = type(None), (int, float)  # for the specs of fields_problem


def fields_problem(msg: dict[str, Any], spec: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> str | None:
    """Why the authentic message ``msg`` cannot be read (one phrase), or None.

    ``spec``: per message kind (``msg["t"]``), the fields it must carry and the fields it may carry, each with
    its type (or tuple of types); kinds not in ``spec`` pass.  The edge of each message handler calls this
    once, so that a peer of another version or with a bug is refused there, never a crash behind it."""
    kind = msg.get("t")
    if not isinstance(kind, str) or kind not in spec:
        return None
    required, optional = spec[kind]
    for key in required:
        if key not in msg:
            return f"a {kind!r} message without {key!r}"
    for key, types in {**required, **optional}.items():
        if key in msg and not isinstance(msg[key], types):
            return f"a {kind!r} message whose {key!r} is a {type(msg[key]).__name__}"
    return None

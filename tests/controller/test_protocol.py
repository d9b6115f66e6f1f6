"""The network channel: HMAC-signed messages, rejections logged and counted, loopback by default."""

from __future__ import annotations

import json
import logging
import time

import pytest

from jaxdist.config import ConfigError, load_config
from jaxdist.controller.protocol import Endpoint, Peer, Signer, Verifier, _mac, check_bind, load_or_create_token


def test_signed_messages_verify_and_carry_sender_and_sequence():
    s, v = Signer("t" * 64, "w:n0:1"), Verifier("t" * 64)
    a, b = v.check(s.frames({"t": "hb", "step": 3})), v.check(s.frames({"t": "hb", "step": 4}))
    assert (a["step"], a["seq"], a["sender"]) == (3, 1, "w:n0:1") and b["seq"] == 2
    assert v.rejected == 0


def test_wrong_token_replay_stale_and_malformed_are_rejected_and_logged(caplog):
    good, v = Signer("right", "x"), Verifier("right")
    caplog.set_level(logging.WARNING, logger="jaxdist.controller.protocol")
    assert v.check(Signer("wrong", "x").frames({"t": "hb"}), peer="n:evil") is None
    assert "rejected a message from n:evil: bad signature (wrong job token?)" in caplog.text
    frames = good.frames({"t": "hb"})
    assert v.check(frames) is not None
    assert v.check(frames) is None and "replayed message" in caplog.text  # the same frames again
    old = json.dumps({"t": "hb", "sender": "x", "sid": "s", "seq": 1, "ts": time.time() - 3600}).encode()
    assert v.check([old, _mac("right", old)]) is None and "stale message" in caplog.text
    assert v.check([b"{}", _mac("right", b"{}")]) is None and "malformed body" in caplog.text
    assert v.check([b"only one frame"]) is None
    body = frames[0].replace(b'"hb"', b'"kill"')  # tampered body, original MAC
    assert v.check([body, frames[1]]) is None
    assert v.rejected == 6


def test_endpoint_listens_on_loopback_only_unless_allowed():
    ep = Endpoint("tok", "127.0.0.1", 0)
    try:
        assert ep.bound_endpoint() == f"tcp://127.0.0.1:{ep.port}"
        peer = Peer("tok", ep.address, "n:a")
        intruder = Peer("not-the-token", ep.address, "n:b")
        try:
            intruder.send({"t": "node_hb"})
            peer.send({"t": "node_hb", "x": 1})
            got = []
            deadline = time.monotonic() + 5
            while (not got or ep.gate.refused < 1) and time.monotonic() < deadline:
                r = ep.recv(0.2)
                if r is not None:
                    got.append(r)
            assert got[0][0] == "n:a" and got[0][1]["x"] == 1
            ep.send("n:a", {"t": "welcome"})
            assert peer.recv(5.0)["t"] == "welcome"
            # the intruder never got past the CURVE handshake: refused there, no message of it reached the socket
            assert ep.gate.refused >= 1 and ep.verifier.rejected == 0
        finally:
            peer.close()
            intruder.close()
    finally:
        ep.close()
    with pytest.raises(
        ConfigError, match="refusing to listen on '0.0.0.0', which is not loopback: set controller.allow_remote=true"
    ):
        Endpoint("tok", "0.0.0.0", 0)
    check_bind("10.0.0.5", allow_remote=True)  # allowed when configured


def test_config_refuses_a_remote_bind_without_allow_remote():
    with pytest.raises(
        ConfigError,
        match=r"controller.bind='0.0.0.0' is not a loopback address: set "
        r"controller.allow_remote=true",
    ):
        load_config(None, ["controller.bind=0.0.0.0"])
    assert load_config(None, ["controller.bind=0.0.0.0", "controller.allow_remote=true"]).controller.allow_remote
    with pytest.raises(ConfigError, match="must be at least twice controller.heartbeat_interval"):
        load_config(None, ["controller.heartbeat_timeout=0.3"])
    with pytest.raises(ConfigError, match="controller.recovery='restart' is unknown: use standby or requeue"):
        load_config(None, ["controller.recovery=restart"])
    with pytest.raises(ConfigError, match="min_nodes=3 and max_nodes=2 are inconsistent"):
        load_config(None, ["controller.min_nodes=3", "controller.max_nodes=2"])


def test_token_file_is_private_and_env_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("JAXDIST_JOB_TOKEN", raising=False)
    t = load_or_create_token(tmp_path / "c" / "token")
    assert len(t) == 64 and (tmp_path / "c" / "token").stat().st_mode & 0o777 == 0o600
    assert load_or_create_token(tmp_path / "c" / "token") == t
    monkeypatch.setenv("JAXDIST_JOB_TOKEN", "from-env")
    assert load_or_create_token(tmp_path / "c" / "token") == "from-env"


def test_an_identity_cannot_be_squatted_without_the_token():
    """Reliability edge 6: a stranger connecting as ``n:a`` (plain TCP, or CURVE with keys not from the token)
    before the real agent neither reaches the controller nor receives what is sent to ``n:a``."""
    import zmq

    from jaxdist.controller.protocol import curve_client

    ep = Endpoint("tok", "127.0.0.1", 0)
    ctx = zmq.Context()
    squatters = []
    try:
        for token in (None, "not-the-token"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IDENTITY, b"n:a")
            if token:
                curve_client(s, token)
            s.connect(f"tcp://{ep.address}")
            s.send_multipart(Signer("tok", "n:a").frames({"t": "node_hb", "squat": True}))  # even a valid body
            squatters.append(s)
        deadline = time.monotonic() + 5
        while ep.gate.refused < 2 and time.monotonic() < deadline:
            assert ep.recv(0.1) is None
        assert ep.gate.refused >= 2
        peer = Peer("tok", ep.address, "n:a")
        try:
            peer.send({"t": "node_hb", "real": True})
            got = None
            while got is None and time.monotonic() < deadline + 5:
                got = ep.recv(0.2)
            assert got[0] == "n:a" and got[1].get("real") and not got[1].get("squat")
            ep.send("n:a", {"t": "welcome"})
            assert peer.recv(5.0)["t"] == "welcome"
            assert all(not s.poll(300) for s in squatters)  # nothing reached the squatters
        finally:
            peer.close()
    finally:
        for s in squatters:
            s.close(0)
        ctx.term()
        ep.close()


def test_a_message_from_before_a_restart_is_refused_after_it(tmp_path):
    """Reliability edge 7: the replay check survives a restart (saved marks, and nothing signed before it)."""
    s = Signer("tok", "n:a")
    before = s.frames({"t": "node_hb"})
    v1 = Verifier("tok")
    assert v1.check(before) is not None
    marks = v1.marks()
    time.sleep(0.05)
    v2 = Verifier("tok", not_before=time.time())  # the restarted controller
    assert v2.check(before) is None  # signed before it started
    v3 = Verifier("tok")
    v3.restore(marks)
    assert v3.check(before) is None  # seen by the previous controller
    assert v2.check(s.frames({"t": "node_hb"})) is not None  # the agent's next message is accepted


def test_a_flood_of_rejected_messages_logs_a_few_lines(caplog):
    """Reliability edge 8: 5,000 forged messages write the first few warnings and then one summary line."""
    from jaxdist.controller import protocol

    caplog.set_level(logging.WARNING, logger="jaxdist.controller.protocol")
    v = Verifier("right")
    forged = Signer("wrong", "x")
    t0 = time.monotonic()
    for _ in range(5000):
        v.check(forged.frames({"t": "hb"}), peer="n:evil")
    assert v.rejected == 5000
    lines = [r for r in caplog.records if "rejected a message" in r.getMessage()]
    assert protocol.LOG_FIRST <= len(lines) <= protocol.LOG_FIRST + 1 + (time.monotonic() - t0) / protocol.LOG_EVERY_S


def test_loopback_is_an_address_check_not_a_prefix():
    """Reliability edge 11: a name that only starts like 127.x is not loopback."""
    from jaxdist.config import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("::1") and is_loopback("[::1]")
    assert is_loopback("localhost")
    assert not is_loopback("127.0.0.1.example.com")  # does not resolve here, and is not an address
    assert not is_loopback("10.0.0.5") and not is_loopback("0.0.0.0")
    with pytest.raises(ConfigError, match="not a loopback address"):
        load_config(None, ["controller.bind=127.0.0.1.example.com"])


def test_own_agents_messages_from_before_a_restart_are_stale_not_attacks(caplog):
    """Issue 35 item 6: what the job's agents queued for the previous controller start is dropped into
    ``stale``; a replay, a message naming no start of ours and a forgery are still rejected and counted."""
    caplog.set_level(logging.WARNING, logger="jaxdist.controller.protocol")
    agent, stranger = Signer("tok", "n:a"), Signer("tok", "n:b")
    old = Verifier("tok")
    delivered = agent.frames({"t": "node_hb", "ctl": "start1"})
    assert old.check(delivered) is not None
    queued = [agent.frames({"t": "node_hb", "ctl": "start1"}) for _ in range(3)]  # never delivered
    unnamed = stranger.frames({"t": "node_hb"})  # signed with the token, for no start of ours
    elsewhere = stranger.frames({"t": "node_hb", "ctl": "start9"})
    time.sleep(0.05)
    new = Verifier("tok", not_before=time.time(), previous_starts=frozenset({"start1"}))
    new.restore(old.marks())
    assert [new.check(f) for f in queued] == [None] * 3
    assert (new.stale, new.rejected) == (3, 0) and "rejected" not in caplog.text
    assert new.check(queued[1]) is None and new.check(delivered) is None  # sent again: replays
    assert new.check(unnamed) is None and new.check(elsewhere) is None
    forged = json.loads(queued[0][0])
    forged["seq"] = 99
    body = json.dumps(forged).encode()
    assert new.check([body, _mac("not-the-token", body)]) is None
    assert (new.stale, new.rejected) == (3, 5)
    assert "replayed message" in caplog.text and "before this process started" in caplog.text
    assert new.check(agent.frames({"t": "node_hb", "ctl": "start1"})) is not None  # signed after the start


def test_a_restarted_endpoint_counts_its_agents_queued_heartbeats_as_stale():
    """The same through real sockets: an agent learns the controller start from its messages and names it;
    heartbeats queued while the controller was away reach the restarted one and are dropped, uncounted."""
    ep = Endpoint("tok", "127.0.0.1", 0)
    port = ep.port
    peer = Peer("tok", ep.address, "n:a")
    try:
        peer.send({"t": "node_hb"})
        deadline = time.monotonic() + 10
        got = None
        while got is None and time.monotonic() < deadline:
            got = ep.recv(0.1)
        ep.send("n:a", {"t": "welcome"})
        assert peer.recv(5.0)["t"] == "welcome" and peer.verifier.last_sid == ep.signer.sid
        marks, first = ep.verifier.marks(), ep.signer.sid
        ep.close()
        for _ in range(5):  # heartbeats while the controller is away: queued by ZeroMQ
            peer.send({"t": "node_hb"})
        time.sleep(0.05)
        ep = Endpoint("tok", "127.0.0.1", port)
        ep.verifier.not_before = time.time()
        ep.verifier.previous_starts = frozenset({first})
        ep.verifier.restore(marks)
        deadline = time.monotonic() + 10
        while ep.verifier.stale < 5 and time.monotonic() < deadline:
            assert ep.recv(0.1) is None
        assert (ep.verifier.stale, ep.verifier.rejected) == (5, 0)
        peer.send({"t": "node_hb", "after": True})
        got = None
        while got is None and time.monotonic() < deadline:
            got = ep.recv(0.1)
        assert got[1].get("after") and got[1]["ctl"] == first  # it has not heard from the new start yet
    finally:
        peer.close()
        ep.close()


def test_a_flood_of_messages_is_read_in_batches_one_poll_each():
    """Under a flood the endpoint reads what is queued after one poll (a poll per message was a fifth of the
    controller's time at 256 simulated nodes): 300 messages, in order, in at most a few polls, not 300."""
    ep = Endpoint("tok", "127.0.0.1", 0)
    peer = Peer("tok", ep.address, "w:n0:1")
    polls = [0]
    poll = ep.poller.poll

    def counted(*a, **k):
        polls[0] += 1
        return poll(*a, **k)

    ep.poller.poll = counted
    try:
        deadline = time.monotonic() + 30
        for i in range(300):  # the peer's queue holds 50 until the connection is up: wait for room
            while not peer.send({"t": "hb", "i": i}):
                assert time.monotonic() < deadline, "no connection to the endpoint in 30 s"
                time.sleep(0.005)
        time.sleep(0.5)  # let most of them arrive: the count below is of polls, not a race
        got: list[int] = []
        backlogs = []  # backlog_since after each batch: set while a batch is full, None once one empties the socket
        deadline = time.monotonic() + 30
        while len(got) < 300 and time.monotonic() < deadline:
            got += [m["i"] for _, m in ep.recv_batch(0.5, most=100)]
            backlogs.append(ep.backlog_since)
        assert got == list(range(300))
        assert backlogs[0] is not None and ep.recv_batch(0.05) == [] and ep.backlog_since is None, backlogs
        assert polls[0] <= 30, polls  # batches of up to RECV_BATCH; the messages trickle in over TCP
    finally:
        peer.close()
        ep.close()


def test_routable_tells_a_connected_peer_from_a_gone_one():
    """What the controller asks before it believes a disconnect (the monitor names connections by a file
    descriptor a new connection may have reused) or a silent worker's connection."""
    ep = Endpoint("tok", "127.0.0.1", 0)
    peer = Peer("tok", ep.address, "w:n0:1")
    try:
        assert not ep.routable("w:n0:2")  # never connected
        deadline = time.monotonic() + 30
        while not ep.routable("w:n0:1"):  # connected once the CURVE handshake is done (no message needed)
            assert time.monotonic() < deadline, "the peer did not connect in 30 s"
            time.sleep(0.05)
        peer.close()
        while ep.routable("w:n0:1"):
            assert time.monotonic() < deadline, "the closed peer stayed routable"
            time.sleep(0.05)
    finally:
        ep.close()


_QUIET_PEER = """
import sys, time
from jaxdist.controller.protocol import Peer
peer = Peer("tok", sys.argv[1], "w:n0:1")
peer.send({"t": "hello"})  # one message (the endpoint maps the connection to the identity), then only pings
print("sent", flush=True)
time.sleep(120)
"""


def test_a_quiet_peer_stays_connected_and_a_stopped_one_is_dropped_by_zeromqs_pings():
    """At the default liveness (1 s): the controller pings each connection every 0.75 s and drops one silent for
    0.75 s after a ping, so a stopped process goes within 1.5 s of its last answer; a live peer that sends nothing
    of its own (a relayed worker) answers every ping and is never dropped, its own pings asking the controller for
    a time to live (2 s) longer than the controller's ping spacing.  Bounds with headroom for a busy host."""
    import signal
    import subprocess
    import sys

    ep = Endpoint("tok", "127.0.0.1", 0, liveness_s=1.0)
    child = subprocess.Popen([sys.executable, "-c", _QUIET_PEER, ep.address], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "sent"
        deadline = time.monotonic() + 30
        while not ep.recv_batch(0.2):
            assert time.monotonic() < deadline, "the peer's message did not come in 30 s"
        quiet_until = time.monotonic() + 6  # 6 of the controller's pings and 3 of the peer's
        while time.monotonic() < quiet_until:
            ep.recv_batch(0.2)
            assert ep.take_disconnects() == [] and ep.routable("w:n0:1")
        child.send_signal(signal.SIGSTOP)
        stopped, dropped = time.monotonic(), []
        while not dropped:
            ep.recv_batch(0.1)
            dropped = ep.take_disconnects()
            assert time.monotonic() - stopped < 1.5 + 3.0, "a stopped peer was still connected 4.5 s later"
        assert [ident for ident, _ in dropped] == ["w:n0:1"]
    finally:
        child.kill()
        child.wait()
        ep.close()

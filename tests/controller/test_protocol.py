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
            while (not got or ep.verifier.rejected < 1) and time.monotonic() < deadline:
                r = ep.recv(0.2)
                if r is not None:
                    got.append(r)
            assert got[0][0] == "n:a" and got[0][1]["x"] == 1
            ep.send("n:a", {"t": "welcome"})
            assert peer.recv(5.0)["t"] == "welcome"
            assert ep.verifier.rejected == 1
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

"""The generation channel and the training side's receiver, without JAX: CURVE + signatures, exactly once."""

import json
import threading
import time

import numpy as np
import pytest
import zmq

from jaxdist.config import ConfigError
from jaxdist.data import Journal, RunBatchList
from jaxdist.controller.protocol import curve_keys
from jaxdist.gen.channel import Client, Server
from jaxdist.gen.config import load_gen_config
from jaxdist.gen.delivery import Ledger, Receiver, run_status, run_token
from jaxdist.gen.tasks import TaskBoard, load_samples, make_tasks

B, L = 2, 16


def make_run(tmp_path):
    run = tmp_path / "run"
    RunBatchList(run, np.arange(B * (L + 1) * 10, dtype=np.uint32) % 250, "synthetic", 1, B, L)
    return run


def shard(n, salt):
    rng = np.random.default_rng(salt)
    return bytes(rng.integers(97, 123, n, dtype=np.uint8))


@pytest.fixture
def receiver(tmp_path):
    rec = Receiver(make_run(tmp_path))
    t = threading.Thread(target=rec.serve, args=(time.monotonic() + 60,), daemon=True)
    t.start()
    yield rec
    rec.stop()
    t.join(timeout=5)
    rec.close()


def deliver(client, key, payload, **override):
    from jaxdist.gen.channel import digest

    msg = {"t": "deliver", "key": key, "sha256": digest(payload), "n_bytes": len(payload), **override}
    return client.request(msg, payload, deadline_s=10)


def test_delivery_adds_each_shard_once_and_refuses_corruption(receiver, caplog):
    run = receiver.run_dir
    c = Client(run_token(run), "g:w0", receiver.address)
    try:
        a = deliver(c, "job:abc:4:0", shard(200, 0))
        assert a["ok"] and not a["duplicate"] and a["tokens"] == 201  # bytes + EOS
        assert deliver(c, "job:abc:4:0", shard(200, 0))["duplicate"]  # a retry after a lost acknowledgement
        assert deliver(c, "job:abc:4:9", shard(200, 0))["duplicate"]  # the same content under another task
        # corrupted in transit: the payload is not what the signed body names
        bad = deliver(c, "job:abc:4:1", shard(200, 1), sha256="0" * 64)
        assert not bad["ok"] and "corrupted" in bad["refused"]
        small = deliver(c, "job:abc:4:2", shard(10, 2))  # fewer tokens than one batch: refused with add_data's reason
        assert not small["ok"] and "fewer than one batch" in small["refused"]
        assert deliver(c, "job:abc:4:3", shard(300, 3))["ok"]
    finally:
        c.close()
    pending = Journal(run).pending()
    assert len(pending) == 2 and all(r is not None for _, r in pending)  # two additions queued, nothing else
    assert len(Ledger(run / "gen" / "ledger.jsonl").by_key) == 2
    assert sorted(p.name.split("-")[-2] for p in (run / "gen" / "shards").iterdir()) == ["0", "3"]
    s = run_status(run)
    assert s["received"] == 2 and s["adopted"] == 0 and s["pending"] == 2
    assert any("corrupted" in r.message for r in caplog.records)


def test_a_stranger_without_the_token_gets_nothing_through(receiver, caplog):
    run = receiver.run_dir
    # the wrong token: the CURVE handshake fails, the request never reaches the receiver
    stranger = Client("f" * 64, "g:w0", receiver.address)
    try:
        assert stranger.request({"t": "status"}, deadline_s=1.5, try_s=0.5) is None
    finally:
        stranger.close()
    # plain TCP (no CURVE) with the right identity: silently dropped by the handshake, nothing changes
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IDENTITY, b"g:w0")
    s.connect(f"tcp://{receiver.address}")
    s.send_multipart([b'{"t":"deliver"}', b"x", b"payload"])
    assert not s.poll(800)
    s.close(0)
    ctx.term()
    assert receiver.server.gate.refused >= 1 and "refused a connection" in caplog.text
    assert Journal(run).pending() == [] and not (run / "gen" / "ledger.jsonl").exists()
    # the right token still works, under an identity a stranger tried to take
    c = Client(run_token(run), "g:w0", receiver.address)
    try:
        assert c.request({"t": "status"}, deadline_s=10)["received"] == 0
    finally:
        c.close()


def test_signed_name_must_match_the_routing_identity(tmp_path):
    token = "a" * 64
    srv = Server(token, "srv")
    seen = []
    t = threading.Thread(
        target=lambda: [srv.serve_once(lambda *a: seen.append(a) or {"ok": True}, 0.2) for _ in range(15)],
        daemon=True,
    )
    t.start()
    c = Client(token, "g:a", srv.address)
    c.signer.sender = "g:b"  # signs as another worker
    assert c.request({"t": "x"}, deadline_s=1.0, try_s=0.5) is None and not seen
    c.close()
    t.join(timeout=10)
    srv.close()
    assert curve_keys(token, "server") != curve_keys(token, "client") != curve_keys("b" * 64, "client")


def test_ledger_skips_a_torn_line_and_appends_on_a_fresh_one(tmp_path, caplog):
    p = tmp_path / "ledger.jsonl"
    led = Ledger(p)
    led.append({"key": "a", "sha256": "1", "tokens": 3})
    p.write_bytes(p.read_bytes() + b'{"key": "b", "sha')  # a kill mid-write
    led = Ledger(p)
    assert list(led.by_key) == ["a"] and "torn" in caplog.text
    led.append({"key": "c", "sha256": "2", "tokens": 3})
    assert list(Ledger(p).by_key) == ["a", "c"]


def test_task_board_hands_out_again_what_a_dead_worker_held(tmp_path):
    samples = [f"s{i}" for i in range(7)]
    tasks = make_tasks("job", samples, 3)
    assert [t.samples for t in tasks] == [["s0", "s1", "s2"], ["s3", "s4", "s5"], ["s6"]]
    assert len({t.key for t in tasks}) == 3 and tasks[0].key.startswith("job:")
    board = TaskBoard(tasks, tmp_path / "tasks.jsonl", lease_s=60)
    a, b = board.take("g:w0"), board.take("g:w1")
    assert (a.index, b.index) == (0, 1)
    assert board.release("g:w0") == [0] and board.pending == [0, 2]
    board.finish(1, "g:w1", {"outcome": "delivered"})
    board.finish(1, "g:w1", {"outcome": "delivered"})  # reported twice: recorded once
    assert len((tmp_path / "tasks.jsonl").read_text().splitlines()) == 1
    board.running[0] = ("g:w0", time.monotonic() - 1)  # an expired lease
    assert board.take("g:w2").index == 0 and board.reassigned == 2
    again = TaskBoard(make_tasks("job", samples, 3), tmp_path / "tasks.jsonl")  # a restarted job
    assert again.pending == [0, 2] and not again.done


def test_sample_sets_and_gen_config_errors(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def f("}) + "\n" + json.dumps("x = ") + "\n\n")
    assert load_samples(tmp_path / "p.jsonl") == ["def f(", "x = "]
    (tmp_path / "p.txt").write_text("a\n\nb\n")
    assert load_samples(tmp_path / "p.txt") == ["a", "b"]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "1.py").write_text("print(1)\n")
    assert load_samples(tmp_path / "d") == ["print(1)\n"]
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n')
    with pytest.raises(ConfigError, match='no "prompt" or "text"'):
        load_samples(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="does not exist"):
        load_samples(tmp_path / "missing.txt")
    base = [f"samples={tmp_path / 'p.txt'}", "deliver_to=127.0.0.1:5601", "run=x", "function=m:f"]
    assert load_gen_config(None, base + ["workers=3", "sampler.temperature=0.5"]).workers == 3
    for bad, match in [
        (["workers=0"], "at least 1"),
        (["task_size=x"], "not a int"),
        (["sampler.nope=1"], "unknown key gen.sampler.nope"),
        (["function=sampler"], "gen.sampler.run is not set"),
        (["function=nocolon"], "module:function"),
        (["name=../x"], "plain name"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_gen_config(None, base + bad)
    with pytest.raises(ConfigError, match="not an address"):
        Client("t", "g:x", "nowhere")

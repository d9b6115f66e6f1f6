"""The generation channel and the training side's receiver, without JAX: CURVE + signatures, exactly once."""

import json
import threading
import time

import numpy as np
import pytest
import zmq

from jaxdist.config import ConfigError
from jaxdist.controller.protocol import curve_keys
from jaxdist.data import Journal, RunBatchList
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
        small = deliver(c, "job:abc:4:2", shard(10, 2))  # 11 tokens, less than one batch (33): it waits
        assert small["ok"] and not small["duplicate"]
        assert run_status(run)["waiting"] == 1 and len(Journal(run).pending()) == 1
        assert deliver(c, "job:abc:4:3", shard(300, 3))["ok"]  # with it, a batch's worth: bundled together
    finally:
        c.close()
    pending = Journal(run).pending()
    assert len(pending) == 2 and all(r is not None for _, r in pending)  # two additions queued, nothing else
    ledger = Ledger(run / "gen" / "ledger.jsonl")
    assert len(ledger.by_key) == 3 and [len(b["keys"]) for b in ledger.bundles.values()] == [1, 2]
    assert sorted(p.name.split("-")[-2] for p in (run / "gen" / "shards").iterdir()) == ["0", "2", "3"]
    s = run_status(run)
    assert (s["received"], s["waiting"], s["queued"], s["adopted"], s["bundles"]) == (3, 0, 3, 0, 2)
    # the trainer adopts both at its next step boundary
    rb = RunBatchList(run, np.arange(B * (L + 1) * 10, dtype=np.uint32) % 250, "synthetic", 1, B, L)
    rb.boundary(0)
    s = run_status(run)
    assert (s["queued"], s["adopted"]) == (0, 3) and s["behind_steps"] > 0
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


def test_a_receiver_killed_between_queueing_a_bundle_and_recording_it_adds_it_once(tmp_path, monkeypatch):
    run = make_run(tmp_path)
    rec = Receiver(run)
    real_append = Ledger.append

    def killed_at_the_bundle_record(self, r):
        if "bundle" in r:
            raise KeyboardInterrupt("killed")  # the addition is queued, its ledger line is not written
        real_append(self, r)

    monkeypatch.setattr(Ledger, "append", killed_at_the_bundle_record)
    payload = shard(100, 7)
    from jaxdist.gen.channel import digest

    msg = {"t": "deliver", "key": "j:x:1:0", "sha256": digest(payload), "n_bytes": len(payload)}
    with pytest.raises(KeyboardInterrupt):
        rec._deliver("g:w0", msg, payload)
    rec.close()
    assert len(Journal(run).pending()) == 1 and Ledger(run / "gen" / "ledger.jsonl").waiting()
    monkeypatch.setattr(Ledger, "append", real_append)
    again = Receiver(run)  # the restarted receiver bundles the waiting shard: the same tokens, already queued
    again.close()
    led = Ledger(run / "gen" / "ledger.jsonl")
    assert len(Journal(run).pending()) == 1 and not led.waiting() and len(led.bundles) == 1
    assert next(iter(led.bundles.values()))["request"] is None


def test_ssh_workers_on_two_hosts_deliver_every_task(tmp_path):
    """gen.hosts_file: one worker per host over SSH (a fake ssh that runs the command here), the token on stdin."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from controller.helpers import fake_ssh

    run = make_run(tmp_path)
    rec = Receiver(run)
    t = threading.Thread(target=rec.serve, args=(time.monotonic() + 120,), daemon=True)
    t.start()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake_ssh(bindir)
    (tmp_path / "hosts").write_text("host-a\nhost-b\n")
    (tmp_path / "p.txt").write_text("\n".join(f"sample {i}" for i in range(8)))
    env = {k: v for k, v in os.environ.items() if k != "JAXDIST_JOB_TOKEN"}
    env.update(PATH=f"{bindir}:{env['PATH']}", PYTHONPATH=str(Path(__file__).resolve().parents[2]), GENFN_SLEEP="0")
    args = [f"samples={tmp_path / 'p.txt'}", "task_size=2", "function=tests.gen.genfns:expand", "workers=1"]
    args += [f"deliver_to={rec.address}", f"run={run}", "hosts_file=hosts", f"state_dir={tmp_path / 'st'}"]
    args += [f"python={sys.executable}"]
    try:
        out = subprocess.run(
            [sys.executable, "-m", "jaxdist.cli", "gen", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        rec.stop()
        t.join(timeout=5)
        rec.close()
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    status = json.loads((tmp_path / "st" / "status.json").read_text())
    assert status["delivered"] == 4 and sorted(status["workers"]) == ["host-a-w0", "host-b-w0"], status
    assert len(Ledger(run / "gen" / "ledger.jsonl").by_key) == 4

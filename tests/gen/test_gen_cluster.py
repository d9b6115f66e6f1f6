"""End to end: 2 generation workers feed a 2-process trainer over the network, through kills on both sides.

1. The student's trainer starts (2 processes x 4 CPU devices); as soon as its
   batch list exists, its receiver (``jaxdist gen receive``) and a generation
   job (``jaxdist gen``: dispatcher + 2 workers running a deterministic
   ``module:function``) start. The trainer does not wait for them.
2. A generation worker is killed with SIGKILL while it holds a task: the task
   is handed out again.
3. The receiver is killed with SIGKILL after two shards and comes back on the
   same port (workers retry their deliveries meanwhile).
4. Once the trainer has adopted shards, both its processes are killed with
   SIGKILL; the generation job finishes meanwhile.
5. The trainer resumes and trains to the end.

Then every delivered shard is in exactly one bundle, every bundle is one
source of the batch list, and each of its batches was trained exactly once
(``jaxdist data verify``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from data.test_batchlist_kills import Attempt, _env

from jaxdist.config import DataConfig
from jaxdist.controller.ports import free_port
from jaxdist.data import check_exactly_once, load_source, trained_batches
from jaxdist.data.batchlist import parse_id, unpack_ids
from jaxdist.data.journal import Journal
from jaxdist.gen.delivery import Ledger

from .genfns import SHARD_BYTES

REPO = Path(__file__).resolve().parents[2]
B, L, MAX_BYTES = 8, 32, 12_000
TASKS, TASK_SIZE = 8, 2
TIMEOUT = 180


def _wait(cond, what, timeout=TIMEOUT, procs=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        for p in procs:
            assert p.poll() is None, f"{what}: process {p.args[:4]} exited with {p.returncode}"
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout} s")


def _status(state: Path) -> dict:
    try:
        return json.loads((state / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def test_generation_workers_feed_the_trainer_exactly_once_through_kills(tmp_path):
    base = (len(load_source(DataConfig(max_bytes=MAX_BYTES)).train) - 1) // L // B
    per_shard = SHARD_BYTES // L // B + 1  # at most, in batches: a shard of SHARD_BYTES bytes + EOS, bundled
    steps = 2 * base + TASKS * per_shard  # room for a second epoch if the first is spent before shards arrive
    common = [
        "model=tiny",
        f"train.steps={steps}",
        f"train.seq_len={L}",
        f"train.batch_size={B}",
        f"data.max_bytes={MAX_BYTES}",
        "train.progress=false",
        "train.tensorboard=false",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "checkpoint.every=4",
        "train.runs_dir=runs",
        "train.name=student",
        "mesh.cluster=cpu-2x4",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
    ]
    run = tmp_path / "runs" / "student"

    def trainer(tag):
        port = free_port()
        jobs = [
            (
                [],
                _env(
                    JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                    JAX_NUM_PROCESSES="2",
                    JAX_PROCESS_ID=str(i),
                    JAXDIST_HEARTBEAT_TIMEOUT="10",
                ),
            )
            for i in range(2)
        ]
        return Attempt(tmp_path, run, tag, jobs, common)

    env = {**_env(), "PYTHONPATH": str(REPO), "GENFN_SLEEP": "1.5"}
    recv_port = free_port()

    def receiver(tag):
        log = open(tmp_path / f"receiver.{tag}.log", "w")
        return subprocess.Popen(
            [sys.executable, "-m", "jaxdist.cli", "gen", "receive", str(run), "--port", str(recv_port)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    (tmp_path / "prompts.txt").write_text("\n".join(f"sample {i}: def f{i}(x): return x * {i}" for i in range(16)))
    state = tmp_path / "gen-state"
    gen_args = [
        f"samples={tmp_path / 'prompts.txt'}",
        f"task_size={TASK_SIZE}",
        "function=tests.gen.genfns:expand",
        "workers=2",
        f"deliver_to=127.0.0.1:{recv_port}",
        f"run={run}",
        f"state_dir={state}",
        "name=student-feed",
    ]
    procs = []
    try:
        a = trainer("a")
        _wait(lambda: (run / "batchlist").is_dir(), "batch list", procs=a.procs)
        rec = receiver("1")
        procs.append(rec)
        _wait(lambda: (run / "gen" / "receiver.json").exists(), "receiver", procs=[rec])
        gen_log = open(tmp_path / "gen.log", "w")
        gen = subprocess.Popen(
            [sys.executable, "-m", "jaxdist.cli", "gen", *gen_args],
            cwd=tmp_path,
            env=env,
            stdout=gen_log,
            stderr=subprocess.STDOUT,
        )
        procs.append(gen)

        # a worker killed while it holds a task: the task goes to another worker
        s = _wait(lambda: (st := _status(state)) and st["running"] >= 2 and st, "two tasks running", procs=[gen])
        os.kill(int(s["workers"]["w0"]["pid"]), signal.SIGKILL)

        # the receiver killed while deliveries go on: workers retry until it is back on the same port
        ledger = run / "gen" / "ledger.jsonl"
        _wait(lambda: ledger.exists() and len(Ledger(ledger).by_key) >= 2, "two shards received", procs=[gen, rec])
        rec.send_signal(signal.SIGKILL)
        rec.wait(timeout=30)
        received_before = len(Ledger(ledger).by_key)
        time.sleep(1.0)
        rec = receiver("2")
        procs.append(rec)

        # the trainer adopts shards at its step boundaries while generation goes on; then it is killed
        a.wait_for(lambda r: bool(r) and r[-1].get("batch_version", 1) >= 2, "an addition adopted")
        a.kill()
        assert gen.wait(timeout=TIMEOUT) == 0, (tmp_path / "gen.log").read_text()[-3000:]
        final = _status(state)
        assert final["delivered"] == TASKS and final["refused"] == 0 and final["reassigned"] >= 1, final
        status = subprocess.run(
            [sys.executable, "-m", "jaxdist.cli", "gen", "status", *gen_args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0 and f"{TASKS} delivered" in status.stdout, status.stdout + status.stderr
        print(f"\n{status.stdout}received before the receiver was killed: {received_before} of {TASKS}")

        b = trainer("b")
        b.finish()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)

    # every delivered shard is in exactly one bundle, every bundle one source of the batch list, and each
    # bundle's batches were trained exactly once
    ledger = Ledger(run / "gen" / "ledger.jsonl")
    assert len(ledger.by_key) == TASKS and sorted(ledger.bundle_of) == sorted(ledger.by_key)
    bl = Journal(run).load()
    by_fp = {s.fingerprint: s for s in bl.sources}
    bundles = list(ledger.bundles.values())
    assert all(b["fingerprint"] in by_fp for b in bundles) and len(bl.sources) == len(bundles) + 1
    report = check_exactly_once(run)
    assert report["ok"], report
    trained = np.array([parse_id(r["batch_id"]) for r in trained_batches(run)])
    src, epoch, _ = unpack_ids(trained)
    for b in bundles:
        source = by_fp[b["fingerprint"]]
        assert int(np.sum((src == source.id) & (epoch == 0))) == source.batches_per_epoch(B, L) > 0, b
    verify = subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", "data", "verify", str(run)], capture_output=True, text=True, timeout=60
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr

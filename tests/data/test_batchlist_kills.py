"""Exactly once through random SIGKILLs, a data-parallel resize, a process-count change and an online addition.

Real ``jaxdist train`` processes (tiny model, 8 simulated CPU devices) train
one run in four attempts; the first three are killed with SIGKILL at steps
drawn from a seeded RNG (the checkpoints are asynchronous, so kills also land
mid-save), each next attempt resumes from the newest committed checkpoint:

1. 1 process, mesh data=8;
2. 1 process, data=4 x tensor=2 (data-parallel size 8 -> 4); while it trains,
   ``add_data`` queues a new text file, which it must adopt at a step boundary;
3. 2 processes x 4 devices (data=2 x fsdp=2 x tensor=2, data across processes);
4. 1 process, data=8, to the end: ``train.steps`` equals the final list length.

Then, from ``metrics.jsonl`` (the lineage of the final state) against the
journal: every batch id trained exactly once, none missing, in the order that
replaying the journal's operations rebuilds.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxdist.cluster import without_device_count
from jaxdist.config import DataConfig
from jaxdist.controller.ports import free_port
from jaxdist.data import (
    add_data,
    check_exactly_once,
    digest_problems,
    format_id,
    load_source,
    replay_order,
    trained_batches,
)
from jaxdist.data.audit import verify
from jaxdist.data.batchlist import unpack_ids
from jaxdist.data.journal import Journal

SEED = 2024
B, L, MAX_BYTES = 16, 64, 60_000
NEW_BATCHES = 20
SEGMENT_TIMEOUT = 150  # seconds per attempt; a healthy one takes ~10-30 s on 2 busy cores
_DROP = ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXDIST_HEARTBEAT_TIMEOUT")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith("SLURM_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)
    env.setdefault("XLA_FLAGS", without_device_count(os.environ["XLA_FLAGS"]))  # conftest's compile flags
    return env


class Attempt:
    """One training attempt (one or more processes) whose progress is read from the run's metrics.jsonl."""

    def __init__(self, cwd: Path, run: Path, tag: str, jobs: list[tuple[list[str], dict[str, str]]], common):
        self.run, self.tag = run, tag
        self.offset = (run / "metrics.jsonl").stat().st_size if (run / "metrics.jsonl").exists() else 0
        self.logs = [cwd / f"{tag}.{i}.log" for i in range(len(jobs))]
        self.procs = []
        for (overrides, env), log in zip(jobs, self.logs):
            with open(log, "w") as f:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "jaxdist.cli", "train", *common, *overrides],
                        cwd=cwd,
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )
        self.deadline = time.monotonic() + SEGMENT_TIMEOUT
        self.t0 = time.monotonic()

    def records(self) -> list[dict]:
        path = self.run / "metrics.jsonl"
        if not path.exists():
            return []
        with open(path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        lines = data.split(b"\n")[:-1]  # complete lines only
        rows = [json.loads(l) for l in lines if l.strip()]
        return [r for r in rows if r.get("kind") == "train"]

    def wait_for(self, cond, what: str) -> list[dict]:
        while True:
            rows = self.records()
            if cond(rows):
                return rows
            if any(p.poll() is not None for p in self.procs):
                self.kill()
                pytest.fail(f"{self.tag} exited before {what}; its log ends:\n{self.tail()}")
            if time.monotonic() > self.deadline:
                self.kill()
                pytest.fail(f"{self.tag}: no {what} within {SEGMENT_TIMEOUT} s; its log ends:\n{self.tail()}")
            time.sleep(0.02)

    def kill(self) -> None:
        print(f"{self.tag}: {time.monotonic() - self.t0:.1f} s")
        for p in self.procs:
            if p.poll() is None:
                p.kill()  # SIGKILL: no cleanup, no final checkpoint
        for p in self.procs:
            p.wait(timeout=30)

    def finish(self) -> None:
        for p in self.procs:
            try:
                rc = p.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"{self.tag} still running after {SEGMENT_TIMEOUT} s; its log ends:\n{self.tail()}")
            assert rc == 0, f"{self.tag} exited with {rc}; its log ends:\n{self.tail()}"

    def tail(self, n: int = 20) -> str:
        lines = [
            l
            for l in self.logs[0].read_text(errors="replace").splitlines()
            if "Involuntary full rematerialization" not in l and "[Gloo]" not in l
        ]
        return "\n".join(lines[-n:])

    def log_text(self) -> str:
        return self.logs[0].read_text(errors="replace")


def test_every_batch_exactly_once_through_kills_resizes_and_an_addition(tmp_path):
    rng = random.Random(SEED)
    base = (len(load_source(DataConfig(max_bytes=MAX_BYTES)).train) - 1) // L // B
    steps = base + NEW_BATCHES
    new = tmp_path / "added.txt"
    new.write_bytes(bytes(np.random.default_rng(SEED).integers(97, 123, NEW_BATCHES * B * L, dtype=np.uint8)))
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
        "checkpoint.every=3",
        "train.runs_dir=runs",
        "train.name=kills",
    ]
    run = tmp_path / "runs" / "kills"
    single = lambda *mesh: [(["mesh.cluster=cpu-8", *mesh], _env())]
    kills = []

    # 1. data=8, killed at a random step.
    a = Attempt(tmp_path, run, "a", single("mesh.data=8"), common)
    target = rng.randint(4, 12)
    rows = a.wait_for(lambda r: r and r[-1]["step"] >= target, f"step {target}")
    a.kill()
    kills.append(rows[-1]["step"])

    # 2. data=4 x tensor=2; data added while it trains, adopted without a restart; killed after it.
    b = Attempt(tmp_path, run, "b", single("mesh.data=4", "mesh.tensor=2"), common)
    b.wait_for(lambda r: len(r) >= 2, "two steps")
    req = add_data(run, [new], seed=rng.randrange(2**31))
    rows = b.wait_for(lambda r: r[-1].get("batch_version") == 2, "the addition adopted")
    adopted_at = next(r["step"] for r in rows if r["batch_version"] == 2)
    target = adopted_at + rng.randint(1, 8)
    rows = b.wait_for(lambda r: r[-1]["step"] >= target, f"step {target}")
    b.kill()
    kills.append(rows[-1]["step"])
    assert [r["batch_version"] for r in rows] == sorted(r["batch_version"] for r in rows)  # 1 ... 1 2 ... 2

    # 3. Two processes of 4 devices: the data axis now crosses processes.
    port = free_port()
    c = Attempt(
        tmp_path,
        run,
        "c",
        [
            (
                ["mesh.cluster=cpu-2x4", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
                _env(
                    JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                    JAX_NUM_PROCESSES="2",
                    JAX_PROCESS_ID=str(i),
                    JAXDIST_HEARTBEAT_TIMEOUT="10",
                ),
            )
            for i in range(2)
        ],
        common,
    )
    rows = c.wait_for(lambda r: bool(r), "a first step")
    target = rows[0]["step"] + rng.randint(2, 8)
    rows = c.wait_for(lambda r: r[-1]["step"] >= target, f"step {target}")
    c.kill()
    kills.append(rows[-1]["step"])

    # 4. Back to one process, data=8, to the end.
    d = Attempt(tmp_path, run, "d", single("mesh.data=8"), common)
    d.finish()
    for attempt in (b, c, d):
        assert "resuming at step" in attempt.log_text()

    # The addition: one new version, spliced at the cursor of the step boundary where attempt b adopted it.
    journal = Journal(run)
    assert journal.versions() == [1, 2]
    v2 = journal.load(2)
    assert v2.op["request"] == req["request"] and v2.op["splice"] == adopted_at - 1
    assert len(v2) == steps and int(np.sum(unpack_ids(v2.order)[0] == 1)) == NEW_BATCHES

    # Exactly once, from the training log against the journal.
    report = check_exactly_once(run)
    print(
        f"\nkilled after steps {kills} (base {base} + {NEW_BATCHES} added batches, addition adopted at step "
        f"{adopted_at}): {report}"
    )
    assert report == {
        "trained": steps,
        "duplicates": 0,
        "missing": 0,
        "misplaced": 0,
        "gaps": 0,
        "unused": 0,
        "version": 2,
        "ok": True,
    }
    # The tokens: each step's digest of the batch it trained (on one process or two) is the one its logged id
    # names, recomputed from the configured data and the added file, not from the trainer's own claim.
    assert digest_problems(run, load_source(DataConfig(max_bytes=MAX_BYTES)).train) == []
    # Replay: the journal's operations alone rebuild the trained sequence, id for id.
    assert [format_id(x) for x in replay_order(journal)] == [r["batch_id"] for r in trained_batches(run)]
    ok, lines = verify(run, full=True)
    assert ok, lines

"""Every process's train step issues the same collectives, or the job refuses to start (jaxdist.parallel.consistency).

Two processes with the same plan start and train: tests/train/test_multiprocess.py (every 2-process run passes this
check; the slow test that repeated it here was removed, issue 42).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxdist.cluster import without_device_count
from jaxdist.config import ConfigError
from jaxdist.controller.ports import free_port
from jaxdist.parallel.consistency import check_same_collectives, collective_sequence, first_difference

HLO = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  p = (s32[], f32[8]{0}) parameter(0)
  x = f32[8]{0} get-tuple-element(p), index=1
  ar = f32[8]{0} all-reduce(x), replica_groups={{0,1},{2,3}}, to_apply=add
  i = s32[] get-tuple-element(p), index=0
  ROOT t = (s32[], f32[8]{0}) tuple(i, ar)
}

ENTRY %main (a: f32[16]) -> f32[16] {
  a = f32[16]{0} parameter(0)
  rs = f32[8]{0} reduce-scatter(a), replica_groups=[2,2]<=[4], dimensions={0}, to_apply=add
  w = (s32[], f32[8]{0}) while(z), condition=cond, body=body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT ag = f32[16]{0} all-gather(rs), replica_groups={{0,2},{1,3}}, dimensions={0}
}
"""


def test_sequence_and_first_difference():
    seq = collective_sequence(HLO)
    assert seq == [
        "reduce-scatter replica_groups=[2,2]<=[4] bytes=64 x1",
        "all-reduce replica_groups={{0,1},{2,3}} bytes=32 x3",
        "all-gather replica_groups={{0,2},{1,3}} bytes=64 x1",
    ]
    other = HLO.replace("{{0,1},{2,3}}", "{{0,2},{1,3}}")
    msg = first_difference(seq, collective_sequence(other), 0, 1)
    assert msg.startswith("collective #1 of the train step is 'all-reduce replica_groups={{0,1},{2,3}}")
    assert "in process 1" in msg
    assert "the first extra one is #3" in first_difference(seq + ["x"], seq, 0, 1)
    assert first_difference(seq, list(seq), 0, 1) is None
    # Over a store shared by two "processes": equal passes, a difference raises in both.
    store: dict[str, str] = {}
    args = (store.__setitem__, lambda k, ms: store[k])
    digest = None
    for n in (0, 1):  # two checks (two fits): each round has its own keys, none is overwritten
        with pytest.raises(KeyError):  # process 1 publishes its list, then finds process 0's missing (a plain dict)
            check_same_collectives(HLO, 1, 2, *args, tag="a")
        digest = check_same_collectives(HLO, 0, 2, *args, tag="a")  # process 0 finds process 1's: equal
        assert json.loads(store[f"jaxdist/collectives/a/{n}/1"])["hash"] == digest
    assert {k for k in store if k.startswith("jaxdist/collectives/a/")} == {
        f"jaxdist/collectives/a/{n}/{p}" for n in (0, 1) for p in (0, 1)
    }
    with pytest.raises(KeyError):
        check_same_collectives(other, 1, 2, *args, tag="b")
    with pytest.raises(ConfigError, match=r"compiled different train steps, .*: collective #1 .* in process 1"):
        check_same_collectives(HLO, 0, 2, *args, tag="b")  # process 0 refuses, naming the first difference
    with pytest.raises(KeyError):
        check_same_collectives(HLO, 0, 2, *args, tag="c")
    with pytest.raises(ConfigError, match=r"compiled different train steps, .*: collective #1 .* in process 1"):
        check_same_collectives(other, 1, 2, *args, tag="c")  # and so does process 1, the same sentence


# --------------------------------------------------------------------------- two processes


RUN_TIMEOUT = 240  # seconds for each group of two processes; a healthy group takes ~20 s on a quiet machine
COMMON = [
    "model=tiny",
    "train.steps=1",
    "train.seq_len=16",
    "train.batch_size=8",
    "data.max_bytes=100000",
    "train.progress=false",
    "train.tensorboard=false",
    "train.eval_every=0",
    "train.eval_batches=1",
    "checkpoint.enabled=false",
    "mesh.cluster=cpu-2x4",
    "mesh.data=8",
    "train.grad_sync=per_block",
    "train.runs_dir=runs",
]
_DROP = ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXDIST_HEARTBEAT_TIMEOUT")


def _group(cwd: Path, name: str, per_process: list[list[str]]) -> list[tuple[int, str]]:
    """Run ``jaxdist train`` as 2 processes (extra overrides each), bounded; (exit code, log) of each."""
    port = free_port()
    procs = []
    try:
        for i, extra in enumerate(per_process):
            env = {k: v for k, v in os.environ.items() if k not in _DROP}
            env["XLA_FLAGS"] = without_device_count(os.environ["XLA_FLAGS"])  # conftest's compile flags
            env.update(
                JAX_PLATFORMS="cpu",
                JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                JAX_NUM_PROCESSES="2",
                JAX_PROCESS_ID=str(i),
                JAXDIST_HEARTBEAT_TIMEOUT="10",
            )
            log = cwd / f"{name}.{i}.log"
            with open(log, "w") as f:
                cmd = [sys.executable, "-m", "jaxdist.cli", "train", *COMMON, f"train.name={name}", *extra]
                procs.append((subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + RUN_TIMEOUT
        out = []
        for p, log in procs:
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{log.name} still running after {RUN_TIMEOUT} s:\n{log.read_text()[-3000:]}")
            out.append((rc, log.read_text(errors="replace")))
        return out
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_two_processes_with_different_plans_are_refused_before_the_first_step(tmp_path):
    # tiny: 2 layers of 121,984 B; the default threshold (8 MB) buckets both, 1 byte gives one bucket per layer.
    refused = _group(tmp_path, "differ", [[], ["train.grad_bucket_bytes=1"]])
    for rc, log in refused:
        assert rc == 2, log[-3000:]
        assert "compiled different train steps" in log and "collective #" in log, log[-3000:]
        metrics = tmp_path / "runs" / "differ" / "metrics.jsonl"
        assert not metrics.exists() or '"train"' not in metrics.read_text()  # no step ran

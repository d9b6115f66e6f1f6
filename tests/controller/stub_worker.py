"""A JAX-free stand-in for ``jaxdist train`` that behaves like a worker group (controller tests).

Run by node agents through ``controller.worker_command="{python} .../stub_worker.py"``
with the job's config arguments.  It uses the real worker agent (heartbeats,
warm-up, assignment), then "trains": every rank waits for all ranks at each
step (a file barrier, so a dead or stopped peer makes the others hang, as a
JAX collective does), the state is a hash chain over the batches
(``state = sha256(state | "batch-<i>")``), and rank 0 checkpoints it every
step under ``checkpoints/<step>/`` with a ``jaxdist_commit.json`` marker.  A
restarted group resumes from the newest committed step, so a batch skipped or
repeated changes the final hash.

Environment: ``JAXDIST_STUB_STEP_S`` (seconds per step, default 0.05),
``JAXDIST_STUB_WARM_S`` (seconds of warm-up, default 0.2),
``JAXDIST_STUB_SLOW_FROM`` / ``JAXDIST_STUB_SLOW_S`` (from that step on, each
step takes that long: a slow cluster), ``JAXDIST_STUB_HANG_AT`` (the first
group to reach that step stops stepping but keeps heartbeating: a deadlock),
``JAXDIST_STUB_NONSENSE_AT`` (rank 0 exits with code 2 at that step, as a
worker does whose run can only produce nonsense, e.g. a NaN loss),
``JAXDIST_STUB_DATA_DELAY=RANK:S`` (that rank waits S seconds for each batch:
a slow input pipeline; ``NODE:S``: the rank on that node), ``JAXDIST_STUB_STUCK=RANK:STEP`` (that rank stops
before that step, still heartbeating, while the others wait: a stuck rank).  Once the file ``stub/hurry``
exists in the run directory (:func:`hurry`), a step no longer sleeps its ``JAXDIST_STUB_STEP_S``: a test
paces the job until it has done what it came to do, then lets it finish.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from jaxdist.config import load_config
from jaxdist.controller.agent import agent_from_env, record_step
from jaxdist.train.efficiency import LoopClock

GENESIS = "genesis"


def advance(state: str, step: int) -> str:
    """The state after training step ``step`` (1-based) on batch ``step - 1``."""
    return hashlib.sha256(f"{state}|batch-{step - 1}".encode()).hexdigest()


def expected_final(steps: int) -> str:
    state = GENESIS
    for s in range(1, steps + 1):
        state = advance(state, s)
    return state


def _latest(ckpt: Path) -> tuple[int, str]:
    steps = sorted(int(p.parent.name) for p in ckpt.glob("*/jaxdist_commit.json"))
    if not steps:
        return 0, GENESIS
    return steps[-1], json.loads((ckpt / str(steps[-1]) / "state.json").read_text())["state"]


def hurry(run_dir: Path) -> None:
    """From now on the job's steps take no time (``JAXDIST_STUB_STEP_S`` no longer applies)."""
    (run_dir / "stub").mkdir(parents=True, exist_ok=True)
    (run_dir / "stub" / "hurry").touch()


def _barrier(d: Path, step: int, rank: int, n: int) -> None:
    (d / f"{step}.{rank}").touch()
    while not all((d / f"{step}.{r}").exists() for r in range(n)):
        time.sleep(0.003)


def _rank_value(spec: str | None, rank: int) -> float | None:
    """``"RANK:VALUE"`` -> VALUE for that rank, ``"NODE:VALUE"`` -> VALUE on that node, else None."""
    if not spec:
        return None
    r, value = spec.rsplit(":", 1)
    mine = int(r) == rank if r.isdigit() else r == os.environ.get("JAXDIST_NODE")
    return float(value) if mine else None


def main(argv: list[str]) -> int:
    path = argv[argv.index("--config") + 1] if "--config" in argv else None
    overrides = [a for i, a in enumerate(argv) if a != "--config" and (i == 0 or argv[i - 1] != "--config")]
    cfg = load_config(path, overrides)
    agent = agent_from_env()
    assert agent is not None, "the stub worker runs under a node agent"
    a = agent.wait_for_rank(warm=lambda: time.sleep(float(os.environ.get("JAXDIST_STUB_WARM_S", "0.2"))))
    rank, n = a.rank, a.num_processes
    run = cfg.run_dir
    ckpt = run / "checkpoints"
    group = run / "stub" / f"gen{a.generation}"
    group.mkdir(parents=True, exist_ok=True)
    agent.update(state="restoring", mesh_device_order=list(range(n)))
    start, state = _latest(ckpt)
    _barrier(group, -1, rank, n)  # like jax.distributed.initialize: everyone is there
    step_s = float(os.environ.get("JAXDIST_STUB_STEP_S", "0.05"))
    slow_from = int(os.environ.get("JAXDIST_STUB_SLOW_FROM", "0")) or None
    hang_at = int(os.environ.get("JAXDIST_STUB_HANG_AT", "0")) or None
    nonsense_at = int(os.environ.get("JAXDIST_STUB_NONSENSE_AT", "0")) or None
    # The loop's parts as a Trainer books them (jaxdist.train.efficiency: JAX-free): the sleep is the step's
    # compute ("dispatch"), the barrier the collective ("blocked"), rank 0's files the checkpoint.
    clock = LoopClock(cfg.train.batch_size // n, start + 1)
    agent.watch_loop(clock)
    slow_data = _rank_value(os.environ.get("JAXDIST_STUB_DATA_DELAY"), rank)  # this rank waits for its batches
    stuck_at = _rank_value(os.environ.get("JAXDIST_STUB_STUCK"), rank)  # this rank stops in "data", heartbeating
    for step in range(start + 1, cfg.train.steps + 1):
        t0 = time.perf_counter()
        clock.enter("data")
        if slow_data:
            time.sleep(slow_data)
        if stuck_at and step == int(stuck_at) and not (run / "stub" / "stuck").exists():
            (run / "stub" / "stuck").touch()
            time.sleep(3600)
        clock.enter("dispatch")
        if step == nonsense_at and rank == 0:
            print(f"jaxdist: the loss at step {step} is not finite: stopping (exit 2).", file=sys.stderr)
            return 2
        if step == hang_at and not (run / "stub" / "hung").exists():
            time.sleep(0.5)
            (run / "stub" / "hung").touch()
            time.sleep(3600)
        slow = slow_from is not None and step >= slow_from
        if slow or not (run / "stub" / "hurry").exists():
            time.sleep(float(os.environ.get("JAXDIST_STUB_SLOW_S", "0.3")) if slow else step_s)
        state = advance(state, step)
        clock.enter("blocked", step)
        _barrier(group, step, rank, n)
        clock.add_window(1, time.perf_counter() - t0)
        clock.enter("checkpoint")
        if rank == 0:
            # Recorded as trained before its commit marker, as the Trainer does (its save commits later): a kill
            # between the two then shows as a recomputed step, never as a committed step no generation trained.
            record_step(run, a.generation, step, None)
            d = ckpt / str(step)
            d.mkdir(parents=True, exist_ok=True)
            (d / "state.json").write_text(json.dumps({"step": step, "state": state}))
            (d / "jaxdist_commit.json").write_text("{}")
            for old in ckpt.glob("*"):
                if old.name.isdigit() and int(old.name) < step - 3:
                    shutil.rmtree(old, ignore_errors=True)
        clock.enter("callbacks")
        dt = time.perf_counter() - t0
        agent.on_step(None, step, {"tokens_per_s": 1000.0 / dt, "step_time": dt})
        if cfg.controller.health_every and step - clock.first_step + 1 >= cfg.controller.health_every:
            agent.close_period(clock, step)
    if rank == 0:
        (run / "stub" / "final.json").write_text(json.dumps({"step": cfg.train.steps, "state": state}))
    agent.finished()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

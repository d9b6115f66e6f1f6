"""Fault injection with real JAX workers: 4 processes x 2 CPU devices plus 1 warm standby.

Two jobs of the same cluster setup run one after the other under the controller:

* ``ref``: uninterrupted (and cold: it builds the setup cache entry and fills
  the compilation cache);
* ``faulty``: the same job resubmitted (it finds the cached setup), with 4
  injections, each of a random rank (the first is rank 0) at a random step: a
  SIGKILL (a crash) or a SIGSTOP (a hang, found by the heartbeat timeout).
  After the third recovery the controller itself is killed and restarted; the
  job trains on meanwhile, and the last failure is handled by the new controller.

Both save to the fast node-local tier every step (``local/<node>/``) and to
the run directory every 8 steps: a failed rank's new node has no local files
and gets its shards back from the node holding their replica.

The faulty job's final parameters must equal the reference's bit for bit, its
per-step losses too (every generation's, the recomputed steps included), and
its generations must together have trained each batch exactly once.

Settings other than the defaults, and why: ``train.log_every=1`` (every step's
loss is logged and compared, the default logs every 10th); ``checkpoint.every=8``
(persistent saves within the 80 steps); ``checkpoint.local_dir=local/{node}``
(the default ``auto`` tier, in the test's own directory so that it can look at
the files); ``controller.crashed_rank=standby`` (the point: each killed process
stands for a lost node, so that a standby takes the rank); the failure limits
raised so that 6 failures over 5 nodes ban none (banning is tested with stub
jobs, and the defaults' chaos run is benchmarks/chaos.py).
"""

from __future__ import annotations

import random
import signal
import time

import numpy as np
import pytest

from jaxdist.config import DataConfig
from jaxdist.controller.local import LocalJob
from jaxdist.controller.policy import lineage
from jaxdist.controller.state import read_events
from jaxdist.controller.timeline import generations_trained
from jaxdist.data import digest_problems, load_source

from .helpers import listening

# At most ~5 steps per injection, and the steps the job trains while the controller is away (killed, restarted,
# attached): ~10 on a quiet host, 27 once beside another test (two processes).
STEPS = 64
# Both signals (the seed's plan: rank 0 SIGKILL, rank 3 SIGKILL, rank 2 SIGSTOP, rank 0 SIGSTOP), rank 0 first, the
# controller killed after the third recovery: the fourth failure is the new controller's.  6 before: each
# injection is a generation of 4 restarted processes, and the fifth and sixth showed nothing these four do not.
INJECTIONS = 4
COMMON = [
    "model=tiny",
    "mesh.cluster=cpu-4x2",
    "mesh.fsdp=2",
    "train.batch_size=16",
    "train.seq_len=32",
    "data.max_bytes=300000",
    "train.progress=false",
    "train.tensorboard=false",
    "checkpoint.every=8",
    "checkpoint.local_dir=local/{node}",
    "checkpoint.local_every=1",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.runs_dir=runs",
    "controller.min_nodes=4",
    "controller.max_nodes=4",
]
JOB_TIMEOUT = 600


def _events(job: LocalJob, kind: str) -> list[dict]:
    return [e for e in job.events() if e["event"] == kind]


def _segments(job: LocalJob) -> list[list[tuple[int, float]]]:
    """Per generation (in order), the (step, loss) its process 0 trained."""
    return list(generations_trained(job.run_dir).values())


def _injection_plan(rng: random.Random, n: int) -> list[tuple[int, int]]:
    """(rank, signal) of ``n`` injections: rank 0 killed first, then random ranks, about one in three a hang."""
    return [(0, signal.SIGKILL)] + [
        (rng.randint(0, 3), signal.SIGSTOP if rng.random() < 0.35 else signal.SIGKILL) for _ in range(n - 1)
    ]


def _run_faulty(
    job: LocalJob, injections: list[tuple[int, int]], rng: random.Random, kill_controller_after: int | None = None
) -> list[dict]:
    """Start the job (the standby a moment later, so the cached layout is reused) and inject (rank, signal)s.

    Each injection comes 1 or 2 steps after the previous recovery's first step, once every node is warm
    again (the standby and the members' spare processes) -- or 3 steps later if they are not: a failure
    may find a spare process still importing JAX, and must be handled all the same.
    """
    job.start(late=1, timeout=JOB_TIMEOUT)
    s = job.wait_until(lambda s: s["phase"] == "running", JOB_TIMEOUT, "generation 0 running")
    job.listening = {pid: listening(pid) for pid in s["pids"].values()}  # what the workers listen on
    done = []
    for k, (rank, sig) in enumerate(injections):
        gen = len(done)
        base = job.wait_until(
            lambda s, gen=gen: s["generation"] == gen and s["phase"] == "running",
            JOB_TIMEOUT,
            f"generation {gen} running",
        )["last_step"]
        target = base + rng.randint(1, 2)
        job.wait_until(
            lambda s, target=target: s["last_step"] >= target or s["phase"] != "running", JOB_TIMEOUT, f"step {target}"
        )
        job.wait_until(
            lambda s, target=target: (
                len(s["warm_nodes"]) >= 5 - len(s["banned"]) or s["last_step"] >= target + 3 or s["phase"] != "running"
            ),
            JOB_TIMEOUT,
            "every node warm",
        )
        s = job.state()
        assert s["phase"] == "running" and s["last_step"] < job.cfg.train.steps, (
            f"the job ended before injection {k + 1} of {len(injections)}: raise STEPS ({job.summary()})"
        )
        done.append(job.inject(rank, sig))
        if kill_controller_after == k:
            job.wait_until(
                lambda s, gen=gen: s["generation"] == gen + 1 and s["phase"] == "running",
                JOB_TIMEOUT,
                "the recovery",
            )
            job.kill_controller()
            time.sleep(2.0)
            job.start_controller()
    assert job.wait(JOB_TIMEOUT) == 0, job.summary()
    return done


def _params(run_dir, step):
    import jax

    from jaxdist.checkpoint import RunCheckpointer
    from jaxdist.config import load_config
    from jaxdist.train.trainer import Trainer

    cfg = load_config(
        None,
        [o for o in COMMON if not o.startswith(("checkpoint.", "controller."))]
        + ["checkpoint.enabled=false", "mesh.cluster=cpu-8", f"train.runs_dir={run_dir}/x"],
    )
    with Trainer(cfg) as t:
        target = t.abstract_state()
    state, meta = RunCheckpointer(run_dir / "checkpoints").restore(target, step)
    return jax.device_get(state["params"]), meta


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("faults")
    rng = random.Random(9)
    ref = LocalJob([*COMMON, f"train.steps={STEPS}", "train.name=ref", "controller.standbys=0"], nodes=4, cwd=cwd)
    try:
        ref.start()
        assert ref.wait(JOB_TIMEOUT) == 0, ref.summary()
    finally:
        ref.close()
    # 6 failures over 5 nodes: no node is banned here (banning is tested with stub workers)
    faulty = LocalJob(
        [
            *COMMON,
            f"train.steps={STEPS}",
            "train.name=faulty",
            f"controller.max_failures={INJECTIONS + 1}",
            f"controller.max_process_failures={INJECTIONS + 1}",
            "controller.crashed_rank=standby",  # each killed process stands for a lost node: a standby takes it
        ],
        nodes=5,
        cwd=cwd,
    )
    try:
        injections = _run_faulty(faulty, _injection_plan(rng, INJECTIONS), rng, kill_controller_after=2)
    finally:
        faulty.close()
    return {"ref": ref, "faulty": faulty, "injections": injections}


def test_final_parameters_are_bit_identical_to_the_uninterrupted_run(jobs):
    ref, faulty = jobs["ref"], jobs["faulty"]
    want, meta_ref = _params(ref.run_dir, STEPS)
    got, meta = _params(faulty.run_dir, STEPS)
    assert meta["data"]["position"] == meta_ref["data"]["position"] == STEPS
    import jax

    leaves = jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), got, want))
    assert leaves and all(leaves), "final parameters differ from the uninterrupted run"


def test_every_batch_trained_once_with_the_reference_losses(jobs):
    ref_segs, segs = _segments(jobs["ref"]), _segments(jobs["faulty"])
    why = [(e["gen"], e["detail"]) for e in _events(jobs["ref"], "failure")]  # a false alarm says which
    assert len(ref_segs) == 1 and [s for s, _ in ref_segs[0]] == list(range(1, STEPS + 1)), why
    reference = dict(ref_segs[0])
    assert len(segs) == INJECTIONS + 1, [[s for s, _ in g] for g in segs]  # one generation more than failures
    assert lineage([(g[0][0] - 1, g[-1][0]) for g in segs], STEPS) == list(range(STEPS))
    firsts = _events(jobs["faulty"], "first_step")
    assert [e["resume_step"] for e in firsts] == [g[0][0] - 1 for g in segs]
    # every recovery restored from the fast local tier (a failed rank's shards from its peer's node)
    assert [e["resumed_from"] for e in firsts] == ["init"] + ["local"] * INJECTIONS
    for g in segs:  # every step each generation trained, the recomputed ones too, has the reference loss
        for step, loss in g:
            assert loss == reference[step], (step, loss, reference[step])
    # each step's tokens (the digest the step took of its input, across 4 processes) are the ones its logged
    # batch id names, read again from the data
    assert digest_problems(jobs["faulty"].run_dir, load_source(DataConfig(max_bytes=300000)).train) == []


def test_failures_are_detected_and_a_standby_takes_the_rank(jobs):
    faulty, inj = jobs["faulty"], jobs["injections"]
    failures = _events(faulty, "failure")
    kinds = {"SIGKILL": ["exit"], "SIGSTOP": ["silent"]}
    assert len(inj) == INJECTIONS and {i["signal"] for i in inj} == {"SIGKILL", "SIGSTOP"}
    assert [f["kinds"] for f in failures] == [kinds[i["signal"]] for i in inj], [f["detail"] for f in failures]
    assert [f["ranks"] for f in failures] == [[i["rank"]] for i in inj]
    detect = [f["time"] - i["time"] for f, i in zip(failures, inj)]
    firsts = _events(faulty, "first_step")[1:]
    to_step = [fs["time"] - f["time"] for fs, f in zip(firsts, failures)]
    segs = _segments(faulty)
    lost = [segs[i][-1][0] - (segs[i + 1][0][0] - 1) for i in range(INJECTIONS)]
    starts = _events(faulty, "start")
    print(
        f"\ndetect {[round(d, 2) for d in detect]} s; detection to first step {[round(t, 1) for t in to_step]} s; "
        f"steps lost {lost}; processes warm for {[st['warm_for_s'] for st in starts[1:]]} s before assignment"
    )
    for i, d in zip(inj, detect):  # SIGSTOP: heartbeat timeout 1.5 s
        assert d < (1.0 if i["signal"] == "SIGKILL" else 2.5), (i, d)
    assert all(0 <= x <= 1 for x in lost)
    # the standby (local-4) took rank 0 of the first failed node; every later swap put a node in the failed rank
    assert starts[1]["members"]["0"] == "local-4" and starts[0]["members"]["0"] != "local-4"
    for before, after, i in zip(starts, starts[1:], inj):
        changed = {r for r in before["members"] if before["members"][r] != after["members"][r]}
        assert changed == {str(i["rank"])}, (before["members"], after["members"], i)
    # the workers (JAX's coordination service, gloo) listen on loopback only
    addrs = [a for pid_addrs in faulty.listening.values() for a in pid_addrs]
    assert addrs and all(a.startswith("127.0.0.1:") for a in addrs), faulty.listening
    for st in starts[1:]:
        assert min(st["warm_for_s"].values()) > 0


def test_the_job_survives_its_controller(jobs):
    """The controller was killed after the third recovery: the job trained on, and the new controller re-attached."""
    faulty = jobs["faulty"]
    attached = _events(faulty, "attached")
    assert len(attached) == 1 and len(_events(faulty, "controller_start")) == 2
    events = faulty.events()
    restart = next(i for i, e in enumerate(events) if e["event"] == "controller_start" and i > 0)
    gone, back = events[restart - 1]["time"], events[restart]["time"]  # the old controller's last word; the new one
    trained = [r for r in read_events(faulty.run_dir / "controller" / "trained.jsonl") if gone < r["time"] < back]
    print(
        f"\n{len(trained)} steps trained in the {back - gone:.1f} s without a controller; re-attached at step "
        f"{attached[0]['step']}"
    )
    assert trained and attached[0]["step"] >= trained[-1]["step"]


def test_resubmitted_job_reuses_the_cached_setup(jobs):
    ref, faulty = jobs["ref"], jobs["faulty"]
    cold, warm = _events(ref, "start")[0], _events(faulty, "start")[0]
    assert cold["setup"] == "built" and warm["setup"] == "reused" and cold["setup_key"] == warm["setup_key"]
    assert warm["members"] == cold["members"]  # the cached rank -> host assignment
    cold_first, warm_first = _events(ref, "first_step")[0], _events(faulty, "first_step")[0]
    print(
        f"\ntime from assignment to first step: cold {cold_first['since_assign_s']:.1f} s, resubmitted "
        f"{warm_first['since_assign_s']:.1f} s; compilation cache hits/misses per rank: cold "
        f"{cold_first['cache_hits']}/{cold_first['cache_misses']}, resubmitted "
        f"{warm_first['cache_hits']}/{warm_first['cache_misses']}"
    )
    assert min(cold_first["cache_misses"]) > 0
    assert warm_first["cache_misses"] == [0, 0, 0, 0] and min(warm_first["cache_hits"]) > 0
    # after the swap the host set (so the key) changed: a new layout entry, the same compiled programs
    swapped = _events(faulty, "start")[1]
    assert swapped["setup"] == "built" and swapped["setup_key"] != warm["setup_key"]
    firsts = _events(faulty, "first_step")
    # every program a recovery runs (the restore's too) was compiled before the first failure: no generation
    # compiles anything, the standby's rank included
    assert all(f["cache_misses"] == [0, 0, 0, 0] for f in firsts[1:]), [f["cache_misses"] for f in firsts]

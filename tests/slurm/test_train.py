"""Real JAX training on the live Slurm cluster: both launch forms, a requeue, and two jobs sharing the cluster.

* ``allocated``: the in-allocation form, ``salloc -N 4 --gpus-per-node=2 jaxdist launch ...
  controller.launcher=slurm`` on ``mesh.cluster=slurm:gpu@cpu-4x2`` (the allocation's cluster file: 4 nodes x 2
  GPUs, each standing for one simulated CPU device), alone on the cluster and uninterrupted: the reference (and
  ``printed``'s solo run);
* ``printed``: the same training as ``jaxdist launch --print ... | sbatch`` on ``mesh.cluster=slurm:gpu@cpu-4x2``:
  Slurm gives it 2 GPUs on each of the 4 nodes (each stands for one CPU device).  After its first checkpoint it
  is cancelled (``scancel``) and resumed (``scontrol requeue``);
* ``shared``: submitted while ``printed`` runs, ``mesh=auto`` on the same partition, one node: planned on the
  GPUs ``printed`` leaves (6 per node), both train at once; ``solo``: its config alone, ``jaxdist train``.

``printed``'s final parameters and every loss must equal ``allocated``'s bit for bit, each batch trained once;
``shared``'s losses must equal its solo run's.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from jaxdist.cluster import load_cluster, without_device_count
from jaxdist.config import load_config
from jaxdist.controller.generations import last_committed_step
from jaxdist.controller.policy import lineage
from jaxdist.controller.slurm_job import SlurmJob
from jaxdist.controller.timeline import generations_trained
from jaxdist.planner.shared import plan_free
from jaxdist.slurm.view import NodeGPUs, PartitionView
from jaxdist.train.metrics import read_metrics

# the same bits after a requeue onto other GPUs, in another device order (tests/conftest.py)
pytestmark = pytest.mark.default_emitters

STEPS, EVERY = 24, 3  # the cancel comes after step 4: 19 paced steps of headroom for scancel on a loaded host
PACE_S = 1.0  # seconds each node of the printed job waits for each batch until it is cancelled (below)
COMMON = [
    "model=tiny",
    "train.batch_size=16",
    "train.seq_len=32",
    "data.max_bytes=300000",
    "train.progress=false",
    "train.tensorboard=false",
    f"checkpoint.every={EVERY}",
    "train.log_every=1",  # every step's loss is compared with the reference's
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.runs_dir=runs",
    f"train.steps={STEPS}",
    "controller.standbys=0",  # the 4 nodes train; the restart here is Slurm's requeue, not a standby's
    "controller.warm_spares=0",  # no process warmed beside the training ones: the restart here is Slurm's requeue
]
GROUP = ["mesh.data=4", "mesh.fsdp=2", "controller.min_nodes=4", "controller.max_nodes=4"]
SHARED = ["mesh.cluster=slurm:gpu@cpu-4x2", "mesh=auto", "controller.max_nodes=1", "train.name=shared"]
TIMEOUT = 300


def shared_key(job) -> str:
    """The setup cache key of the job's first generation."""
    return job.events_of("start")[0]["setup_key"]


def _gpus(job) -> dict[str, frozenset[int]]:
    return job.record().gpus


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("slurm-train")
    allocated = SlurmJob([*COMMON, *GROUP, "mesh.cluster=slurm:gpu@cpu-4x2", "train.name=allocated"], cwd=cwd)
    # Until the cancel has landed, every node of `printed` waits PACE_S more for each batch (the test-only fault
    # hooks, jaxdist/train/faults.py): the cancel after step EVERY + 1 then has (STEPS - EVERY - 1) x PACE_S
    # seconds to land before the job could end by itself.  Unpaced, those 19 steps took ~4 s, and once, with
    # another test beside it, the job completed before Slurm cancelled it.  A wait changes no number trained.
    printed = SlurmJob(
        [*COMMON, *GROUP, "mesh.cluster=slurm:gpu@cpu-4x2", "train.name=printed"],
        cwd=cwd,
        env={"JAXDIST_FAULT_HOOKS": "1"},
    )
    pace = printed.run_dir / "faults.json"
    pace.parent.mkdir(parents=True)
    pace.write_text(json.dumps([{"kind": "data", "node": f"n{i}", "delay_s": PACE_S} for i in range(1, 5)]))
    shared = SlurmJob([*COMMON, *SHARED], cwd=cwd)
    out = {"allocated": allocated, "printed": printed, "shared": shared}
    solo = None
    try:
        allocated.run_in_allocation(4, "--gpus-per-node=2")
        assert allocated.wait(TIMEOUT) == 0, allocated.summary()

        out["printed_script"] = printed.script()
        printed.submit(out["printed_script"])
        printed.wait_state(("RUNNING",), TIMEOUT)
        out["printed_gpus"] = _gpus(printed)
        out["shared_script"] = shared.script()  # planned now, on what printed leaves
        shared.submit(out["shared_script"])
        shared.wait_state(("RUNNING",), TIMEOUT)
        out["shared_gpus"] = _gpus(shared)
        # the shared job's config alone: the arguments its batch script runs, in one `jaxdist train` off the
        # cluster, once the shared job is done (with its compiled programs: the same executables)
        launch = shlex.split(next(l for l in out["shared_script"].splitlines() if l.startswith("exec ")))
        solo_args = [a for a in launch[5:] if not a.startswith("controller.")] + ["train.name=solo"]

        printed.wait_until(lambda s: s.get("last_step", 0) > EVERY, TIMEOUT, f"step {EVERY + 1}")
        printed.cancel()
        printed.wait_state(("CANCELLED",), TIMEOUT)
        pace.unlink()  # the requeued generation trains at full speed
        out["kept"] = last_committed_step(printed.run_dir)
        printed.requeue()
        printed.wait_state(("RUNNING", "COMPLETED"), TIMEOUT)
        assert shared.wait(TIMEOUT) == 0, shared.summary()
        entry = json.loads(
            next((cwd / "runs" / ".setup_cache" / "layout").glob(f"{shared_key(shared)}*/*.json")).read_text()
        )
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith(("JAX_", "SLURM_J"))}
        env["XLA_FLAGS"] = without_device_count(os.environ["XLA_FLAGS"])  # conftest's compile flags
        env.update(
            JAX_COMPILATION_CACHE_DIR=entry["compile_cache"],
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
        solo = subprocess.Popen(
            [sys.executable, "-m", "jaxdist.cli", "train", *solo_args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert printed.wait(TIMEOUT) == 0, printed.summary()
        log, _ = solo.communicate(timeout=TIMEOUT)
        assert solo.returncode == 0, log[-3000:]
        out["solo_dir"] = cwd / "runs" / "solo"
    finally:
        for job in (allocated, printed, shared):
            job.close()
        if solo is not None and solo.poll() is None:
            solo.kill()
            solo.wait()
    return out


def _params(job):
    import jax

    from jaxdist.checkpoint import RunCheckpointer
    from jaxdist.train.trainer import Trainer

    cfg = load_config(
        None,
        [o for o in COMMON if not o.startswith(("checkpoint.", "controller."))]
        + ["checkpoint.enabled=false", "mesh.cluster=cpu-8", f"train.runs_dir={job.run_dir}/x"],
    )
    with Trainer(cfg) as t:
        target = t.abstract_state()
    state, meta = RunCheckpointer(job.run_dir / "checkpoints").restore(target, STEPS)
    return jax.device_get(state["params"]), meta


def test_both_forms_train_end_to_end(jobs):
    cluster = (jobs["allocated"].dir / "cluster.toml").read_text()  # written inside the allocation
    assert "nodes = 4\ndevices_per_node = 2\n" in cluster and 'device_kind = "cpu"' in cluster
    for name in ("allocated", "printed"):
        job = jobs[name]
        assert job.events_of("done")[0]["step"] == STEPS, name
        assert all(sorted(st["members"].values()) == ["n1", "n2", "n3", "n4"] for st in job.events_of("start"))
    assert (
        "#SBATCH --gpus-per-node=2" in jobs["printed_script"]
        and "#SBATCH --nodelist=n1,n2,n3,n4" in jobs["printed_script"]
    )
    assert {n: len(g) for n, g in jobs["printed_gpus"].items()} == {f"n{i}": 2 for i in range(1, 5)}
    printed = jobs["printed"]
    print(
        f"\nsbatch to first step {printed.events_of('first_step')[0]['time'] - printed.submitted_at:.1f} s "
        f"(real JAX, 4 x 2, setup cached by the in-allocation job)"
    )


def test_requeued_run_trains_each_batch_once_and_equals_the_uninterrupted_one(jobs):
    printed, allocated, kept = jobs["printed"], jobs["allocated"], jobs["kept"]
    segs = list(generations_trained(printed.run_dir).values())
    ref = list(generations_trained(allocated.run_dir).values())
    assert len(segs) == 2 and len(ref) == 1 and kept % EVERY == 0 and EVERY <= kept < STEPS, kept
    # resumed from the persistent checkpoint, or from a newer step of the local tier (on by default: the nodes'
    # temporary directories outlive the requeue here), never from before the checkpoint or past the kill
    resumed = printed.events_of("first_step")[1]
    assert printed.events_of("new_allocation") and segs[1][0][0] - 1 == resumed["resume_step"], resumed
    assert kept <= resumed["resume_step"] <= segs[0][-1][0], (kept, resumed, segs[0][-1])
    assert resumed["resumed_from"] == ("local" if resumed["resume_step"] > kept else "persistent"), resumed
    assert lineage([(g[0][0] - 1, g[-1][0]) for g in segs], STEPS) == list(range(STEPS))
    reference = dict(ref[0])
    for g in segs:  # every step each generation trained, the recomputed ones too, has the reference loss
        for step, loss in g:
            assert loss == reference[step], (step, loss, reference[step])
    want, meta_ref = _params(allocated)
    got, meta = _params(printed)
    assert meta["data"]["position"] == meta_ref["data"]["position"] == STEPS
    import jax

    same = jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), got, want))
    assert same and all(same), "final parameters differ from the uninterrupted run"


def test_a_second_job_is_planned_on_what_the_first_leaves_and_both_train(jobs):
    printed_gpus, shared_gpus = jobs["printed_gpus"], jobs["shared_gpus"]
    [(node, mine)] = shared_gpus.items()
    assert not mine & printed_gpus[node]  # no GPU of the running job
    # on the 6 free GPUs per node the fastest plan of one node uses 4; on an empty node it would use 8
    free = PartitionView("gpu", "", tuple(NodeGPUs(f"n{i}", "idle", 8, frozenset()) for i in range(1, 5)))
    model = load_config(None, [*COMMON, *SHARED[:2]]).model
    empty = plan_free(model, free, load_cluster("cpu-4x2"), batch_size=16, seq_len=32, max_nodes=1).choice.best
    assert len(mine) == 4 < empty.gpus_per_node == 8
    assert "#SBATCH --gpus-per-node=4" in jobs["shared_script"]
    shared = [(r["step"], r["loss"]) for r in read_metrics(jobs["shared"].run_dir)]
    solo = [(r["step"], r["loss"]) for r in read_metrics(jobs["solo_dir"])]
    assert [s for s, _ in shared] == list(range(1, STEPS + 1)) and shared == solo

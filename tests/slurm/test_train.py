"""Real JAX training on the live Slurm cluster: 4 nodes x 2 simulated CPU devices, in both launch forms.

* ``printed``: ``jaxdist launch --print ... controller.launcher=slurm | sbatch``, cancelled with ``scancel``
  after its first checkpoint and resumed with ``scontrol requeue``;
* ``allocated``: the in-allocation form, ``salloc -N 4 jaxdist launch ... controller.launcher=slurm``,
  uninterrupted: the reference.

Both train the same batches: the requeued run's final parameters must equal the reference's bit for bit,
its per-step losses too, and its generations must have trained each batch exactly once.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxdist.controller.generations import last_committed_step
from jaxdist.controller.policy import lineage
from jaxdist.controller.slurm_job import SlurmJob
from jaxdist.controller.timeline import generations_trained

STEPS, EVERY = 12, 4
COMMON = [
    "model=tiny",
    "mesh.cluster=cpu-4x2",
    "mesh.fsdp=2",
    "train.batch_size=16",
    "train.seq_len=32",
    "data.max_bytes=300000",
    "train.progress=false",
    "train.tensorboard=false",
    f"checkpoint.every={EVERY}",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.runs_dir=runs",
    f"train.steps={STEPS}",
    "controller.min_nodes=4",
    "controller.max_nodes=4",
    "controller.standbys=0",
]
TIMEOUT = 300


@pytest.fixture(scope="module")
def jobs(slurm, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("slurm-train")
    printed = SlurmJob([*COMMON, "train.name=printed"], cwd=cwd)
    allocated = SlurmJob([*COMMON, "train.name=allocated"], cwd=cwd)
    try:
        printed.submit()
        printed.wait_until(lambda s: s.get("last_step", 0) > EVERY + 1, TIMEOUT, f"step {EVERY + 2}")
        printed.cancel()
        printed.wait_state(("CANCELLED",), TIMEOUT)
        kept = last_committed_step(printed.run_dir)
        printed.requeue()
        printed.wait_state(("RUNNING", "COMPLETED"), TIMEOUT)
        assert printed.wait(TIMEOUT) == 0, printed.summary()
        allocated.run_in_allocation(4)
        assert allocated.wait(TIMEOUT) == 0, allocated.summary()
    finally:
        printed.close()
        allocated.close()
    return {"printed": printed, "allocated": allocated, "kept": kept}


def _params(job):
    import jax

    from jaxdist.checkpoint import RunCheckpointer
    from jaxdist.config import load_config
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
    for name in ("printed", "allocated"):
        job = jobs[name]
        assert job.events_of("done")[0]["step"] == STEPS, name
        starts = job.events_of("start")
        assert all(sorted(st["members"].values()) == ["n1", "n2", "n3", "n4"] for st in starts), starts
    firsts = jobs["printed"].events_of("first_step")
    print(f"\nsbatch to first step {firsts[0]['time'] - jobs['printed'].submitted_at:.1f} s (real JAX, 4 x 2)")


def test_requeued_run_trains_each_batch_once_and_equals_the_uninterrupted_one(jobs):
    printed, allocated, kept = jobs["printed"], jobs["allocated"], jobs["kept"]
    segs = list(generations_trained(printed.run_dir).values())
    ref = list(generations_trained(allocated.run_dir).values())
    assert len(segs) == 2 and len(ref) == 1 and kept >= EVERY
    assert printed.events_of("new_allocation") and segs[1][0][0] == kept + 1  # resumed from the checkpoint
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

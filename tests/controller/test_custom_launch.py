"""`jaxdist launch --entry module:function` (train.entry): your own model and dataset under the controller.

The entry is :func:`spec` below (the classifier and the points of tests/train/test_custom_data.py); a local job
of two members and a standby loses rank 1 to SIGKILL and ends with exit 0, every item of the trained batches
once and the digests of the items each logged id names.  An entry that cannot be found or returns the wrong
thing is one sentence with exit code 2.
"""

from __future__ import annotations

import signal
from pathlib import Path

import optax
import pytest

from jaxdist.cli import main
from jaxdist.controller.local import LocalJob, write_cpu_cluster
from jaxdist.data.audit import check_exactly_once, digest_problems
from jaxdist.data.items import ItemSource
from tests.train.test_custom_data import Points, build, xent

ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.controller.test_custom_launch"  # as the workers import it (pytest may name it otherwise)
STEPS = 30


def spec(config):
    """The entry point: the Trainer's keywords for this job's config."""
    return {"model": build, "loss": xent, "optimizer": optax.adam(3e-2), "data": Points(), "eval_data": Points(32, 1)}


def not_a_dict(config):
    return build


def test_a_launched_entry_survives_a_killed_worker_exactly_once(tmp_path):
    cluster = write_cpu_cluster(tmp_path / "cpu-3x2.toml", nodes=3, devices_per_node=2)
    job = LocalJob(
        [
            f"train.entry={MODULE}:spec",
            f"train.steps={STEPS}",
            "train.batch_size=8",
            "train.log_every=1",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.every=4",
            f"mesh.cluster={cluster}",
            "mesh.data=-1",
            "train.runs_dir=runs",
            "train.name=entry",
            "controller.min_nodes=2",
            "controller.max_nodes=2",
            "controller.standbys=1",
        ],
        nodes=3,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT)},  # the workers import this module by name
    )
    try:
        job.start(late=1)
        job.wait_until(lambda s: s["phase"] == "running" and s["last_step"] >= 6, 300, "step 6")
        job.inject(1, signal.SIGKILL)
        assert job.wait(300) == 0, job.summary()
    finally:
        job.close()
    run = tmp_path / "runs" / "entry"
    report = check_exactly_once(run)
    assert report["ok"] and report["trained"] == STEPS, report
    assert digest_problems(run, ItemSource(Points())) == []
    gens = {e["gen"] for e in job.events() if e["event"] == "start"} | {
        e["gen"] for e in job.events() if e["event"] == "replacement"
    }
    assert len(gens) >= 2 or any(e["event"] == "failure" for e in job.events()), job.summary()


@pytest.mark.parametrize(
    "entry, words",
    [
        ("nosuch_module_xyz:spec", "module 'nosuch_module_xyz' cannot be imported"),
        (f"{MODULE}:nosuch", "has no function 'nosuch'"),
        (f"{MODULE}:not_a_dict", "returned function: return a dict with model and loss"),
        ("not an entry", "is not module:function"),
    ],
)
def test_a_bad_entry_is_one_sentence_and_exit_code_2(tmp_path, capsys, entry, words):
    code = main(["train", "--entry", entry, f"train.runs_dir={tmp_path}", "train.steps=1", "train.progress=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err, err
    assert len(err.splitlines()) == 1 and err.endswith(".")
    assert not any(tmp_path.iterdir())  # nothing written

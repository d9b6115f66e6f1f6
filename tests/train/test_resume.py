"""A run stopped at step 10 and resumed to 20 equals an uninterrupted 20-step run, bit for bit."""

import jax
import numpy as np

from jaxdist.config import load_config
from jaxdist.train.metrics import read_metrics
from jaxdist.train.trainer import Trainer
from tests.trees import leaf_pairs


def small_config(tmp_path, name, steps, extra=()):
    return load_config(
        None,
        [
            "model=tiny",
            f"train.steps={steps}",
            "train.seq_len=32",
            "train.batch_size=8",
            "train.log_every=5",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.every=5",
            "data.max_bytes=400000",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "train.warmup_steps=3",
            f"train.runs_dir={tmp_path}",
            f"train.name={name}",
            *extra,
        ],
    )


def run(cfg):
    with Trainer(cfg) as t:
        t.fit()
        return jax.device_get(t.state), t


def test_resume_is_bit_identical(tmp_path):
    full, _ = run(small_config(tmp_path, "full", 20))

    cfg10 = small_config(tmp_path, "split", 20)
    with Trainer(cfg10) as t:
        t.fit(steps=10)  # stops after 10 of 20 steps (saves at 5 and 10)
        t.checkpointer.wait()
        assert t.checkpointer.latest_step() == 10
    resumed_trainer = Trainer(small_config(tmp_path, "split", 20))
    with resumed_trainer as t:
        t.init_state()
        assert int(t.state["step"]) == 10
        t.fit()
        resumed = jax.device_get(t.state)

    for a, b in leaf_pairs(full, resumed):
        np.testing.assert_array_equal(a, b)
    losses_full = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "full")]
    losses_split = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "split")]
    assert [s for s, _ in losses_full] == list(range(1, 21))
    assert losses_split == losses_full  # same steps, same losses, none logged twice


def test_training_reduces_loss_and_checkpoints_rotate(tmp_path):
    cfg = small_config(tmp_path, "rot", 20, ["checkpoint.keep=2", "train.learning_rate=1e-2"])
    state, t = run(cfg)
    rows = read_metrics(tmp_path / "rot")
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert sorted(t.checkpointer.all_steps()) == [15, 20]
    evals = read_metrics(tmp_path / "rot", kind="eval")
    assert evals and evals[-1]["step"] == 20 and np.isfinite(evals[-1]["loss"])


def test_hooks_fire_every_n(tmp_path):
    seen = []
    cfg = small_config(tmp_path, "hooks", 6, ["checkpoint.enabled=false"])
    with Trainer(cfg) as t:
        t.add_hook(lambda tr, step, m: seen.append((step, round(m["loss"], 6))), every=2)
        hist = t.fit()
    assert [s for s, _ in seen] == [2, 4, 6]
    by_step = {r["step"]: round(r["loss"], 6) for r in hist}
    assert all(by_step[s] == l for s, l in seen)

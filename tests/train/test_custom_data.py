"""A random-access Python dataset through the batch list (jaxdist/data/items.py): a classifier defined only in
this file trains on 200 items, is killed, resumes on half the devices, and every item of the epoch is trained
exactly once with the batches of an uninterrupted run; changed and ill-shaped data are refused in one sentence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxdist.config import ConfigError, load_config
from jaxdist.data.audit import check_exactly_once, digest_problems, trained_batches
from jaxdist.data.batchloader import BatchReader
from jaxdist.data.items import ItemSource
from jaxdist.data.journal import Journal
from jaxdist.train.metrics import read_metrics
from jaxdist.train.trainer import Trainer

ITEMS, FEATURES, CLASSES = 200, 16, 4


class Points:
    """``ITEMS`` points of ``FEATURES`` floats, each labelled by the sign pattern of its first two features."""

    def __init__(self, n=ITEMS, seed=0, odd=None):
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, FEATURES)).astype(np.float32)
        self.y = ((self.x[:, 0] > 0) * 2 + (self.x[:, 1] > 0)).astype(np.int32)
        self.odd = odd  # an item index whose features are one longer (a dataset whose items change shape)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        x = self.x[i] if i != self.odd else np.append(self.x[i], 0.0).astype(np.float32)
        return {"x": x, "label": self.y[i]}


class Classifier(nnx.Module):
    def __init__(self, hidden=32, *, rngs):
        named, init = nnx.with_partitioning, nnx.initializers
        self.up = nnx.Linear(FEATURES, hidden, kernel_init=named(init.lecun_normal(), (None, "mlp")), rngs=rngs)
        self.out = nnx.Linear(hidden, CLASSES, kernel_init=named(init.lecun_normal(), ("mlp", None)), rngs=rngs)

    def __call__(self, batch):
        return self.out(jax.nn.relu(self.up(batch["x"])))


def build(rngs):
    return Classifier(rngs=rngs)


def xent(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def config(tmp_path, name, steps, extra=()):
    """The defaults but for a short run of batches of 8 items in ``tmp_path``, saved every 4 steps."""
    return load_config(
        None,
        [
            f"train.steps={steps}",
            "train.batch_size=8",
            "train.log_every=1",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.every=4",
            "mesh.data=4",
            "mesh.tensor=2",
            f"train.runs_dir={tmp_path}",
            f"train.name={name}",
            *extra,
        ],
    )


def train(cfg, devices=None, data=None):
    opt = optax.adam(3e-2)
    with Trainer(
        cfg, devices, model=build, loss=xent, optimizer=opt, data=data or Points(), eval_data=Points(32, 1)
    ) as t:
        t.fit()
        return t


KILLED = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests.train import test_custom_data as m
from jaxdist.train.trainer import Trainer
import optax
cfg = m.config({tmp!r}, "split", 30)
with Trainer(cfg, model=m.build, loss=m.xent, optimizer=optax.adam(3e-2), data=m.Points(), eval_data=m.Points(32, 1)) as t:
    t.add_hook(lambda t, step, _: os.kill(os.getpid(), signal.SIGKILL) if step == 11 else None)
    t.fit()
"""


def test_every_item_once_per_epoch_across_a_kill_and_a_resize(tmp_path):
    """30 steps of 8 items (an epoch is 25): SIGKILL at step 11 on data=4 tensor=2 (8 devices), resumed on data=2
    tensor=2 (4 devices).  The steps' batch ids are the uninterrupted run's, the logged digests are those of the
    items the ids name, and positions 0..24 hold each of the 200 items once."""
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", KILLED.format(root=root, tmp=str(tmp_path))],
        env=os.environ.copy(),
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    t = train(config(tmp_path, "split", 30, ["mesh.data=2"]), jax.devices()[:4])
    assert t.resumed_from is not None and t.resumed_from[1] in (4, 8), t.resumed_from
    assert len(t.devices) == 4
    train(config(tmp_path, "full", 30))
    # the final lineage of each log (the killed run's steps past its checkpoint were trained again)
    ids = {
        n: [(r["step"], r["batch_id"], r["batch_digest"]) for r in trained_batches(tmp_path / n)]
        for n in ("split", "full")
    }
    assert ids["split"] == ids["full"] and [r[0] for r in ids["full"]] == list(range(1, 31))
    for n in ("split", "full"):
        report = check_exactly_once(tmp_path / n)
        assert report["ok"] and report["trained"] == 30, report
        assert digest_problems(tmp_path / n, ItemSource(Points())) == []
    reader = BatchReader(Journal(tmp_path / "split").load(), {0: ItemSource(Points())})
    epoch = np.concatenate([reader.window_ids(p)[1] for p in range(25)])
    assert sorted(epoch.tolist()) == list(range(ITEMS))
    losses = [r["loss"] for r in read_metrics(tmp_path / "full")]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])  # it learns the four classes
    evals = read_metrics(tmp_path / "full", kind="eval")
    assert evals and evals[-1]["step"] == 30 and np.isfinite(evals[-1]["loss"])


def test_a_changed_dataset_is_refused_on_resume(tmp_path):
    train(config(tmp_path, "run", 4))
    for changed, words in (
        (Points(ITEMS - 8), "192 items now, 200 then"),
        (Points(seed=3), "the same length, other items"),
    ):
        with pytest.raises(ConfigError) as e:
            train(config(tmp_path, "run", 8), data=changed)
        assert words in str(e.value) and "the dataset given as data=" in str(e.value), str(e.value)


def test_items_that_change_shape_stop_the_run_in_one_sentence(tmp_path):
    with pytest.raises(ConfigError) as e:
        train(config(tmp_path, "odd", 30), data=Points(odd=57))  # found when the run registers the dataset
    msg = str(e.value)
    assert "item 57 of data gives 'x' as float32[17] per row, item 0 as float32[16]" in msg, msg
    assert msg.count(". ") == 0, msg
    assert not (tmp_path / "odd" / "checkpoints").exists()
    with pytest.raises(ConfigError, match="not a random-access dataset"):
        ItemSource(iter([{"x": 1}]))
    with pytest.raises(ConfigError, match="not a dict of arrays"):
        ItemSource([np.zeros(3)])
    with pytest.raises(ConfigError, match="holds no items"):
        ItemSource([])


def test_a_collate_function_makes_the_rows():
    """``collate`` sees the items and returns the batch: here it adds a feature; a wrong row count is refused."""
    src = ItemSource(Points(), lambda items: {"x": np.stack([i["x"] * 2 for i in items]), "n": np.ones(len(items))})
    assert src.spec == {"x": ((FEATURES,), np.dtype("float32")), "n": ((), np.dtype("float64"))}
    np.testing.assert_array_equal(src.read(np.array([3, 5]))["x"], 2 * Points().x[[3, 5]])
    bad = ItemSource(Points(), lambda items: {"x": np.stack([i["x"] for i in items[:1]])})
    with pytest.raises(ConfigError, match="same shape"):
        bad.read(np.array([1, 2]))
    assert jnp.asarray(src.read(np.array([0]))["x"]).shape == (1, FEATURES)

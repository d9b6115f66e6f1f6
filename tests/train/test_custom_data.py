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
from jaxdist.data import add_data
from jaxdist.data.audit import check_exactly_once, digest_problems, trained_batches, verify
from jaxdist.data.batchlist import batch_digest, parse_id, unpack_ids
from jaxdist.data.batchloader import BatchReader
from jaxdist.data.items import ItemSource, stack
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


def train(cfg, devices=None, data=None, added_data=None, add_at=None):
    """Train ``cfg`` on ``data`` (default: the 200 points); ``add_at``: the step whose hook adds :func:`added`."""
    opt = optax.adam(3e-2)
    with Trainer(
        cfg,
        devices,
        model=build,
        loss=xent,
        optimizer=opt,
        data=data or Points(),
        eval_data=Points(32, 1),
        added_data=added_data,
    ) as t:
        if add_at is not None:
            t.add_hook(lambda t, step, _: t.add_data(added(), seed=11) if step == add_at else None)
        t.fit()
        return t


def added():
    """The dataset added while the runs train: 64 other points (8 batches)."""
    return Points(64, seed=5)


def run_until_killed(script: str, tmp_path) -> None:
    """Run ``script`` (formatted with the repository root and ``tmp_path``) in a new process that kills itself."""
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run(
        [sys.executable, "-c", script.format(root=root, tmp=str(tmp_path))],
        env=os.environ.copy(),
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]


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
    run_until_killed(KILLED, tmp_path)
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


def test_a_resume_reads_each_added_dataset_s_quick_sample_once():
    """given_items matches journal entries by length and quick fingerprint: with three entries to look up against
    two datasets, each dataset's QUICK_SAMPLES items are read once, not once per lookup."""
    from jaxdist.data.catalog import given_items
    from jaxdist.data.items import QUICK_SAMPLES

    class Counted(Points):
        reads = 0

        def __getitem__(self, i):
            Counted.reads += 1
            return super().__getitem__(i)

    a, b = ItemSource(Counted(seed=1), name="a"), ItemSource(Counted(seed=2), name="b")
    entries = [{"n_tokens": len(s), "quick": ItemSource(Points(seed=k)).quick()} for k, s in ((1, a), (2, b))]
    entries.append({"n_tokens": ITEMS, "quick": "0" * 64})  # a dataset not given: every candidate compared
    Counted.reads = 0
    assert [given_items(e, [a, b]) for e in entries * 2] == [a, b, None] * 2
    assert Counted.reads == 2 * QUICK_SAMPLES


def test_a_collate_function_makes_the_rows():
    """``collate`` sees the items and returns the batch: here it adds a feature; a wrong row count is refused."""
    src = ItemSource(Points(), lambda items: {"x": np.stack([i["x"] * 2 for i in items]), "n": np.ones(len(items))})
    assert src.spec == {"x": ((FEATURES,), np.dtype("float32")), "n": ((), np.dtype("float64"))}
    np.testing.assert_array_equal(src.read(np.array([3, 5]))["x"], 2 * Points().x[[3, 5]])
    bad = ItemSource(Points(), lambda items: {"x": np.stack([i["x"] for i in items[:1]])})
    with pytest.raises(ConfigError, match="same shape"):
        bad.read(np.array([1, 2]))
    assert jnp.asarray(src.read(np.array([0]))["x"]).shape == (1, FEATURES)


KILLED_AFTER_ADDING = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests.train import test_custom_data as m
from jaxdist.train.trainer import Trainer
import optax
cfg = m.config({tmp!r}, "added", 30)
with Trainer(cfg, model=m.build, loss=m.xent, optimizer=optax.adam(3e-2), data=m.Points(), eval_data=m.Points(32, 1)) as t:
    t.add_hook(lambda t, step, _: t.add_data(m.added(), seed=11) if step == 6 else None)
    t.add_hook(lambda t, step, _: os.kill(os.getpid(), signal.SIGKILL) if step == 14 else None)
    t.fit()
"""


def test_a_dataset_added_while_training_joins_at_the_next_step_and_each_item_trains_once_across_a_kill(tmp_path):
    """Trainer.add_data at step 6 of 30 (64 more points, 8 batches): the run is killed at step 14 and resumed
    with ``added_data=[it]``; its steps train the batch ids and items (logged digests) of a run that was never
    interrupted, the addition joins at position 6, and version 2's first 33 positions hold each of the 200 + 64
    items once."""
    run_until_killed(KILLED_AFTER_ADDING, tmp_path)
    t = train(config(tmp_path, "added", 30), added_data=[added()])
    assert t.resumed_from is not None and t.resumed_from[1] in (8, 12), t.resumed_from
    train(config(tmp_path, "whole", 30), add_at=6)
    ids = {
        n: [(r["step"], r["batch_id"], r["batch_digest"]) for r in trained_batches(tmp_path / n)]
        for n in ("added", "whole")
    }
    assert ids["added"] == ids["whole"] and [r[0] for r in ids["whole"]] == list(range(1, 31))
    sources = [ItemSource(Points())], [ItemSource(added())]
    for n in ("added", "whole"):
        report = check_exactly_once(tmp_path / n)
        assert report["ok"] and report["trained"] == 30, report
        assert digest_problems(tmp_path / n, *sources[0], items=sources[1]) == []
    # The items each step trained, from the datasets themselves: batch (s, e, i) is items perm[8i:8i+8] of source s,
    # perm the seeded permutation the batch list defines (jaxdist.data.batchloader.BatchReader).
    newest = Journal(tmp_path / "added").load()
    for r in trained_batches(tmp_path / "added"):
        s, e, i = (int(x) for x in unpack_ids(parse_id(r["batch_id"])))
        data = (Points(), added())[s]
        rows = np.random.default_rng([newest.source(s).seed, s, e]).permutation(len(data))[8 * i : 8 * i + 8]
        assert r["batch_digest"] == int(batch_digest(stack([data[int(w)] for w in rows]))), r
    bl = Journal(tmp_path / "added").load(2)
    assert bl.op["kind"] == "add" and bl.op["splice"] == 6 and [s.kind for s in bl.sources] == ["config", "items"]
    reader = BatchReader(bl, {0: ItemSource(Points()), 1: ItemSource(added())})
    seen = [reader.window_ids(p) for p in range(33)]
    for source, n in ((0, ITEMS), (1, 64)):
        windows = np.concatenate([w for s, w in seen if s == source])
        assert sorted(windows.tolist()) == list(range(n)), source
    assert any(s == 1 for s, _ in seen[6:14]) and all(s == 0 for s, _ in seen[:6])  # trained from step 7 on


class Other(Points):
    """Points with their features under another key (items of another shape than the run's)."""

    def __getitem__(self, i):
        return {"z": self.x[i], "label": self.y[i]}


def test_added_datasets_are_checked_on_resume_and_bad_additions_are_one_sentence(tmp_path):
    """Resuming a run that was added to: without the added dataset, with a changed one, or with one never added,
    refused in one sentence.  add_data of items of another shape, of fewer items than a batch, or of items the
    run has: refused in one sentence, and no request is left in the journal."""
    train(config(tmp_path, "run", 4), add_at=2)
    for given, words in (
        (None, "source 1 of the batch list (python:Points, 64 items) is a Python dataset added to the run"),
        ([Points(64, seed=6)], "no dataset given as added_data= has its length and items"),
        ([added(), Points(40, seed=9)], "added_data= gives python:Points (40 items), which was never added"),
    ):
        with pytest.raises(ConfigError) as e:
            train(config(tmp_path, "run", 8), added_data=given)
        assert words in str(e.value) and str(e.value).count(". ") == 0, str(e.value)
    t = Trainer(
        config(tmp_path, "run", 8),
        model=build,
        loss=xent,
        optimizer=optax.adam(3e-2),
        data=Points(),
        eval_data=Points(32, 1),
        added_data=[added()],
    )
    with t:
        for dataset, words in (
            (Other(64, seed=7), "the items of python:Other are {label: int32[], z: float32[16]} per row, the run's"),
            (Points(5, seed=8), "python:Points holds 5 items, fewer than one batch of 8"),
            (added(), "holds the same items (fingerprint"),
            (Points(), "as source 0 ('python:Points') of the batch list"),
        ):
            with pytest.raises(ConfigError) as e:
                t.add_data(dataset)
            assert words in str(e.value) and str(e.value).count(". ") == 0, str(e.value)
        with pytest.raises(ConfigError) as e:  # token files: the run trains on a Python dataset's items
            add_data(tmp_path / "run", [__file__])
        assert "trains on a Python dataset's items, not on token data" in str(e.value), str(e.value)
        assert Journal(tmp_path / "run").pending() == []
        t.fit()  # the run goes on from its checkpoint with the dataset added at step 2
    assert check_exactly_once(tmp_path / "run")["ok"]
    ok, lines = verify(tmp_path / "run")
    assert ok and "source 1: the Python dataset 'python:Points' added to the run, 64 items" in "\n".join(lines), lines

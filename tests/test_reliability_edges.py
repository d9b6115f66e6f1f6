"""Reliability edges (issue 22, items 1-5 and 12): no silent restart, no silent nonsense, one sentence per mistake.

Each test names its item.  The training runs are tiny (model=tiny, a few steps of 8 x 16 tokens on the 8
simulated CPU devices) and in-process; the CLI is called through ``jaxdist.cli.main`` for its exit codes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist import cli
from jaxdist.checkpoint import RunCheckpointer, integrity
from jaxdist.cluster import without_device_count
from jaxdist.config import ConfigError, load_config
from jaxdist.data import add_data, write_token_file
from jaxdist.data.audit import trained_batches
from jaxdist.models.names import CHECKPOINT_NAMES
from jaxdist.remat.named import remat_policy
from jaxdist.train import step as step_module
from jaxdist.train.metrics import MetricsWriter, read_metrics
from jaxdist.train.optimizer import learning_rate_schedule
from jaxdist.train.trainer import Trainer

SMALL = [
    "model=tiny",
    "train.seq_len=16",
    "train.batch_size=8",
    "train.log_every=3",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.progress=false",
    "train.tensorboard=false",
    "train.warmup_steps=1",
    "checkpoint.every=2",
    "data.max_bytes=60000",
]


def args(tmp_path, name, *extra):
    """Overrides of a tiny run ``name`` under ``tmp_path``."""
    return [*SMALL, f"train.runs_dir={tmp_path}", f"train.name={name}", *extra]


def config(tmp_path, name, *extra):
    return load_config(None, args(tmp_path, name, *extra))


def train(cfg):
    with Trainer(cfg) as t:
        t.fit()
        return t


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 4-step run (checkpoints at 2 and 4) that tests copy: ``(runs_dir, name)``."""
    runs = tmp_path_factory.mktemp("base")
    train(config(runs, "base", "train.steps=4"))
    return runs / "base"


def copy_run(base, tmp_path, name):
    shutil.copytree(base, tmp_path / name)
    cfg = json.loads((tmp_path / name / "config.json").read_text())
    cfg["train"].update(runs_dir=str(tmp_path), name=name)
    (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    return tmp_path / name


def damage(step_dir):
    """Flip one byte of the biggest file a committed step recorded (its checksum no longer holds)."""
    marker = integrity.read_commit(step_dir)
    rel = max(marker["files"], key=lambda k: marker["files"][k]["size"])
    path = step_dir / rel
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- 1


def test_item1_all_checkpoints_damaged_keeps_refusing(base, tmp_path, capsys):
    ckdir = copy_run(base, tmp_path, "r") / "checkpoints"
    damage(ckdir / "2")
    damage(ckdir / "4")
    run = ["train", *args(tmp_path, "r", "train.steps=4")]
    assert cli.main(run) == 2
    assert "every checkpoint" in capsys.readouterr().err
    assert cli.main(run) == 2  # the same command again: still refused, not a silent start from step 1
    err = capsys.readouterr().err.splitlines()[-1]  # after the run's description line
    assert err.startswith("jaxdist: every checkpoint") and "checkpoint.resume=false" in err, err
    assert sorted(p.name for p in ckdir.iterdir()) == ["2.damaged", "4.damaged"]  # nothing trained
    with Trainer(config(tmp_path, "r", "train.steps=4", "checkpoint.resume=false")) as t:
        assert int(t.init_state()["step"]) == 0  # the user said otherwise: start over


def test_item1_a_flipped_byte_in_every_commit_marker_is_refused_not_a_restart(base, tmp_path, capsys):
    # Issue 35 item 5: a marker that exists but does not parse is damage, never an unfinished save.
    ckdir = copy_run(base, tmp_path, "m") / "checkpoints"
    for step in ("2", "4"):
        marker = ckdir / step / integrity.COMMIT_FILE
        data = bytearray(marker.read_bytes())
        data[len(data) // 2] ^= 0xFF
        marker.write_bytes(bytes(data))
    assert cli.main(["ckpt", "verify", str(ckdir.parent)]) == 1
    out = capsys.readouterr().out
    assert out.count("DAMAGED") == 2 and out.count("does not parse") == 2, out
    run = ["train", *args(tmp_path, "m", "train.steps=6")]
    for _ in range(2):  # and the same command again
        assert cli.main(run) == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert err.startswith("jaxdist: every checkpoint") and "steps 2, 4" in err, err
    assert sorted(p.name for p in ckdir.iterdir()) == ["2.damaged", "4.damaged"]  # nothing trained, no .incomplete


# --------------------------------------------------------------------------- 2


def test_item2_ids_outside_the_vocabulary_are_refused(tmp_path, capsys):
    ids = np.arange(4000) % 200
    ids[1234] = 300
    bad = write_token_file(tmp_path / "bad.bin", ids)
    with pytest.raises(ConfigError, match=r"300.*model\.vocab_size=260"):
        Trainer(config(tmp_path, "tok", "data.source=tokens", f"data.path={bad}"))
    with pytest.raises(ConfigError, match=r"258.*model\.vocab_size=10"):  # the byte corpus (EOS is 258)
        Trainer(config(tmp_path, "small", "model.vocab_size=10"))
    Trainer(config(tmp_path, "run")).close()  # a run to add data to
    assert cli.main(["data", "add", str(tmp_path / "run"), str(bad)]) == 2
    err = capsys.readouterr().err
    assert "300" in err and "model.vocab_size=260" in err and err.count("\n") == 1
    with pytest.raises(ConfigError, match="300"):
        add_data(tmp_path / "run", [bad])


@pytest.fixture
def poison(monkeypatch):
    """``poison(batches)``: a train step whose input is one of ``batches`` gets a NaN loss and NaN gradients."""

    def install(batches):
        rows = jnp.asarray(np.stack([np.asarray(jax.device_get(b))[0] for b in batches]))
        real = step_module.objective

        def objective(graphdef, params, tokens, *packing):  # packing: the packed-documents arguments, passed on
            loss, metrics = real(graphdef, params, tokens, *packing)
            bad = jnp.any(jnp.all(tokens[0][None, :] == rows, axis=1))
            return loss * jnp.where(bad, jnp.nan, 1.0), metrics

        monkeypatch.setattr(step_module, "objective", objective)

    return install


def test_item2_nonfinite_step_stops_the_run_exit_2(tmp_path, poison, capsys):
    # Step 5 is non-finite.  The host syncs at 3 and 6 (train.log_every=3) and at the saves (2, 4, 6):
    # step 5 is found at step 6, before its save, so the newest checkpoint is the last good state.
    with Trainer(config(tmp_path, "n", "train.steps=6")) as t:
        poison([t.batch(4)])
    assert cli.main(["train", *args(tmp_path, "n", "train.steps=6")]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("jaxdist: step 5 has loss nan") and "train.skip_nonfinite=0" in err, err
    assert "the newest checkpoint is step 4" in err, err
    ck = RunCheckpointer(tmp_path / "n" / "checkpoints")
    assert ck.all_steps() == [2, 4]  # nothing from after the non-finite step was saved
    ck.close()


@dataclasses.dataclass
class KeepStates:
    """A callback that copies the state after some steps without syncing the host (the loop's pattern stays)."""

    steps: tuple[int, ...]
    states: dict = dataclasses.field(default_factory=dict)
    syncs: bool = False

    def due(self, step, last):
        return step in self.steps

    def __call__(self, ctx):
        self.states[ctx.step] = jax.tree.map(jnp.copy, {k: ctx.trainer.state[k] for k in ("params", "opt_state")})


def test_item2_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path, poison, caplog):
    # Steps 3 and 5 are non-finite; train.skip_nonfinite=1 skips step 3, step 5 stops the run (found at 6).
    keep = KeepStates((2, 3, 4))
    with Trainer(config(tmp_path, "n", "train.steps=6", "train.skip_nonfinite=1")) as t:
        poison([t.batch(2), t.batch(4)])
        t.add_callback(keep)
        with caplog.at_level(logging.WARNING), pytest.raises(ConfigError) as e:  # the CLI exits 2
            t.fit()
    msg = str(e.value)
    assert "step 5" in msg and "train.skip_nonfinite=1" in msg and "step 4" in msg, msg
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "step 3" in skipped[0], skipped
    same = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), keep.states[2], keep.states[3])
    assert all(jax.tree.leaves(same))  # step 3's update was not applied: parameters and optimizer state
    assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, keep.states[3]["params"], keep.states[4]["params"])))
    ck = RunCheckpointer(tmp_path / "n" / "checkpoints")
    assert ck.all_steps() == [2, 4]  # nothing after the non-finite step 5 was saved
    ck.close()
    rows = read_metrics(tmp_path / "n")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # step 3 counts as consumed
    assert [i + 1 for i, r in enumerate(rows) if not math.isfinite(r["loss"])] == [3, 5]
    assert rows[2].get("skipped") is True and "skipped" not in rows[1]


@pytest.mark.parametrize(
    "override",
    [
        "train.learning_rate=nan",
        "train.learning_rate=-0.001",
        "train.warmup_steps=-1",
        "train.grad_clip=-1",
        "train.skip_nonfinite=-1",
        "train.schedule_steps=-5",
    ],
)
def test_item2_negative_or_nan_optimizer_settings_are_config_errors(override):
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        load_config(None, [override])


# --------------------------------------------------------------------------- 3


def test_item3_longer_run_keeps_the_recorded_schedule(base, tmp_path, caplog):
    run = copy_run(base, tmp_path, "lr")
    with caplog.at_level(logging.WARNING):
        longer = train(config(tmp_path, "lr", "train.steps=6"))
    rows = {r["step"]: r for r in read_metrics(run)}
    t = longer.config.train  # the 4-step schedule goes on: past its end, the rate stays at its minimum
    assert rows[5]["lr"] == pytest.approx(t.learning_rate * t.min_lr_ratio, rel=1e-6)
    assert rows[5]["lr"] != pytest.approx(float(learning_rate_schedule(t, steps=6)(4)), rel=1e-3)  # not stretched
    notices = [r.getMessage() for r in caplog.records if "train.steps" in r.getMessage()]
    assert len(notices) == 1 and "4" in notices[0] and "6" in notices[0] and "schedule_steps" in notices[0]
    for step in (4, 6):  # recorded when the run started, and kept
        assert json.loads((run / "checkpoints" / str(step) / "meta" / "metadata").read_text())["schedule_steps"] == 4
    # train.schedule_steps says otherwise: a schedule of that length from here on
    with Trainer(config(tmp_path, "lr", "train.steps=8", "train.schedule_steps=8")) as t:
        t.init_state()
        assert t.schedule_steps == 8 and float(t.schedule(6)) == float(learning_rate_schedule(t.config.train, 8)(6))
    with Trainer(config(tmp_path, "lr", "train.steps=6")) as t:  # the same total: the recorded one, no notice
        caplog.clear()
        t.init_state()
        assert t.schedule_steps == 4 and not [r for r in caplog.records if "train.steps" in r.getMessage()]


# --------------------------------------------------------------------------- 4


def test_item4_torn_metrics_line_is_named_and_skipped(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    good = {"kind": "train", "step": 1, "loss": 5.0, "batch_id": "1:0", "batch_version": 1}
    path.write_text(json.dumps(good) + "\n" + '{"kind": "train", "step": 2, "lo')  # killed mid-write
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write("train", 2, {"loss": 4.0, "batch_id": "1:1", "batch_version": 1})  # the resumed run
    w.close()
    with caplog.at_level(logging.WARNING):
        rows = read_metrics(tmp_path)
        trained = trained_batches(tmp_path)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 5.0), (2, 4.0)]
    assert [r["batch_id"] for r in trained] == ["1:0", "1:1"]
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("line 2" in m and "metrics.jsonl" in m for m in warnings) == 2  # each reader names it


# --------------------------------------------------------------------------- 5


def _fake_step(ckdir, step, committed):
    d = ckdir / str(step)
    (d / "state").mkdir(parents=True)
    (d / "state" / "data").write_bytes(b"x" * 10)
    if committed:
        integrity.record_own_checksums(d, 0)
        integrity.commit(d, 1, {"step": step})
    return d


def test_item5_incomplete_folders_older_than_the_newest_commit_are_removed(tmp_path):
    ckdir = tmp_path / "checkpoints"
    _fake_step(ckdir, 4, committed=True)
    _fake_step(ckdir, 2, committed=False)  # a kill while step 2 was being deleted (its marker gone first)
    old = _fake_step(ckdir, 1, committed=False)
    integrity.set_aside(old, "incomplete")  # set aside by an earlier start: 1.incomplete
    _fake_step(ckdir, 6, committed=False)  # newer than the newest commit: perhaps still being written
    RunCheckpointer(ckdir).close()
    names = sorted(p.name for p in ckdir.iterdir())
    assert names == ["4", "6.incomplete"], names
    RunCheckpointer(ckdir).close()  # and the next start keeps the newer one set aside
    assert sorted(p.name for p in ckdir.iterdir()) == ["4", "6.incomplete"]


# --------------------------------------------------------------------------- 12


def refused(capsys, argv, *words):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_item12_non_utf8_config_file(tmp_path, capsys):
    latin = tmp_path / "latin.toml"
    latin.write_bytes('[train]\nname = "caf\xe9"\n'.encode("latin-1"))
    refused(capsys, ["config", "--config", str(latin)], "is not UTF-8", "0xe9")


def test_item12_config_directory(tmp_path, capsys):
    refused(capsys, ["config", "--config", str(tmp_path)], "is a directory")


def test_item12_ckpt_verify_on_a_folder_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "notarun").mkdir()
    (tmp_path / "notarun" / "notes.txt").write_text("hello")
    refused(capsys, ["ckpt", "verify", str(tmp_path / "notarun")], "neither a run directory", "without checkpoints/")


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", "a\\b"])
def test_item12_run_name_with_a_path(name):
    with pytest.raises(ConfigError, match="train.name"):
        load_config(None, [f"train.name={name}"])


def test_item12_min_nodes_above_the_cluster_says_why(tmp_path):
    # A subprocess: the controller binds its socket before it checks the node counts.
    out = subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", "launch", "mesh.cluster=cpu-4x2", "controller.min_nodes=5"],
        cwd=tmp_path,
        env={**os.environ, "XLA_FLAGS": without_device_count(os.environ["XLA_FLAGS"])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "None" not in out.stderr and "controller.min_nodes=5" in out.stderr and "4 nodes" in out.stderr, out.stderr


def test_item12_remat_save_with_a_misspelt_tag(tmp_path):
    with pytest.raises(ConfigError, match="attn_outt.*attn_out"):
        remat_policy("save:query_proj,attn_outt")
    assert remat_policy("save:" + ",".join(CHECKPOINT_NAMES)) is not None
    with pytest.raises(ConfigError, match="attn_outt"):
        Trainer(config(tmp_path, "remat", "train.remat=save:attn_outt"))

"""The fast local tier in one process (8 devices): resume from it, fall back from it, never reuse a stale one.

The multi-node part (replication to a peer node, a replaced node restored
from its peer) is in test_local_multiprocess.py.
"""

from __future__ import annotations

import json
import logging
import time

import jax
import numpy as np
import pytest

from jaxdist.config import ConfigError, load_config
from jaxdist.run_owner import HISTORY_SINCE_ENV
from jaxdist.train.metrics import read_metrics
from jaxdist.train.trainer import Trainer
from tests.trees import leaf_pairs

STEPS = 10


def config(tmp_path, name, extra=()):
    return load_config(
        None,
        [
            "model=tiny",
            f"train.steps={STEPS}",
            "train.seq_len=32",
            "train.batch_size=8",
            "train.log_every=5",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.every=4",
            "data.max_bytes=400000",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            "train.warmup_steps=3",
            f"train.runs_dir={tmp_path}",
            f"train.name={name}",
            f"checkpoint.local_dir={tmp_path}/local/{{node}}",
            *extra,
        ],
    )


class Crash(Exception):
    pass


def crash_at(step):
    def hook(t, done, _):
        if done == step:
            t.local.wait()  # the previous step's local files are on disk, this step's state is not saved
            raise Crash(done)

    return hook


def run_until_crash(cfg, step):
    t = Trainer(cfg)
    t.add_hook(crash_at(step))
    with pytest.raises(Crash):
        t.fit()
    t.close()
    return t


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    with Trainer(config(tmp, "full", ["checkpoint.local_dir="])) as t:
        t.fit()
        return jax.device_get(t.state), [(r["step"], r["loss"]) for r in read_metrics(tmp / "full")]


def test_resume_from_local_tier_is_bit_identical(tmp_path, reference):
    full, losses = reference
    cfg = config(tmp_path, "crash")
    t = run_until_crash(cfg, 8)  # persistent at 4; local at 1 to 7 (keep 2: 6 and 7 on disk)
    assert t.checkpointer.latest_step() == 4
    assert sorted(t.local._own_steps()) == [6, 7]
    stats = t.local.stats
    assert [s.step for s in stats] == [1, 2, 3, 4, 5, 6, 7] and all(s.replicate_s == 0 for s in stats)

    with Trainer(config(tmp_path, "crash")) as t2:
        t2.init_state()
        assert int(t2.state["step"]) == 7 and t2.resumed_from == ("local", 7)
        t2.fit()
        resumed = jax.device_get(t2.state)
    for a, b in leaf_pairs(full, resumed):
        np.testing.assert_array_equal(a, b)
    logged = [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "crash")]
    assert sorted(set(logged)) == losses  # the same loss at every step, step 8 (lost in the crash) twice
    assert len(logged) == len(losses) + 1 and [s for s, _ in logged].count(8) == 2


def test_damaged_or_foreign_local_files_fall_back(tmp_path, reference):
    cfg = config(tmp_path, "damaged")
    t = run_until_crash(cfg, 7)  # local 5 and 6 on disk, persistent 4
    newest = sorted(t.local.directory.glob("6/r0.w0.bin"))
    assert newest
    data = bytearray(newest[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest[0].write_bytes(bytes(data))
    with Trainer(config(tmp_path, "damaged")) as t2:
        t2.init_state()
        assert t2.resumed_from == ("local", 5)  # step 6 failed its checksum: the older local step
        five = jax.device_get(t2.state)
    # Another mesh: local step 5 (newer than the persistent 4) is resharded onto it, the same values
    other = ["mesh.data=4", "mesh.fsdp=2", "mesh.tensor=1"]
    with Trainer(config(tmp_path, "damaged", other)) as t3:
        t3.init_state()
        assert t3.resumed_from == ("local", 5)
        for a, b in leaf_pairs(five, jax.device_get(t3.state)):
            np.testing.assert_array_equal(a, b)
        assert not (t3.local.directory / "6").exists()  # the damaged step 6 came after it: an abandoned future
    # Another mesh again, with the local step 5 file damaged too: the persistent checkpoint (any mesh) is used
    five_file = t.local.directory / "5" / "r0.w0.bin"
    data = bytearray(five_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    five_file.write_bytes(bytes(data))
    with Trainer(config(tmp_path, "damaged", ["mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1"])) as t4:
        t4.init_state()
        assert t4.resumed_from == ("persistent", 4)
        assert t4.local._own_steps() == set()  # local step 5 came after the step resumed from: deleted


def test_a_local_marker_that_does_not_parse_or_match_is_named_and_not_used(tmp_path, caplog):
    cfg = config(tmp_path, "marker")
    t = run_until_crash(cfg, 7)  # local 5 and 6 on disk, persistent 4
    six, five = t.local.directory / "6" / "r0.w0.json", t.local.directory / "5" / "r0.w0.json"
    data = bytearray(six.read_bytes())
    data[len(data) // 2] ^= 0xFF  # no longer UTF-8: does not parse
    six.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint.local"), Trainer(cfg) as t2:
        t2.init_state()
        assert t2.resumed_from == ("local", 5)
    assert f"local checkpoint marker {six} does not parse or match its file" in caplog.text
    caplog.clear()
    marker = json.loads(five.read_text())
    five.write_text(json.dumps({**marker, "step": 6}))  # parses, but is not the marker of the file beside it
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint.local"), Trainer(cfg) as t3:
        t3.init_state()
        assert t3.resumed_from == ("persistent", 4)
    assert f"local checkpoint marker {five} does not parse or match its file" in caplog.text


def test_a_fresh_start_clears_the_local_tier(tmp_path):
    crashed = run_until_crash(config(tmp_path, "fresh"), 3)
    assert crashed.local._own_steps() == {1, 2}
    with Trainer(config(tmp_path, "fresh", ["checkpoint.resume=false"])) as t:
        assert t.local._own_steps() == set()  # cleared when the fresh start opens the run, before any restore
        t.init_state()
        assert int(t.state["step"]) == 0 and t.local._own_steps() == set()


def test_local_tier_config_errors(tmp_path):
    from jaxdist.config import validate

    with pytest.raises(ConfigError, match="local_every"):
        validate(config(tmp_path, "x", ["checkpoint.local_every=0"]), 8)
    with pytest.raises(ConfigError, match="checkpoint.enabled"):
        validate(config(tmp_path, "x", ["checkpoint.enabled=false"]), 8)


def test_marker_records_size_crc_and_layout(tmp_path):
    t = run_until_crash(config(tmp_path, "marker"), 2)
    marker = json.loads(next(t.local.directory.glob("1/r0.w0.json")).read_text())
    assert marker["step"] == 1 and marker["rank"] == 0 and marker["writer"] == 0
    assert marker["bytes"] == (t.local.directory / "1" / "r0.w0.bin").stat().st_size
    assert len(marker["signature"]) == 32


def test_a_job_that_started_over_does_not_restore_the_earlier_historys_local_files(tmp_path, monkeypatch):
    """Under `jaxdist launch ... checkpoint.resume=false` the controller sets the history aside and its workers
    resume (checkpoint.resume=true) with JAXDIST_HISTORY_SINCE: local files from before that are not theirs."""
    run_until_crash(config(tmp_path, "since"), 3)  # local steps 1 and 2, no persistent checkpoint yet
    with Trainer(config(tmp_path, "since")) as t:  # these files, in their own history: used
        t.init_state()
        assert t.resumed_from == ("local", 2)
    monkeypatch.setenv(HISTORY_SINCE_ENV, repr(time.time() + 1e-3))
    with Trainer(config(tmp_path, "since")) as t:  # the same files, older than the job's fresh start: not used
        t.init_state()
        assert t.resumed_from is None and int(t.state["step"]) == 0


def test_local_dir_auto_is_on_under_a_node_agent_with_room_and_off_otherwise(tmp_path, monkeypatch, caplog):
    """The default checkpoint.local_dir=auto: off for jaxdist train; in a launched job (a node agent sets
    $JAXDIST_NODE) <tmp>/jaxdist-local/<node>/<run>; off, with one logged reason, when the disk lacks room;
    a finished run's files removed."""
    import shutil
    import tempfile
    from collections import namedtuple

    from jaxdist.train.trainer import Trainer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    base = ["model=tiny", "train.seq_len=32", "train.batch_size=8", "data.max_bytes=200000", "mesh.cluster=cpu-8"]
    cfg = load_config(None, [*base, f"train.runs_dir={tmp_path / 'runs'}", "train.steps=2", "train.name=auto"])
    assert cfg.checkpoint.local_dir == "auto"
    monkeypatch.delenv("JAXDIST_NODE", raising=False)
    with Trainer(cfg) as t:
        assert t.local is None  # jaxdist train
    monkeypatch.setenv("JAXDIST_NODE", "n7")
    with Trainer(cfg) as t:
        assert t.local is not None and t.local.directory.parent == tmp_path / "tmp" / "jaxdist-local" / "n7"
        t.init_state()
        t.fit()
        assert t.local._own_steps() == {1, 2}
        where = t.local.directory
    assert not where.exists()  # the run finished: its persistent step 2 holds the end
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint.local"), Trainer(cfg) as t:
        assert t.local is None
    assert "the local tier is off" in caplog.text and "set checkpoint.local_dir" in caplog.text

"""A train state saved on one mesh restores bit for bit onto another; the Trainer skips a damaged step."""

import logging
import shutil

import jax
import numpy as np
import pytest

from jaxdist.checkpoint import RunCheckpointer, integrity
from jaxdist.config import load_config
from jaxdist.train.trainer import Trainer
from tests.trees import leaf_pairs


def config(tmp_path, mesh, *extra):
    return load_config(
        None,
        [
            "model=tiny",
            "train.steps=4",
            "train.seq_len=32",
            "train.batch_size=8",
            "train.log_every=2",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.progress=false",
            "train.tensorboard=false",
            "data.max_bytes=200000",
            "checkpoint.every=2",
            f"train.runs_dir={tmp_path}",
            "train.name=run",
            *[f"mesh.{k}={v}" for k, v in mesh.items()],
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A data=8 (fully replicated) run of 4 real steps, checkpoints at 2 and 4; its final state on the host."""
    tmp = tmp_path_factory.mktemp("restore")
    with Trainer(config(tmp, {"data": 8})) as t:
        t.fit()
        assert all(a.sharding.is_fully_replicated for a in jax.tree.leaves(t.state))
        names = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(t.state)[0]]
        return tmp, names, jax.device_get(t.state)


def test_state_saved_on_data8_restores_bit_identical_on_fsdp4_tensor2(trained):
    tmp, names, saved = trained
    with Trainer(config(tmp, {"fsdp": 4, "tensor": 2}, "checkpoint.enabled=false")) as t2:
        target = t2.abstract_state()
    state, meta = RunCheckpointer(tmp / "run" / "checkpoints").restore(target)
    assert meta["step"] == 4 and meta["data"]["position"] == 4
    for name, a, b, tgt in zip(names, jax.tree.leaves(saved), jax.tree.leaves(state), jax.tree.leaves(target)):
        assert b.sharding == tgt.sharding, name
        got = np.asarray(b)
        assert got.dtype == a.dtype and np.array_equal(got, a), name
    sharded = [b for b in jax.tree.leaves(state["params"]) if not b.sharding.is_fully_replicated]
    assert len(sharded) >= 5  # the target really is a different layout


def test_trainer_resumes_from_the_newest_good_checkpoint(trained, tmp_path, caplog):
    tmp, _, _ = trained
    ckdir = tmp_path / "run" / "checkpoints"
    shutil.copytree(tmp / "run", tmp_path / "run")  # checkpoints and whatever else the run keeps
    files = integrity.read_commit(ckdir / "4")["files"]
    victim = ckdir / "4" / max((f for f in files if "/d/" in f), key=lambda f: files[f]["size"])
    data = bytearray(victim.read_bytes())
    data[100] ^= 1
    victim.write_bytes(data)
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint.manager"):
        with Trainer(config(tmp_path, {"data": 8})) as t:
            t.init_state()
            assert int(t.state["step"]) == 2
            assert (
                f"checkpoint {ckdir / '4'} is damaged: {victim.relative_to(ckdir / '4').as_posix()} has CRC-32"
                in caplog.text
            )
            ref, meta = t.checkpointer.restore(t.abstract_state(), step=2)
            assert meta["step"] == 2 and all(
                np.array_equal(np.asarray(a), np.asarray(b)) for a, b in leaf_pairs(t.state, ref)
            )
    assert sorted(p.name for p in ckdir.iterdir()) == ["2", "4.damaged"]

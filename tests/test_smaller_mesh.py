"""A mesh smaller than the devices, asked for explicitly, runs on the first ones; a larger one is refused."""

import logging
from types import SimpleNamespace

import jax
import pytest

from jaxdist.config import ConfigError, MeshConfig, load_config, unused_devices_note, validate
from jaxdist.parallel.mesh import mesh_devices
from jaxdist.resolve import resolve
from jaxdist.train.trainer import Trainer


def test_which_meshes_use_fewer_devices():
    assert MeshConfig(data=2).devices_used(8) == 2
    assert MeshConfig(data=1, tensor=2, fsdp=2).devices_used(8) == 4
    assert MeshConfig(data=-1, tensor=2).devices_used(8) == 8  # data=-1 fills the devices
    assert MeshConfig(data=3, tensor=4).devices_used(8) == 8  # too large: left to resolved() to refuse
    assert unused_devices_note(MeshConfig(data=2, fsdp=2), 8) == (
        "mesh data=2 x fsdp=2 runs on the first 4 of the 8 devices; 4 left unused (mesh.data=-1 uses them all)"
    )
    assert unused_devices_note(MeshConfig(data=8), 8) is None
    validate(load_config(None, ["mesh.data=1"]), 8)  # was "mesh 1 has 1 devices but 8 are available"
    with pytest.raises(ConfigError, match=r"^mesh data=3 x tensor=4 has 12 devices but 8 are available: "):
        validate(load_config(None, ["mesh.data=3", "mesh.tensor=4"]), 8)
    with pytest.raises(ConfigError, match="is not divisible by the data axes data\\*fsdp=3"):  # checked on 3 devices
        validate(load_config(None, ["mesh.data=3", "train.batch_size=32"]), 8)


def test_a_multi_process_job_needs_a_device_on_every_process():
    devices = [SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    assert mesh_devices(MeshConfig(data=8), devices) == devices
    assert [d.id for d in mesh_devices(MeshConfig(data=2, fsdp=2, tensor=2), devices)] == list(range(8))
    with pytest.raises(ConfigError, match="leaves some of the job's 2 processes without a device"):
        mesh_devices(MeshConfig(data=2), devices)


def test_train_on_the_first_two_of_eight_devices(tmp_path, caplog):
    cfg = load_config(
        None,
        [
            "model=tiny",
            "mesh.data=2",
            "train.steps=2",
            "train.batch_size=4",
            "train.seq_len=32",
            "train.log_every=1",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.progress=false",
            "train.tensorboard=false",
            f"train.runs_dir={tmp_path}",
            "data.max_bytes=100000",
            "checkpoint.enabled=false",
        ],
    )
    with caplog.at_level(logging.WARNING, logger="jaxdist"):
        resolved = resolve(cfg, jax.devices())
    notes = [r.getMessage() for r in caplog.records if "left unused" in r.getMessage()]
    assert notes == ["mesh data=2 runs on the first 2 of the 8 devices; 6 left unused (mesh.data=-1 uses them all)"]
    with Trainer(resolved) as trainer:
        assert trainer.devices == jax.devices()[:2] and trainer.mesh.devices.size == 2
        trainer.init_state()
        history = trainer.fit()
    assert [h["step"] for h in history] == [1, 2]
    with Trainer(cfg) as trainer:  # built without resolve(): the same first two devices
        assert list(trainer.mesh.devices.flat) == jax.devices()[:2]

"""resolve(): mesh=auto and train.remat=auto settled before the Trainer, validated once for the devices."""

import dataclasses

import jax
import pytest

from jaxdist.config import ConfigError, load_config
from jaxdist.resolve import resolve
from jaxdist.train.trainer import Trainer

COMMON = [
    "model=tiny",
    "train.batch_size=16",
    "train.seq_len=64",
    "checkpoint.enabled=false",
    "train.tensorboard=false",
    "train.progress=false",
    "data.max_bytes=100000",
]


def test_remat_auto_becomes_the_selectors_plan_and_the_trainer_plans_nothing(tmp_path):
    cfg = load_config(
        None,
        COMMON
        + [
            "train.remat=auto",
            "train.remat_budget_bytes=3000000",
            "train.remat_verify=false",
            f"train.runs_dir={tmp_path}",
        ],
    )
    resolved = resolve(cfg, jax.devices())
    spec = resolved.remat  # beside the config, not inside it
    assert spec.kind == "selected" and spec.plan.activation_bytes <= 3_000_000
    assert (
        resolved.config.train.remat == "auto" and str(spec) == "auto"
    )  # config.json says auto; a resume selects again
    assert resolved.config == cfg and resolved.devices == tuple(jax.devices())
    # a copy of the config made later cannot drop the choice: it was never in the config
    assert dataclasses.replace(resolved.config).train.remat_spec.kind == "auto" and resolved.remat is spec
    assert cfg.train.remat_spec.kind == "auto"  # the input is untouched
    with Trainer(resolved) as trainer:
        assert trainer.remat_plan is spec.plan
    with pytest.raises(ConfigError, match="train.remat=auto is settled before the Trainer is built"):
        Trainer(cfg)


def test_mesh_auto_must_be_resolved_and_devices_are_checked_once(tmp_path):
    cfg = load_config(None, COMMON + ["mesh=auto", f"train.runs_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="mesh=auto is settled before the Trainer is built"):
        Trainer(cfg)
    resolved = resolve(cfg, jax.devices())
    assert resolved.config.mesh.auto is False and len(resolved.devices) == 8
    assert Trainer.for_compiling(resolved).devices == list(resolved.devices)  # taken as it is: checked once
    with pytest.raises(ConfigError, match="is not divisible by the data axes"):
        resolve(load_config(None, COMMON + ["train.batch_size=12", f"train.runs_dir={tmp_path}"]), jax.devices())

"""Plan output: table, config round trip, axes, fallback to fewer devices, mesh=auto, and the CLI."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jaxdist.cluster import without_device_count
from jaxdist.config import load_config, validate
from jaxdist.planner import plan
from jaxdist.planner.candidates import REMAT_CHOICES
from jaxdist.planner.plan import trainable_axes

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_saved_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_CALIBRATION_DIR", str(tmp_path / "calibration"))


def test_plan_writes_a_config_that_loads_to_the_chosen_strategy(tmp_path):
    m = load_config(None, ["model=llama-8b"]).model
    p = plan(m, "h100x8", batch_size=32, seq_len=4096)
    path = tmp_path / "plan.toml"
    path.write_text(p.to_toml())
    cfg = load_config(path)
    s = p.best.strategy
    assert cfg.mesh.sizes() == s.mesh and cfg.mesh.cluster == "h100x8"
    assert cfg.train.microbatches == s.microbatches and cfg.train.batch_size == 32 and cfg.train.seq_len == 4096
    assert cfg.train.remat == {c.name: c.train_remat for c in REMAT_CHOICES}[s.remat]
    assert cfg.model == m
    validate(cfg, 8)
    lines = p.table(3).splitlines()
    assert (
        lines[0].split()[:4] == ["#", "mesh", "mb", "remat"] and len([l for l in lines if l[:2].strip().isdigit()]) == 3
    )
    assert f"{p.best.step_time:.4g}" in lines[2]


def test_planned_axes_are_the_ones_train_accepts():
    axes = trainable_axes()
    assert axes[:4] == ("data", "fsdp", "context", "tensor")
    # train accepts pipeline stages for a dense model, so the planner must be able to choose them (no except
    # around the assertion: a missing axis fails here instead of being caught as "train refuses it")
    load_config(None, ["mesh.pipeline=2"])
    assert "pipeline" in axes


def test_fewer_devices_when_the_batch_does_not_divide_the_free_ones():
    m = load_config(None, ["model=llama-1b"]).model
    busy = [f"{n}:*" for n in range(5)]  # 3 nodes (24 devices) stay free
    p = plan(m, "h100x64", batch_size=32, seq_len=2048, busy=busy)
    assert p.cluster.n_devices == 16 and p.best.strategy.n_devices == 16
    assert set(p.cluster.devices) <= set(range(40, 64))


def test_mesh_auto_makes_the_trainer_use_the_plan(tmp_path):
    import jax

    from jaxdist.resolve import resolve
    from jaxdist.train.trainer import Trainer

    overrides = [
        "model=tiny",
        "mesh=auto",
        "train.batch_size=16",
        "train.seq_len=64",
        "train.progress=false",
        "checkpoint.enabled=false",
        "train.tensorboard=false",
        "data.max_bytes=100000",
        f"train.runs_dir={tmp_path}",
    ]
    cfg = load_config(None, overrides)
    expected = plan(cfg.model, "cpu-8", batch_size=16, seq_len=64).best.strategy
    with Trainer(resolve(cfg, jax.devices())) as trainer:
        assert dict(trainer.mesh.shape) == expected.mesh
        assert trainer.config.train.microbatches == expected.microbatches
        assert trainer.config.mesh.auto is False and trainer.config.mesh.cluster == "cpu-8"


def _env(tmp_path):
    env = {**os.environ, "XLA_FLAGS": without_device_count(os.environ["XLA_FLAGS"])}  # conftest's compile flags
    env.update(JAX_PLATFORMS="cpu", JAXDIST_CALIBRATION_DIR=str(tmp_path / "calibration"))
    return env


def jaxdist(*args, cwd, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", *args],
        cwd=cwd,
        env=_env(cwd),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_cli_plans_llama_70b_and_writes_its_config(tmp_path):
    out = jaxdist(
        "plan",
        "--model",
        "llama-70b",
        "--cluster",
        str(REPO / "meshes" / "h100x64.toml"),
        "train.batch_size=64",
        "--out",
        "p70.toml",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dominated by" in out.stdout and "chosen:" in out.stdout and "wrote p70.toml" in out.stdout
    plan_cfg = tomllib.loads((tmp_path / "p70.toml").read_text())
    assert plan_cfg["model"]["preset"] == "llama-70b" and plan_cfg["train"]["seq_len"] == 8192
    assert 1 < plan_cfg["mesh"]["tensor"] <= 8


def test_cli_too_large_is_a_one_sentence_error(tmp_path):
    out = jaxdist(
        "plan", "--model", "llama-70b", "--cluster", "h100x8", "train.batch_size=8", "train.seq_len=4096", cwd=tmp_path
    )
    err = out.stderr.strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("jaxdist: model 'llama-70b'") and "GiB per device" in err


def test_cli_plan_then_train_runs_the_planned_config(tmp_path):
    out = jaxdist(
        "plan",
        "model=tiny",
        "--cluster",
        "cpu-8",
        "train.batch_size=16",
        "train.seq_len=32",
        "--out",
        "tiny.toml",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    planned = load_config(tmp_path / "tiny.toml")
    run = jaxdist(
        "train",
        "--config",
        "tiny.toml",
        "train.steps=2",
        "train.progress=false",
        "checkpoint.enabled=false",
        "data.max_bytes=300000",
        "train.name=planned",
        cwd=tmp_path,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    shape = " ".join(f"{a}={n}" for a, n in planned.mesh.sizes().items() if n != 1)
    assert f"mesh {shape} (8 devices" in run.stderr
    assert "steps 1..2: loss" in run.stderr


def test_a_pipelined_plan_writes_its_schedule_and_chunks():
    m = load_config(None, ["model=small", "model.n_layers=8"]).model
    p = plan(m, "cpu-8", batch_size=16, seq_len=64, axes=("pipeline",))
    s = p.best.strategy
    assert s.pipeline == 8 and s.schedule in ("gpipe", "1f1b", "seq1f1b")
    cfg = p.to_config()
    validate(cfg, 8)
    assert cfg.pipeline.schedule == s.schedule and cfg.mesh.pipeline == 8
    if s.schedule == "seq1f1b":
        assert cfg.pipeline.chunks == s.chunks > 1 and f"seq1f1b x{s.chunks}" in p.table(1)
    seq = [e.strategy for e in p.ranked if e.strategy.schedule == "seq1f1b"]
    assert seq and {x.chunks for x in seq} <= {2, 4}

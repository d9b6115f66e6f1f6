"""jaxdist on a machine with only JAX, flax, optax, orbax-checkpoint and numpy (the lent GPU image has no pyzmq or
tensorboardX): it imports, trains at the defaults and runs benchmarks/gpu_check.py; a command that needs a missing
package says which, in one sentence, with exit code 2.

The optional packages are hidden from the subprocesses by a ``sitecustomize`` that refuses to import them, as if
they were not installed.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdist import optional
from jaxdist.cluster import without_device_count
from jaxdist.errors import ConfigError
from jaxdist.train.callbacks import ProgressBar
from jaxdist.train.metrics import MetricsWriter

REPO = Path(__file__).resolve().parents[1]
HIDDEN = (*optional.PACKAGES, "torch", "transformers", "matplotlib")

SITECUSTOMIZE = f"""
import importlib.abc, sys

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {HIDDEN!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, _NotInstalled())
"""


def _run(args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    hide = tmp_path / "hide"
    hide.mkdir(exist_ok=True)
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["XLA_FLAGS"] = without_device_count(os.environ["XLA_FLAGS"])  # conftest's compile flags
    env["PYTHONPATH"] = os.pathsep.join([str(hide), str(REPO), env.get("PYTHONPATH", "")])
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_the_default_job_trains_without_the_optional_packages(tmp_path):
    """The defaults (progress bar and TensorBoard on) train; each missing convenience is one warning."""
    done = _run(["-m", "jaxdist.cli", "train", "train.steps=3"], tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps 1..3" in done.stderr
    for package, setting in (("tensorboardX", "train.tensorboard=false"), ("tqdm", "train.progress=false")):
        warnings = [line for line in done.stderr.splitlines() if f"package {package} is not installed" in line]
        assert len(warnings) == 1 and setting in warnings[0], done.stderr[-3000:]
    run = tmp_path / "runs" / "default"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 3 in steps
    assert not (run / "tb").exists()


def test_a_controller_command_without_pyzmq_is_one_sentence_and_exit_2(tmp_path):
    done = _run(["-m", "jaxdist.cli", "launch", "--print"], tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip() == (
        "jaxdist: this command needs the Python package pyzmq, which is not installed: pip install pyzmq."
    )


def test_the_gpu_check_runs_without_the_optional_packages(tmp_path):
    """``benchmarks/gpu_check.py --cpu-smoke``: every row that can run on a CPU has its figures, none an error."""
    done = _run([str(REPO / "benchmarks" / "gpu_check.py"), "--cpu-smoke"], tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "Error" not in out and "error" not in out, out
    xla_rows = [line for line in out.splitlines() if line.startswith("| xla |")]
    assert len(xla_rows) == 2 and all(" ms | " in r for r in xla_rows), out
    memory = [line for line in out.splitlines() if line.startswith("memory, remat ")]
    assert len(memory) == 2 and all(" GiB, planner " in line for line in memory), out
    assert any(line.startswith("remat auto ") and " ms, MFU " in line for line in out.splitlines()), out


def _hide(monkeypatch, *roots: str) -> None:
    """Make ``roots`` (and their modules) unimportable in this process, as if they were not installed."""
    for name in list(sys.modules):
        if name.split(".")[0] in roots:
            monkeypatch.delitem(sys.modules, name)

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in roots:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(sys, "meta_path", [NotInstalled(), *sys.meta_path])


def test_a_missing_package_a_feature_needs_is_a_config_error(monkeypatch):
    _hide(monkeypatch, "safetensors")
    with pytest.raises(ConfigError, match=r"^writing a Hugging Face checkpoint needs the Python package safetensors, "):
        optional.require("safetensors.numpy", "writing a Hugging Face checkpoint")


def test_a_missing_convenience_is_skipped_with_one_warning(monkeypatch, tmp_path, caplog):
    _hide(monkeypatch, "tensorboardX", "tqdm")
    monkeypatch.setattr(optional, "_warned", set())
    with caplog.at_level("WARNING", logger="jaxdist.optional"):
        for _ in range(2):
            writer = MetricsWriter(tmp_path, tensorboard=True)
            writer.write("train", 1, {"loss": 1.0})
            writer.close()
            assert ProgressBar.start(10, 0, "x") is None
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["no TensorBoard event files", "no progress bar"]
    assert not (tmp_path / "tb").exists()
    assert (tmp_path / "metrics.jsonl").read_text().count('"loss": 1.0') == 2


def test_an_error_inside_an_installed_package_is_not_called_missing():
    """Only the package itself being absent is 'not installed'; a module missing inside it stays a real error."""
    assert optional.missing_package(ModuleNotFoundError("No module named 'zmq'", name="zmq")) is not None
    assert optional.missing_package(ModuleNotFoundError("No module named 'zmq.x'", name="zmq.x")) is None
    assert optional.missing_package(ModuleNotFoundError("No module named 'yaml'", name="yaml")) is None
    with pytest.raises(ModuleNotFoundError):
        optional.load("tqdm.no_such_module", "x")  # tqdm is installed: raised, not skipped


def test_tensorboard_files_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports torch at import when torch is installed; the metrics writer keeps it out (a training
    process pays no torch import), and a later ``import torch`` in the same process still works."""
    pytest.importorskip("tensorboardX", reason="tensorboardX is not installed")
    code = f"""
import importlib.util, sys
from jaxdist.train.metrics import MetricsWriter
w = MetricsWriter({str(tmp_path)!r}, tensorboard=True)
w.write("train", 1, {{"loss": 1.5}})
w.close()
assert "tensorboardX" in sys.modules and "torch" not in sys.modules, "torch was imported"
if importlib.util.find_spec("torch") is not None:
    import torch
    assert torch.ones(2).sum().item() == 2.0
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "no event file written"

"""``jaxdist`` end to end: a real training run and resume, the config commands, user errors.

Every command runs as a subprocess (``python -m jaxdist.cli``, cwd a temporary
directory, bounded by a timeout that kills it) with no device count in XLA_FLAGS, so
the CLI itself must turn ``mesh.cluster=cpu-8`` into 8 simulated devices.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jaxdist.cluster import without_device_count
from jaxdist.config import load_config, reference_markdown

REPO = Path(__file__).resolve().parents[1]
TRAIN_TIMEOUT = 180  # seconds; a healthy run takes ~10 s
QUICK_TIMEOUT = 60  # seconds; errors are reported before any training

SMALL = [
    "model=tiny",
    "train.seq_len=32",
    "train.batch_size=16",
    "data.max_bytes=300000",
    "train.progress=false",
    "checkpoint.every=4",
    "train.name=cli",
]


def _env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
        and not k.startswith("SLURM_")
    }
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = without_device_count(os.environ["XLA_FLAGS"])  # conftest's compile flags, no device count
    return env


def jaxdist(*args: str, cwd: Path, timeout: float = QUICK_TIMEOUT) -> subprocess.CompletedProcess:
    """Run ``python -m jaxdist.cli ARGS`` in ``cwd``; subprocess.run kills it on timeout."""
    return subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _quiet(stderr: str) -> str:
    """stderr without XLA's sharding performance warnings."""
    return "\n".join(l for l in stderr.splitlines() if "Involuntary full rematerialization" not in l)


def _train_records(run: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in rows if r["kind"] == kind]


def _tb_scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    """step -> value of one scalar in the TFRecord event files under ``tb_dir``."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[int, float] = {}
    for path in sorted(tb_dir.rglob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = Event.FromString(data[i + 12 : i + 12 + n])
            i += 12 + n + 4
            for v in event.summary.value:
                if v.tag == tag:
                    out[event.step] = v.simple_value
    return out


# --------------------------------------------------------------------------- a real run, then resume


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``jaxdist train`` for 8 steps, then the same command with train.steps=12."""
    cwd = tmp_path_factory.mktemp("cli")
    first = jaxdist("train", *SMALL, "train.steps=8", cwd=cwd, timeout=TRAIN_TIMEOUT)
    assert first.returncode == 0, _quiet(first.stderr)[-3000:]
    run = cwd / "runs" / "cli"
    after_first = {
        "records": _train_records(run),
        "checkpoints": sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()),
    }
    second = jaxdist("train", *SMALL, "train.steps=12", cwd=cwd, timeout=TRAIN_TIMEOUT)
    assert second.returncode == 0, _quiet(second.stderr)[-3000:]
    return {"cwd": cwd, "run": run, "first": first, "second": second, **after_first}


def test_train_writes_the_run_folder(trained):
    run = trained["run"]
    assert trained["checkpoints"] == [4, 8]
    stderr = _quiet(trained["first"].stderr)
    assert "(8 devices, 1 process)" in stderr  # the CLI set up cpu-8's devices itself
    assert "resuming" not in stderr
    assert "steps 1..8: loss" in stderr and f"outputs in {Path('runs') / 'cli'}" in stderr
    # config.json is the resolved config of the overrides (of the latest invocation).
    assert json.loads((run / "config.json").read_text()) == load_config(None, [*SMALL, "train.steps=12"]).to_dict()


def test_loss_falls_and_metrics_are_complete(trained):
    recs = trained["records"]
    assert [r["step"] for r in recs] == list(range(1, 9))
    losses = [r["loss"] for r in recs]
    assert all(math.isfinite(x) for x in losses)
    # Untrained byte model: about ln(260) = 5.56 nats; 8 steps of warmup already cut it.
    assert abs(losses[0] - math.log(260)) < 0.5
    assert losses[-1] < losses[0] - 0.3
    for r in recs:
        assert r["tokens_per_s"] > 0 and r["step_time"] > 0 and 0 <= r["lr"] <= 3e-3 * (1 + 1e-6)  # float32 peak
    evals = _train_records(trained["run"], "eval")
    assert [e["step"] for e in evals] == [8, 12] and all(math.isfinite(e["loss"]) for e in evals)


def test_tensorboard_mirrors_the_jsonl(trained):
    tb = trained["run"] / "tb"
    assert list(tb.rglob("events.out.tfevents.*"))
    scalars = _tb_scalars(tb, "train/loss")
    jsonl = {r["step"]: r["loss"] for r in _train_records(trained["run"])}
    assert sorted(scalars) == sorted(jsonl) == list(range(1, 13))
    for step, loss in jsonl.items():
        assert scalars[step] == pytest.approx(loss, rel=1e-6)
    assert sorted(_tb_scalars(tb, "eval/loss")) == [8, 12]


def test_second_invocation_resumes_and_continues(trained):
    stderr = _quiet(trained["second"].stderr)
    assert "resuming at step 8" in stderr
    assert "steps 9..12: loss" in stderr
    recs = _train_records(trained["run"])
    # Steps 1..8 from the first run, 9..12 from the second, none twice.
    assert [r["step"] for r in recs] == list(range(1, 13))
    assert recs[:8] == trained["records"]
    assert recs[-1]["loss"] < recs[7]["loss"]
    ckpts = sorted(int(p.name) for p in (trained["run"] / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == [4, 8, 12]  # keep=3


# --------------------------------------------------------------------------- config commands


def test_config_prints_toml_that_reloads_to_the_same_config(tmp_path):
    overrides = ["model=tiny", "train.steps=7", "mesh.tensor=2", "data.seed=3"]
    out = jaxdist("config", *overrides, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    want = load_config(None, overrides).to_dict()
    assert tomllib.loads(out.stdout) == want
    (tmp_path / "run.toml").write_text(out.stdout)
    again = jaxdist("config", "--config", "run.toml", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert tomllib.loads(again.stdout) == want


def test_console_script_is_installed(tmp_path):
    exe = shutil.which("jaxdist")
    if exe is None:
        pytest.skip("the jaxdist console script is not on PATH (package not installed)")
    out = subprocess.run(
        [exe, "config", "--reference"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=QUICK_TIMEOUT
    )
    assert out.returncode == 0 and out.stdout.strip() == reference_markdown().strip()


def test_a_reader_that_leaves_early_is_not_an_error(tmp_path):
    """``jaxdist config --reference | head -1`` under ``pipefail``: a reader that closes the pipe before jaxdist
    is done writing (here ``true``, which reads nothing and exits while Python starts) ends jaxdist without a
    traceback, exit 0."""
    cmd = f"set -o pipefail; {shlex.quote(sys.executable)} -m jaxdist.cli config --reference | true"
    out = subprocess.run(["bash", "-c", cmd], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr


def test_docs_configuration_contains_the_config_reference(tmp_path):
    out = jaxdist("config", "--reference", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    page = (REPO / "docs" / "configuration.md").read_text()
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    assert start in page and end in page, f"docs/configuration.md lacks the markers {start} ... {end}"
    section = page[page.index(start) + len(start) : page.index(end)]
    assert out.stdout.strip() in section, (
        "docs/configuration.md's configuration reference is out of date: replace the text between the markers "
        "with the output of `jaxdist config --reference`."
    )


# --------------------------------------------------------------------------- user errors

ERRORS = {
    "unknown key": (["train.stpes=3"], "did you mean 'train.steps'"),
    "unknown key in a file": (["--config", "typo.toml"], "did you mean 'train.steps'"),
    # A mesh smaller than the devices runs on the first ones (tests/remat/test_edges.py); a larger one is refused.
    "mesh vs devices": (["mesh.data=3", "mesh.fsdp=4"], "multiply to 8"),
    "mesh vs devices, tensor": (["mesh.data=3", "mesh.tensor=4"], "has 12 devices but 8 are available"),
    "batch vs data axes": (["train.batch_size=12", "mesh.data=4", "mesh.fsdp=2"], "not divisible by the data axes"),
    "heads vs tensor": (["model=tiny", "mesh.tensor=3"], "model.n_heads=4 is not divisible by mesh.tensor=3"),
    "missing config file": (["--config", "nope.toml"], "'nope.toml' does not exist"),
    "invalid config file": (["--config", "broken.toml"], "is not valid TOML"),
    "missing token file": (["data.source=tokens", "data.path=missing.bin"], "'missing.bin' does not exist"),
    "missing text dir": (["data.source=text_dir", "data.path=nodir"], "'nodir' is not a directory"),
    "source without path": (["data.source=tokens"], "needs data.path"),
    "bad value": (["train.steps=abc"], "config key 'train.steps' needs"),
    "not KEY=VALUE": (["train.steps"], "is not KEY=VALUE"),
    "unknown cluster": (["mesh.cluster=nope"], "cluster description 'nope' not found"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_user_errors_exit_2_with_one_sentence(case, tmp_path):
    args, fragment = ERRORS[case]
    (tmp_path / "typo.toml").write_text("[train]\nstpes = 3\n")
    (tmp_path / "broken.toml").write_text("[train\n")
    out = jaxdist("train", *args, cwd=tmp_path)
    err = _quiet(out.stderr).strip()
    assert out.returncode == 2, f"exit {out.returncode}, stderr:\n{err[-2000:]}"
    assert len(err.splitlines()) == 1 and err.startswith("jaxdist: "), err[-2000:]
    assert fragment in err
    assert err[-1] in ".?" and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # failed before creating the run


def test_config_command_reports_errors_the_same_way(tmp_path):
    out = jaxdist("config", "train.stpes=3", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == "jaxdist: unknown config key 'train.stpes'; did you mean 'train.steps'?"

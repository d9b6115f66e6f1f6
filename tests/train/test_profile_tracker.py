"""train.profile_steps (a JAX profiler trace of those steps) and train.tracker (W&B / MLflow, never required)."""

import gzip
import importlib.machinery
import json
import sys
import types

import pytest

from jaxdist.config import ConfigError, load_config
from jaxdist.train.trainer import Trainer


def _config(tmp_path, *extra):
    return load_config(
        None,
        [
            "model=tiny",
            "train.steps=5",
            "train.batch_size=8",
            "train.seq_len=32",
            "train.log_every=1",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.enabled=false",
            "data.max_bytes=100000",
            f"train.runs_dir={tmp_path}",
            "mesh.data=8",
            *extra,
        ],
    )


def test_the_trace_holds_exactly_the_profiled_steps(tmp_path):
    with Trainer(_config(tmp_path, "train.profile_steps=[2,3]")) as t:
        t.fit()
    traces = list((tmp_path / "default" / "profile").glob("plugins/profile/*/*.trace.json.gz"))
    assert len(traces) == 1 and list(traces[0].parent.glob("*.xplane.pb"))
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    # Device 0 ran the train step's program once per profiled step: steps 2 and 3, not 1, 4 or 5.
    runs = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("name", "").startswith("[0] ") and "jit_train_step" in e["name"]
    ]
    assert len(runs) == 2, sorted({e.get("name") for e in events if "train_step" in e.get("name", "")})


def test_a_trace_from_the_first_step_and_one_past_the_end_of_fit(tmp_path):
    with Trainer(_config(tmp_path, "train.profile_steps=[1,9]")) as t:
        t.fit()  # steps 1..5: the trace starts before step 1 and stops when fit ends
    traces = list((tmp_path / "default" / "profile").glob("plugins/profile/*/*.trace.json.gz"))
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    runs = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("name", "").startswith("[0] ") and "jit_train_step" in e["name"]
    ]
    assert len(runs) == 5


@pytest.mark.parametrize("value", ["[3,2]", "[0,2]", "[4]", "[1,2,3]"])
def test_profile_steps_must_be_first_and_last(value):
    with pytest.raises(ConfigError, match=r"train.profile_steps=.* is not \[first, last\]"):
        load_config(None, [f"train.profile_steps={value}"])


def test_a_tracker_that_is_not_installed_is_one_sentence():
    with pytest.raises(ConfigError, match=r"train.tracker='mlflow' needs the mlflow package, which is not installed"):
        load_config(None, ["train.tracker=mlflow"])


def test_wandb_gets_the_same_scalars_as_tensorboard(tmp_path, monkeypatch):
    """A stand-in ``wandb`` module records what the tracker sends: one run, every record's numbers, finish."""
    calls = []

    class Run:
        def log(self, scalars, step):
            calls.append(("log", step, scalars))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw["name"], kw["config"]["train"]["steps"])) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    with Trainer(_config(tmp_path, "train.tracker=wandb")) as t:
        history = t.fit()
    assert calls[0] == ("init", "default", 5) and calls[-1] == ("finish",)
    train = [c for c in calls if c[0] == "log" and "train/loss" in c[2]]
    assert [c[1] for c in train] == [1, 2, 3, 4, 5]
    assert [c[2]["train/loss"] for c in train] == [r["loss"] for r in history]
    assert any(c[0] == "log" and "eval/loss" in c[2] for c in calls)

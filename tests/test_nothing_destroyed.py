"""Nothing destroyed (issue 39, item 0): one writer per run, no command writes into its input or over files it did
not make, a fresh start sets the old history aside, no calibration from other devices, no silent cast on resume,
and ``data verify`` sees two writers' histories.

Each test is one of the data-loss cases an outside test found (each exited 0 and lost or mixed data before).
The runs are tiny and in-process (see tests/test_reliability_edges.py); the CLI is called through
``jaxdist.cli.main`` for its exit codes, and a second process holds a run where that is the point.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdist import cli
from jaxdist.config import ConfigError
from jaxdist.data.audit import read_records, verify
from jaxdist.run_owner import LOCK_NAME, RunLock
from jaxdist.train.metrics import MetricsWriter
from jaxdist.train.trainer import Trainer
from tests.test_reliability_edges import args, config, copy_run, train

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A finished 4-step run (checkpoints at 2 and 4)."""
    runs = tmp_path_factory.mktemp("base")
    train(config(runs, "base", "train.steps=4"))
    return runs / "base"


def _tree(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` with its bytes (the lock file aside: its holder line changes with each writer)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != LOCK_NAME}


def _hold(run: Path) -> subprocess.Popen:
    """Another process holding ``run``'s lock as `jaxdist train` does, until killed."""
    code = (
        "import sys, time; from jaxdist.run_owner import RunLock; "
        f"RunLock({str(run)!r}, 'jaxdist train').acquire(); print('held', flush=True); time.sleep(600)"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_train_on_a_held_run_is_refused_naming_the_holder(base, tmp_path, capsys):
    run = copy_run(base, tmp_path, "r")
    before = _tree(run)
    holder = _hold(run)
    try:
        # the second writer, with another learning rate: refused before it writes anything
        assert cli.main(["train", *args(tmp_path, "r", "train.steps=8", "train.learning_rate=0.01")]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("jaxdist: the run") and f"pid {holder.pid}" in err and "jaxdist train" in err, err
        assert _tree(run) == before
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    # the holder crashed: its lock went with it, and the run trains on
    assert cli.main(["train", *args(tmp_path, "r", "train.steps=6")]) == 0
    assert max(r["step"] for r in read_records(run / "metrics.jsonl") if r["kind"] == "train") == 6
    ok, lines = verify(run)
    assert ok, lines


def test_the_lock_is_reentrant_in_one_process_and_released_on_close(tmp_path):
    with RunLock(tmp_path / "x", "a") as a, RunLock(tmp_path / "x", "b"):
        assert a.path.is_file()
    holder = _hold(tmp_path / "x")  # free again: another process takes it
    try:
        with pytest.raises(ConfigError, match=f"in use by jaxdist train \\(pid {holder.pid}"):
            RunLock(tmp_path / "x", "c").acquire()
    finally:
        holder.kill()
        holder.wait(30)


def test_convert_never_writes_into_its_input_or_a_directory_of_the_other_kind(base, tmp_path, capsys):
    run = copy_run(base, tmp_path, "r")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("{}\n")
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "metrics.jsonl").write_text("")  # another run's log
    (tmp_path / "model2").mkdir()
    (tmp_path / "model2" / "model.safetensors").write_bytes(b"")  # another model's weights
    dirs = [run, hf, tmp_path / "other", tmp_path / "run2", tmp_path / "model2"]
    before = [_tree(d) for d in dirs]
    cases = [
        (["jaxdist-to-hf", str(run), str(run)], "the input"),  # replaced the run's config.json, exit 0
        (["jaxdist-to-hf", str(run), str(run / "hf")], "inside or around the input"),
        (["hf-to-jaxdist", str(hf), str(hf)], "the input"),  # overwrote the model's config.json, exit 0
        (["hf-to-jaxdist", str(hf), str(run)], "not empty"),  # an existing run is not a new run
        (["jaxdist-to-hf", str(run), str(tmp_path / "other")], "--force"),  # overwrote its config.json, exit 0
        (["jaxdist-to-hf", str(run), str(tmp_path / "run2")], "jaxdist run directory"),
        (["hf-to-jaxdist", str(hf), str(tmp_path / "model2")], "Hugging Face model directory"),
    ]
    for argv, phrase in cases:
        assert cli.main(["convert", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and phrase in err, (argv, err)
    assert [_tree(d) for d in dirs] == before


def test_export_into_a_non_empty_directory_only_with_force(base, tmp_path, capsys):
    run = copy_run(base, tmp_path, "r")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert cli.main(["convert", "jaxdist-to-hf", str(run), str(out)]) == 2
    assert "--force" in capsys.readouterr().err and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert cli.main(["convert", "jaxdist-to-hf", str(run), str(out), "--force"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and json.loads((out / "config.json").read_text())["model_type"]
    assert json.loads((run / "config.json").read_text())["train"]["name"] == "r"  # the run is still a run


def test_a_fresh_start_sets_the_old_history_aside(base, tmp_path, caplog):
    run = copy_run(base, tmp_path, "r")
    old = _tree(run)
    with Trainer(config(tmp_path, "r", "train.steps=2", "checkpoint.resume=false")) as t:
        aside = t.set_aside
        assert aside is not None and aside.parent == run / "set_aside"
        assert any("set aside" in r.getMessage() for r in caplog.records)
        t.fit()
    # everything the old run had is there, byte for byte, in the set-aside folder
    for name, data in old.items():
        if name.startswith(("checkpoints/", "batchlist/", "metrics.jsonl")):
            assert (aside / name).read_bytes() == data, name
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [2]
    # the next plain command resumes the new run's step 2, not the old run's step 4
    with Trainer(config(tmp_path, "r", "train.steps=3")) as t:
        t.init_state()
        assert t.resumed_from == ("persistent", 2)
    ok, lines = verify(run)
    assert ok, lines


def test_calibrate_refuses_devices_of_another_kind(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXDIST_CALIBRATION_DIR", str(tmp_path / "cal"))
    assert cli.main(["calibrate", "--cluster", "h100x8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "NVIDIA H100" in err and "cpu" in err and "--cluster" in err, err
    assert not (tmp_path / "cal").exists() or not any((tmp_path / "cal").iterdir())


@pytest.mark.parametrize(
    "change,phrase",
    [
        (["model.dtype=bfloat16", "model.param_dtype=bfloat16"], "model.param_dtype"),
        (["model.d_model=96"], "model's shape"),
    ],
)
def test_a_resume_that_would_change_the_state_is_refused(base, tmp_path, capsys, change, phrase):
    run = copy_run(base, tmp_path, "r")
    before = _tree(run / "checkpoints")
    assert cli.main(["train", *args(tmp_path, "r", "train.steps=6", *change)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxdist: cannot resume") and phrase in err, err
    assert "Traceback" not in err
    assert _tree(run / "checkpoints") == before


def test_data_verify_sees_two_writers_a_duplicate_and_a_missing_log(base, tmp_path, capsys):
    # Two writers at once (what two unlocked `jaxdist train` processes wrote): their records interleave.
    run = copy_run(base, tmp_path, "two")
    records = [r for r in read_records(run / "metrics.jsonl") if r["kind"] == "train"]
    (run / "metrics.jsonl").unlink()
    a, b = MetricsWriter(run, tensorboard=False), MetricsWriter(run, tensorboard=False)
    for r in records:
        values = {k: v for k, v in r.items() if k not in ("kind", "step", "writer")}
        a.write("train", r["step"], values)
        b.write("train", r["step"], values)
    a.close()
    b.close()
    assert cli.main(["data", "verify", str(run)]) == 1
    out = capsys.readouterr().out
    assert "two writers' histories" in out and "PROBLEMS FOUND" in out, out
    # One record written twice by the same writer.
    run = copy_run(base, tmp_path, "dup")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    train_line = next(ln for ln in lines if json.loads(ln)["kind"] == "train")
    (run / "metrics.jsonl").write_text("".join(lines) + train_line)
    ok, report = verify(run)
    assert not ok and any("logged twice" in x for x in report), report
    # The log deleted: what was trained cannot be checked, which is not "ok".
    run = copy_run(base, tmp_path, "gone")
    (run / "metrics.jsonl").unlink()
    ok, report = verify(run)
    assert not ok and any("no training log" in x for x in report), report
    # The untouched run is fine.
    ok, report = verify(copy_run(base, tmp_path, "fine"))
    assert ok, report


def test_a_resumed_run_is_one_history(base, tmp_path):
    """A stop and a resume (two writers one after the other, the second rolling back) is not two writers."""
    run = copy_run(base, tmp_path, "r")
    train(config(tmp_path, "r", "train.steps=6"))
    writers = [r["writer"] for r in read_records(run / "metrics.jsonl") if r["kind"] == "train"]
    assert len(set(writers)) == 2
    ok, lines = verify(run)
    assert ok, lines


def test_plan_replaces_only_its_own_earlier_plan(tmp_path, capsys):
    out = tmp_path / "plan.toml"
    argv = ["plan", "--model", "tiny", "--cluster", "cpu-8", "--out", str(out)]
    assert cli.main(argv) == 0
    first = out.read_text()
    assert first.startswith("# jaxdist plan:")
    assert cli.main(argv) == 0  # its own earlier output: replaced
    mine = tmp_path / "mine.toml"
    mine.write_text("# my notes\n")
    assert cli.main([*argv[:-1], str(mine)]) == 2
    assert "--force" in capsys.readouterr().err and mine.read_text() == "# my notes\n"
    assert cli.main([*argv[:-1], str(mine), "--force"]) == 0
    assert mine.read_text().startswith("# jaxdist plan:")


def test_a_launched_job_that_starts_over_sets_the_history_aside_once(base, tmp_path, monkeypatch):
    """`jaxdist launch ... checkpoint.resume=false`: the controller (which holds the run) sets the history aside
    when the job starts, and its workers resume the job's own history: a later generation restarts from the
    job's checkpoints, not from step 0 (before: every generation started over, each worker being told
    resume=false).  A restarted controller attaching to the running job sets nothing aside again."""
    from jaxdist.controller.controller import Controller
    from jaxdist.controller.state import JobState
    from jaxdist.run_owner import HISTORY_SINCE_ENV

    run = copy_run(base, tmp_path, "r")
    old = _tree(run)
    overrides = ["checkpoint.resume=false", "mesh.cluster=cpu-2x4"]
    ctl = Controller(config(tmp_path, "r", *overrides), list(overrides))
    (aside,) = (run / "set_aside").iterdir()
    for name, data in old.items():
        if name.startswith(("checkpoints/", "batchlist/", "metrics.jsonl")):
            assert (aside / name).read_bytes() == data, name
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert ctl.argv[-3:] == [*overrides, "checkpoint.resume=true"]  # the later override wins
    sent = []
    monkeypatch.setattr(ctl.endpoint, "send", lambda to, msg: sent.append(msg))
    ctl._welcome(next(iter([type("V", (), {"name": "n0"})()])))
    assert float(sent[0]["env"][HISTORY_SINCE_ENV]) == ctl.state.history_since > 0
    assert [e["event"] for e in ctl.events.events] == ["history_set_aside"]
    since = ctl.state.history_since
    ctl.state.phase = "running"
    ctl._save(force=True)
    ctl.endpoint.close()
    ctl.run_lock.release()
    (run / "checkpoints").mkdir()  # the job's own first checkpoint folder, say
    again = Controller(config(tmp_path, "r", *overrides), list(overrides))
    try:
        assert len(list((run / "set_aside").iterdir())) == 1 and (run / "checkpoints").is_dir()
        assert again.argv[-1] == "checkpoint.resume=true" and again.state.history_since == since
        assert JobState.load(again.dir / "state.json").history_since == since
    finally:
        again.endpoint.close()
        again.run_lock.release()

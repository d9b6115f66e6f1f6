"""Bad input to every command, as a table (issue 39, item 1): one row per case, the exit code and a phrase of
the one sentence it prints; a row that should work checks what it made.

Rows run in-process through ``jaxdist.cli.main`` (its exit code, stderr captured); ``{tmp}`` in a row is the
test's temporary directory, where the row's files are written first.  The data, sampling and checkpoint
commands have their own table in tests/test_bad_input_data.py.
"""

from __future__ import annotations

import json

import pytest

from jaxdist import cli
from jaxdist.config import load_config

DEEP = "[train]\nprofile_steps = " + "[" * 20000 + "]" * 20000 + "\n"

# (command and arguments, exit code, a phrase of the last stderr line, files to write first)
ROWS: list[tuple[str, int, str, dict[str, str]]] = [
    # ------------------------------------------------------------------ config values (jaxdist config)
    ("config train.b1=1.5", 2, "train.b1=1.5 is outside its range", {}),
    ("config train.b1=-0.1", 2, "train.b1=-0.1 must be a finite number >= 0", {}),
    ("config train.b2=1.0", 2, "train.b2=1.0 is outside its range", {}),
    ("config train.b2=nan", 2, "train.b2=nan", {}),
    ("config train.min_lr_ratio=50", 2, "train.min_lr_ratio=50.0 is outside its range", {}),
    ("config train.learning_rate=-1", 2, "train.learning_rate=-1.0 must be a finite number", {}),
    ("config train.learning_rate=nan", 2, "train.learning_rate=nan", {}),
    ("config train.learning_rate=inf", 2, "train.learning_rate=inf", {}),
    ("config train.learning_rate=1e9", 2, "train.learning_rate=1000000000.0 is outside its range", {}),
    ("config train.weight_decay=-0.1", 2, "train.weight_decay=-0.1", {}),
    ("config train.grad_clip=-1", 2, "train.grad_clip=-1.0", {}),
    ("config train.steps=0", 2, "train.steps=0 must be positive", {}),
    ("config train.steps=-1", 2, "train.steps=-1 must be positive", {}),
    ("config train.steps=1e3", 2, "needs an int", {}),
    ("config train.steps=3.5", 2, "needs an int", {}),
    ("config train.steps=inf", 2, "needs an int", {}),
    ("config train.steps=99999999999999999999999", 2, "does not fit in 64 bits", {}),
    ("config train.batch_size=0", 2, "train.batch_size=0 must be positive", {}),
    ("config train.seq_len=0", 2, "train.seq_len=0 must be positive", {}),
    ("config train.microbatches=3", 2, "not divisible by train.microbatches=3", {}),
    ("config train.warmup_steps=-1", 2, "train.warmup_steps=-1", {}),
    ("config train.schedule_steps=-5", 2, "train.schedule_steps=-5", {}),
    ("config train.log_every=0", 2, "train.log_every=0 must be positive", {}),
    ("config train.log_every=-1", 2, "train.log_every=-1 must be positive", {}),
    ("config train.eval_every=-1", 2, "train.eval_every=-1", {}),
    ("config train.eval_batches=-1", 2, "train.eval_batches=-1", {}),
    ("config train.seed=-1", 2, "train.seed=-1 is not a seed", {}),
    ("config train.seed=4294967296", 2, "train.seed=4294967296 is not a seed", {}),
    ("config train.seed=99999999999999999999999", 2, "does not fit in 64 bits", {}),
    ("config data.seed=-1", 2, "data.seed=-1 is not a seed", {}),
    ("config train.remat=bogus", 2, "train.remat='bogus' is unknown", {}),
    ("config train.remat=save:", 2, "names no checkpoint tags", {}),
    ("config train.remat=save:nosuchtag", 2, "nosuchtag", {}),
    ("config train.remat_slack=2", 2, "train.remat_slack=2.0 is not a share", {}),
    ("config train.tracker=bogus", 2, "train.tracker='bogus' is unknown", {}),
    ("config train.grad_sync=sometimes", 2, "train.grad_sync='sometimes' is not one of its values", {}),
    ("config train.profile_steps=[8,5]", 2, "is not [first, last]", {}),
    ("config train.skip_nonfinite=-1", 2, "train.skip_nonfinite=-1", {}),
    ("config train.name=", 2, "is not a plain folder name", {}),
    ("config train.name=..", 2, "is not a plain folder name", {}),
    ("config train.name=a/b", 2, "is not a plain folder name", {}),
    ("config train.name=a\x00b", 2, "control character", {}),
    ("config train.runs_dir=runs\x07", 2, "control character", {}),
    ("config train.progress=maybe", 2, "needs a bool", {}),
    ("config model=nonexistent", 2, "unknown model preset 'nonexistent'", {}),
    ("config model.d_model=0", 2, "model.d_model=0 must be positive", {}),
    ("config model.n_layers=0", 2, "model.n_layers=0 must be positive", {}),
    ("config model.n_heads=0", 2, "model.n_heads=0 must be positive", {}),
    ("config model.n_heads=6 model.n_kv_heads=4", 2, "not divisible by model.n_kv_heads=4", {}),
    ("config model.vocab_size=-3", 2, "model.vocab_size=-3 must be positive", {}),
    ("config model.head_dim=7", 2, "model.head_dim=7 is odd", {}),
    ("config model.max_seq_len=99999999999999", 2, "beyond the int32 positions", {}),
    ("config model.rope_theta=0", 2, "model.rope_theta=0.0 is outside its range", {}),
    ("config model.rope_theta=nan", 2, "model.rope_theta=nan is outside its range", {}),
    ("config model.rope_theta=-10000", 2, "model.rope_theta=-10000.0", {}),
    ("config model.norm_eps=-1", 2, "model.norm_eps=-1.0 is outside its range", {}),
    ("config model.norm_eps=0", 2, "model.norm_eps=0.0 is outside its range", {}),
    ("config model.init_std=0", 2, "model.init_std=0.0 is outside its range", {}),
    ("config model.init_std=nan", 2, "model.init_std=nan", {}),
    ("config model.dtype=float64", 2, "model.dtype='float64' is not supported", {}),
    ("config model.param_dtype=int8", 2, "model.param_dtype='int8' is not supported", {}),
    ("config model.attention=flash9", 2, "model.attention='flash9' is not supported", {}),
    ("config model.attention_block=0", 2, "model.attention_block=0 must be positive", {}),
    ("config model.rope_scaling=yarn", 2, "model.rope_scaling='yarn' is not supported", {}),
    ("config model.rope_scaling=linear model.rope_factor=0", 2, "model.rope_factor=0.0 must be positive", {}),
    ("config model.moe.experts=-1", 2, "model.moe.experts=-1", {}),
    ("config model.moe.experts=4 model.moe.top_k=8", 2, "model.moe.top_k=8 must lie between 1", {}),
    ("config model.moe.router=bogus", 2, "model.moe.router='bogus' is not one of its values", {}),
    ("config model.moe.dispatch=bogus", 2, "model.moe.dispatch='bogus' is not one of its values", {}),
    ("config model.moe.every=0", 2, "model.moe.every=0 must be positive", {}),
    ("config mesh.data=0", 2, "mesh.data=0 is not a valid axis size", {}),
    ("config mesh.tensor=-2", 2, "mesh.tensor=-2 is not a valid axis size", {}),
    ("config mesh.tensor=3", 2, "not divisible by mesh.tensor=3", {}),
    ("config mesh.pipeline=2 model.moe.experts=4 model.moe.dispatch=capacity", 2, "a sequence chunk would drop", {}),
    ("config data.source=bogus", 2, "data.source='bogus' is unknown", {}),
    ("config data.source=tokens", 2, "needs data.path", {}),
    ("config data.source=tokens data.path=/nonexistent.bin", 2, "does not exist", {}),
    ("config data.source=text_dir data.path={tmp}/a.toml", 2, "is not a directory", {"a.toml": ""}),
    ("config data.token_dtype=int8", 2, "data.token_dtype='int8' is not supported", {}),
    ("config data.eval_fraction=0", 2, "data.eval_fraction=0.0 must lie strictly between 0 and 1", {}),
    ("config data.eval_fraction=1.5", 2, "data.eval_fraction=1.5", {}),
    ("config data.tokenizer=/nonexistent.json", 2, "does not exist", {}),
    ("config data.tokenizer={tmp}/t.txt", 2, "is neither a Hugging Face tokenizer.json", {"t.txt": "x"}),
    ("config data.max_bytes=-1", 2, "data.max_bytes=-1", {}),
    ("config checkpoint.every=0", 2, "checkpoint.every and checkpoint.keep must be positive", {}),
    ("config checkpoint.keep=0", 2, "checkpoint.every and checkpoint.keep must be positive", {}),
    ("config checkpoint.local_every=0", 2, "checkpoint.local_every=0", {}),
    ("config controller.port=70000", 2, "is not a TCP port", {}),
    ("config controller.launcher=bogus", 2, "controller.launcher='bogus' is unknown", {}),
    ("config controller.recovery=bogus", 2, "controller.recovery='bogus' is unknown", {}),
    ("config controller.min_nodes=0", 2, "are inconsistent", {}),
    ("config controller.min_nodes=4 controller.max_nodes=2", 2, "are inconsistent", {}),
    ("config controller.standbys=-1", 2, "must be >= 0", {}),
    ("config controller.start_grace=-1", 2, "controller.start_grace=-1.0", {}),
    ("config controller.heartbeat_timeout=0", 2, "must be at least twice", {}),
    ("config controller.heartbeat_timeout=nan", 2, "must be at least twice", {}),
    ("config controller.ban_cooldown=-1", 2, "ban_cooldown=-1.0 must be >= 0", {}),
    ("config controller.ban_cooldown=nan", 2, "must be >= 0", {}),
    ("config controller.bind=999.1.1.1", 2, "is not a loopback address", {}),
    ("config controller.crashed_rank=bogus", 2, "controller.crashed_rank='bogus' is unknown", {}),
    ("config controller.max_failures=-1", 2, "must be >= 0", {}),
    ("config pipeline.schedule=bogus", 2, "pipeline.schedule='bogus' is unknown", {}),
    ("config pipeline.chunks=0", 2, "pipeline.chunks=0 must be positive", {}),
    ("config nosuchsection.key=1", 2, "unknown config key 'nosuchsection.key'", {}),
    ("config train.nosuchkey=1", 2, "unknown config key 'train.nosuchkey'", {}),
    ("config train.steps", 2, "is not KEY=VALUE", {}),
    # ------------------------------------------------------------------ config files
    ("config --config /nonexistent.toml", 2, "does not exist", {}),
    ("config --config {tmp}", 2, "is a directory", {}),
    ("config --config {tmp}/a.toml", 2, "is not valid TOML", {"a.toml": "[train\n"}),
    ("config --config {tmp}/a.toml", 2, "needs a str", {"a.toml": "[train]\nname = ['a']\n"}),
    (
        "config --config {tmp}/a.toml",
        2,
        "does not fit in 64 bits",
        {"a.toml": "[train]\nsteps = 99999999999999999999999\n"},
    ),
    ("config --config {tmp}/a.toml", 2, "nests arrays or tables too deeply", {"a.toml": DEEP}),
    ("config --config {tmp}/a.toml", 2, "did you mean 'train.steps'", {"a.toml": "[train]\nstpes = 3\n"}),
    ("config --config {tmp}/a.toml", 2, "needs an int", {"a.toml": "[train]\nsteps = 'many'\n"}),
    ("config --config {tmp}/a.toml", 2, "train.b1=1.5 is outside its range", {"a.toml": "[train]\nb1 = 1.5\n"}),
    ("config --config {tmp}/a.toml", 2, "needs an int", {"a.toml": "[train]\nsteps = [1, 2]\n"}),
    # ------------------------------------------------------------------ train (fails before the run is written)
    ("train model.d_model=1000000000000", 2, "cannot fit 8 devices", {}),
    ("train model.vocab_size=100000000000", 2, "cannot fit 8 devices", {}),
    ("train model.n_layers=100000000", 2, "cannot fit 8 devices", {}),
    ("train mesh.data=16", 2, "but 8 are available", {}),
    ("train train.batch_size=12", 2, "not divisible by the data axes", {}),
    ("train train.seq_len=100000", 2, "is longer than model.max_seq_len", {}),
    ("train mesh.cluster=nonexistent", 2, "cluster description 'nonexistent' not found", {}),
    ("train train.runs_dir=/dev/null", 2, "cannot create the run directory", {}),
    # ------------------------------------------------------------------ planner and tools
    ("plan --model nonexistent", 2, "unknown model preset 'nonexistent'", {}),
    ("plan --cluster nonexistent", 2, "cluster description 'nonexistent' not found", {}),
    ("plan --busy /nonexistent", 2, "is not an index or 'NODE:LOCAL'", {}),
    ("plan --model tiny --cluster cpu-8 train.b2=1.5", 2, "train.b2=1.5", {}),
    ("remat --model nonexistent", 2, "unknown model preset 'nonexistent'", {}),
    ("remat --budget lots", 2, "budget 'lots' is not a size", {}),
    ("remat --budget -5GiB", 2, "is not a positive size", {}),
    ("remat --mesh nonexistent", 2, "cluster description 'nonexistent' not found", {}),
    ("pipeline --stages 0 --microbatches 4", 2, "stages=0 must be a positive integer", {}),
    ("pipeline --stages 2 --microbatches 0", 2, "microbatches=0 must be a positive integer", {}),
    ("pipeline --stages 2 --microbatches 4 --chunks 0", 2, "chunks=0 must be a positive integer", {}),
    ("comm plan mesh.data=0", 2, "mesh.data=0 is not a valid axis size", {}),
    ("plan --model tiny --out {tmp}/mine.toml", 2, "--force", {"mine.toml": "[train]\nsteps = 3\n"}),
    ("plan --config {tmp}/c.toml --out {tmp}/c.toml", 2, "is this command's input", {"c.toml": "# jaxdist plan: x\n"}),
    ("plan --model tiny --out {tmp}", 2, "is not a file", {}),
    ("calibrate --out {tmp}/mine.json", 2, "--force", {"mine.json": "{}"}),
    ("calibrate --cluster nonexistent", 2, "cluster description 'nonexistent' not found", {}),
    ("calibrate --cluster h100x8", 2, "describes NVIDIA H100", {}),
    # ------------------------------------------------------------------ launch, status, gen, convert
    ("launch --print", 2, "--print is for the slurm and kubernetes launchers", {}),
    ("launch controller.launcher=kubernetes controller.min_nodes=0", 2, "are inconsistent", {}),
    ("status /nonexistent", 2, "does not exist", {}),
    ("gen status --config /nonexistent.toml", 2, "does not exist", {}),
    ("gen run --config /nonexistent.toml", 2, "does not exist", {}),
    ("gen receive /nonexistent", 2, "is not a training run with a batch list", {}),
    ("convert hf-to-jaxdist /nonexistent {tmp}/out", 2, "does not exist", {}),
    ("convert jaxdist-to-hf /nonexistent {tmp}/out", 2, "does not exist", {}),
    ("convert jaxdist-to-hf {tmp} {tmp}/out", 2, "inside or around the input", {}),
    ("convert hf-to-jaxdist {tmp} {tmp}", 2, "is the input", {}),
]

# Rows that work: the value is legitimate, and what it means is checked on the loaded config.
WORKS: list[tuple[str, object]] = [
    ("train.eval_batches=0", lambda c: c.train.eval_batches == 0),  # no evaluation at all
    ("train.remat=dots_saveable", lambda c: str(c.train.remat_spec) == "dots_saveable"),
    ("controller.bind=[::1]", lambda c: c.controller.bind == "[::1]"),
    ("train.seed=4294967295", lambda c: c.train.seed == 2**32 - 1),
    ("train.b2=0.999", lambda c: c.train.b2 == 0.999),
    ("train.min_lr_ratio=1", lambda c: c.train.min_lr_ratio == 1.0),
    ("train.name=run-1", lambda c: c.run_dir.name == "run-1"),
]


def _ids():
    seen: dict[str, int] = {}
    out = []
    for argv, *_ in ROWS:
        seen[argv] = seen.get(argv, 0) + 1
        out.append(argv if seen[argv] == 1 else f"{argv} #{seen[argv]}")
    return out


@pytest.mark.parametrize("row", ROWS, ids=_ids())
def test_bad_input_gets_one_sentence(row, tmp_path, capsys):
    argv, code, phrase, files = row
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv.split(" ")]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli.main(args) == code
    err = capsys.readouterr().err.strip()
    last = err.splitlines()[-1] if err else ""
    assert phrase in last, f"{argv!r}: {last!r}"
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written beside the row's files


@pytest.mark.parametrize("override,check", WORKS, ids=[w[0] for w in WORKS])
def test_legitimate_values_work(override, check):
    assert check(load_config(None, [override]))


def test_rows_per_command():
    """The table covers every command this file owns (counted for the issue's note)."""
    counts: dict[str, int] = {}
    for argv, *_ in ROWS:
        counts[argv.split(" ")[0]] = counts.get(argv.split(" ")[0], 0) + 1
    print(json.dumps(counts))
    assert set(counts) >= {
        "config",
        "train",
        "plan",
        "remat",
        "pipeline",
        "comm",
        "calibrate",
        "launch",
        "status",
        "gen",
        "convert",
    }
    assert sum(counts.values()) >= 140


def _ctrl_c(argv: list[str], ready, start_s: float, last_line: str) -> None:
    """Run ``argv`` (a Python command line) with the repository on PYTHONPATH, wait at most ``start_s`` seconds for
    ``ready()``, press Ctrl-C (SIGINT): exit 130, no traceback, and ``last_line`` as the last stderr line."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The child starts with Ctrl-C's default action, as from a terminal: a suite started in the background by a
    # shell without job control (``nohup ... &``) hands its children SIGINT ignored, and Python then never raises
    # KeyboardInterrupt (the user who ignores SIGINT on purpose keeps that: jaxdist does not override it).  A
    # small launcher resets it and execs the command (no preexec_fn: forking this multithreaded process is unsafe).
    launcher = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", launcher, sys.executable, *argv],
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.monotonic() + start_s
    while time.monotonic() < deadline and p.poll() is None and not ready():
        time.sleep(0.05)
    assert p.poll() is None, p.stderr.read()[-2000:]
    p.send_signal(signal.SIGINT)
    try:
        err = p.communicate(timeout=120)[1]
    finally:
        p.kill()
    assert p.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == last_line


def test_ctrl_c_during_train_is_one_line_and_the_run_resumes(tmp_path):
    """Ctrl-C (SIGINT) while training: exit 130 and one line, no KeyboardInterrupt traceback; the next command
    resumes from the newest checkpoint."""
    from jaxdist.data.audit import read_records

    small = ["model=tiny", "train.seq_len=16", "train.batch_size=8", "train.log_every=1", "train.progress=false",
             "train.tensorboard=false", "checkpoint.every=2", "data.max_bytes=60000", f"train.runs_dir={tmp_path}",
             "train.name=r", "train.eval_every=0"]  # fmt: skip
    metrics = tmp_path / "r" / "metrics.jsonl"
    _ctrl_c(
        ["-m", "jaxdist.cli", "train", *small, "train.steps=100000"],
        lambda: any(r.get("kind") == "checkpoint" for r in read_records(metrics)),
        240,  # start and compile on a loaded 2-core host: bounded with headroom
        "jaxdist: train interrupted (Ctrl-C); what it had finished is kept.",
    )
    last = max(r["step"] for r in read_records(metrics) if r.get("kind") == "train")
    assert cli.main(["train", *small, f"train.steps={last + 2}"]) == 0
    steps = [r["step"] for r in read_records(metrics) if r.get("kind") == "train"]
    assert steps[-1] == last + 2


_SLOW_PREPARE = """
import sys, time
import jaxdist.data.prepare as prep
from jaxdist import cli
real = prep._tokenize_piece
def slow(job):  # a slow tokenizer: each piece takes 0.5 s, so Ctrl-C lands in the middle of the corpus
    time.sleep(0.5)
    return real(job)
prep._tokenize_piece = slow
sys.exit(cli.main(sys.argv[1:]))
"""


def test_ctrl_c_during_data_prepare_is_one_line_and_the_rerun_finishes_it(tmp_path):
    """Ctrl-C (SIGINT) while ``data prepare`` tokenizes: exit 130 and one line, no KeyboardInterrupt traceback,
    no token file claimed finished; the same command again finishes the prepare, and its token file equals an
    uninterrupted one.  (Each piece is slowed by 0.5 s in the child so the signal lands mid-corpus.)"""
    import numpy as np

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i}: " + "words and more words " * 3000)
    args = ["data", "prepare", str(corpus), str(tmp_path / "out"), "--piece-mb", "0.02"]
    journal = tmp_path / "out" / ".prepare" / "journal.jsonl"
    _ctrl_c(
        ["-c", _SLOW_PREPARE, *args],
        lambda: journal.is_file() and journal.read_text().count("\n") >= 2,
        120,  # start on a loaded 2-core host: bounded with headroom
        "jaxdist: data prepare interrupted (Ctrl-C); what it had finished is kept.",
    )
    assert not (tmp_path / "out" / "manifest.json").exists() and not (tmp_path / "out" / "tokens.bin").exists()
    assert cli.main(args) == 0
    assert cli.main(["data", "prepare", str(corpus), str(tmp_path / "whole")]) == 0
    got = np.fromfile(tmp_path / "out" / "tokens.bin", dtype=np.uint16)
    assert np.array_equal(got, np.fromfile(tmp_path / "whole" / "tokens.bin", dtype=np.uint16))

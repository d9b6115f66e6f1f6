"""Bad input to the data and sampling commands (issue 39 item 1): one sentence and exit 2, or a correct result.

One row per case: the argv of ``jaxdist.cli.main`` (``{name}`` fields filled from the module's files), the
exit code, a phrase of the one ``jaxdist:`` line (or of the report on stdout, for ``data verify``'s exit 1),
and for rows that work a check of the result.  The inputs live in one module directory; one tiny trained
run (2 steps) serves every row that needs one.  A fuzz pass flips and cuts bytes of a prepared token file,
its manifest and a batch-list file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from jaxdist import cli
from jaxdist.config import ConfigError
from jaxdist.data import write_token_file
from jaxdist.data.prepare import prepare
from jaxdist.data.tokenizer import EOS
from tests.test_reliability_edges import config, train

DOCS = [f"document {i}: hello world" for i in range(40)]


def expected_tokens(docs: list[str]) -> np.ndarray:
    """What ``data prepare --tokenizer bytes`` writes: each document's UTF-8 bytes, then EOS."""
    return np.array([t for d in docs for t in [*d.encode(), EOS]], dtype=np.uint16)


def _write_inputs(d: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (d / "ok.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    (d / "other.jsonl").write_text(json.dumps({"text": "another corpus entirely"}) + "\n")
    (d / "garbage.parquet").write_bytes(b"PAR1 this is not parquet" * 8)
    pq.write_table(pa.table({"text": [1, 2, 3]}), d / "ints.parquet")
    pq.write_table(pa.table({"body": ["a", "b"]}), d / "nocol.parquet")
    (d / "ints.jsonl").write_text('{"text": 5}\n{"text": 6}\n')
    (d / "null.jsonl").write_text('{"text": null}\n')
    (d / "list.jsonl").write_text('{"text": ["a", "b"]}\n')
    (d / "notjson.jsonl").write_text("{this is not json\n")
    (d / "array.jsonl").write_text("[1, 2]\n")
    (d / "emptytexts.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    (d / "notes.txt").write_text("plain text")
    (d / "bad_tok.json").write_text("garbage {{{")
    (d / "tokenizer.json").write_text("")
    (d / "bad.model").write_bytes(b"\x00garbage")
    (d / "src").mkdir()
    for n in "ab":
        (d / "src" / f"{n}.txt").write_text(n * 300)
    (d / "emptydir").mkdir()
    (d / "full").mkdir()
    (d / "full" / "precious.txt").write_text("keep me")
    (d / "forced").mkdir()
    (d / "forced" / "precious.txt").write_text("keep me")
    (d / "a_file").write_text("x")
    prepare(d / "ok.jsonl", d / "prepared", "bytes", progress=False)
    # data add inputs
    os.mkfifo(d / "fifo")
    (d / "noread").mkdir()
    (d / "noread" / "x.txt").write_text("x" * 5000)
    os.chmod(d / "noread", 0)
    (d / "unread.txt").write_text("y" * 3000)
    os.chmod(d / "unread.txt", 0)
    os.symlink(d / "nowhere", d / "dangling.txt")
    (d / "empty.txt").write_bytes(b"")
    (d / "empty.bin").write_bytes(b"")
    (d / "odd.bin").write_bytes(b"\x01\x00\x02")
    (d / "text.txt").write_text("z" * 2000)
    ids = np.random.default_rng(0).integers(0, 256, 5000)
    write_token_file(d / "u32.bin", ids, "uint32")
    write_token_file(d / "u16.bin", ids, "uint16")
    write_token_file(d / "big.bin", ids + 1000, "uint16")
    write_token_file(d / "few.bin", ids[:3], "uint16")
    b = (d / "u32.bin").read_bytes()
    (d / "half.bin").write_bytes(b[: len(b) // 2 + 1])
    # manifests damaged or edited by hand
    for name, edit in MANIFEST_EDITS.items():
        shutil.copytree(d / "prepared", d / name)
        path = d / name / "manifest.json"
        if isinstance(edit, bytes):
            path.write_bytes(edit)
        else:
            m = json.loads(path.read_text())
            edit(m)
            path.write_text(json.dumps(m))


def _set(*keys, value=None, drop=False):
    def edit(m):
        for k in keys:
            t = m
            *path, last = k.split(".")
            for p in path:
                t = t[p]
            t.pop(last) if drop else t.__setitem__(last, value)

    return edit


MANIFEST_EDITS = {
    "m_eos": _set("eos_id", "tokenizer.eos_id", value=99999),
    "m_bos": _set("tokenizer.bos_id", value=70000),
    "m_eos_neg": _set("eos_id", value=-1),
    "m_eos_str": _set("eos_id", value="258"),
    "m_vocab": _set("vocab_size", value="many"),
    "m_ntok": _set("n_tokens", value=12),
    "m_dtype": _set("token_dtype", drop=True),
    "m_notjson": b'{"format": 1, "tokens_',
}


def _copy_run(base: Path, dst: Path) -> Path:
    shutil.copytree(base, dst)
    return dst


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """Paths the rows name: ``run`` (a 2-step tiny run), its copies, and the inputs above."""
    d = tmp_path_factory.mktemp("bad_data")
    runs = d / "runs"
    train(config(runs, "r", "train.steps=2"))
    run = runs / "r"
    _write_inputs(d)
    paths = {"d": d, "run": run, "addrun": _copy_run(run, d / "addrun"), "tok": d / "tokens.bin"}
    for name, damage in BATCHLIST_DAMAGE.items():
        r = _copy_run(run, d / name)
        damage(r)
        paths[name] = r
    r = _copy_run(run, d / "badstep")
    (r / "checkpoints" / "7").mkdir()
    (r / "checkpoints" / "7" / "junk").write_text("x")
    paths["badstep"] = r
    r = _copy_run(run, d / "badconfig")
    (r / "config.json").write_text("{not json")
    paths["badconfig"] = r
    return paths


def _truncate(r):
    p = r / "batchlist" / "v000001.json"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _order_changed(r):
    p = r / "batchlist" / "v000001.json"
    v = json.loads(p.read_text())
    v["order"] = v["order"][::-1] if isinstance(v["order"], list) else v["order"][:-4] + "AAAA"
    p.write_text(json.dumps(v))


BATCHLIST_DAMAGE = {
    "bl_trunc": _truncate,
    "bl_garbage": lambda r: (r / "batchlist" / "v000001.json").write_bytes(bytes(range(256)) * 2),
    "bl_list": lambda r: (r / "batchlist" / "v000001.json").write_text("[1, 2, 3]"),
    "bl_empty": lambda r: (r / "batchlist" / "v000001.json").write_text(""),
    "bl_order": _order_changed,
    "bl_cursor": lambda r: (r / "batchlist" / "cursor.json").write_text("{]"),
    "bl_gone": lambda r: shutil.rmtree(r / "batchlist"),
}


@dataclass(frozen=True)
class Row:
    """One case: argv (``{name}`` filled from the fixture), exit code, a phrase of its message, a result check."""

    argv: str
    rc: int
    phrase: str
    check: Callable[[dict, str, str], None] | None = None
    root_only: bool = False


def _pending(env, run="addrun") -> list[dict]:
    req = sorted((env[run] / "batchlist" / "requests").glob("*.json"))
    return [json.loads(p.read_text()) for p in req]


def _queued_tokens(path: str, n: int):
    def check(env, out, err):
        entries = [s for r in _pending(env) for s in r["sources"] if s["name"] == path.format(**env)]
        assert [e["n_tokens"] for e in entries] == [n]

    return check


def _prepared(out: str, docs=DOCS):
    def check(env, o, e):
        d = Path(out.format(**env))
        assert np.array_equal(np.fromfile(d / "tokens.bin", dtype=np.uint16), expected_tokens(docs))
        assert json.loads((d / "manifest.json").read_text())["n_tokens"] == len(expected_tokens(docs))

    return check


def _untouched(out: str, produced: bool):
    def check(env, o, e):
        d = Path(out.format(**env))
        assert (d / "precious.txt").read_text() == "keep me"
        assert (d / "tokens.bin").exists() == produced
        if produced:
            _prepared(out)(env, o, e)

    return check


def _sampled_like(prompt: str, n: int, **settings):
    """The CLI's text equals the Python API's for the same settings (the module's reference sampler)."""

    def check(env, out, err):
        ref = env["sampler"].generate([prompt], n, **settings)[0]
        assert out == prompt + ref.text + "\n"

    return check


P, D, S = "data prepare", "data add {addrun}", "sample {run}"
TOK = "train model=tiny train.seq_len=16 train.batch_size=8 train.steps=1 train.runs_dir={d}/truns data.source=tokens"
ROWS: dict[str, Row] = {
    # ---- data prepare
    "prep_garbage_parquet": Row(f"{P} {{d}}/garbage.parquet {{d}}/o", 2, "not a readable Parquet file"),
    "prep_int_parquet_column": Row(f"{P} {{d}}/ints.parquet {{d}}/o", 2, "holds int64, not text"),
    "prep_parquet_no_column": Row(f"{P} {{d}}/nocol.parquet {{d}}/o", 2, "has no column 'text'"),
    "prep_int_jsonl_field": Row(f"{P} {{d}}/ints.jsonl {{d}}/o", 2, "holds 5 in field 'text', not text"),
    "prep_null_jsonl_field": Row(f"{P} {{d}}/null.jsonl {{d}}/o", 2, "holds null in field 'text'"),
    "prep_list_jsonl_field": Row(f"{P} {{d}}/list.jsonl {{d}}/o", 2, "in field 'text', not text"),
    "prep_not_json": Row(f"{P} {{d}}/notjson.jsonl {{d}}/o", 2, "is not JSON"),
    "prep_json_array_line": Row(f"{P} {{d}}/array.jsonl {{d}}/o", 2, "has no text field 'text'"),
    "prep_text_field_missing": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --text-field body", 2, "has no text field 'body'"),
    "prep_only_empty_texts": Row(f"{P} {{d}}/emptytexts.jsonl {{d}}/o_empty", 2, "holds no text"),
    "prep_piece_mb_nan": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --piece-mb nan", 2, "--piece-mb=nan"),
    "prep_piece_mb_inf": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --piece-mb inf", 2, "--piece-mb=inf"),
    "prep_piece_mb_zero": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --piece-mb 0", 2, "--piece-mb=0.0"),
    "prep_piece_mb_negative": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --piece-mb -1", 2, "--piece-mb=-1.0"),
    "prep_piece_mb_below_a_byte": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --piece-mb 1e-9", 2, "--piece-mb=1e-09"),
    "prep_piece_mb_text": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --piece-mb lots", 2, "invalid float value"),
    "prep_small_pieces_work": Row(
        f"{P} {{d}}/ok.jsonl {{d}}/o_small --piece-mb 0.0002", 0, "", _prepared("{d}/o_small")
    ),
    "prep_tokenizer_garbage_json": Row(
        f"{P} {{d}}/ok.jsonl {{d}}/o --tokenizer {{d}}/bad_tok.json", 2, "not a readable Hugging Face tokenizer"
    ),
    "prep_tokenizer_empty_json": Row(
        f"{P} {{d}}/ok.jsonl {{d}}/o --tokenizer {{d}}/tokenizer.json", 2, "not a readable Hugging Face tokenizer"
    ),
    "prep_tokenizer_garbage_model": Row(
        f"{P} {{d}}/ok.jsonl {{d}}/o --tokenizer {{d}}/bad.model", 2, "not a readable SentencePiece model"
    ),
    "prep_tokenizer_missing": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --tokenizer {{d}}/nope.json", 2, "does not exist"),
    "prep_out_is_src": Row(f"{P} {{d}}/src {{d}}/src", 2, "is inside the corpus"),
    "prep_out_inside_src": Row(f"{P} {{d}}/src {{d}}/src/out", 2, "is inside the corpus"),
    "prep_out_foreign_files": Row(
        f"{P} {{d}}/ok.jsonl {{d}}/full", 2, "pass --force", _untouched("{d}/full", produced=False)
    ),
    "prep_out_foreign_files_force": Row(
        f"{P} {{d}}/ok.jsonl {{d}}/forced --force", 0, "", _untouched("{d}/forced", produced=True)
    ),
    "prep_out_is_a_file": Row(f"{P} {{d}}/ok.jsonl {{d}}/a_file", 2, "is a file"),
    "prep_out_other_corpus": Row(f"{P} {{d}}/other.jsonl {{d}}/prepared", 2, "prepared from other sources"),
    "prep_rerun_finished": Row(f"{P} {{d}}/ok.jsonl {{d}}/prepared", 0, "", _prepared("{d}/prepared")),
    "prep_works": Row(f"{P} {{d}}/ok.jsonl {{d}}/o_ok", 0, "", _prepared("{d}/o_ok")),
    "prep_workers_zero": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --workers 0", 2, "--workers=0 must be at least 1"),
    "prep_workers_negative": Row(f"{P} {{d}}/ok.jsonl {{d}}/o --workers -2", 2, "--workers=-2 must be at least 1"),
    "prep_src_missing": Row(f"{P} {{d}}/nope.jsonl {{d}}/o", 2, "does not exist"),
    "prep_src_empty_dir": Row(f"{P} {{d}}/emptydir {{d}}/o", 2, "contains no files"),
    "prep_src_plain_file": Row(f"{P} {{d}}/notes.txt {{d}}/o", 2, "neither .jsonl nor .parquet"),
    "prep_two_outputs": Row(f"{P} {{d}}/ok.jsonl {{d}}/o {{d}}/o2", 2, "takes SRC OUT"),
    # ---- data add
    "add_fifo": Row(f"{D} {{d}}/fifo", 2, "is not a regular file or a directory"),
    "add_char_device": Row(f"{D} /dev/null", 2, "is not a regular file or a directory"),
    "add_unreadable_regular_file": Row(f"{D} /proc/self/mem", 2, "cannot be read"),
    "add_dir_without_permission_as_root": Row(
        f"{D} {{d}}/noread", 0, "", _queued_tokens("{d}/noread", 5001), root_only=True
    ),
    "add_file_mode_000_as_root": Row(
        f"{D} {{d}}/unread.txt", 0, "", _queued_tokens("{d}/unread.txt", 3001), root_only=True
    ),
    "add_dangling_symlink": Row(f"{D} {{d}}/dangling.txt", 2, "is a symbolic link to"),
    "add_missing": Row(f"{D} {{d}}/missing.txt", 2, "does not exist"),
    "add_empty_text": Row(f"{D} {{d}}/empty.txt", 2, "fewer than one batch"),
    "add_empty_token_file": Row(f"{D} {{d}}/empty.bin", 2, "has 0 bytes, not a positive multiple of 2"),
    "add_odd_token_file": Row(f"{D} {{d}}/odd.bin", 2, "has 3 bytes, not a positive multiple of 2"),
    "add_uint32_as_uint16": Row(f"{D} {{d}}/u32.bin", 2, "pass --token-dtype uint32"),
    "add_uint32_declared": Row(f"{D} {{d}}/u32.bin --token-dtype uint32", 0, "", _queued_tokens("{d}/u32.bin", 5000)),
    "add_ids_beyond_vocab": Row(f"{D} {{d}}/big.bin", 2, "outside model.vocab_size"),
    "add_too_few_tokens": Row(f"{D} {{d}}/few.bin", 2, "fewer than one batch"),
    "add_same_path_twice": Row(f"{D} {{d}}/text.txt {{d}}/text.txt", 2, "holds the same data"),
    "add_empty_dir": Row(f"{D} {{d}}/emptydir", 2, "contains no files"),
    "add_no_path": Row(D, 2, "needs at least one PATH"),
    "add_run_missing": Row("data add {d}/norun {d}/text.txt", 2, "does not exist"),
    "add_kind_unknown": Row(f"{D} {{d}}/text.txt --kind words", 2, "invalid choice"),
    # ---- token files (no manifest) and manifests, read by train before any model is built
    "tok_uint32_read_as_uint16": Row(f"{TOK} data.path={{d}}/u32.bin", 2, "set data.token_dtype=uint32"),
    "tok_cut_in_half": Row(f"{TOK} data.path={{d}}/half.bin data.token_dtype=uint32", 2, "not a multiple of 4"),
    "tok_cut_in_half_uint16": Row(f"{TOK} data.path={{d}}/half.bin", 2, "not a multiple of 2"),
    "tok_empty": Row(f"{TOK} data.path={{d}}/empty.bin", 2, "is empty"),
    "tok_missing": Row(f"{TOK} data.path={{d}}/nope.bin", 2, "does not exist"),
    "tok_too_few": Row(f"{TOK} data.path={{d}}/few.bin", 2, "too few"),
    "manifest_eos_beyond_vocab": Row(f"{TOK} data.path={{d}}/m_eos/tokens.bin", 2, "eos_id=99999, outside"),
    "manifest_bos_beyond_vocab": Row(f"{TOK} data.path={{d}}/m_bos/tokens.bin", 2, "bos_id=70000, outside"),
    "manifest_eos_negative": Row(f"{TOK} data.path={{d}}/m_eos_neg/tokens.bin", 2, "eos_id=-1, outside"),
    "manifest_eos_string": Row(f"{TOK} data.path={{d}}/m_eos_str/tokens.bin", 2, "eos_id='258', outside"),
    "manifest_vocab_garbage": Row(f"{TOK} data.path={{d}}/m_vocab/tokens.bin", 2, "vocab_size='many'"),
    "manifest_n_tokens_wrong": Row(f"{TOK} data.path={{d}}/m_ntok/tokens.bin", 2, "tokens its manifest records"),
    "manifest_no_dtype": Row(f"{TOK} data.path={{d}}/m_dtype/tokens.bin", 2, "lacks its tokenizer, token_dtype"),
    "manifest_not_json": Row(f"{TOK} data.path={{d}}/m_notjson/tokens.bin", 2, "is not readable"),
    # ---- data verify / show
    "verify_not_a_run": Row("data verify {d}/emptydir", 2, "is not a run directory"),
    "verify_missing": Row("data verify {d}/nope", 2, "does not exist"),
    "verify_extra_path": Row("data verify {run} {d}/x", 2, "takes only RUN_DIR"),
    "verify_truncated_list": Row("data verify {bl_trunc}", 1, "cut short or altered"),
    "verify_garbage_list": Row("data verify {bl_garbage}", 1, "cut short or altered"),
    "verify_json_list": Row("data verify {bl_list}", 1, "not a jaxdist-batchlist/2 file"),
    "verify_empty_list": Row("data verify {bl_empty}", 1, "cut short or altered"),
    "verify_order_changed": Row("data verify {bl_order}", 1, "PROBLEMS FOUND"),
    "verify_batchlist_deleted": Row("data verify {bl_gone}", 1, "no batch list"),
    "verify_cursor_garbage": Row("data verify {bl_cursor}", 0, "2 batches trained, 0 duplicates"),
    "show_truncated_list": Row("data show {bl_trunc}", 2, "cut short or altered"),
    "show_not_a_run": Row("data show {d}/emptydir", 2, "has no batch list"),
    # ---- sample
    "sample_temperature_nan": Row(f"{S} --temperature nan", 2, "temperature=nan is not a finite number"),
    "sample_temperature_inf": Row(f"{S} --temperature inf", 2, "temperature=inf is not a finite number"),
    "sample_temperature_minus_inf": Row(f"{S} --temperature=-inf", 2, "is not a finite number"),
    "sample_temperature_beyond_float32": Row(f"{S} --temperature 1e308", 2, "is not a finite number"),
    "sample_temperature_negative": Row(f"{S} --temperature -1", 2, "temperature=-1.0 is negative"),
    "sample_top_p_zero": Row(f"{S} --top-p 0", 2, "top_p=0.0 is outside (0, 1]"),
    "sample_top_p_above_one": Row(f"{S} --top-p 1.5", 2, "top_p=1.5 is outside (0, 1]"),
    "sample_top_p_nan": Row(f"{S} --top-p nan", 2, "top_p=nan is outside (0, 1]"),
    "sample_top_k_negative": Row(f"{S} --top-k -1", 2, "top_k=-1 is negative"),
    "sample_max_new_zero": Row(f"{S} --max-new-tokens 0", 2, "max_new_tokens=0 generates nothing"),
    "sample_max_new_negative": Row(f"{S} --max-new-tokens -3", 2, "max_new_tokens=-3 generates nothing"),
    "sample_max_new_not_int": Row(f"{S} --max-new-tokens 1e9", 2, "invalid int value"),
    "sample_max_new_past_max_seq_len": Row(
        f"{S} --prompt ab --max-new-tokens 1000000000", 0, "generating at most 126 tokens (clamped)"
    ),
    "sample_prompt_invalid_utf8": Row(f"{S} --prompt \udcff", 2, "prompt 0 is not valid UTF-8"),
    "sample_stop_invalid_utf8": Row(f"{S} --prompt a --stop x\udcfe", 2, "stop string 0 is not valid UTF-8"),
    "sample_stop_empty": Row(f"{S} --prompt a --stop=", 2, "a stop string is empty"),
    "sample_prompt_fills_max_seq_len": Row(f"{S} --prompt {'q' * 128}", 2, "leaves no room"),
    "sample_prompt_past_max_seq_len": Row(f"{S} --prompt {'q' * 300}", 2, "leaves no room"),
    "sample_empty_prompt": Row(f"{S} --prompt= --max-new-tokens 12", 0, "", _sampled_like("", 12)),
    "sample_top_k_beyond_vocab": Row(
        f"{S} --prompt ab --max-new-tokens 6 --temperature 1 --top-k 100000 --seed 3",
        0,
        "",
        _sampled_like("ab", 6, temperature=1.0, top_k=0, seed=3),
    ),
    "sample_step_missing": Row(f"{S} --step 99", 2, "no checkpoint of step 99: choose one of [2]"),
    "sample_step_negative": Row(f"{S} --step -1", 2, "no checkpoint of step -1"),
    "sample_not_a_run": Row("sample {d}/emptydir", 2, "has no config.json"),
    "sample_missing_run": Row("sample {d}/nope", 2, "does not exist"),
    "sample_config_garbage": Row("sample {badconfig}", 2, "is not a readable config"),
    # ---- ckpt
    **{
        f"ckpt_{a}_missing": Row(f"ckpt {a} {{d}}/nope", 2, "(it does not exist)")
        for a in ("list", "inspect", "verify")
    },
    **{
        f"ckpt_{a}_not_a_run": Row(f"ckpt {a} {{d}}/emptydir", 2, "without checkpoints/ or step folders")
        for a in ("list", "inspect", "verify")
    },
    "ckpt_inspect_step_missing": Row("ckpt inspect {run} --step 99", 2, "no committed checkpoint of step 99"),
    "ckpt_verify_step_missing": Row("ckpt verify {run} --step 99", 2, "no committed checkpoint of step 99"),
    "ckpt_inspect_step_garbage": Row("ckpt inspect {run} --step two", 2, "invalid int value"),
    "ckpt_inspect_garbage_step_folder": Row("ckpt inspect {badstep} --step 7", 2, "no committed checkpoint of step 7"),
    "ckpt_verify_garbage_step_folder": Row("ckpt verify {badstep}", 0, "step 7: incomplete (7), not a checkpoint"),
    "ckpt_list_garbage_step_folder": Row("ckpt list {badstep}", 0, "incomplete"),
    "ckpt_overrides": Row("ckpt list {run} train.steps=3", 2, "takes no overrides"),
}


def call(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``jaxdist.cli.main(argv)`` in-process; argparse's exit counts as one."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
    return rc, out.getvalue(), err.getvalue()


def _argv(row: Row, env: dict) -> list[str]:
    return [a.format(**env) for a in row.argv.split(" ")]


def assert_one_sentence(rc: int, out: str, err: str, row: Row) -> None:
    assert "Traceback" not in err + out
    assert rc == row.rc, (rc, out[-500:], err[-500:])
    if rc == 2:
        said = [ln for ln in err.splitlines() if ln.startswith("jaxdist: ") or ": error: " in ln]
        assert len(said) == 1, err
        assert row.phrase in said[0], said[0]
    elif row.phrase:
        assert row.phrase in out + err, (out[-800:], err[-800:])


@pytest.fixture(scope="module")
def sampler(env):
    from jaxdist.sample.sampler import Sampler

    s = Sampler.from_run(env["run"])
    env["sampler"] = s
    return s


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input_row(name, env, request):
    row = ROWS[name]
    if row.root_only and os.geteuid() != 0:
        pytest.skip("root reads files without read permission; as a user the row is add_unreadable_regular_file")
    if row.check is not None and name.startswith("sample_"):
        request.getfixturevalue("sampler")
    argv = _argv(row, env)
    if name == "add_fifo":  # a regression would block on the FIFO forever: a process with a timeout
        p = subprocess.run(
            [sys.executable, "-m", "jaxdist.cli", *argv], capture_output=True, text=True, timeout=60, env=os.environ
        )
        rc, out, err = p.returncode, p.stdout, p.stderr
    else:
        rc, out, err = call(argv)
    assert_one_sentence(rc, out, err, row)
    if row.check is not None:
        row.check(env, out, err)


def test_clamped_new_tokens_are_the_room_left(env, sampler):
    """The clamp of ``sample_max_new_past_max_seq_len``: max_seq_len less the longest prompt's tokens."""
    from jaxdist.sample.config import clamp_new_tokens

    assert sampler.model.max_seq_len == 128 and [len(i) for i in sampler.prompt_ids(["ab", "abcd", ""])] == [2, 4, 1]
    assert clamp_new_tokens(10**9, 4, 128)[0] == 124
    assert clamp_new_tokens(124, 4, 128) == (124, None)
    with pytest.raises(ConfigError, match="leaves no room"):
        clamp_new_tokens(1, 128, 128)


def test_table_covers_the_issue(env):
    per_command: dict[str, int] = {}
    for name in ROWS:
        key = name.split("_")[0]
        per_command[key] = per_command.get(key, 0) + 1
    assert sum(per_command.values()) >= 60, per_command


# --------------------------------------------------------------------------- fuzz

FUZZ_SEED, FUZZ_INPUTS = 39, 200


def _mutate(data: bytes, rng: random.Random) -> bytes:
    """One of: flip 1-8 bytes, cut at a random point, cut and append garbage, or an empty file."""
    kind = rng.randrange(4)
    if kind == 0 and data:
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 1:
        return data[: rng.randrange(len(data) + 1)]
    if kind == 2:
        return data[: rng.randrange(len(data) + 1)] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
    return b""


def test_fuzz_token_file_manifest_and_batch_list(env, tmp_path):
    """200 damaged inputs: a prepared token file, its manifest (read as train reads them: settle_tokenizer and
    load_source), and a run's batch-list file (``data verify``).  Each works or is one sentence (exit 2, or the
    PROBLEMS report with exit 1); never a traceback.  No hang is possible here (regular files), so in-process."""
    from jaxdist.config import load_config
    from jaxdist.data.manifest import settle_tokenizer
    from jaxdist.data.sources import check_vocab, load_source

    rng = random.Random(FUZZ_SEED)
    prepared = env["d"] / "prepared"
    token_bytes, manifest_bytes = (prepared / "tokens.bin").read_bytes(), (prepared / "manifest.json").read_bytes()
    run = _copy_run(env["run"], tmp_path / "fuzzrun")
    list_file = run / "batchlist" / "v000001.json"
    list_bytes = list_file.read_bytes()
    outcomes: dict[str, int] = {}
    for i in range(FUZZ_INPUTS):
        target = ("tokens", "manifest", "batchlist")[i % 3]
        if target == "batchlist":
            list_file.write_bytes(_mutate(list_bytes, rng))
            rc, out, err = call(["data", "verify", str(run)])
            assert "Traceback" not in out + err and rc in (0, 1, 2), (rc, out, err)
            assert rc != 2 or len(err.strip().splitlines()) == 1, err
            outcome = f"verify rc={rc}"
        else:
            d = tmp_path / f"p{i}"
            d.mkdir()
            (d / "tokens.bin").write_bytes(_mutate(token_bytes, rng) if target == "tokens" else token_bytes)
            (d / "manifest.json").write_bytes(_mutate(manifest_bytes, rng) if target == "manifest" else manifest_bytes)
            cfg = load_config(None, ["model=tiny", "data.source=tokens", f"data.path={d / 'tokens.bin'}"])
            try:
                cfg = settle_tokenizer(cfg)
                split = load_source(cfg.data)
                check_vocab(split.train, cfg.model.vocab_size, "train")  # as the Trainer does
                check_vocab(split.eval, cfg.model.vocab_size, "eval")
                outcome = f"{target} ok"
            except ConfigError as e:
                assert "\n" not in str(e)
                outcome = f"{target} refused"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"fuzz: {FUZZ_INPUTS} inputs, outcomes {outcomes}")
    assert sum(outcomes.values()) == FUZZ_INPUTS

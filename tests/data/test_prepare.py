"""``jaxdist data prepare`` (jaxdist/data/prepare.py, corpus.py, manifest.py): JSONL, Parquet and text
corpora into a token file and its manifest, resumable after SIGKILL, checked by ``jaxdist train``.

The reference token stream is built here from the tokenizer library directly:
each document's ids, then EOS (BOS first where the tokenizer's convention has it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import sentencepiece
from tokenizers import Tokenizer as HFLibTokenizer

from jaxdist.cluster import without_device_count
from jaxdist.config import load_config
from jaxdist.data.manifest import settle_tokenizer
from jaxdist.data.prepare import prepare
from jaxdist.data.sources import concat_files, load_source, scan_files
from jaxdist.data.tokenizer_files import file_sha256
from jaxdist.errors import ConfigError

from .corpora import stdlib_texts, write_jsonl

REPO = Path(__file__).resolve().parents[2]
DOCS = stdlib_texts(("json", "email", "http"))  # ~55 documents, ~0.9 MB


def _env() -> dict[str, str]:
    env = {**os.environ, "XLA_FLAGS": without_device_count(os.environ["XLA_FLAGS"])}  # conftest's compile flags
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _jaxdist(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _tokens(out: Path) -> np.ndarray:
    m = json.loads((out / "manifest.json").read_text())
    return np.fromfile(out / "tokens.bin", dtype=m["token_dtype"])


def _bpe_reference(bpe_json: Path, docs: list[str]) -> list[int]:
    lib = HFLibTokenizer.from_file(str(bpe_json))
    eos = lib.token_to_id("<|endoftext|>")
    return [i for d in docs for i in [*lib.encode(d, add_special_tokens=False).ids, eos]]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The same documents as a JSONL file, a Parquet file (row groups of 8) and a directory of text files."""
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(root / "docs.jsonl", DOCS)
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "text": DOCS}), root / "docs.parquet", row_group_size=8)
    (root / "text").mkdir()
    for i, d in enumerate(DOCS):
        (root / "text" / f"{i:03d}.py").write_text(d, encoding="utf-8")
    return root


def test_jsonl_parquet_and_text_dir_give_the_reference_tokens(corpus, bpe_json, tmp_path):
    want = _bpe_reference(bpe_json, DOCS)
    m = prepare(corpus / "docs.jsonl", tmp_path / "j", str(bpe_json), piece_bytes=64 << 10, progress=False)
    assert _tokens(tmp_path / "j").tolist() == want
    assert (m["n_tokens"], m["n_documents"], m["token_dtype"], m["vocab_size"], m["eos_id"]) == (
        len(want),
        len(DOCS),
        "uint16",
        512,
        0,
    )
    assert m["tokenizer"]["sha256"] == file_sha256(bpe_json)
    assert m["sources"] == [
        {
            "path": "docs.jsonl",
            "bytes": (corpus / "docs.jsonl").stat().st_size,
            "sha256": file_sha256(corpus / "docs.jsonl"),
            "documents": len(DOCS),
            "tokens": len(want),
        }
    ]
    assert m["plan"]["pieces"] > 5  # cut into several pieces, still the reference stream
    prepare(corpus / "docs.parquet", tmp_path / "p", str(bpe_json), workers=2, progress=False)
    assert _tokens(tmp_path / "p").tolist() == want
    t = prepare(corpus / "text", tmp_path / "t", str(bpe_json), piece_bytes=100 << 10, progress=False)
    assert _tokens(tmp_path / "t").tolist() == want
    assert [s["tokens"] for s in t["sources"]] == [len(_bpe_reference(bpe_json, [d])) for d in DOCS]
    # Prepared already: the same command again is a no-op, other inputs into the same directory are refused.
    assert prepare(corpus / "docs.jsonl", tmp_path / "j", str(bpe_json), progress=False) == m
    with pytest.raises(ConfigError, match="already holds a corpus prepared from other sources"):
        prepare(corpus / "text", tmp_path / "j", str(bpe_json), progress=False)


def test_prepare_records_where_each_document_starts_and_a_packed_run_reads_them(corpus, bpe_json, tmp_path):
    """documents.bin holds the offset of each document's first token (the reference: each document's ids and EOS,
    by the tokenizer library), whatever the pieces; data.packing=documents packs rows from exactly those."""
    want = [len(_bpe_reference(bpe_json, [d])) for d in DOCS]
    prepare(corpus / "docs.jsonl", tmp_path / "j", str(bpe_json), piece_bytes=64 << 10, progress=False)
    starts = np.fromfile(tmp_path / "j" / "documents.bin", dtype=np.uint64)
    np.testing.assert_array_equal(starts, np.concatenate([[0], np.cumsum(want)[:-1]]))
    over = ["data.source=tokens", f"data.path={tmp_path / 'j' / 'tokens.bin'}", "data.packing=documents"]
    split = load_source(load_config(None, [*over, "train.seq_len=64"]).data)
    cut = len(split.train)  # the held-out tail is whole documents
    assert cut in starts.tolist() and split.train_starts.tolist() == [s for s in starts.tolist() if s < cut]
    assert split.eval_starts.tolist() == [s - cut for s in starts.tolist() if s >= cut]


def test_bytes_on_a_text_dir_equals_the_text_dir_source(corpus, tmp_path):
    prepare(corpus / "text", tmp_path / "b", "bytes", piece_bytes=200 << 10, progress=False)
    root = str((corpus / "text").resolve())
    np.testing.assert_array_equal(_tokens(tmp_path / "b"), concat_files(root, list(scan_files(root))))


def test_sentencepiece_documents_start_with_bos(corpus, sp_model, tmp_path):
    lib = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    docs = DOCS[:6]
    write_jsonl(tmp_path / "six.jsonl", docs, field="body")
    m = prepare(tmp_path / "six.jsonl", tmp_path / "out", str(sp_model), text_field="body", progress=False)
    assert _tokens(tmp_path / "out").tolist() == [i for d in docs for i in [1, *lib.encode(d), 2]]
    assert (m["vocab_size"], m["tokenizer"]["bos_id"], m["eos_id"], m["tokenizer"]["add_bos"]) == (400, 1, 2, True)


def test_prepare_killed_midway_then_rerun_gives_the_same_file(corpus, bpe_json, tmp_path):
    whole = prepare(corpus / "docs.jsonl", tmp_path / "whole", str(bpe_json), progress=False)
    args = ["data", "prepare", str(corpus / "docs.jsonl"), "out", "--tokenizer", str(bpe_json), "--workers", "2"]
    args += ["--piece-mb", str(4 / 1024)]  # pieces of 4 KiB: ~230 of them
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdist.cli", *args],
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the workers share its process group: one SIGKILL takes them all
    )
    journal = tmp_path / "out" / ".prepare" / "journal.jsonl"
    deadline = time.monotonic() + 60
    while not (journal.is_file() and journal.read_bytes().count(b"\n") >= 5):
        assert proc.poll() is None and time.monotonic() < deadline, "prepare ended before 5 pieces were journaled"
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    plan = json.loads((tmp_path / "out" / ".prepare" / "plan.json").read_text())
    committed = journal.read_bytes().count(b"\n")
    assert 5 <= committed < plan["pieces"] and not (tmp_path / "out" / "manifest.json").exists()  # midway
    r = _jaxdist(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "out" / "tokens.bin").read_bytes() == (tmp_path / "whole" / "tokens.bin").read_bytes()
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["tokens_sha256"] == whole["tokens_sha256"] and not (tmp_path / "out" / ".prepare").exists()


def test_prepare_then_train_the_loss_falls(corpus, bpe_json, tmp_path):
    r = _jaxdist("data", "prepare", str(corpus / "docs.jsonl"), "c", "--tokenizer", str(bpe_json), cwd=tmp_path)
    assert r.returncode == 0 and "data.path=c/tokens.bin" in r.stdout, r.stderr[-2000:]
    train = ["model=tiny", "train.seq_len=32", "train.batch_size=16", "train.steps=16", "train.progress=false"]
    train += ["checkpoint.enabled=false", "train.name=bpe", "data.source=tokens", "data.path=c/tokens.bin"]
    r = _jaxdist("train", *train, f"data.tokenizer={bpe_json}", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "bpe"
    assert json.loads((run / "config.json").read_text())["model"]["vocab_size"] == 512
    losses = [json.loads(l)["loss"] for l in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
    assert losses[0] > 5.5 and losses[-1] < losses[0] - 0.5  # starts near ln(512) = 6.24 and falls
    # Text added to this run would be read byte by byte: refused, with the prepare command to run instead.
    r = _jaxdist("data", "add", str(run), str(corpus / "docs.jsonl"), cwd=tmp_path)
    assert r.returncode == 2 and "trains with data.tokenizer" in r.stderr and "jaxdist data prepare" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_data_prepare_imports_no_jax(corpus, bpe_json, tmp_path):
    code = (
        "import sys; from jaxdist.cli import main; "
        f"rc = main(['data', 'prepare', {str(corpus / 'docs.parquet')!r}, 'o', '--tokenizer', {str(bpe_json)!r}]); "
        "assert rc == 0 and 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)[:5]"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_user_mistakes_get_one_sentence(corpus, bpe_json, sp_model, tmp_path):
    prepare(corpus / "docs.parquet", tmp_path / "c", str(bpe_json), progress=False)
    path = tmp_path / "c" / "tokens.bin"
    base = ["model=tiny", "data.source=tokens", f"data.path={path}"]
    with pytest.raises(ConfigError) as e:  # a manifest from another tokenizer
        settle_tokenizer(load_config(None, [*base, f"data.tokenizer={sp_model}"]))
    assert str(e.value) == (
        f"token file '{path}' was prepared with tokenizer '{bpe_json}' (512 tokens), not data.tokenizer "
        f"'{sp_model}': set data.tokenizer to the tokenizer it was prepared with, or prepare the corpus again "
        f"with --tokenizer {sp_model}."
    )
    with pytest.raises(ConfigError, match=r"prepared with tokenizer .* not data.tokenizer 'bytes'"):
        settle_tokenizer(load_config(None, base))  # data.tokenizer forgotten
    with pytest.raises(ConfigError, match="has a vocabulary of 512 tokens, larger than model.vocab_size=300"):
        settle_tokenizer(load_config(None, [*base, f"data.tokenizer={bpe_json}", "model.vocab_size=300"]))
    with pytest.raises(ConfigError) as e:  # a JSONL without the text field
        prepare(corpus / "docs.jsonl", tmp_path / "x", str(bpe_json), text_field="content", progress=False)
    assert str(e.value) == (
        "line 1 of 'docs.jsonl' has no text field 'content' (its fields: id, text): "
        "pass --text-field with the field that holds the text."
    )
    with pytest.raises(ConfigError, match="Parquet file 'docs.parquet' has no column 'content'"):
        prepare(corpus / "docs.parquet", tmp_path / "x", str(bpe_json), text_field="content", progress=False)
    r = _jaxdist("data", "prepare", str(corpus / "docs.jsonl"), "x", "--tokenizer", "missing.json", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == (
        "jaxdist: tokenizer 'missing.json' does not exist: point it at a tokenizer.json or a SentencePiece "
        ".model, or use bytes."
    )


def test_a_bad_line_midway_stops_the_prepare_and_other_inputs_cannot_continue_it(bpe_json, sp_model, tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS[:20])
    with open(src, "a", encoding="utf-8") as f:
        f.write(json.dumps({"body": "no text here"}) + "\n")
    want = r"^line \d+ after byte \d+ of 'd.jsonl' has no text field 'text' \(its fields: body\): pass --text-field"
    with pytest.raises(ConfigError, match=want):  # line 1 is fine: found while tokenizing its piece
        prepare(src, tmp_path / "o", str(bpe_json), piece_bytes=16 << 10, progress=False)
    assert (tmp_path / "o" / ".prepare" / "journal.jsonl").is_file()  # the pieces before it are kept
    with pytest.raises(ConfigError, match=r"holds an interrupted prepare of other sources or with another tokenizer"):
        prepare(src, tmp_path / "o", str(sp_model), piece_bytes=16 << 10, progress=False)

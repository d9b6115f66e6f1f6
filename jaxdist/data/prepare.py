"""``jaxdist data prepare SRC OUT --tokenizer T``: tokenize a corpus into a token file with a manifest.

The result, in the directory ``OUT``:

* ``tokens.bin``: the flat token file ``data.source=tokens`` reads
  (``data.path=OUT/tokens.bin``), uint16 when the vocabulary fits 65,536 ids,
  else uint32; each document is ``[BOS] text EOS`` (BOS only where the
  tokenizer's convention starts documents with it, see
  :mod:`jaxdist.data.tokenizer_files`), in corpus order;
* ``documents.bin``: the offset (uint64) of each document's first token in
  ``tokens.bin``, what ``data.packing=documents`` packs rows from
  (:mod:`jaxdist.data.documents`);
* ``manifest.json`` (:mod:`jaxdist.data.manifest`): the source files with
  their SHA-256, documents and tokens each, the tokenizer's file hash,
  vocabulary size, BOS/EOS ids, the dtype and the token count.  ``jaxdist
  train`` checks it against its config.

The corpus is cut into pieces (:mod:`jaxdist.data.corpus`) that worker
processes tokenize (``--workers``, each a whole piece at a time, a
contiguous range of documents).  Every finished piece is written to
``OUT/.prepare/pieces/NNNNNN.bin`` (temporary name, fsync, rename) and then
recorded in ``OUT/.prepare/journal.jsonl``: a killed prepare rerun with the
same arguments redoes only the pieces not recorded, and the pieces are
concatenated in order at the end, so the token file is byte-identical to an
uninterrupted one, whatever the number of workers.  No JAX on this path.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist import optional
from jaxdist.data.chat import ChatTemplate, conversation, encode_chat
from jaxdist.data.corpus import Corpus, Piece, check_text_field, read_documents, read_records, scan_corpus
from jaxdist.data.documents import DOCUMENTS, TARGETS
from jaxdist.data.journal import append_lines, atomic_write
from jaxdist.data.manifest import MANIFEST, TOKENS, build_manifest, read_manifest, same_inputs
from jaxdist.data.tokenizer import Tokenizer, load_tokenizer
from jaxdist.errors import ConfigError

WORK = ".prepare"
_worker: dict[str, Any] = {}  # per worker process: the tokenizer, loaded once by _init_worker


def piece_bytes_of(piece_mb: float) -> int:
    """``--piece-mb`` in bytes; ConfigError (one sentence) unless it is a finite positive number of MiB that makes
    at least one byte."""
    if not math.isfinite(piece_mb) or piece_mb <= 0 or piece_mb * (1 << 20) < 1 or piece_mb > 1 << 20:
        raise ConfigError(
            f"--piece-mb={piece_mb} is not a size of input per piece of work: pass a number of MiB such as 8 "
            "(more than 0, at most 1048576)."
        )
    return int(piece_mb * (1 << 20))


def check_output(src: str | Path, out: Path, force: bool) -> None:
    """ConfigError (one sentence) if the output directory ``out`` is the corpus ``src`` or inside it (a rerun
    would read its own tokens), or holds files that prepare did not write and ``force`` is not given."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output '{out}' is a file: pass a directory (it gets tokens.bin and manifest.json).")
    source, target = Path(src).resolve(), out.resolve()
    if source.is_dir() and (target == source or source in target.parents):
        raise ConfigError(
            f"output '{out}' is inside the corpus '{src}': the next prepare would read its tokens as text; "
            "choose an output directory outside the corpus."
        )
    if not out.is_dir():
        return
    names = {e.name for e in out.iterdir()}
    outputs = (TOKENS, MANIFEST, DOCUMENTS, TARGETS)
    ours = {WORK, f".{TOKENS}.tmp"} | (set(outputs) if names & {WORK, MANIFEST} else set())
    # a temporary file of an output, left by a killed prepare (jaxdist.data.journal.atomic_write's names)
    ours |= {n for n in names if n.endswith(".tmp") and any(n.startswith(f".{o}.") for o in outputs)}
    foreign = sorted(names - ours)
    if foreign and not force:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ConfigError(
            f"output '{out}' holds files that data prepare did not write ({shown}): choose a new or empty "
            "directory, or pass --force to write tokens.bin and manifest.json beside them."
        )


def token_dtype_for(vocab_size: int) -> str:
    """The smallest token-file dtype that holds ids ``0..vocab_size-1``: uint16 or uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def encode_documents(tok: Tokenizer, texts: list[str], dtype: str) -> tuple[np.ndarray, list[int]]:
    """``[BOS] ids EOS`` of every text, concatenated, as ``dtype``; and each document's length (tokens)."""
    bos = np.array([tok.bos_id] if tok.add_bos else [], dtype=dtype)
    eos = np.array([tok.eos_id], dtype=dtype)
    parts: list[np.ndarray] = []
    for ids in tok.encode_batch(texts):
        parts += [bos, ids.astype(dtype, copy=False), eos]
    lengths = [len(b) + len(i) + 1 for b, i in zip(parts[0::3], parts[1::3])]
    return (np.concatenate(parts) if parts else np.zeros((0,), dtype=dtype)), lengths


def encode_conversations(
    tok: Tokenizer, template: ChatTemplate, records: list[tuple[Any, str]], dtype: str, every: bool
):
    """The ids ``apply_chat_template`` gives each conversation, concatenated as ``dtype``; whether each token is a
    target (uint8: the assistant's tokens, or all with ``every``); each conversation's length."""
    ids, targets, lengths = [], [], []
    for record, where in records:
        i, t = encode_chat(tok, template, conversation(record, where), all_targets=every)
        ids.append(np.asarray(i, dtype=dtype))
        targets.append(t.astype(np.uint8))
        lengths.append(len(i))
    if not ids:
        return np.zeros((0,), dtype=dtype), np.zeros((0,), np.uint8), lengths
    return np.concatenate(ids), np.concatenate(targets), lengths


def _init_worker(spec: str, single_threaded: bool, chat: str = "") -> None:
    if single_threaded:  # the processes are the parallelism: one core each, no oversubscription
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
    _worker["tok"] = load_tokenizer(spec)
    _worker["template"] = ChatTemplate.beside(spec) if chat else None


def _write(final: Path, data: bytes) -> None:
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")  # per process: an orphaned worker cannot clash
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)


def _tokenize_piece(job: tuple[Corpus, Piece, str, str, str, str]) -> dict[str, Any]:
    """Tokenize one piece into its file (atomically); returns its journal record.  Chat data (``chat``:
    ``assistant`` or ``all``) also writes each token's target flag beside it (``.tgt``, before the ``.bin``)."""
    corpus, piece, text_field, dtype, pieces_dir, chat = job
    if chat:
        records, owners = read_records(corpus, piece)
        tokens, targets, lengths = encode_conversations(
            _worker["tok"], _worker["template"], records, dtype, chat == "all"
        )
        _write(Path(pieces_dir) / f"{piece.index:06d}.tgt", targets.tobytes())
    else:
        texts, owners = read_documents(corpus, piece, text_field)
        tokens, lengths = encode_documents(_worker["tok"], texts, dtype)
    files: dict[str, list[int]] = {}  # file index -> [documents, tokens]
    for owner, n in zip(owners, lengths):
        counts = files.setdefault(str(owner), [0, 0])
        counts[0] += 1
        counts[1] += n
    _write(Path(pieces_dir) / f"{piece.index:06d}.bin", tokens.tobytes())
    return {
        "piece": piece.index,
        "documents": len(lengths),
        "tokens": int(tokens.size),
        "files": files,
        "lengths": [int(n) for n in lengths],  # each document's tokens: documents.bin
    }


def _done_pieces(work: Path, itemsize: int, chat: bool = False) -> dict[int, dict[str, Any]]:
    """Pieces the journal records whose file is there with the recorded size (a torn last line is skipped)."""
    done: dict[int, dict[str, Any]] = {}
    journal = work / "journal.jsonl"
    if not journal.is_file():
        return done
    for line in journal.read_bytes().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        p = work / "pieces" / f"{rec['piece']:06d}.bin"
        # a record without its documents' lengths (an older prepare's) is done again
        tgt = p.with_suffix(".tgt")  # chat data: the targets, one byte per token
        if chat and not (tgt.is_file() and tgt.stat().st_size == rec["tokens"]):
            continue
        if p.is_file() and p.stat().st_size == rec["tokens"] * itemsize and "lengths" in rec:
            done[rec["piece"]] = rec
    return done


def prepare(
    src: str | Path,
    out: str | Path,
    tokenizer: str,
    workers: int = 1,
    text_field: str = "text",
    piece_bytes: int = 8 << 20,
    progress: bool = True,
    force: bool = False,
    chat: str = "",
) -> dict[str, Any]:
    """Tokenize the corpus ``src`` into ``out/tokens.bin`` + ``out/manifest.json`` (see the module docstring);
    returns the manifest.  Resumes an interrupted prepare of the same inputs; a finished one is not redone.
    ConfigError (one sentence) for a bad corpus, tokenizer or output directory (see :func:`check_output`;
    ``force`` writes beside files it did not write).

    ``chat``: JSONL conversations (:mod:`jaxdist.data.chat`), each rendered with the tokenizer's chat template as
    ``apply_chat_template`` does and written as one document, with ``targets.bin`` (uint8 per token) marking the
    targets: the assistant's tokens (``assistant``) or every token (``all``)."""
    if workers < 1:
        raise ConfigError(f"--workers={workers} must be at least 1.")
    if chat not in ("", "assistant", "all"):
        raise ConfigError(f"chat={chat!r} is unknown: use 'assistant' (the assistant's tokens are targets) or 'all'.")
    out = Path(out)
    check_output(src, out, force)
    tok = load_tokenizer(tokenizer)
    if tok.eos_id is None:
        raise ConfigError(
            f"tokenizer '{tokenizer}' has no end-of-text token to separate documents: use a tokenizer with one, "
            "or put a tokenizer_config.json with eos_token beside its tokenizer.json."
        )
    corpus = scan_corpus(src, piece_bytes)
    if chat:
        if corpus.kind != "jsonl":
            raise ConfigError(f"--chat reads JSONL conversations, but '{src}' is {corpus.kind}: pass .jsonl files.")
        ChatTemplate.beside(tokenizer)  # no template: one sentence now, not in a worker
    else:
        check_text_field(corpus, text_field)
    dtype = token_dtype_for(tok.vocab_size)
    plan = {
        "sources": [[f.rel, f.size, f.sha256] for f in corpus.files],
        "kind": corpus.kind,
        "text_field": text_field,
        "tokenizer": tok.fingerprint,
        "token_dtype": dtype,
        "pieces": len(corpus.pieces),
        "piece_bytes": piece_bytes,
        "chat": chat,
    }
    work = out / WORK
    if (out / MANIFEST).is_file():
        done_manifest = read_manifest(out / MANIFEST)
        if same_inputs(done_manifest["plan"], plan) and (out / TOKENS).is_file():
            shutil.rmtree(work, ignore_errors=True)  # a kill after the manifest was written left it behind
            return done_manifest
        raise ConfigError(
            f"'{out}' already holds a corpus prepared from other sources or with another tokenizer: "
            "choose another output directory, or delete it first."
        )
    (work / "pieces").mkdir(parents=True, exist_ok=True)
    plan_file = work / "plan.json"
    if plan_file.is_file():
        before = json.loads(plan_file.read_text())
        if not same_inputs(before, plan):
            raise ConfigError(
                f"'{work}' holds an interrupted prepare of other sources or with another tokenizer or text field: "
                f"rerun that prepare, or delete '{work}' to start over."
            )
        if before["piece_bytes"] != piece_bytes:  # continue with the interrupted prepare's pieces
            piece_bytes = before["piece_bytes"]
            corpus = scan_corpus(src, piece_bytes)
            plan.update(pieces=len(corpus.pieces), piece_bytes=piece_bytes)
    atomic_write(plan_file, json.dumps(plan, indent=1).encode())

    itemsize = np.dtype(dtype).itemsize
    done = _done_pieces(work, itemsize, bool(chat))
    todo = [p for p in corpus.pieces if p.index not in done]
    tqdm = optional.load("tqdm", "no progress bar") if progress else None
    bar = (tqdm.tqdm if tqdm is not None else _NoBar)(
        total=sum(p.bytes for p in corpus.pieces),
        initial=sum(p.bytes for p in corpus.pieces if p.index in done),
        unit="B",
        unit_scale=True,
        desc="prepare",
        file=sys.stderr,
        disable=not progress,
    )
    jobs = [(corpus, p, text_field, dtype, str(work / "pieces"), chat) for p in todo]

    def commit(rec: dict[str, Any]) -> None:
        append_lines(work / "journal.jsonl", (json.dumps(rec) + "\n").encode(), fsync=True)
        done[rec["piece"]] = rec
        bar.update(corpus.pieces[rec["piece"]].bytes)

    try:
        if workers == 1 or len(jobs) <= 1:
            _init_worker(tokenizer, False, chat)
            for job in jobs:
                commit(_tokenize_piece(job))
        elif jobs:
            # spawn, not fork: the caller may have started threads (JAX, the tokenizers pool) that fork would break.
            ctx = multiprocessing.get_context("spawn")
            with ctx.Pool(min(workers, len(jobs)), _init_worker, (tokenizer, True, chat)) as pool:
                for rec in pool.imap_unordered(_tokenize_piece, jobs):
                    commit(rec)
    finally:
        bar.close()  # ends the bar's line, also when interrupted: a message after it starts on its own line
    return _finish(corpus, out, work, tok, dtype, text_field, plan, done)


def _finish(corpus, out: Path, work: Path, tok, dtype, text_field, plan, done) -> dict[str, Any]:
    """Concatenate the pieces in order into tokens.bin, write the manifest, remove the work directory."""
    h = hashlib.sha256()
    tmp = out / f".{TOKENS}.tmp"
    per_file: dict[int, list[int]] = {i: [0, 0] for i in range(len(corpus.files))}
    with open(tmp, "wb") as f:
        for p in corpus.pieces:
            data = (work / "pieces" / f"{p.index:06d}.bin").read_bytes()
            f.write(data)
            h.update(data)
            for i, (docs, tokens) in done[p.index]["files"].items():
                per_file[int(i)][0] += docs
                per_file[int(i)][1] += tokens
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out / TOKENS)
    lengths = np.asarray([n for p in corpus.pieces for n in done[p.index]["lengths"]], dtype=np.uint64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64) if len(lengths) else lengths
    atomic_write(out / DOCUMENTS, starts.tobytes())  # data.packing=documents reads the boundaries here
    if plan.get("chat"):  # which tokens are targets, beside the tokens
        atomic_write(
            out / TARGETS, b"".join((work / "pieces" / f"{p.index:06d}.tgt").read_bytes() for p in corpus.pieces)
        )
    n_tokens = sum(r["tokens"] for r in done.values())
    if n_tokens == 0:
        raise ConfigError(f"corpus '{corpus.root}' holds no text: check --text-field and the files.")
    manifest = build_manifest(corpus, tok, dtype, text_field, plan, per_file, n_tokens, h.hexdigest())
    atomic_write(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    shutil.rmtree(work, ignore_errors=True)
    return manifest


class _NoBar:
    """What ``prepare`` updates and closes where there is no progress bar (none asked for, or no tqdm)."""

    def __init__(self, **_: Any):
        pass

    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass

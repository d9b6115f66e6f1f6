"""Corpora to tokenize: JSONL, Parquet and plain text, cut into pieces that can be tokenized independently.

``jaxdist data prepare SRC`` (:mod:`jaxdist.data.prepare`) reads ``SRC``:

* a ``.jsonl`` file, or a directory of them: one document per line, its text
  in a field (``--text-field``, default ``text``);
* a ``.parquet`` file, or a directory of them: one document per row, its text
  in a column (``pyarrow``);
* any other directory: every file is one document (UTF-8 text, like
  ``data.source=text_dir``).

Files are taken in sorted order of their relative path.  A *piece* is a
contiguous range of documents: a byte range of a JSONL file cut at line
ends, a Parquet row group, or a run of text files; pieces depend only on the
files and ``piece_bytes``, never on the number of workers, so the token file
is the same however it was made.  No JAX, no tokenizer here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxdist.data.sources import scan_files
from jaxdist.data.tokenizer_files import file_sha256
from jaxdist.errors import ConfigError

KINDS = ("jsonl", "parquet", "text")


@dataclass(frozen=True)
class CorpusFile:
    """One input file: ``rel`` its path relative to SRC (its name when SRC is a file), ``size`` in bytes."""

    path: str  # absolute
    rel: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Piece:
    """Documents ``start..stop`` of a file range: JSONL byte offsets, Parquet row groups, or (text) the files
    ``first..last`` themselves (``start``/``stop`` unused)."""

    index: int
    first: int  # index of the first file of the piece
    last: int  # index of the last file (== first except for text)
    start: int
    stop: int
    bytes: int  # input bytes (for the progress bar)


@dataclass(frozen=True)
class Corpus:
    """The input of a prepare: its kind, files and pieces."""

    root: str
    kind: str
    files: tuple[CorpusFile, ...]
    pieces: tuple[Piece, ...]


def _kind_of(p: Path) -> str:
    return "jsonl" if p.suffix == ".jsonl" else "parquet" if p.suffix == ".parquet" else "text"


def scan_corpus(src: str | Path, piece_bytes: int = 8 << 20) -> Corpus:
    """The files and pieces of ``src`` (see the module docstring); ConfigError for a missing or empty source."""
    p = Path(src)
    if not p.exists():
        raise ConfigError(f"corpus '{src}' does not exist: pass a JSONL or Parquet file or a directory of them.")
    if p.is_file():
        kind, root, rels = _kind_of(p), str(p.parent.resolve()), [p.name]
        if kind == "text":
            raise ConfigError(
                f"corpus '{src}' is neither .jsonl nor .parquet: pass such a file, or a directory of text files."
            )
    else:
        root = str(p.resolve())
        entries = [e[0] for e in scan_files(root)]
        jsonl = [r for r in entries if r.endswith(".jsonl")]
        parquet = [r for r in entries if r.endswith(".parquet")]
        kind, rels = ("jsonl", jsonl) if jsonl else ("parquet", parquet) if parquet else ("text", entries)
        if not rels:
            raise ConfigError(f"corpus directory '{src}' contains no files: put JSONL, Parquet or text files in it.")
    try:
        files = tuple(
            CorpusFile(
                os.path.join(root, r), r, os.path.getsize(os.path.join(root, r)), file_sha256(os.path.join(root, r))
            )
            for r in rels
        )
    except OSError as e:
        raise ConfigError(f"corpus file '{e.filename}' cannot be read ({e.strerror}): check its permissions.") from None
    return Corpus(root, kind, files, tuple(_pieces(kind, files, max(1, piece_bytes))))


def _pieces(kind: str, files: tuple[CorpusFile, ...], piece_bytes: int) -> list[Piece]:
    out: list[Piece] = []
    if kind == "text":  # runs of whole files of about piece_bytes
        first, size = 0, 0
        for i, f in enumerate(files):
            size += f.size
            if size >= piece_bytes or i == len(files) - 1:
                out.append(Piece(len(out), first, i, 0, 0, size))
                first, size = i + 1, 0
        return out
    for i, f in enumerate(files):
        if kind == "parquet":
            for g, n in enumerate(_row_group_bytes(f.path)):
                out.append(Piece(len(out), i, i, g, g + 1, n))
            continue
        with open(f.path, "rb") as fh:  # byte ranges cut just after a newline
            start = 0
            while start < f.size:
                fh.seek(min(start + piece_bytes, f.size))
                fh.readline()
                stop = min(fh.tell(), f.size)
                out.append(Piece(len(out), i, i, start, stop, stop - start))
                start = stop
    return out


def _pyarrow_parquet():
    try:
        import pyarrow.parquet as pq  # loaded when used (about 0.5 s): only Parquet corpora need it
    except ImportError:
        raise ConfigError("reading Parquet needs the pyarrow package: pip install pyarrow.") from None
    return pq


def _parquet_file(path: str):
    """The opened Parquet file; ConfigError (one sentence) when it is not one (no footer, damaged metadata)."""
    pq = _pyarrow_parquet()
    import pyarrow as pa  # pyarrow.parquet imported it already

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(
            f"'{path}' is not a readable Parquet file ({str(e).splitlines()[0]}): remove it from the corpus or "
            "write it again."
        ) from None


def _row_group_bytes(path: str) -> list[int]:
    meta = _parquet_file(path).metadata
    return [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]


def check_text_field(corpus: Corpus, text_field: str) -> None:
    """ConfigError (one sentence) if the first document of a JSONL file, or a Parquet file's schema, lacks the
    text field: caught before any worker starts."""
    for f in corpus.files:
        if corpus.kind == "parquet":
            schema = _parquet_file(f.path).schema_arrow
            if text_field not in schema.names:
                raise ConfigError(
                    f"Parquet file '{f.rel}' has no column '{text_field}' (it has {', '.join(schema.names[:8])}): "
                    "pass --text-field with the column that holds the text."
                )
            kind = schema.field(text_field).type
            if not (_pa_types().is_string(kind) or _pa_types().is_large_string(kind)):
                raise ConfigError(
                    f"column '{text_field}' of Parquet file '{f.rel}' holds {kind}, not text: "
                    "pass --text-field with the column that holds the text."
                )
        elif corpus.kind == "jsonl":
            with open(f.path, "rb") as fh:
                for line in fh:
                    if line.strip():
                        _text_of(line, text_field, f"line 1 of '{f.rel}'")
                        break


def _pa_types():
    """``pyarrow.types`` (loaded with pyarrow.parquet)."""
    import pyarrow.types  # pyarrow.parquet imported it already

    return pyarrow.types


def _text_of(line: bytes, text_field: str, where: str) -> str:
    """The text of one JSONL line; ``where`` names the line in messages (e.g. "line 1 of 'a.jsonl'")."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ConfigError(f"{where} is not JSON ({e}): fix it or remove it from the corpus.") from None
    value = record.get(text_field) if isinstance(record, dict) else None
    if isinstance(record, dict) and text_field in record and not isinstance(value, str):
        raise ConfigError(
            f"{where} holds {json.dumps(value)[:40]} in field '{text_field}', not text: "
            "pass --text-field with the field that holds the text, or fix the line."
        )
    if not isinstance(value, str):
        fields = ", ".join(list(record)[:8]) if isinstance(record, dict) else "none"
        raise ConfigError(
            f"{where} has no text field '{text_field}' (its fields: {fields}): "
            "pass --text-field with the field that holds the text."
        )
    return value


def read_documents(corpus: Corpus, piece: Piece, text_field: str) -> tuple[list[str], list[int]]:
    """The texts of the documents of ``piece`` in order (empty ones left out), and the file index of each."""
    if corpus.kind == "text":
        texts, owners = [], []
        for i in range(piece.first, piece.last + 1):
            with open(corpus.files[i].path, "rb") as fh:
                text = fh.read().decode("utf-8", errors="replace")
            if text:
                texts.append(text)
                owners.append(i)
        return texts, owners
    f = corpus.files[piece.first]
    if corpus.kind == "parquet":
        import pyarrow as pa  # pyarrow.parquet imported it already

        try:
            table = _parquet_file(f.path).read_row_group(piece.start, columns=[text_field])
        except (pa.ArrowException, OSError) as e:
            raise ConfigError(
                f"row group {piece.start} of Parquet file '{f.rel}' is not readable ({str(e).splitlines()[0]}): "
                "remove the file from the corpus or write it again."
            ) from None
        texts = [t for t in table.column(text_field).to_pylist() if t]
        return texts, [piece.first] * len(texts)
    texts = [t for line, where in _jsonl_lines(corpus, piece) if (t := _text_of(line, text_field, where))]
    return texts, [piece.first] * len(texts)


def _jsonl_lines(corpus: Corpus, piece: Piece) -> list[tuple[bytes, str]]:
    """The non-blank lines of a JSONL ``piece``, each with where it is (file and line, for errors)."""
    f = corpus.files[piece.first]
    with open(f.path, "rb") as fh:
        fh.seek(piece.start)
        data = fh.read(piece.stop - piece.start)
    return [
        (line, f"line {k + 1} after byte {piece.start} of '{f.rel}'")
        for k, line in enumerate(data.split(b"\n"))
        if line.strip()
    ]


def read_records(corpus: Corpus, piece: Piece) -> tuple[list[tuple[Any, str]], list[int]]:
    """The JSON value of each non-blank line of a JSONL ``piece`` with where it is (file and line, for errors),
    and the file index of each; ConfigError naming the line that is not JSON."""
    records = []
    for line, where in _jsonl_lines(corpus, piece):
        try:
            records.append((json.loads(line), where))
        except ValueError as e:
            raise ConfigError(f"{where} is not JSON ({e}): fix or remove it.") from None
    return records, [piece.first] * len(records)

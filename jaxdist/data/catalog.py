"""The sources a batch list draws from: the run's configured data and data added while it runs.

``add_data(run_dir, paths)`` (and ``jaxdist data add RUN_DIR PATH...``)
reads each new path, fingerprints its tokens and queues the addition in the
run's journal; the trainer turns it into the next batch-list version at its
next step boundary (see :mod:`jaxdist.data.batchlist`). A path is

* a directory: every file under it, sorted by relative path, byte-tokenized,
  each followed by EOS (like ``data.source=text_dir``, but nothing held out);
* a file ending ``.bin``, ``.tok`` or ``.tokens`` (or any file with
  ``kind="tokens"``): a flat token file of ``token_dtype`` ids;
* any other file: one text file, byte-tokenized, then EOS.

Data is identified by content: the SHA-256 of its tokens. Adding data whose
fingerprint the run already has (under any path) is refused.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist.config import ConfigError
from jaxdist.data import sources as _sources
from jaxdist.data.batchlist import BatchList, BatchListError, SourceEntry, Stored
from jaxdist.data.documents import PackedStream, Packing, eos_starts, pack, read_documents, read_targets
from jaxdist.data.items import ItemSource
from jaxdist.data.journal import Journal
from jaxdist.data.tokenizer import EOS

TOKEN_SUFFIXES = (".bin", ".tok", ".tokens")
_CHUNK = 1 << 24  # tokens hashed per call: bounds the memory a memmap'ed file pulls in at once
_QUICK_SLICES, _QUICK_LEN = 17, 4096


def fingerprint(tokens: np.ndarray) -> str:
    """SHA-256 (hex) of the token ids as stored (dtype name, then the raw bytes): about 1 GB/s."""
    h = hashlib.sha256(str(tokens.dtype).encode())
    for i in range(0, len(tokens), _CHUNK):
        h.update(np.ascontiguousarray(tokens[i : i + _CHUNK]).view(np.uint8))
    return h.hexdigest()


def quick_fingerprint(tokens: np.ndarray | ItemSource) -> str:
    """SHA-256 (hex) of the length and 17 evenly spaced slices of 4096 tokens: reads at most ~0.3 MB (a Python
    dataset: its length and 17 items, jaxdist.data.items.ItemSource.quick)."""
    if isinstance(tokens, ItemSource):
        return tokens.quick()
    n = len(tokens)
    h = hashlib.sha256(f"{tokens.dtype}:{n}".encode())
    for start in np.linspace(0, max(0, n - _QUICK_LEN), _QUICK_SLICES).astype(np.int64):
        h.update(np.ascontiguousarray(tokens[start : start + _QUICK_LEN]).view(np.uint8))
    return h.hexdigest()


def config_entry(tokens: np.ndarray | ItemSource, name: str, seed: int, packing: Packing | None = None) -> SourceEntry:
    """Source 0 of a run: the train split of its ``data.*`` source (``packing``: its rows packed from documents),
    or the Python dataset the Trainer was given (jaxdist.data.items: one window per item)."""
    if isinstance(tokens, ItemSource):
        n = len(tokens)
        return SourceEntry(
            0, "config", name, "", "items", n, tokens.fingerprint(), tokens.quick(), int(seed), 1, "items", n
        )
    return SourceEntry(
        id=0,
        kind="config",
        name=name,
        path="",
        token_dtype=str(tokens.dtype),
        n_tokens=len(tokens),
        fingerprint=fingerprint(tokens),
        quick=quick_fingerprint(tokens),
        seed=int(seed),
        added_in=1,
        packing="stream" if packing is None else "documents",
        rows=0 if packing is None else packing.rows,
    )


def _text_file(p: Path) -> np.ndarray:
    body = np.frombuffer(p.read_bytes(), dtype=np.uint8).astype(np.uint16)
    out = np.append(body, np.uint16(EOS))
    out.flags.writeable = False
    return out


def _token_file(p: Path, token_dtype: str) -> np.ndarray:
    if token_dtype not in _sources.TOKEN_DTYPES:
        raise ConfigError(f"token dtype '{token_dtype}' is not supported: use uint16 or uint32.")
    size, itemsize = p.stat().st_size, np.dtype(token_dtype).itemsize
    if size == 0 or size % itemsize:
        raise ConfigError(
            f"token file '{p}' has {size} bytes, not a positive multiple of {itemsize} "
            f"({token_dtype}): pass the dtype it was written with."
        )
    tokens = np.memmap(p, dtype=token_dtype, mode="r")
    _sources.check_token_layout(tokens, f"token file '{p}'", "pass --token-dtype uint32")
    return tokens


def read_path(path: str | Path, kind: str = "auto", token_dtype: str = "uint16") -> tuple[str, np.ndarray]:
    """(kind, tokens) of one path to add: text_dir, tokens or text (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        if p.is_symlink():
            raise ConfigError(
                f"data path '{path}' is a symbolic link to '{p.readlink()}', which does not exist: fix the link."
            )
        raise ConfigError(f"data path '{path}' does not exist: check the path and add it again.")
    if kind not in ("auto", "text", "tokens"):
        raise ConfigError(f"kind '{kind}' is unknown: use auto, text or tokens.")
    if not p.is_dir() and not p.is_file():  # a FIFO would block the read forever, a device never ends
        raise ConfigError(
            f"data path '{path}' is not a regular file or a directory: copy its data into a file and add that."
        )
    try:
        return _read_path(p, kind, token_dtype)
    except OSError as e:
        raise ConfigError(
            f"data path '{path}' cannot be read ({e.strerror}): check its permissions and add it again."
        ) from None


def _read_path(p: Path, kind: str, token_dtype: str) -> tuple[str, np.ndarray]:
    if p.is_dir():
        root = str(p.resolve())
        entries = _sources.scan_files(root)
        if not entries:
            raise ConfigError(f"directory '{p}' contains no files: put text files in it first.")
        return "text_dir", _sources.concat_files(root, list(entries))
    if kind == "tokens" or (kind == "auto" and p.suffix in TOKEN_SUFFIXES):
        return "tokens", _token_file(p, token_dtype)
    return "text", _text_file(p)


def _reads_as_text(path: str | Path, kind: str) -> bool:
    """Whether :func:`read_path` would read ``path`` byte by byte (a text file or a directory of them)."""
    p = Path(path)
    return p.is_dir() or kind == "text" or (kind == "auto" and p.exists() and p.suffix not in TOKEN_SUFFIXES)


def known_sources(journal: Journal, current: BatchList | Stored) -> dict[str, tuple[str, SourceEntry | dict]]:
    """Fingerprint -> (what holds it, in words; its entry) for every source of the batch list ``current`` and of
    the journal's pending additions: the data a new addition must not repeat."""
    known: dict[str, tuple[str, SourceEntry | dict]] = {
        s.fingerprint: (f"source {s.id} ('{s.name}') of the batch list", s) for s in current.sources
    }
    for name, req in journal.pending():
        for s in (req or {}).get("sources", []):
            if isinstance(s, dict):
                known.setdefault(s["fingerprint"], (f"the pending addition {name} ('{s['name']}')", s))
    return known


def given_items(entry: SourceEntry | dict, items: Sequence[ItemSource]) -> ItemSource | None:
    """The dataset of ``items`` that is the added Python dataset ``entry`` names (its length and quick
    fingerprint), or None."""
    n, quick = (entry["n_tokens"], entry["quick"]) if isinstance(entry, dict) else (entry.n_tokens, entry.quick)
    return next((src for src in items if len(src) == n and src.quick() == quick), None)


def read_source(
    entry: SourceEntry, config_tokens: np.ndarray | ItemSource | None = None, items: Sequence[ItemSource] = ()
) -> np.ndarray | ItemSource:
    """The tokens of a registered source, checked against the journal (length and quick fingerprint).

    ``config_tokens``: the train split the config gives now (for source 0).  ``items``: the Python datasets
    added to a run on one (``Trainer.add_data``, or given again as ``added_data=`` on resume), matched to an
    ``items`` source by length and quick fingerprint.
    Raises BatchListError naming the source when it is missing or changed.
    """
    if entry.kind == "items":
        src = given_items(entry, items)
        if src is None:
            raise BatchListError(
                f"source {entry.id} of the batch list ({entry.name}, {entry.n_tokens:,} items) is a Python dataset "
                "added to the run, and no dataset given as added_data= has its length and items: pass it there "
                "as it was added, since the run's remaining batches read from it."
            )
        return src
    if entry.kind == "config" and isinstance(config_tokens, ItemSource):
        tokens, what = config_tokens, f"the dataset given as data=, {entry.name}"
        fix = "pass the dataset the run started with, or use a new train.name"
    elif entry.kind == "config":
        assert config_tokens is not None
        tokens, what = config_tokens, "the configured data (data.*)"
        fix = "restore the data settings the run started with, or use a new train.name"
    else:
        p = Path(entry.path)
        if not p.exists():
            raise BatchListError(
                f"source {entry.id} of the batch list, '{entry.path}', is missing: put it back, "
                "since the run's remaining batches read from it."
            )
        tokens = (
            _token_file(p, entry.token_dtype)
            if entry.kind == "tokens"
            else _text_file(p)
            if entry.kind == "text"
            else read_path(p)[1]
        )
        what, fix = f"'{entry.path}'", "put back the data that was added"
    if len(tokens) != entry.n_tokens or quick_fingerprint(tokens) != entry.quick:
        unit = "items" if isinstance(tokens, ItemSource) else "tokens"
        now = (
            f"{len(tokens):,} {unit} now, {entry.n_tokens:,} then"
            if len(tokens) != entry.n_tokens
            else "the same length"
        )
        raise BatchListError(
            f"source {entry.id} of the batch list ({what}) has changed since it was registered ({now}, other "
            f"{unit}): {fix}."
        )
    return tokens


def _run_config(run_dir: Path, section: str, key: str, default: Any) -> Any:
    """``[section] key`` of the config the run was started with (``<run>/config.json``), or ``default``."""
    try:
        return json.loads((run_dir / "config.json").read_text())[section][key]
    except (OSError, ValueError, KeyError, TypeError):
        return default


def run_token_dtype(run_dir: Path) -> str:
    """The run's data.token_dtype (from its config.json; uint16 when it cannot be read)."""
    return _run_config(run_dir, "data", "token_dtype", "uint16")


def add_data(
    run_dir: str | Path,
    paths: list[str | Path],
    *,
    seed: int | None = None,
    kind: str = "auto",
    token_dtype: str | None = None,
) -> dict[str, Any]:
    """Register ``paths`` as new training data of the run in ``run_dir``; the trainer mixes it in.

    The request waits in ``<run>/batchlist/requests/`` until the trainer's next
    step boundary (or its next start), which makes it the next batch-list
    version: the new batches shuffled, with ``seed`` (default: a random one,
    recorded), into the batches not yet trained. ``token_dtype`` of token
    files defaults to the run's ``data.token_dtype``. Returns ``{"request",
    "seed", "sources", "batches"}``. ConfigError, naming the path, for a
    missing path, data the run already has (same fingerprint) or data too
    small for one batch, or ids outside the run's ``model.vocab_size``.
    """
    run_dir = Path(run_dir)
    journal = Journal(run_dir)
    current = journal.head()  # the sources and shapes: its order is not needed
    if not paths:
        raise ConfigError("no data paths given: name at least one file or directory to add.")
    if current.sources[0].packing == "items":
        raise ConfigError(
            f"the run in {run_dir} trains on a Python dataset's items, not on token data: add another dataset to "
            "it with Trainer.add_data."
        )
    token_dtype = token_dtype or run_token_dtype(run_dir)
    known = {fp: what for fp, (what, _) in known_sources(journal, current).items()}
    B, L = current.batch_size, current.seq_len
    vocab_size = _run_config(run_dir, "model", "vocab_size", None)
    entries, total = [], 0
    tokenizer = _run_config(run_dir, "data", "tokenizer", "bytes")
    for path in paths:
        if tokenizer != "bytes" and _reads_as_text(path, kind):
            raise ConfigError(
                f"'{path}' is text, and this run trains with data.tokenizer '{tokenizer}', not bytes: tokenize it "
                f"first with `jaxdist data prepare {path} OUT --tokenizer {tokenizer}` and add OUT/tokens.bin."
            )
        k, tokens = read_path(path, kind, token_dtype)
        if vocab_size is not None:
            _sources.check_vocab(tokens, int(vocab_size), f"'{path}'")
        fp = fingerprint(tokens)
        if fp in known:
            raise ConfigError(
                f"'{path}' holds the same data (fingerprint {fp[:12]}) as {known[fp]}: "
                "each piece of data is added once, so leave it out."
            )
        batches = max(0, (len(tokens) - 1) // L) // B
        if batches < 1:
            raise ConfigError(
                f"'{path}' holds {len(tokens):,} tokens, fewer than one batch of {B} sequences of "
                f"{L + 1} tokens needs ({B * L + 1:,}): add it together with more data."
            )
        known[fp] = f"'{path}' given earlier in the same call"
        entries.append(
            {
                "kind": k,
                "name": str(path),
                "path": str(Path(path).resolve()),
                "token_dtype": str(tokens.dtype),
                "n_tokens": len(tokens),
                "fingerprint": fp,
                "quick": quick_fingerprint(tokens),
            }
        )
        total += batches
    seed = secrets.randbits(63) if seed is None else int(seed)
    name = journal.submit({"sources": entries, "seed": seed, "created": time.time()})
    return {"request": name, "seed": seed, "sources": entries, "batches": total}


def add_items(run_dir: str | Path, source: ItemSource, base: ItemSource, *, seed: int | None = None) -> dict[str, Any]:
    """Queue the Python dataset ``source`` as new training data of the run in ``run_dir``, which trains on the
    Python dataset ``base``: as :func:`add_data` for files, the trainer mixes its items into the batches not yet
    trained at its next step boundary.  Returns ``{"request", "seed", "sources", "batches"}``.  ConfigError (one
    sentence) for items of another shape than ``base``'s, fewer items than one batch, or items the run already
    has."""
    run_dir = Path(run_dir)
    journal = Journal(run_dir)
    current = journal.head()
    if current.sources[0].packing != "items":
        raise ConfigError(
            f"the run in {run_dir} trains on token data, not on a Python dataset's items: add files to it with "
            "jaxdist.data.add_data (jaxdist data add)."
        )
    if source.spec != base.spec:

        def show(spec: dict) -> str:
            return "{" + ", ".join(f"{k}: {d}{list(shape)}" for k, (shape, d) in sorted(spec.items())) + "}"

        raise ConfigError(
            f"the items of {source.name} are {show(source.spec)} per row, the run's {show(base.spec)}: "
            "give them the same keys, shapes and dtypes (or collate them so), since the step is compiled for one."
        )
    B = current.batch_size
    if len(source) < B:
        raise ConfigError(
            f"{source.name} holds {len(source):,} items, fewer than one batch of {B}: add it together with more items."
        )
    fp = source.fingerprint()
    known = {fp: what for fp, (what, _) in known_sources(journal, current).items()}
    if fp in known:
        raise ConfigError(
            f"{source.name} holds the same items (fingerprint {fp[:12]}) as {known[fp]}: each dataset is added "
            "once, so leave it out."
        )
    entry = {
        "kind": "items",
        "name": source.name,
        "path": "",
        "token_dtype": "items",
        "n_tokens": len(source),
        "fingerprint": fp,
        "quick": source.quick(),
        "packing": "items",
        "rows": len(source),
    }
    seed = secrets.randbits(63) if seed is None else int(seed)
    name = journal.submit({"sources": [entry], "seed": seed, "created": time.time()})
    return {"request": name, "seed": seed, "sources": [entry], "batches": len(source) // B}


def pack_source(entry: SourceEntry, tokens: np.ndarray, seq_len: int) -> PackedStream:
    """An added source's tokens with rows packed from its documents (data.packing=documents): a text source's
    documents end with the byte tokenizer's EOS, a token file's are in the documents.bin beside it (ConfigError
    when it has none)."""
    if entry.kind == "tokens":
        starts, targets = read_documents(entry.path, len(tokens)), read_targets(entry.path, len(tokens))
    else:
        starts, targets = eos_starts(tokens, EOS), None
    return PackedStream(tokens, pack(starts, len(tokens), seq_len, targets))

"""The manifest of a prepared corpus (``OUT/manifest.json``) and what ``jaxdist train`` checks against it.

:func:`settle_tokenizer` runs in :func:`jaxdist.resolve.resolve`, before the
model is planned or built:

* ``data.tokenizer`` a file: ``model.vocab_size`` becomes the tokenizer's
  vocabulary size when it was left at the preset's value; set to anything
  else and smaller than the vocabulary, it is a one-sentence error (a larger
  one is kept: padded vocabularies are common);
* ``data.source=tokens`` with a manifest beside the token file: the file must
  come from the same tokenizer (file hash) as ``data.tokenizer``, with a
  vocabulary no larger than ``model.vocab_size`` and the recorded length;
  ``data.token_dtype`` becomes the manifest's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist.config import MODEL_PRESETS, Config, ModelConfig
from jaxdist.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_fingerprint
from jaxdist.errors import ConfigError

MANIFEST = "manifest.json"
TOKENS = "tokens.bin"
FORMAT = 1


def build_manifest(corpus, tok: Tokenizer, dtype: str, text_field: str, plan, per_file, n_tokens, sha) -> dict:
    """The manifest of a finished prepare (``per_file``: file index -> [documents, tokens])."""
    return {
        "format": FORMAT,
        "tokens_file": TOKENS,
        "token_dtype": dtype,
        "n_tokens": int(n_tokens),
        "n_documents": int(sum(d for d, _ in per_file.values())),
        "tokens_sha256": sha,
        "tokenizer": {
            "name": tok.name,
            "sha256": tok.fingerprint,
            "vocab_size": int(tok.vocab_size),
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "add_bos": bool(tok.add_bos),
        },
        "vocab_size": int(tok.vocab_size),
        "eos_id": tok.eos_id,
        "corpus": {"root": corpus.root, "kind": corpus.kind, "text_field": text_field},
        "sources": [
            {"path": f.rel, "bytes": f.size, "sha256": f.sha256, "documents": per_file[i][0], "tokens": per_file[i][1]}
            for i, f in enumerate(corpus.files)
        ],
        "plan": plan,
        "created": time.time(),
    }


def read_manifest(path: Path) -> dict[str, Any]:
    """A manifest's content; ConfigError (one sentence) when it is not readable."""
    try:
        m = json.loads(path.read_text())
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ValueError(f"format {m.get('format') if isinstance(m, dict) else None}, expected {FORMAT}")
        return m
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"manifest '{path}' is not readable ({e}): prepare the corpus again with `jaxdist data prepare`."
        ) from None


INPUT_KEYS = ("sources", "kind", "text_field", "tokenizer", "token_dtype")


def same_inputs(done: dict[str, Any], plan: dict[str, Any]) -> bool:
    """Whether two prepare plans read the same inputs the same way (sources and their hashes, tokenizer,
    text field); how the work was cut into pieces does not change the token file."""
    return all(done.get(k) == plan.get(k) for k in INPUT_KEYS)


def manifest_for(token_file: str | Path) -> dict[str, Any] | None:
    """The manifest beside ``token_file`` that describes it, or None (a token file written another way)."""
    p = Path(token_file)
    m_path = p.parent / MANIFEST
    if not m_path.is_file():
        return None
    m = read_manifest(m_path)
    return m if m.get("tokens_file") == p.name else None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_manifest(m: dict[str, Any], token_file: str) -> None:
    """ConfigError (one sentence) if the manifest's fields that training reads are not what prepare writes, or
    its EOS or BOS id is not an id of its own vocabulary (documents would be separated by a token the model
    cannot embed): a manifest damaged or edited by hand."""
    again = "prepare the corpus again with `jaxdist data prepare`"
    t, vocab = m.get("tokenizer"), m.get("vocab_size")
    if not isinstance(t, dict) or m.get("token_dtype") not in ("uint16", "uint32") or not _is_count(m.get("n_tokens")):
        raise ConfigError(f"manifest of '{token_file}' lacks its tokenizer, token_dtype or n_tokens: {again}.")
    if not _is_count(vocab) or vocab < 1:
        raise ConfigError(
            f"manifest of '{token_file}' records vocab_size={vocab!r}, not a positive number of tokens: {again}."
        )
    for key, value in (("eos_id", m.get("eos_id")), ("eos_id", t.get("eos_id")), ("bos_id", t.get("bos_id"))):
        if value is None and key == "bos_id":
            continue
        if not _is_count(value) or value >= vocab:
            raise ConfigError(
                f"manifest of '{token_file}' records {key}={value!r}, outside its vocabulary of {vocab} tokens "
                f"(ids 0..{vocab - 1}): {again}."
            )


def _preset_vocab(model: ModelConfig) -> int:
    return MODEL_PRESETS.get(model.preset, {}).get("vocab_size", ModelConfig().vocab_size)


def settle_tokenizer(cfg: Config) -> Config:
    """``cfg`` with ``model.vocab_size`` and ``data.token_dtype`` following the tokenizer and the manifest
    (see the module docstring); ConfigError (one sentence) when they disagree with the config."""
    d = cfg.data
    tok = load_tokenizer(d.tokenizer) if d.tokenizer != "bytes" else None
    if tok is not None:
        v = cfg.model.vocab_size
        if v == _preset_vocab(cfg.model) and not cfg.model.init_from:  # imported weights fix the vocabulary
            cfg = cfg.replace(**{"model.vocab_size": tok.vocab_size})
        elif v < tok.vocab_size:
            raise ConfigError(
                f"data.tokenizer '{d.tokenizer}' has a vocabulary of {tok.vocab_size} tokens, larger than "
                f"model.vocab_size={v}: set model.vocab_size to at least {tok.vocab_size}, or leave it unset "
                "to follow the tokenizer."
            )
    if d.source != "tokens" or not d.path or not Path(d.path).is_file():  # load_source names a missing file
        return cfg
    m = manifest_for(d.path)
    if m is None:
        return cfg
    _check_manifest(m, d.path)
    t = m["tokenizer"]
    fingerprint = tok.fingerprint if tok is not None else tokenizer_fingerprint(d.tokenizer)
    if t.get("sha256") != fingerprint:
        raise ConfigError(
            f"token file '{d.path}' was prepared with tokenizer '{t.get('name')}' ({t.get('vocab_size')} tokens), "
            f"not data.tokenizer '{d.tokenizer}': set data.tokenizer to the tokenizer it was prepared with, "
            f"or prepare the corpus again with --tokenizer {d.tokenizer}."
        )
    if int(m["vocab_size"]) > cfg.model.vocab_size:
        raise ConfigError(
            f"token file '{d.path}' was prepared with a vocabulary of {m['vocab_size']} tokens, larger than "
            f"model.vocab_size={cfg.model.vocab_size}: set model.vocab_size to at least {m['vocab_size']}."
        )
    if m["token_dtype"] != d.token_dtype:  # the manifest knows how the file was written
        cfg = cfg.replace(**{"data.token_dtype": m["token_dtype"]})
    size = Path(d.path).stat().st_size
    if size != int(m["n_tokens"]) * np.dtype(m["token_dtype"]).itemsize:
        raise ConfigError(
            f"token file '{d.path}' has {size} bytes, not the {m['n_tokens']} {m['token_dtype']} tokens its "
            "manifest records: prepare the corpus again with `jaxdist data prepare`."
        )
    return cfg

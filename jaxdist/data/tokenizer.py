"""Tokenizers: the byte-level one (the default) and files of the common libraries, behind one interface.

:class:`ByteTokenizer` gives one token per UTF-8 byte: ids 0..255 are the byte
values themselves, so any text (or binary file) encodes without an
out-of-vocabulary case and a token file is readable with ``xxd``.  The specials
sit right after the bytes: PAD=256, BOS=257, EOS=258, UNK=259, which gives the
260-entry vocabulary the model presets use.

:func:`load_tokenizer` (``data.tokenizer``) gives that one for ``"bytes"``, or
wraps a Hugging Face ``tokenizer.json`` (:mod:`jaxdist.data.tokenizer_files`)
or a SentencePiece ``.model``.  Every tokenizer has ``encode``, ``encode_batch``,
``decode``, ``vocab_size``, ``bos_id``, ``eos_id``, ``pad_id``, ``add_bos``
(whether a document starts with BOS in this tokenizer's convention) and
``name`` (what the manifest of a prepared corpus records).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxdist.data.tokenizer_files import HFTokenizer, SentencePieceTokenizer, file_sha256
from jaxdist.errors import ConfigError

PAD = 256
BOS = 257
EOS = 258
UNK = 259
VOCAB_SIZE = 260


class ByteTokenizer:
    """Encode text to byte ids (uint16) and back; ``vocab_size`` = 260 tokens."""

    pad_id = PAD
    bos_id = BOS
    eos_id = EOS
    unk_id = UNK
    vocab_size = VOCAB_SIZE
    add_bos = False  # text sources put only EOS between files
    name = "bytes"
    fingerprint = "bytes"  # what a prepared corpus's manifest records for this tokenizer

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        """Token ids of ``text`` (str is UTF-8 encoded first), shape [n_bytes (+ specials)], uint16.

        ``bos``/``eos`` add BOS before and EOS after the bytes.
        """
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        body = np.frombuffer(data, dtype=np.uint8)
        out = np.empty(len(body) + bos + eos, dtype=np.uint16)
        if bos:
            out[0] = BOS
        out[bos : bos + len(body)] = body
        if eos:
            out[-1] = EOS
        return out

    def decode(self, ids) -> str:
        """The text of ``ids`` (any int array or sequence): specials and ids >= 260 dropped.

        Byte sequences that are not valid UTF-8 (e.g. a sample cut mid-character)
        become U+FFFD rather than raising, since generated text may be cut anywhere.
        """
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        kept = arr[(arr >= 0) & (arr < 256)].astype(np.uint8)
        return kept.tobytes().decode("utf-8", errors="replace")

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text (no specials)."""
        return [self.encode(t) for t in texts]


class Tokenizer(Protocol):
    """What jaxdist needs of a tokenizer: ids are ints in ``0..vocab_size-1``; ``bos_id`` may be None."""

    vocab_size: int  # ids the tokenizer can produce (tokens)
    bos_id: int | None
    eos_id: int | None
    pad_id: int  # filler of left-padded prompts (never trained on)
    add_bos: bool  # whether a document starts with BOS in this tokenizer's convention
    name: str  # "bytes" or the file's path
    fingerprint: str  # "bytes" or the SHA-256 (hex) of the tokenizer file

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids) -> str: ...


def tokenizer_fingerprint(spec: str) -> str:
    """What identifies ``data.tokenizer`` = ``spec`` in a manifest: "bytes", or the SHA-256 of its file."""
    return "bytes" if spec == "bytes" else file_sha256(spec)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names: "bytes", a Hugging Face ``tokenizer.json`` or a SentencePiece
    ``.model``.  ConfigError (one sentence) for a missing or unreadable file or a missing library."""
    if spec == "bytes":
        return ByteTokenizer()
    p = Path(spec)
    if not p.is_file():
        raise ConfigError(
            f"tokenizer '{spec}' does not exist: point it at a tokenizer.json or a SentencePiece .model, or use bytes."
        )
    return _load_file(str(p.resolve()), p.stat().st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _load_file(path: str, mtime_ns: int) -> Tokenizer:
    # Cached per file version: resolve, the trainer's checks and the sampler all ask for the same one.
    if path.endswith(".model"):
        return SentencePieceTokenizer(path)
    if path.endswith(".json"):
        return HFTokenizer(path)
    raise ConfigError(
        f"tokenizer '{path}' is neither a Hugging Face tokenizer.json nor a SentencePiece .model: "
        "point it at one of those, or use bytes."
    )

"""Tokenizer files: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) and a SentencePiece ``.model``.

Both give what :class:`jaxdist.data.tokenizer.Tokenizer` asks for.  The
special ids come from the tokenizer itself: for a ``tokenizer.json``, a
``tokenizer_config.json`` beside it (``bos_token``, ``eos_token``,
``pad_token``, ``add_bos_token``, as Hugging Face writes it) when there is
one, else its special added tokens by their usual names (``</s>``,
``<|endoftext|>``, ``<|end_of_text|>``, ...), and whether a document starts
with BOS from its own post-processor; a SentencePiece model carries its ids
and, when it has a BOS, starts documents with it (the Llama convention).
The libraries are optional: they are imported when a file is opened, with a
one-sentence error saying what to install when missing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from jaxdist.errors import ConfigError

_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


def file_sha256(path: str | Path) -> str:
    """SHA-256 (hex) of a file's bytes, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _keep_known(ids, vocab_size: int) -> list[int]:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    return arr[(arr >= 0) & (arr < vocab_size)].tolist()


def read_settings(path: Path) -> dict:
    """A ``tokenizer_config.json`` as a dict ({} when there is none); ConfigError when it is not readable JSON."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"'{path}' is not readable JSON ({e}): fix it or remove it.") from None
    return data if isinstance(data, dict) else {}


def token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (fast tokenizer); ids as uint32 arrays."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as _Tokenizer  # loaded when used: only a tokenizer.json needs it
        except ImportError:
            raise ConfigError(
                f"data.tokenizer '{path}' is a tokenizer.json, which needs the tokenizers package: "
                "pip install tokenizers."
            ) from None
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise ConfigError(
                f"tokenizer '{path}' is not a readable Hugging Face tokenizer.json ({str(e)[:120]}): "
                "point data.tokenizer at the tokenizer.json saved with the model."
            ) from None
        self.name, self.fingerprint = path, file_sha256(path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(self._tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)
        settings = read_settings(Path(path).with_name("tokenizer_config.json"))
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}

        def pick(key: str, names: tuple[str, ...]) -> int | None:
            text = token_text(settings.get(key))
            candidates = [text] if text else [n for n in names if n in specials]
            for c in candidates:
                i = self._tok.token_to_id(c)
                if i is not None:
                    return int(i)
            return None

        self.bos_id, self.eos_id = pick("bos_token", _BOS_NAMES), pick("eos_token", _EOS_NAMES)
        pad = pick("pad_token", _PAD_NAMES)
        self.pad_id = pad if pad is not None else self.eos_id if self.eos_id is not None else 0
        if isinstance(settings.get("add_bos_token"), bool):
            self.add_bos = settings["add_bos_token"] and self.bos_id is not None
        else:  # the post-processor's template says whether encoding starts with BOS
            first = self._tok.encode("a", add_special_tokens=True).ids[:1]
            self.add_bos = self.bos_id is not None and first == [self.bos_id]

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        """Token ids of ``text`` [n] uint32; ``bos``/``eos`` add this tokenizer's BOS before / EOS after."""
        return _with_specials(self._tok.encode(text, add_special_tokens=False).ids, self, bos, eos)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no specials), encoded by the library's batch path."""
        return [np.array(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Token ids of ``text`` (no specials added; special tokens written in it are recognised) and each
        token's [start, end) characters in it."""
        e = self._tok.encode(text, add_special_tokens=False)
        return np.array(e.ids, dtype=np.uint32), list(e.offsets)

    def decode(self, ids) -> str:
        """The text of ``ids``: special tokens and ids outside the vocabulary dropped."""
        return self._tok.decode(_keep_known(ids, self.vocab_size), skip_special_tokens=True)


class SentencePieceTokenizer:
    """A SentencePiece ``.model``; ids as uint32 arrays."""

    def __init__(self, path: str):
        try:
            import sentencepiece  # loaded when used: only a .model needs it
        except ImportError:
            raise ConfigError(
                f"data.tokenizer '{path}' is a SentencePiece model, which needs the sentencepiece package: "
                "pip install sentencepiece."
            ) from None
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ConfigError(
                f"tokenizer '{path}' is not a readable SentencePiece model ({str(e)[:120]}): "
                "point data.tokenizer at the .model file the tokenizer was saved as."
            ) from None
        self.name, self.fingerprint = path, file_sha256(path)
        self.vocab_size = int(self._sp.get_piece_size())

        def known(i: int) -> int | None:
            return int(i) if i >= 0 else None

        self.bos_id, self.eos_id = known(self._sp.bos_id()), known(self._sp.eos_id())
        pad = known(self._sp.pad_id())
        self.pad_id = pad if pad is not None else self.eos_id if self.eos_id is not None else 0
        self.add_bos = self.bos_id is not None

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        """Token ids of ``text`` [n] uint32; ``bos``/``eos`` add BOS before / EOS after."""
        return _with_specials(self._sp.encode(text), self, bos, eos)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no specials)."""
        return [np.array(ids, dtype=np.uint32) for ids in self._sp.encode(texts)]

    def decode(self, ids) -> str:
        """The text of ``ids``: control ids (BOS, EOS, PAD) and ids outside the vocabulary dropped."""
        return self._sp.decode(_keep_known(ids, self.vocab_size))


def _with_specials(ids: list[int], tok, bos: bool, eos: bool) -> np.ndarray:
    """``ids`` [n] as uint32, with ``tok``'s BOS before (``bos``) and EOS after (``eos``) where it has them."""
    head = [tok.bos_id] if bos and tok.bos_id is not None else []
    tail = [tok.eos_id] if eos and tok.eos_id is not None else []
    return np.array(head + list(ids) + tail, dtype=np.uint32)

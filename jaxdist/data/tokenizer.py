"""Byte-level tokenizer: one token per UTF-8 byte, plus four special tokens.

Ids 0..255 are the byte values themselves, so any text (or binary file) encodes
without an out-of-vocabulary case and a token file is readable with ``xxd``.
The specials sit right after the bytes: PAD=256, BOS=257, EOS=258, UNK=259,
which gives the 260-entry vocabulary the model presets use.
"""

from __future__ import annotations

import numpy as np

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

"""Sequences packed from whole documents (``data.packing=documents``), and the flags their tokens carry.

With ``data.packing=stream`` (the default) a training row is a window of ``seq_len + 1`` tokens cut from the
stream of concatenated documents: a token attends to the previous document and every token is a target.  With
``documents`` a row is packed from whole documents, in the stream's order (next fit: a document that does not
fit in what is left of the row starts the next row, and the rest of the row is padding).  A document longer
than a row is cut into pieces of ``seq_len + 1`` tokens that overlap by one token, as stream windows do, so
every token after the first is still predicted once; each piece is a document of its own (it attends only to
itself, its positions restart at 0).  A piece of one token predicts nothing and is dropped.

The flags ride in the row itself, so a packed row is still one int32 array ``[seq_len + 1]`` and every part of
the data path (the batch list, its audit digests, sharding, microbatches, pipeline chunks) handles it as it
handles a stream window.  A token id is below 2**29 (:data:`ID_MASK`); bit 29 (:data:`START`) marks the
first token of a document or piece, and of the padding; bit 30 (:data:`NO_LOSS`) a token that is never a
target (padding; for chat data, what the assistant did not say).  Prediction ``j`` (of token ``j + 1`` from
tokens ``0..j``) is a target unless token ``j + 1`` carries either flag: no loss across a document boundary,
none on padding.  A stream window carries no flag, so it trains exactly as before.

The model sees, per row, the segment of each token (the count of START flags up to it: a token attends only
within its segment) and its position in its segment (:func:`jaxdist.models.packed.unpack`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.packed_row import ID_MASK, NO_LOSS, START

PAD_ID = 0  # the id under the padding (never a target, attended only by padding)
DOCUMENTS = "documents.bin"  # beside a prepared token file: uint64 offset of every document's first token
TARGETS = "targets.bin"  # beside prepared chat data: uint8 per token, 1 where the token is a target


@dataclass(frozen=True)
class Packing:
    """The rows of ``seq_len + 1`` tokens packed from one stream's documents.

    Row ``r`` is the pieces ``row_ptr[r]:row_ptr[r + 1]``, piece ``i`` the tokens
    ``piece_start[i]:piece_start[i] + piece_len[i]`` of the stream, then padding.
    """

    seq_len: int
    piece_start: np.ndarray  # int64
    piece_len: np.ndarray  # int64
    row_ptr: np.ndarray  # int64 [rows + 1]
    targets: np.ndarray | None = None  # chat data: uint8 per stream token, 0 where it is not a target (NO_LOSS)

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def real_tokens(self) -> int:
        """Tokens of documents in the rows (padding excluded)."""
        return int(self.piece_len.sum())

    @property
    def efficiency(self) -> float:
        """The share of the rows' tokens that are documents' tokens (the rest is padding)."""
        return self.real_tokens / max(1, self.rows * (self.seq_len + 1))

    def read(self, tokens: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The packed rows ``rows`` of the stream ``tokens``: int32 ``[len(rows), seq_len + 1]`` with flags."""
        width = self.seq_len + 1
        out = np.full((len(rows), width), PAD_ID | NO_LOSS, dtype=np.int32)
        for k, r in enumerate(np.asarray(rows, dtype=np.int64)):
            at = 0
            for i in range(self.row_ptr[r], self.row_ptr[r + 1]):
                s, n = int(self.piece_start[i]), int(self.piece_len[i])
                out[k, at : at + n] = tokens[s : s + n]
                if self.targets is not None:
                    out[k, at : at + n] |= np.where(self.targets[s : s + n] == 0, NO_LOSS, 0).astype(np.int32)
                out[k, at] |= START
                at += n
            if at < width:
                out[k, at] |= START  # the padding is a segment of its own
        return out


@dataclass(frozen=True)
class PackedStream:
    """A stream's tokens with the rows packed from its documents: what the batch list reads for a source with
    ``packing=documents``."""

    tokens: np.ndarray
    packing: Packing

    def read(self, rows: np.ndarray) -> np.ndarray:
        return self.packing.read(self.tokens, rows)


def pack(doc_starts: np.ndarray, n_tokens: int, seq_len: int, targets: np.ndarray | None = None) -> Packing:
    """Next-fit packing of the documents starting at ``doc_starts`` (sorted offsets, the first 0) of a stream of
    ``n_tokens`` into rows of ``seq_len + 1`` tokens (see the module docstring).  Linear in the documents.
    ``targets`` (chat data, uint8 per token): a token marked 0 is read with NO_LOSS."""
    width = seq_len + 1
    starts = np.asarray(doc_starts, dtype=np.int64)
    ends = np.append(starts[1:], n_tokens)
    piece_start: list[int] = []
    piece_len: list[int] = []
    row_ptr = [0]
    used = 0  # tokens in the open row
    for s, e in zip(starts.tolist(), ends.tolist()):
        pieces = []
        while e - s > width:  # a long document: full rows of width tokens, overlapping by one
            pieces.append((s, width))
            s += seq_len
        if e - s >= 2:
            pieces.append((s, e - s))
        for ps, pn in pieces:
            if used + pn > width:  # close the open row
                row_ptr.append(len(piece_start))
                used = 0
            piece_start.append(ps)
            piece_len.append(pn)
            used += pn
    if used:
        row_ptr.append(len(piece_start))
    return Packing(
        seq_len,
        np.asarray(piece_start, dtype=np.int64),
        np.asarray(piece_len, dtype=np.int64),
        np.asarray(row_ptr, dtype=np.int64),
        targets,
    )


def eos_starts(tokens: np.ndarray, eos: int) -> np.ndarray:
    """Document starts of a stream whose every document ends with ``eos`` (the byte tokenizer's text sources,
    where no text byte can be that id): 0 and each position after an EOS but the last."""
    after = np.flatnonzero(np.asarray(tokens) == eos).astype(np.int64) + 1
    return np.concatenate([[0], after[after < len(tokens)]]).astype(np.int64)


def documents_path(token_file: str | Path) -> Path:
    """Where ``jaxdist data prepare`` writes the document starts of ``token_file``."""
    return Path(token_file).with_name(DOCUMENTS)


def read_documents(token_file: str | Path, n_tokens: int) -> np.ndarray:
    """The document starts recorded beside ``token_file`` (a stream of ``n_tokens``); ConfigError when there are
    none or they do not describe that file."""
    p = documents_path(token_file)
    if not p.is_file():
        raise ConfigError(
            f"data.packing=documents needs the document boundaries of '{token_file}' in '{p}', which is missing: "
            "prepare the corpus again with `jaxdist data prepare` (it writes them), or set data.packing=stream."
        )
    raw = p.read_bytes()
    starts = np.frombuffer(raw, dtype=np.uint64).astype(np.int64) if len(raw) % 8 == 0 else None
    if starts is None or not len(starts) or starts[0] != 0 or np.any(np.diff(starts) <= 0) or starts[-1] >= n_tokens:
        raise ConfigError(
            f"'{p}' does not hold the document starts of '{token_file}' ({n_tokens:,} tokens): it is damaged or "
            "from another corpus; prepare the corpus again, or set data.packing=stream."
        )
    return starts


def read_targets(token_file: str | Path, n_tokens: int) -> np.ndarray | None:
    """The target flags recorded beside ``token_file`` (chat data; uint8 per token), None where there are none;
    ConfigError when they do not describe that file."""
    p = Path(token_file).with_name(TARGETS)
    if not p.is_file():
        return None
    if p.stat().st_size != n_tokens:
        raise ConfigError(
            f"'{p}' holds {p.stat().st_size:,} target flags but '{token_file}' {n_tokens:,} tokens: it is damaged or "
            "from another corpus; prepare the corpus again."
        )
    return np.memmap(p, dtype=np.uint8, mode="r")


def split_starts(starts: np.ndarray, cut: int) -> tuple[np.ndarray, np.ndarray]:
    """Document starts of the two sides of a stream cut at ``cut`` (a document start): (before, after - cut)."""
    i = int(np.searchsorted(starts, cut))
    return starts[:i], starts[i:] - cut


def targets(words):
    """Whether each prediction of the row ``words[:, :-1] -> words[:, 1:]`` is a target (bool [B, T])."""
    labels = words[:, 1:]
    return (labels & (START | NO_LOSS)) == 0


def ids(words):
    """The token ids of ``words`` (flags cleared)."""
    return words & ID_MASK

"""Token sources: where the training and held-out token streams come from.

``load_source(cfg.data)`` returns a :class:`TokenSplit` of two flat token
streams. Three sources exist:

* ``stdlib``: the Python standard library's own ``.py`` files, byte-tokenized.
  Always present and needs no network, so every example and test can train.
* ``text_dir``: every regular file under a directory, byte-tokenized.
* ``tokens``: a flat binary file of uint16/uint32 ids, memory-mapped so a file
  larger than RAM costs nothing until a window is read from it.

Text sources are split into train/eval *by file*, with a stable hash of the
file's relative path, so the same file is held out on every machine and in
every run no matter how many files are added beside it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdist.config import ConfigError, DataConfig
from jaxdist.data.documents import eos_starts, read_documents, read_targets, split_starts
from jaxdist.data.tokenizer import EOS

# Hash buckets for the by-file split; eval_fraction is resolved to 1e-4.
_BUCKETS = 10_000
# Directories under the stdlib root that hold installed packages, not the stdlib.
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "__pycache__"})
TOKEN_DTYPES = ("uint16", "uint32")
_ID_CHUNK = 1 << 24  # tokens read at a time when looking for the largest id
_LAYOUT_SAMPLE = 1 << 20  # uint16 items looked at for the layout of uint32 ids (2 MiB)
_LAYOUT_MIN = 64  # fewer items than this say nothing about the layout


@dataclass(frozen=True)
class TokenSplit:
    """Train and held-out token streams (1-D arrays of token ids).

    For the ``tokens`` source both are ``np.memmap`` views of the file, so
    nothing is read until used; text sources give in-memory uint16 arrays
    (read-only: they are shared through a per-process cache).
    """

    train: np.ndarray
    eval: np.ndarray
    name: str  # e.g. "stdlib", "text_dir:/data/books", "tokens:/data/t.bin"
    n_files: int  # files read (1 for a token file)
    n_eval_files: int = 0  # of which held out (0 for a token file: its tail is held out)
    # data.packing=documents: the offset of each document's first token in train and eval (None: a stream)
    train_starts: np.ndarray | None = None
    eval_starts: np.ndarray | None = None
    # chat data (targets.bin beside the token file): 0 where a token is not a target
    train_targets: np.ndarray | None = None
    eval_targets: np.ndarray | None = None

    def summary(self) -> str:
        """One line for logs: source, files and token counts."""
        files = f"{self.n_files} files ({self.n_eval_files} eval)" if self.n_eval_files else f"{self.n_files} file(s)"
        return f"{self.name}: {files}, {len(self.train):,} train tokens, {len(self.eval):,} eval tokens"


def eval_file_mask(relpaths: list[str], eval_fraction: float) -> np.ndarray:
    """Which files are held out: bool array, True where ``crc32(relpath) % 10000 < fraction*10000``.

    A pure function of the paths. With two or more files and a split that puts
    every file on one side, the file closest to the threshold moves over, so
    both streams are never empty.
    """
    buckets = np.array([zlib.crc32(p.encode("utf-8")) % _BUCKETS for p in relpaths], dtype=np.int64)
    mask = buckets < round(eval_fraction * _BUCKETS)
    if len(relpaths) >= 2:
        if not mask.any():
            mask[np.argmin(buckets)] = True
        elif mask.all():
            mask[np.argmax(buckets)] = False
    return mask


def load_source(cfg: DataConfig) -> TokenSplit:
    """The train/eval token streams that ``cfg`` describes; ConfigError on a user mistake."""
    if not 0 < cfg.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={cfg.eval_fraction} must lie strictly between 0 and 1.")
    if cfg.max_bytes < 0:
        raise ConfigError(f"data.max_bytes={cfg.max_bytes} must be 0 (no limit) or positive.")
    split = _load_split(cfg)
    if cfg.packing != "documents":
        if cfg.source == "tokens" and read_targets(cfg.path, len(split.train) + len(split.eval)) is not None:
            raise ConfigError(
                f"'{cfg.path}' is chat data whose targets are marked (targets.bin beside it), which stream windows "
                "would ignore: set data.packing=documents."
            )
        return split
    if cfg.source == "tokens":  # a prepared corpus: documents.bin beside the token file; eval is whole documents
        n = len(split.train) + len(split.eval)
        starts = read_documents(cfg.path, n)
        i = int(np.searchsorted(starts, len(split.train)))
        if i == 0 or i == len(starts):
            raise ConfigError(
                f"token file '{cfg.path}' holds {len(starts)} document(s), too few to hold out "
                f"data.eval_fraction={cfg.eval_fraction} as whole documents: use a larger corpus or "
                "data.packing=stream."
            )
        whole = np.memmap(cfg.path, dtype=cfg.token_dtype, mode="r")
        train, eval_ = whole[: starts[i]], whole[starts[i] :]
        tr, ev = split_starts(starts, int(starts[i]))
        targets = read_targets(cfg.path, n)
        if targets is not None:
            targets = {"train_targets": targets[: starts[i]], "eval_targets": targets[starts[i] :]}
        return dataclasses.replace(split, train=train, eval=eval_, train_starts=tr, eval_starts=ev, **(targets or {}))
    # text sources: each file's bytes then EOS, an id no byte has
    return dataclasses.replace(
        split, train_starts=eos_starts(split.train, EOS), eval_starts=eos_starts(split.eval, EOS)
    )


def _load_split(cfg: DataConfig) -> TokenSplit:
    if cfg.source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        entries = _stdlib_files(root)
        if not entries:
            raise ConfigError(
                f"no .py files found under the standard library at '{root}': "
                "use data.source=text_dir with a directory of text files instead."
            )
        return _text_split("stdlib", "the standard library", root, entries, cfg)
    if cfg.source == "text_dir":
        return _load_text_dir(cfg)
    if cfg.source == "tokens":
        return _load_token_file(cfg)
    raise ConfigError(f"data.source='{cfg.source}' is unknown: use stdlib, text_dir or tokens.")


def largest_id(tokens: np.ndarray) -> int:
    """The largest id of a token stream (-1 if empty), read in chunks of 16M tokens (a memmap'ed file
    is paged through once, never held whole)."""
    top = -1
    for i in range(0, len(tokens), _ID_CHUNK):
        top = max(top, int(np.max(tokens[i : i + _ID_CHUNK])))
    return top


def check_vocab(tokens: np.ndarray, vocab_size: int, what: str) -> None:
    """ConfigError (one sentence) if an id of ``tokens`` (``what``: where they come from) is outside
    ``model.vocab_size``: the embedding lookup would read past its table and train on garbage."""
    top = largest_id(tokens)
    if top >= vocab_size:
        raise ConfigError(
            f"{what} holds token id {top}, outside model.vocab_size={vocab_size} (ids 0..{vocab_size - 1}): "
            f"set model.vocab_size to at least {top + 1}, or use data written for this vocabulary."
        )


def check_token_layout(tokens: np.ndarray, what: str, fix: str) -> None:
    """ConfigError (one sentence) if ``tokens`` read as uint16 look like uint32 ids: a zero at every odd position of
    the first 1M items (the high halves of little-endian uint32 ids below 65,536) while the even ones are not all
    zero.  Real uint16 text never has a zero every other token; ``what`` names the file, ``fix`` the setting."""
    if tokens.dtype != np.uint16:
        return
    head = np.asarray(tokens[: min(len(tokens), _LAYOUT_SAMPLE) // 2 * 2])
    if len(head) < _LAYOUT_MIN or head[1::2].any() or not head[0::2].any():
        return
    raise ConfigError(f"{what} read as uint16 has a zero at every odd position, the layout of uint32 token ids: {fix}.")


def write_token_file(path: str | Path, ids, dtype: str = "uint16") -> Path:
    """Write ``ids`` as a flat ``dtype`` file (native byte order) that ``data.source=tokens`` reads.

    Raises ValueError if an id does not fit the dtype. Written to a temporary
    name and renamed, so a reader never sees a half-written file.
    """
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"dtype must be one of {TOKEN_DTYPES}, got {dtype!r}")
    arr = np.asarray(ids).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(dtype).max):
        raise ValueError(f"token ids span [{arr.min()}, {arr.max()}], which does not fit {dtype}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    arr.astype(dtype).tofile(tmp)
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- text sources

# (relative posix path, size in bytes, mtime in ns); the mtime makes the read
# cache notice a file rewritten in place.
FileEntry = tuple[str, int, int]


def scan_files(
    root: str, *, suffix: str = "", skip_dirs: frozenset = frozenset(), ignore_errors: bool = False
) -> tuple[FileEntry, ...]:
    """Regular files under ``root`` (recursively, symlinked dirs not followed), sorted by relative path."""
    out: list[FileEntry] = []
    stack = [root]
    prefix = len(root.rstrip(os.sep)) + 1
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            if ignore_errors:
                continue
            raise
        with it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    if e.name not in skip_dirs:
                        stack.append(e.path)
                elif e.name.endswith(suffix) and e.is_file():
                    st = e.stat()
                    rel = e.path[prefix:].replace(os.sep, "/")
                    out.append((rel, st.st_size, st.st_mtime_ns))
    out.sort()
    return tuple(out)


@functools.lru_cache(maxsize=2)
def _stdlib_files(root: str) -> tuple[FileEntry, ...]:
    # The stdlib does not change while a process runs; listing it once saves ~0.1 s a call.
    return scan_files(root, suffix=".py", skip_dirs=_STDLIB_SKIP, ignore_errors=True)


def _load_text_dir(cfg: DataConfig) -> TokenSplit:
    if not cfg.path:
        raise ConfigError("data.source='text_dir' needs data.path: set it to the directory of text files.")
    root = Path(cfg.path)
    if not root.is_dir():
        raise ConfigError(f"data.path '{root}' is not a directory: point it at a directory of text files.")
    entries = scan_files(str(root.resolve()))
    if not entries:
        raise ConfigError(
            f"data.path '{root}' contains no files: add text files to it or point data.path at another directory."
        )
    return _text_split(f"text_dir:{root}", f"data.path '{root}'", str(root.resolve()), entries, cfg)


def _text_split(name: str, where: str, root: str, entries: tuple[FileEntry, ...], cfg: DataConfig) -> TokenSplit:
    """Cap, split by file and read; ``where`` names the source in error messages."""
    chosen = _cap(entries, cfg.max_bytes)
    if not chosen:
        raise ConfigError(
            f"data.max_bytes={cfg.max_bytes} is smaller than the first file '{entries[0][0]}' "
            f"({entries[0][1]} bytes) of {where}: raise data.max_bytes or set it to 0."
        )
    if len(chosen) < 2:
        cap = f" within data.max_bytes={cfg.max_bytes}" if len(entries) >= 2 else ""
        raise ConfigError(
            f"{where} gives only one file{cap}, but train and eval are split by file: "
            + ("raise data.max_bytes." if cap else "add at least one more file.")
        )
    train, eval_, n_eval = _read_split(root, chosen, cfg.eval_fraction)
    return TokenSplit(train=train, eval=eval_, name=name, n_files=len(chosen), n_eval_files=n_eval)


def _cap(entries: tuple[FileEntry, ...], max_bytes: int) -> tuple[FileEntry, ...]:
    """The longest prefix (in sorted order) whose sizes sum to at most ``max_bytes`` (0: all)."""
    if max_bytes <= 0:
        return entries
    ends = np.cumsum([size for _, size, _ in entries])
    return entries[: int(np.searchsorted(ends, max_bytes, side="right"))]


@functools.lru_cache(maxsize=4)
def _read_split(root: str, entries: tuple[FileEntry, ...], eval_fraction: float):
    """(train, eval, n_eval_files): each file's bytes then EOS, in sorted order, per side.

    Cached per process because the trainer, evaluator and tests all ask for the
    same split; the arrays are made read-only so a caller cannot corrupt the cache.
    """
    mask = eval_file_mask([rel for rel, _, _ in entries], eval_fraction)
    sides = []
    for want in (False, True):
        picked = [e for e, m in zip(entries, mask) if m == want]
        sides.append(concat_files(root, picked))
    return sides[0], sides[1], int(mask.sum())


def concat_files(root: str, entries: list[FileEntry]) -> np.ndarray:
    """uint16 tokens of the files, each followed by EOS; reads at most each file's listed size."""
    parts, lengths = [], []
    for rel, size, _ in entries:
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read(size)  # listed size: keeps max_bytes exact even if a file grew
        parts.append(data)
        lengths.append(len(data))
    # One join + one vectorised insert is ~50x faster than per-file array copies.
    body = np.frombuffer(b"".join(parts), dtype=np.uint8).astype(np.uint16)
    out = np.insert(body, np.cumsum(lengths, dtype=np.int64), np.uint16(EOS))
    out.flags.writeable = False
    return out


# --------------------------------------------------------------------------- token file


def _load_token_file(cfg: DataConfig) -> TokenSplit:
    if cfg.token_dtype not in TOKEN_DTYPES:
        raise ConfigError(f"data.token_dtype='{cfg.token_dtype}' is not supported: use uint16 or uint32.")
    if not cfg.path:
        raise ConfigError("data.source='tokens' needs data.path: set it to the token file.")
    p = Path(cfg.path)
    if not p.is_file():
        raise ConfigError(f"token file '{p}' does not exist: point data.path at a flat token file.")
    size = p.stat().st_size
    itemsize = np.dtype(cfg.token_dtype).itemsize
    if size == 0:
        raise ConfigError(
            f"token file '{p}' is empty: write tokens to it (see write_token_file) or point data.path at another file."
        )
    if size % itemsize:
        raise ConfigError(
            f"token file '{p}' has {size} bytes, not a multiple of {itemsize} "
            f"({cfg.token_dtype}): set data.token_dtype to the type the file was written with."
        )
    n = size // itemsize
    n_eval = int(n * cfg.eval_fraction)
    # Two tokens are the least one (input, target) pair needs on each side.
    if n_eval < 2 or n - n_eval < 2:
        raise ConfigError(
            f"token file '{p}' holds only {n} tokens, too few to hold out "
            f"data.eval_fraction={cfg.eval_fraction} with at least 2 tokens on each side: "
            "use a longer token file."
        )
    mm = np.memmap(p, dtype=cfg.token_dtype, mode="r")
    check_token_layout(mm, f"token file '{p}'", "set data.token_dtype=uint32")
    return TokenSplit(train=mm[: n - n_eval], eval=mm[n - n_eval :], name=f"tokens:{p}", n_files=1)

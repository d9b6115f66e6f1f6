"""Deterministic, resumable batches of fixed-length token windows.

The token stream is cut into windows of ``seq_len + 1`` tokens (inputs plus the
shifted targets); window ``w`` is ``tokens[w*seq_len : w*seq_len + seq_len + 1]``,
so neighbouring windows share one boundary token and every token is a target
exactly once. Sample ``s = step * batch_size + row`` of the run is window
``perm_e[s % n_windows]`` of epoch ``e = s // n_windows``, where ``perm_e`` is a
seeded permutation. Data is thus a pure function of ``(seed, step, row)``:
resuming at step k needs only k, and each process reads only its own rows.

JAX is imported only inside :func:`global_batch_array`, so the CLI can load
data (and this module) before it has set up devices.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxdist.config import ConfigError
from jaxdist.data.documents import Packing

# Eval batches use their own fixed seed so eval loss is comparable between runs
# that differ only in data.seed.
EVAL_SEED = 1234


class SequenceSampler:
    """Batches of ``batch_size`` windows of ``seq_len + 1`` tokens drawn from ``tokens``.

    Each epoch visits every one of ``n_windows = (len(tokens) - 1) // seq_len``
    windows exactly once, in the order ``np.random.default_rng([seed, epoch]).permutation``;
    a batch may straddle two epochs. Thread-safe.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int,
        *,
        name: str = "train",
        packing: Packing | None = None,
    ):
        if seq_len <= 0 or batch_size <= 0:
            raise ConfigError(f"seq_len={seq_len} and batch_size={batch_size} must both be positive.")
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array of token ids, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.name = name
        self.packing = packing  # data.packing=documents: window w is packed row w
        self.n_windows = packing.rows if packing is not None else (len(tokens) - 1) // self.seq_len
        if self.n_windows < 1:
            raise ConfigError(
                f"the {name} split has {len(tokens)} tokens, fewer than one window of seq_len+1 = "
                f"{self.seq_len + 1}: lower train.seq_len or give the {name} split more data."
            )
        self._perms: dict[int, np.ndarray] = {}  # the (at most two) epochs last used
        self._lock = threading.Lock()

    @property
    def steps_per_epoch(self) -> float:
        """Optimizer steps per pass over all windows (fractional when batches straddle epochs)."""
        return self.n_windows / self.batch_size

    def epoch_of(self, step: int) -> int:
        """Epoch of the first sample of ``step``."""
        return step * self.batch_size // self.n_windows

    def _perm(self, epoch: int) -> np.ndarray:
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
                # Keep this epoch and the one before, for batches straddling a boundary.
                self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
                self._perms[epoch] = perm
            return perm

    def _row_ids(self, rows: np.ndarray | slice | None) -> np.ndarray:
        if rows is None:
            return np.arange(self.batch_size, dtype=np.int64)
        if isinstance(rows, slice):
            return np.arange(self.batch_size, dtype=np.int64)[rows]
        ids = np.asarray(rows, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.batch_size):
            raise IndexError(f"rows {ids.min()}..{ids.max()} outside the batch of {self.batch_size}")
        return ids

    def window_ids(self, step: int, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """Window index of each requested row of batch ``step``, int64 shape [n_rows]."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        samples = step * self.batch_size + self._row_ids(rows)
        epochs, pos = np.divmod(samples, self.n_windows)
        out = np.empty_like(samples)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self._perm(int(e))[pos[sel]]
        return out

    def rows(self, step: int, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """The requested rows of global batch ``step``: int32 [n_rows, seq_len + 1] tokens.

        Reads only those windows (from a memmap, only their pages), so each
        process or device pays for its own slice of the batch.
        """
        if self.packing is not None:
            return self.packing.read(self.tokens, self.window_ids(step, rows))
        starts = self.window_ids(step, rows) * self.seq_len
        idx = starts[:, None] + np.arange(self.seq_len + 1, dtype=np.int64)
        return np.asarray(self.tokens[idx], dtype=np.int32)

    def batch(self, step: int) -> np.ndarray:
        """All rows of global batch ``step``: int32 [batch_size, seq_len + 1]."""
        return self.rows(step)


def eval_sampler(tokens: np.ndarray, seq_len: int, batch_size: int, packing: Packing | None = None) -> SequenceSampler:
    """Sampler over held-out tokens; eval batch ``i`` is ``.batch(i)``, the same in every run.

    Uses the fixed ``EVAL_SEED``; if more batches are asked for than the split
    holds, later batches repeat windows in a new order.  ``packing``: rows packed from its documents.
    """
    return SequenceSampler(tokens, seq_len, batch_size, EVAL_SEED, name="eval", packing=packing)


def global_batch_array(sampler: SequenceSampler, step: int, sharding) -> Any:
    """Batch ``step`` as one global ``jax.Array`` [batch_size, seq_len + 1] int32 laid out by ``sharding``.

    Each process reads only the rows its addressable devices hold; devices that
    hold the same rows (replicas along, e.g., the tensor axis) share one read.
    Works for any sharding, including a first dim split over several mesh axes
    and a second dim split too.
    """
    import jax  # deferred: see module docstring

    if isinstance(sharding, dict):  # a Python dataset's batches: one array per key (jaxdist.data.items)
        return _global_item_arrays(sampler, step, sharding)
    shape = (sampler.batch_size, sampler.seq_len + 1)
    cache: dict[tuple[int, int, int], np.ndarray] = {}

    def read(index: tuple[slice, ...]) -> np.ndarray:
        row_slice = index[0] if len(index) > 0 else slice(None)
        col_slice = index[1] if len(index) > 1 else slice(None)
        key = row_slice.indices(shape[0])  # normalised, so slice(None) and slice(0, B) share
        if key not in cache:
            cache[key] = sampler.rows(step, slice(*key))
        return cache[key][:, col_slice]

    return jax.make_array_from_callback(shape, sharding, read, dtype=np.int32)


def _global_item_arrays(sampler: Any, step: int, shardings: dict) -> dict:
    """Batch ``step`` of a sampler over a Python dataset's items (``sampler.item_spec``: key -> (trailing shape,
    dtype)) as ``{key: global jax.Array [batch_size, ...]}``; each process reads its own rows once for every key."""
    import jax  # deferred: see module docstring

    cache: dict[tuple[int, int, int], dict[str, np.ndarray]] = {}
    b = sampler.batch_size

    def reader(key: str):
        def read(index: tuple[slice, ...]) -> np.ndarray:
            rows = (index[0] if index else slice(None)).indices(b)
            if rows not in cache:
                cache[rows] = sampler.rows(step, slice(*rows))
            return cache[rows][key][(slice(None), *index[1:])]

        return read

    return {
        k: jax.make_array_from_callback((b, *shape), shardings[k], reader(k), dtype=dtype)
        for k, (shape, dtype) in sampler.item_spec.items()
    }


class ItemSampler:
    """Held-out batches of a Python dataset (jaxdist.data.items.ItemSource): batch ``i`` is items ``i*B`` ..
    ``(i+1)*B - 1`` modulo its length, in order, the same in every run."""

    def __init__(self, source: Any, batch_size: int):
        self.source, self.batch_size = source, batch_size
        self.item_spec = source.spec

    def rows(self, step: int, rows: slice | None = None) -> dict[str, np.ndarray]:
        ids = (step * self.batch_size + np.arange(self.batch_size, dtype=np.int64)) % len(self.source)
        return self.source.read(ids[rows if rows is not None else slice(None)])


class Prefetcher:
    """Computes ``fn(step)`` for ``start_step, start_step + 1, ...`` on a background thread.

    At most ``depth`` results wait ready. ``get(step)`` must be called with
    consecutive steps and returns ``fn(step)``; an exception raised by ``fn`` is
    re-raised by the ``get`` for that step (and any later one). Use as a
    context manager or call ``close()``.
    """

    def __init__(self, fn: Callable[[int], Any], start_step: int, depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._fn = fn
        self._next = start_step
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, args=(start_step,), name="jaxdist-prefetch", daemon=True)
        self._thread.start()

    def _work(self, step: int) -> None:
        while not self._stop.is_set():
            try:
                item = (step, True, self._fn(step))
            except BaseException as e:  # handed to the consumer, who decides what to do
                item = (step, False, e)
            # Blocking put with a timeout, so close() can stop a producer waiting on a full queue.
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not item[1]:
                return
            step += 1

    def get(self, step: int) -> Any:
        """``fn(step)``, waiting for it if not ready; ``step`` must be the next in order."""
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise RuntimeError("Prefetcher.get called after close()")
        if step != self._next:
            raise ValueError(f"Prefetcher hands out steps in order: expected step {self._next}, got {step}")
        got_step, ok, value = self._queue.get()
        assert got_step == step, (got_step, step)
        if not ok:
            self._error = value
            raise value
        self._next += 1
        return value

    def close(self) -> None:
        """Stop the thread and drop results not yet taken; waits for an ``fn`` call in progress."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

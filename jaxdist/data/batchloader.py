"""Reading a run's batches in batch-list order: the reader, the prefetching loader, the trainer's view.

* :class:`BatchReader` turns a position of one batch-list version into tokens;
  it has the ``rows``/``batch_size``/``seq_len`` of a sampler, so
  :func:`~jaxdist.data.loader.global_batch_array` builds the global array from
  it and each process reads only its own rows of the same global batch,
  whatever the number of processes or the mesh.
* :class:`BatchLoader` reads ahead on a background thread.
* :class:`RunBatchList` is what the Trainer holds: it opens (or creates) the
  journal, checks a resume against the checkpoint's version and cursor, and at
  every step boundary applies queued additions (splice = the cursor) and
  appends the next epoch when the list runs out.

JAX is imported only for multi-process agreement and global arrays.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist.config import ConfigError
from jaxdist.data.batchlist import BatchList, BatchListError, SourceEntry, epoch_seed, make_version, unpack_ids
from jaxdist.data.catalog import add_items, config_entry, given_items, known_sources, pack_source, read_source
from jaxdist.data.documents import PackedStream, Packing
from jaxdist.data.items import ItemSource
from jaxdist.data.journal import Journal
from jaxdist.data.loader import Prefetcher, global_batch_array

log = logging.getLogger(__name__)

SAMPLER = "batchlist-v1"  # the ``sampler`` a checkpoint's data meta names


class _Permutations:
    """Window permutations per (source, epoch), the few newest kept; thread-safe."""

    def __init__(self, keep: int = 8):
        self.keep, self._cache, self._lock = keep, {}, threading.Lock()

    def get(self, source: SourceEntry, epoch: int, n_windows: int) -> np.ndarray:
        key = (source.id, source.seed, epoch, n_windows)
        with self._lock:
            perm = self._cache.pop(key, None)
            if perm is None:
                perm = np.random.default_rng([source.seed, source.id, epoch]).permutation(n_windows)
                perm = perm.astype(np.int32 if n_windows < 2**31 else np.int64)
            self._cache[key] = perm  # re-inserted: newest last
            while len(self._cache) > self.keep:
                self._cache.pop(next(iter(self._cache)))
            return perm


class BatchReader:
    """Tokens of the batch at each position of one batch-list version (immutable, thread-safe).

    Batch ``(s, e, i)`` is the windows ``perm[i*B:(i+1)*B]`` of source ``s``,
    ``perm = default_rng([seed_s, s, e]).permutation(n_windows_s)``; window
    ``w`` is tokens ``[w*seq_len, w*seq_len + seq_len + 1)``. ``tokens`` maps
    each source id to its 1-D token array.
    """

    def __init__(self, blist: BatchList, tokens: dict[int, np.ndarray], perms: _Permutations | None = None):
        self.list = blist
        self.batch_size, self.seq_len = blist.batch_size, blist.seq_len
        self._tokens = tokens
        self._perms = perms or _Permutations()

    def id_at(self, position: int) -> int:
        return self.list.id_at(position)

    @property
    def item_spec(self) -> dict | None:
        """A Python dataset's batches: key -> (trailing shape, dtype) of its rows (jaxdist.data.items); else None."""
        src = self._tokens.get(0)
        return src.spec if isinstance(src, ItemSource) else None

    def window_ids(self, position: int, rows: np.ndarray | slice | None = None) -> tuple[int, np.ndarray]:
        """(source id, window index of each requested row) of the batch at ``position``."""
        return self._windows_of(self.id_at(position), rows)

    def _windows_of(self, batch_id: int, rows: np.ndarray | slice | None = None) -> tuple[int, np.ndarray]:
        s, e, i = (int(x) for x in unpack_ids(batch_id))
        src = self.list.source(s)
        perm = self._perms.get(src, e, src.n_windows(self.seq_len))
        row_ids = np.arange(self.batch_size, dtype=np.int64)
        if rows is not None:
            row_ids = row_ids[rows] if isinstance(rows, slice) else np.asarray(rows, dtype=np.int64).reshape(-1)
        if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= self.batch_size):
            raise IndexError(f"rows {row_ids.min()}..{row_ids.max()} outside the batch of {self.batch_size}")
        return s, perm[i * self.batch_size + row_ids].astype(np.int64)

    def rows(self, position: int, rows: np.ndarray | slice | None = None) -> np.ndarray:
        """The requested rows of the global batch at ``position``: int32 [n_rows, seq_len + 1]."""
        return self._read(*self.window_ids(position, rows))

    def batch_of_id(self, batch_id: int) -> np.ndarray:
        """All rows of the batch named ``batch_id`` (packed), at whatever position: int32 [batch_size, seq_len + 1].

        A batch's tokens depend on its id alone (its source, epoch and index), not on the version or position."""
        return self._read(*self._windows_of(batch_id))

    def _read(self, s: int, windows: np.ndarray) -> np.ndarray:
        src = self._tokens[s]
        if isinstance(src, (PackedStream, ItemSource)):  # packed row w, or item w of a Python dataset (a dict)
            return src.read(windows)
        idx = windows[:, None] * self.seq_len + np.arange(self.seq_len + 1, dtype=np.int64)
        return np.asarray(src[idx], dtype=np.int32)

    def batch(self, position: int) -> np.ndarray:
        """All rows of the batch at ``position``: int32 [batch_size, seq_len + 1]."""
        return self.rows(position)


class BatchLoader:
    """``(batch id, batch)`` for positions ``start, start + 1, ...`` read ahead on a thread (``depth`` ready).

    With a ``sharding`` each batch is a global ``jax.Array`` of which this
    process reads only its own rows; without, a host int32 array.
    """

    def __init__(self, reader: BatchReader, start: int, sharding=None, depth: int = 2):
        def read(position: int):
            batch = reader.batch(position) if sharding is None else global_batch_array(reader, position, sharding)
            return reader.id_at(position), batch

        self.reader = reader
        self._prefetch = Prefetcher(read, start, depth)

    def get(self, position: int) -> tuple[int, Any]:
        """(packed id, batch) at ``position``; positions must be asked for in order."""
        return self._prefetch.get(position)

    def close(self) -> None:
        self._prefetch.close()

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RunBatchList:
    """The batch list of one run as the Trainer uses it (every process of the job holds one).

    Opens ``<run_dir>/batchlist`` or creates version 1 from the configured
    data's train split ``train_tokens`` (named ``source_name``) and ``seed``;
    refuses a journal made for other data or batch shape. Process 0 writes
    every new version; with several processes all agree on it at each step
    boundary. ``version`` and ``reader`` follow the version in use.
    """

    def __init__(
        self,
        run_dir: str | Path,
        train_tokens: np.ndarray,
        source_name: str,
        seed: int,
        batch_size: int,
        seq_len: int,
        *,
        is_main: bool = True,
        process_count: int = 1,
        packing: Packing | None = None,
        added_items: Sequence[ItemSource] = (),
    ):
        self.journal = Journal(run_dir)
        # A run on a Python dataset: the datasets added to it (Trainer.add_data), given again on resume.
        self._items: list[ItemSource] = list(added_items)
        self._packing = packing  # data.packing=documents: the rows of the configured data's train split
        self.seed, self.batch_size, self.seq_len = int(seed), int(batch_size), int(seq_len)
        self.is_main, self.process_count = is_main, process_count
        self._config_tokens, self._source_name = train_tokens, source_name
        self._tokens: dict[int, np.ndarray] = {}
        self._perms = _Permutations()
        self.created = False
        if is_main and self.journal.latest() is None:
            self.journal.write(self._first_version())
            self.created = True
        self._sync("open")
        bl = self.journal.load()
        self._check_config(bl)
        self._adopt(bl)
        self._check_added_items(bl)

    def _first_version(self) -> BatchList:
        base = config_entry(self._config_tokens, self._source_name, self.seed, self._packing)
        if base.batches_per_epoch(self.batch_size, self.seq_len) < 1 and base.packing == "items":
            raise ConfigError(
                f"the training data ({self._source_name}) holds {base.rows:,} items, fewer than one batch of "
                f"{self.batch_size}: lower train.batch_size, or give it more items."
            )
        if base.batches_per_epoch(self.batch_size, self.seq_len) < 1:
            packed = f" ({base.rows:,} rows packed from its documents)" if self._packing is not None else ""
            raise ConfigError(
                f"the training data ({self._source_name}) holds {base.n_tokens:,} tokens{packed}, fewer than one "
                f"batch of {self.batch_size} sequences of {self.seq_len + 1} tokens: lower train.batch_size or "
                "train.seq_len, or give it more data."
            )
        return make_version(
            None, {"kind": "create", "seed": self.seed, "splice": 0}, (base,), self.batch_size, self.seq_len
        )

    def _check_config(self, bl: BatchList) -> None:
        where = self.journal.dir
        if (bl.batch_size, bl.seq_len) != (self.batch_size, self.seq_len):
            raise ConfigError(
                f"the batch list in {where} holds batches of {bl.batch_size} sequences of {bl.seq_len} tokens, but "
                f"the config has train.batch_size={self.batch_size} and train.seq_len={self.seq_len}: restore "
                "them, or use a new train.name."
            )
        base = bl.sources[0]
        if base.seed != self.seed:
            raise ConfigError(
                f"the batch list in {where} was made with data.seed={base.seed} but the config has "
                f"{self.seed}: restore it, or use a new train.name."
            )
        packing = "stream" if self._packing is None else "documents"
        packing = "items" if isinstance(self._config_tokens, ItemSource) else packing
        if base.packing != packing:
            raise ConfigError(
                f"the batch list in {where} was made with data.packing={base.packing} but the config has "
                f"{packing}: restore it, or use a new train.name."
            )
        if base.name != self._source_name:
            raise ConfigError(
                f"the batch list in {where} was made from data '{base.name}' but the config gives "
                f"'{self._source_name}': restore the data settings, or use a new train.name."
            )

    def _check_added_items(self, bl: BatchList) -> None:
        """Every dataset given as ``added_items`` is a source of the batch list or of a pending addition."""
        entries = [e for _, e in known_sources(self.journal, bl).values() if _kind(e) == "items"]
        for src in self._items:
            if not any(given_items(e, [src]) for e in entries):
                raise ConfigError(
                    f"added_data= gives {src.name} ({len(src):,} items), which was never added to the run in "
                    f"{self.journal.run_dir}: add it with Trainer.add_data, or leave it out."
                )

    def add_items(self, source: ItemSource, seed: int | None = None) -> dict[str, Any] | None:
        """Register the Python dataset ``source`` in this process; process 0 also queues it in the journal
        (:func:`jaxdist.data.catalog.add_items`) and returns the request, the others None.  Every process of the
        job must add it before the step boundary that adopts it, since each reads its own rows of its items."""
        base = self._tokens[0]
        if not isinstance(base, ItemSource):
            raise ConfigError(
                "this run trains on token data, not on a Python dataset's items: add files to it with "
                "jaxdist.data.add_data (jaxdist data add)."
            )
        request = add_items(self.journal.run_dir, source, base, seed=seed) if self.is_main else None
        self._items.append(source)
        return request

    # ------------------------------------------------------------------ versions

    @property
    def current(self) -> BatchList:
        return self.reader.list

    @property
    def version(self) -> int:
        return self.reader.list.version

    def _adopt(self, bl: BatchList) -> None:
        for s in bl.sources:
            if s.id not in self._tokens:
                self._tokens[s.id] = read_source(s, self._config_tokens, self._items)
                if s.id == 0 and self._packing is not None:
                    self._tokens[0] = PackedStream(self._tokens[0], self._packing)
                elif s.packing == "documents":
                    self._tokens[s.id] = pack_source(s, self._tokens[s.id], self.seq_len)
        self.reader = BatchReader(bl, dict(self._tokens), self._perms)

    def _sync(self, what: str) -> None:
        if self.process_count > 1:
            from jax.experimental import multihost_utils  # JAX only in a job: `jaxdist data` stays JAX-free

            multihost_utils.sync_global_devices(f"jaxdist-batchlist-{what}")

    def _agree(self, version: int) -> int:
        """Process 0's ``version``, on every process."""
        if self.process_count == 1:
            return version
        from jax.experimental import multihost_utils  # JAX only in a job: `jaxdist data` stays JAX-free

        return int(multihost_utils.broadcast_one_to_all(np.int32(version)))

    def resume(self, data_meta: dict[str, Any], cursor: int) -> None:
        """Check that a checkpoint's data meta fits this journal and that the positions before ``cursor`` kept their batches."""
        if data_meta.get("sampler") != SAMPLER:
            raise ConfigError(
                f"the checkpoint was written without a batch list (data sampler "
                f"{data_meta.get('sampler')!r}): start a new run with a new train.name."
            )
        v, where = int(data_meta["version"]), self.journal.dir
        if v not in self.journal.versions():
            raise ConfigError(
                f"the checkpoint was written with batch list version {v}, which {where} lacks: copy "
                "the run's batchlist folder along with its checkpoints."
            )
        then = self.journal.load(v)
        if data_meta.get("order_sha256") not in (None, then.order_sha256()):
            raise ConfigError(
                f"batch list version {v} in {where} is not the one the checkpoint was written with "
                "(its order differs): copy the run's batchlist folder along with its checkpoints."
            )
        now = self.current
        if cursor > len(then) or not np.array_equal(now.order[:cursor], then.order[:cursor]):
            raise BatchListError(
                f"batch list version {now.version} in {where} changes batches before position "
                f"{cursor}, which the checkpoint (version {v}) already trained: move the versions "
                f"after {v} aside."
            )

    def checkpoint_meta(self, cursor: int) -> dict[str, Any]:
        """The data part of a checkpoint's meta at ``cursor``; also records it in the journal's cursor file."""
        bl = self.current
        if self.is_main:
            self.journal.write_cursor(bl.version, cursor)
        return {
            "sampler": SAMPLER,
            "source": bl.sources[0].name,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "position": cursor,
            "cursor": cursor,
            "version": bl.version,
            "order_sha256": bl.order_sha256(),
        }

    def boundary(self, cursor: int, poll: bool = True) -> bool:
        """At the step boundary before position ``cursor``: adopt additions (if ``poll``), extend a spent list.

        Returns True if the version changed. Every process must call it with
        the same arguments: with several processes it agrees on process 0's
        version, a host sync that waits for the steps in flight, which is why
        the loader polls only every ``poll_every`` steps there.
        """
        bl = self.current
        if not poll and cursor < len(bl):
            return False
        if self.is_main:
            bl = self._apply_requests(bl, cursor)
            if cursor >= len(bl):
                op = {"kind": "epoch", "seed": epoch_seed(self.seed, bl.version + 1), "splice": len(bl)}
                bl = self.journal.write(make_version(bl, op, bl.sources, self.batch_size, self.seq_len))
                log.info("batch list version %d: next epoch appended at position %d", bl.version, cursor)
        v = self._agree(bl.version)
        if v == self.version:
            return False
        self._adopt(bl if v == bl.version else self.journal.load(v, known=self.current))
        return True

    def _apply_requests(self, bl: BatchList, cursor: int) -> BatchList:
        pending = self.journal.pending()
        if not pending:
            return bl
        applied = self.journal.applied_requests()
        for name, req in pending:
            if name in applied:  # written before a crash, not yet moved
                self.journal.settle(name, "applied")
                continue
            try:
                if req is None:
                    raise ValueError("the request file is damaged")
                items = [s.get("kind") == "items" for s in req["sources"]]
                if bl.sources[0].packing == "items" and not all(items):
                    raise ValueError("a run that trains on a Python dataset's items takes no token files")
                if bl.sources[0].packing != "items" and any(items):
                    raise ValueError("a Python dataset's items are added to a run that trains on one only")
                known = {s.fingerprint for s in bl.sources}
                if any(s["fingerprint"] in known for s in req["sources"]):
                    raise ValueError("it holds data the batch list already has")
                new = tuple(
                    SourceEntry.from_dict(
                        {**s, "id": len(bl.sources) + k, "seed": req["seed"], "added_in": bl.version + 1}
                    )
                    for k, s in enumerate(req["sources"])
                )
                for s in new:
                    read_source(s, items=self._items)  # missing or changed since it was requested: refuse it here
                if self._packing is not None:  # a documents run packs what it adds too
                    new = tuple(
                        dataclasses.replace(
                            s, packing="documents", rows=pack_source(s, read_source(s), self.seq_len).packing.rows
                        )
                        for s in new
                    )
            except (ValueError, KeyError, TypeError, BatchListError, ConfigError) as e:
                log.warning("batch list: addition %s rejected: %s", name, e)
                self.journal.settle(name, "rejected")
                continue
            op = {
                "kind": "add",
                "mix": "insert",
                "seed": req["seed"],
                "splice": cursor,
                "sources": [s.id for s in new],
                "request": name,
            }
            bl = self.journal.write(make_version(bl, op, bl.sources + new, self.batch_size, self.seq_len))
            self.journal.settle(name, "applied")
            log.info(
                "batch list version %d: %s added at position %d (%d batches now)",
                bl.version,
                ", ".join(s.name for s in new),
                cursor,
                len(bl),
            )
        return bl

    # ------------------------------------------------------------------ reading

    def loader(self, start: int, sharding=None, depth: int = 2, poll_every: int = 1) -> FollowingLoader:
        """A loader from position ``start`` that adopts new versions at step boundaries.

        Additions are looked for at ``start`` and every ``poll_every``-th
        position (1: every step; multi-process jobs pass their metrics
        interval, where the host waits for the devices anyway).
        """
        return FollowingLoader(self, start, sharding, depth, poll_every)


class FollowingLoader:
    """A :class:`BatchLoader` that checks the batch list at step boundaries and restarts on a new version."""

    def __init__(self, run: RunBatchList, start: int, sharding, depth: int, poll_every: int = 1):
        if poll_every < 1:
            raise ValueError(f"poll_every must be >= 1, got {poll_every}")
        self.run, self._sharding, self._depth, self._poll_every = run, sharding, depth, poll_every
        self._start, self._agreed = start, -1
        self._inner = BatchLoader(run.reader, start, sharding, depth)

    def agree(self, position: int) -> None:
        """Adopt any new version at this boundary (with several processes, a collective at the polled
        positions: the loop books it apart from its own wait for data).  Once per position."""
        if self._agreed == position:
            return
        self._agreed = position
        poll = position == self._start or position % self._poll_every == 0
        if self.run.boundary(position, poll):  # batches read ahead from the old version are dropped
            self._inner.close()
            self._inner = BatchLoader(self.run.reader, position, self._sharding, self._depth)

    def get(self, position: int) -> tuple[int, Any]:
        """(packed id, batch) at ``position``, after adopting any new version at this boundary."""
        self.agree(position)
        return self._inner.get(position)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> FollowingLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _kind(entry: SourceEntry | dict) -> str:
    """A source's kind, from the batch list (a SourceEntry) or from a pending addition's request (a dict)."""
    return entry["kind"] if isinstance(entry, dict) else entry.kind


__all__ = ["BatchLoader", "BatchReader", "FollowingLoader", "RunBatchList", "SAMPLER"]

"""The batch list: which global batch every training step reads, kept as a versioned journal.

**Batch ids.** A batch id names one global batch exactly: ``(source, epoch,
index)`` is the ``batch_size`` windows ``perm[index*B : (index+1)*B]`` of
source ``source``, where ``perm`` is the seeded permutation of that source's
windows of ``seq_len + 1`` tokens for that epoch (see
:meth:`~jaxdist.data.batchloader.BatchReader.window_ids`). An id is packed
into one int64 (``source << 48 | epoch << 32 | index``) and printed as
``"source:epoch:index"``.

**Versions.** A :class:`BatchList` is one version: the order of batch ids
(position ``p`` is trained at step ``p + 1``) and the table of sources. Each
version is made from its parent by one operation, recorded with its seed:

* ``create``: one epoch of the config's source, shuffled (version 1);
* ``add``: the batches of newly registered sources, shuffled, each put at a
  uniformly random place among the parent's unused ids (positions >=
  ``splice``), which keep their order (``"mix": "insert"``; a list written
  before it, ``jaxdist-batchlist/1``, reshuffled every unused id instead, and
  its versions replay that way);
* ``epoch``: the next epoch of every source, shuffled, appended at the end.

Every version keeps its parent's first ``splice`` ids, so a position already
trained never changes meaning; :func:`replay_order` rebuilds any version from
the operations alone.

**Files.** Version 1 and every :data:`WHOLE_EVERY`-th version after it store
the whole order; the others store only their :class:`Delta` from the parent
(the inserted ids and their places), so an addition costs bytes in proportion
to what it adds, not to the list (a whole order per version made 1,000
additions to a list of 10^6 batches a journal of gigabytes).  Every file
records the SHA-256 of its version's whole order, which loading checks, and a
copy of the previous version's change (``previous``), from which that version is
built when its own file is damaged.

On disk each version is one checksummed file of the run's journal
(:mod:`jaxdist.data.journal`); :func:`encode` and :func:`decode` are its format.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import time
import zlib
from dataclasses import MISSING
from typing import Any

import numpy as np

from jaxdist.config import ConfigError

FORMAT = "jaxdist-batchlist/2"
FORMATS_READ = ("jaxdist-batchlist/1", FORMAT)  # /1: every version held its whole order
WHOLE_EVERY = 64  # a whole order every this many versions: bounds the deltas applied to load a version
_SOURCE_SHIFT, _EPOCH_SHIFT = 48, 32
MAX_SOURCES, MAX_EPOCHS, MAX_INDEX = 1 << 15, 1 << 16, 1 << 32


class BatchListError(ConfigError):
    """A damaged or inconsistent batch list, or data that cannot join it (one sentence)."""


# --------------------------------------------------------------------------- ids


def pack_ids(source, epoch, index) -> np.ndarray:
    """int64 batch ids from (source, epoch, index) arrays or scalars."""
    s, e, i = (np.asarray(x, dtype=np.int64) for x in (source, epoch, index))
    assert np.all((s >= 0) & (s < MAX_SOURCES) & (e >= 0) & (e < MAX_EPOCHS) & (i >= 0) & (i < MAX_INDEX))
    return (s << _SOURCE_SHIFT) | (e << _EPOCH_SHIFT) | i


def unpack_ids(ids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source, epoch, index) int64 arrays of packed batch ids."""
    ids = np.asarray(ids, dtype=np.int64)
    return ids >> _SOURCE_SHIFT, (ids >> _EPOCH_SHIFT) & (MAX_EPOCHS - 1), ids & (MAX_INDEX - 1)


def format_id(batch_id: int) -> str:
    """``"source:epoch:index"`` of one packed id."""
    s, e, i = (int(x) for x in unpack_ids(batch_id))
    return f"{s}:{e}:{i}"


def parse_id(text: str) -> int:
    """The packed id of ``"source:epoch:index"``."""
    s, e, i = (int(x) for x in text.split(":"))
    return int(pack_ids(s, e, i))


def token_digest(tokens, xp=np):
    """A 32-bit digest (uint32 scalar) of one global batch's tokens ``[B, T+1]``, from numpy or inside a jitted step.

    ``xp`` is the array module (``numpy`` or ``jax.numpy``).  Each token is mixed with its flat position
    (murmur3's finaliser) and the mixes are summed modulo 2**32: a sum, so a sharded batch reduces to the
    same bits in any order, over any mesh.  The train step logs it as ``batch_digest`` beside the batch id;
    :func:`jaxdist.data.audit.digest_problems` recomputes it from the data for each id.
    """
    u32 = xp.uint32
    rows, cols = tokens.shape
    pos = xp.arange(rows, dtype=u32)[:, None] * u32(cols) + xp.arange(cols, dtype=u32)[None, :]
    x = tokens.astype(u32) ^ (pos * u32(0x9E3779B9))
    x = x ^ (x >> u32(16))
    x = x * u32(0x85EBCA6B)
    x = x ^ (x >> u32(13))
    x = x * u32(0xC2B2AE35)
    x = x ^ (x >> u32(16))
    return xp.sum(x, dtype=u32)


def batch_digest(batch, xp=np):
    """:func:`token_digest` of a token batch, or of a Python dataset's batch ``{key: array [B, ...]}``: each key's
    rows as 32-bit words (integers converted, floats as float32 bits), digested, and combined by key order."""
    if not hasattr(batch, "items"):
        return token_digest(batch, xp)
    total = xp.uint32(0)
    with np.errstate(over="ignore"):  # modulo 2**32 is the point (numpy warns on its scalars' wrap-around)
        for k, key in enumerate(sorted(batch)):
            x = batch[key].reshape(batch[key].shape[0], -1)
            words = x.astype(xp.float32).view(xp.uint32) if xp.issubdtype(x.dtype, xp.floating) else x.astype(xp.uint32)
            total = total + token_digest(words, xp) * xp.uint32(2 * k + 1)
    return total


# --------------------------------------------------------------------------- sources and versions


@dataclasses.dataclass(frozen=True)
class SourceEntry:
    """One source of training batches, as the journal records it.

    ``kind``: ``config`` (the run's ``data.*`` source, train split), ``text``
    (one file, byte-tokenized, then EOS), ``text_dir`` (every file under a
    directory, sorted, each followed by EOS) or ``tokens`` (a flat token file).
    ``n_tokens`` counts tokens; ``fingerprint`` is the SHA-256 of all of them,
    ``quick`` a hash of their length and a few slices (cheap to re-check at
    every start); ``seed`` orders the windows in every epoch.
    """

    id: int
    kind: str
    name: str
    path: str
    token_dtype: str
    n_tokens: int
    fingerprint: str
    quick: str
    seed: int
    added_in: int  # the version that registered it
    packing: str = "stream"  # data.packing; a list written before it existed is a stream
    rows: int = 0  # packing=documents: the rows packed from its documents at the list's seq_len

    def n_windows(self, seq_len: int) -> int:
        """Windows of ``seq_len + 1`` tokens (neighbours share one token), or the packed rows, or the items of a
        Python dataset (``packing="items"``, jaxdist.data.items)."""
        if self.packing in ("documents", "items"):
            return self.rows
        return max(0, (self.n_tokens - 1) // seq_len)

    def batches_per_epoch(self, batch_size: int, seq_len: int) -> int:
        """Whole global batches per pass; the ``n_windows % batch_size`` left over vary by epoch."""
        return self.n_windows(seq_len) // batch_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SourceEntry:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d or f.default is MISSING})


def _pack(a: np.ndarray, level: int = 6) -> str:
    return base64.b64encode(zlib.compress(np.ascontiguousarray(a, dtype="<i8").tobytes(), level)).decode("ascii")


def _unpack(text: str) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<i8").astype(np.int64)


def _sha256(order: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(order, dtype="<i8").tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Delta:
    """How a version's order differs from its parent's: ``ids`` sit at the positions ``at`` (strictly
    increasing) of the new order, and the parent's order fills the other positions, in its order.

    An ``add`` inserts among the unused positions, an ``epoch`` appends (``at`` runs on from the parent's end).
    """

    at: np.ndarray
    ids: np.ndarray

    def apply(self, parent: np.ndarray) -> np.ndarray:
        """The new order (read-only); ValueError when ``at`` does not fit ``parent``."""
        n = len(parent) + len(self.ids)
        if len(self.at) and (self.at[0] < 0 or self.at[-1] >= n):
            raise ValueError(f"it places ids past the end of its parent's {len(parent):,} batches")
        order = np.empty(n, dtype=np.int64)
        keep = np.ones(n, dtype=bool)
        keep[self.at] = False
        order[keep] = parent
        order[self.at] = self.ids
        order.flags.writeable = False
        return order

    def to_json(self) -> dict[str, str]:
        # Positions as their differences (small numbers, which compress); ids as int64 (their high bytes repeat).
        return {"at": _pack(np.diff(self.at, prepend=0)), "ids": _pack(self.ids)}

    @classmethod
    def from_json(cls, d: dict[str, str]) -> Delta:
        at, ids = np.cumsum(_unpack(d["at"])), _unpack(d["ids"])
        if len(at) != len(ids) or (len(at) > 1 and np.any(np.diff(at) <= 0)):
            raise ValueError("its change from the parent is not a set of places and ids")
        return cls(at, ids)


@dataclasses.dataclass(frozen=True)
class BatchList:
    """One version of a run's batch list: ``order[p]`` is the id of the batch trained at position ``p``.

    ``op`` records how it was made from version ``parent``: ``kind``
    (create/add/epoch), ``seed``, ``splice`` (positions kept from the parent)
    and, for ``add``, the new ``sources`` ids and the ``request`` it applied.
    ``delta`` is its change from the parent (None for version 1, and for a version read from a whole order
    of format /1); ``depth`` counts the deltas stored since the last whole order (0: its file holds the whole
    order); ``previous`` is the parent's :meth:`change_record`, which this version's file keeps as a copy.
    ``checksum`` is the SHA-256 of the file content (set when written or read).
    """

    version: int
    parent: int | None
    op: dict[str, Any]
    batch_size: int
    seq_len: int
    sources: tuple[SourceEntry, ...]
    order: np.ndarray
    created: float = 0.0
    checksum: str = ""
    delta: Delta | None = None
    depth: int = 0
    previous: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    _sha: list = dataclasses.field(default_factory=list, init=False, compare=False, repr=False)  # order_sha256's

    def __len__(self) -> int:
        return len(self.order)

    def added_sources(self) -> tuple[SourceEntry, ...]:
        """The sources this version registered (an ``add``'s), none for the other operations."""
        return self.sources[min(self.op.get("sources") or [len(self.sources)]) :]

    def change_record(self) -> dict[str, Any] | None:
        """What the next version's file keeps of this one (:meth:`body`'s ``previous``): its operation, change
        and added sources, enough to build it from its parent when its own file is damaged; None without a
        change (version 1)."""
        if self.delta is None or self.parent is None:
            return None
        return {
            "version": self.version,
            "parent": self.parent,
            "op": self.op,
            "n_sources": len(self.sources),
            "n_batches": len(self.order),
            "order_sha256": self.order_sha256(),
            "created": self.created,
            "delta": self.delta.to_json(),
            "sources": [s.to_dict() for s in self.added_sources()],
        }

    def id_at(self, position: int) -> int:
        """Packed id of the batch at ``position`` (0-based)."""
        if not 0 <= position < len(self.order):
            raise IndexError(
                f"position {position} is outside batch list version {self.version} of {len(self.order)} batches"
            )
        return int(self.order[position])

    def source(self, source_id: int) -> SourceEntry:
        return self.sources[source_id]

    def order_sha256(self) -> str:
        """SHA-256 (hex) of the order (little-endian int64): equal for equal orders, whenever written."""
        if not self._sha:  # the order is read-only: one pass over it per version, not one per use
            self._sha.append(_sha256(self.order))
        return self._sha[0]

    def body(self) -> dict[str, Any]:
        """The JSON content of the version file, without its checksum: the whole order at depth 0, else the delta."""
        body = {
            "format": FORMAT,
            "version": self.version,
            "parent": self.parent,
            "op": self.op,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "n_sources": len(self.sources),
            "n_batches": len(self.order),
            "order_sha256": self.order_sha256(),
            "created": self.created,
            "depth": self.depth,
        }
        if self.previous is not None:
            # A copy of the parent's change: a damaged parent file is rebuilt from it (Journal.load), so one
            # damaged file does not take the versions built on it along.
            body["previous"] = self.previous
        if self.depth == 0:
            body["sources"] = [s.to_dict() for s in self.sources]
            # zlib level 1: a shuffled order barely compresses at any level, and higher levels cost most of the
            # time of writing one at a million batches (benchmarks/scale.py); any level reads back.
            body["order"] = _pack(self.order, 1)
        else:
            assert self.delta is not None and self.parent is not None, "a version stored as a delta needs its parent"
            body["delta"] = self.delta.to_json()
            # Only the sources it adds (a table of every source in every version grew the journal with the square
            # of the additions); the parent's come from the parent.
            body["sources"] = [s.to_dict() for s in self.added_sources()]
        return body


@dataclasses.dataclass(frozen=True)
class Stored:
    """One version file as read (checksum checked): the version's fields, and its whole ``order`` and every
    source (depth 0), or its ``delta`` from the parent and the ``sources`` it adds, which the journal joins to
    the parent's to make the :class:`BatchList` (:meth:`jaxdist.data.journal.Journal.load`).  ``order`` and
    ``delta`` are None when the file was read without them (``decode(..., orders=False)``)."""

    version: int
    parent: int | None
    op: dict[str, Any]
    batch_size: int
    seq_len: int
    sources: tuple[SourceEntry, ...]
    n_sources: int
    n_batches: int
    order_sha256: str
    created: float
    checksum: str
    depth: int
    order: np.ndarray | None
    delta: Delta | None
    previous: Stored | None = None  # the copy of the parent's change this file keeps
    copy_in: int | None = None  # read from the copy that version ``copy_in`` keeps (its own file is damaged)

    def __len__(self) -> int:
        return self.n_batches

    def all_sources(self, parent_sources: tuple[SourceEntry, ...] | None) -> tuple[SourceEntry, ...]:
        """Every source of the version: its own table when whole, else the parent's and the ones it adds."""
        if self.depth == 0:
            return self.sources
        assert parent_sources is not None
        ids = [s.id for s in self.sources]
        if len(parent_sources) + len(ids) != self.n_sources or ids != list(range(len(parent_sources), self.n_sources)):
            raise ValueError(
                f"it adds sources {ids} to its parent's {len(parent_sources)}, not the {self.n_sources} it records"
            )
        return parent_sources + self.sources

    def resolve(self, parent: BatchList | None, check: bool = True) -> BatchList:
        """The version, its order whole from the file or ``delta`` applied to ``parent``'s; ValueError when the
        result is not the order the file recorded (``check``: its SHA-256 compared, one pass over it)."""
        if self.depth == 0:
            assert self.order is not None, "read without its order"
            order = self.order
        else:
            assert self.delta is not None and parent is not None
            if len(parent.order) + len(self.delta.ids) != self.n_batches:
                raise ValueError(
                    f"it adds {len(self.delta.ids):,} batches to its parent's {len(parent.order):,}, not the "
                    f"{self.n_batches:,} it records"
                )
            order = self.delta.apply(parent.order)
            if check and _sha256(order) != self.order_sha256:
                raise ValueError(f"its change applied to version {self.parent} does not give its recorded order")
        bl = BatchList(
            version=self.version,
            parent=self.parent,
            op=self.op,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            sources=self.all_sources(None if parent is None else parent.sources),
            order=order,
            created=self.created,
            checksum=self.checksum,
            delta=self.delta,
            depth=self.depth,
        )
        if self.depth == 0 or check:  # its SHA-256 was compared (decode checks a whole order's): not taken again
            bl._sha.append(self.order_sha256)
        return bl


def canonical_json(body: dict) -> bytes:
    """The bytes a batch-list file's checksum is taken over: sorted keys, no spaces, UTF-8."""
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def encode(bl: BatchList) -> tuple[bytes, str]:
    """(file bytes, checksum) of a version."""
    body = bl.body()
    checksum = hashlib.sha256(canonical_json(body)).hexdigest()
    return json.dumps({**body, "checksum": checksum}, sort_keys=True).encode("utf-8") + b"\n", checksum


def decode(data: bytes, where: str, orders: bool = True) -> Stored:
    """The version file in ``data`` (format /1 or /2); raises ``ValueError`` saying what is wrong (``where``
    names the file).  ``orders=False``: the order or delta is left packed (None), for its operation and
    sources alone."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("it is not complete JSON, so it was cut short or altered") from None
    if not isinstance(doc, dict) or doc.get("format") not in FORMATS_READ:
        raise ValueError(f"not a {FORMAT} file")
    checksum = doc.pop("checksum", None)
    if checksum != hashlib.sha256(canonical_json(doc)).hexdigest():
        raise ValueError("its checksum does not match its content, so it was altered")
    order, delta = None, None
    depth = int(doc.get("depth", 0))
    if "order" not in doc and (doc.get("parent") is None or depth < 1):
        raise ValueError("it holds neither a whole order nor a change from a parent")
    if "order" in doc and orders:
        order = _unpack(doc["order"])
        if _sha256(order) != doc["order_sha256"]:  # the checksum above makes this an internal check
            raise ValueError("its order does not match its recorded hash")
        order.flags.writeable = False
        assert len(order) == doc["n_batches"], where
    elif "order" not in doc and orders:
        delta = Delta.from_json(doc["delta"])
    previous = None
    if doc.get("previous") is not None:  # the parent's change, kept as a copy: built from its own parent as well
        p = doc["previous"]
        delta_p = Delta.from_json(p["delta"]) if orders else None
        previous = _stored(p, doc, checksum="", depth=1, order=None, delta=delta_p, copy_in=doc["version"])
    depth = 0 if "order" in doc else depth
    return _stored(doc, doc, checksum=checksum, depth=depth, order=order, delta=delta, previous=previous)


def _stored(record: dict[str, Any], doc: dict[str, Any], **rest: Any) -> Stored:
    """A :class:`Stored` of the fields a file's ``record`` holds (the file's own, or its ``previous`` copy), the
    shapes from the file ``doc``."""
    return Stored(
        version=record["version"],
        parent=record["parent"],
        op=record["op"],
        batch_size=doc["batch_size"],
        seq_len=doc["seq_len"],
        sources=tuple(SourceEntry.from_dict(s) for s in record["sources"]),
        n_sources=record.get("n_sources", len(record["sources"])),
        n_batches=record["n_batches"],
        order_sha256=record["order_sha256"],
        created=record["created"],
        **rest,
    )


# --------------------------------------------------------------------------- operations (pure)


def epoch_ids(source: SourceEntry, epoch: int, batch_size: int, seq_len: int) -> np.ndarray:
    """The ids of every batch of one epoch of ``source``, in index order."""
    n = source.batches_per_epoch(batch_size, seq_len)
    return pack_ids(np.full(n, source.id), np.full(n, epoch), np.arange(n))


def create_order(source: SourceEntry, batch_size: int, seq_len: int, seed) -> np.ndarray:
    """Version 1: epoch 0 of ``source`` in the order ``default_rng(seed).permutation``."""
    return np.random.default_rng(seed).permutation(epoch_ids(source, 0, batch_size, seq_len))


def insert_order(parent: np.ndarray, splice: int, new_ids: np.ndarray, seed) -> tuple[np.ndarray, Delta]:
    """``parent[:splice]``, then the unused ids ``parent[splice:]`` in their order with ``new_ids`` inserted:
    (order, delta).

    With ``rng = default_rng(seed)``: the new ids in the order ``rng.permutation(new_ids)`` take the places
    ``splice + sort(rng.choice(unused + new, new, replace=False))``.  Every set of places is equally likely, so
    when the unused ids are in a uniformly random order (a shuffle's) the result is too, as a reshuffle of all
    of them would be; an epoch appended earlier stays after the one before it.  The cost is the new ids and
    one pass over the order, and the delta holds only the new ids and their places.  The new ids are ids of
    sources registered by this very addition, so none of them was used.
    """
    rng = np.random.default_rng(seed)
    new = rng.permutation(np.asarray(new_ids, dtype=np.int64))
    unused = len(parent) - splice
    at = splice + np.sort(rng.choice(unused + len(new), size=len(new), replace=False)).astype(np.int64)
    delta = Delta(at, new)
    return delta.apply(parent), delta


def add_order(parent: np.ndarray, splice: int, new_ids: np.ndarray, seed) -> np.ndarray:
    """The ``add`` of format /1, kept to replay its lists: ``parent[:splice]`` then the unused ids
    ``parent[splice:]`` and ``new_ids`` (minus used ones), shuffled together.

    The shuffle is ``default_rng(seed).permutation`` of ``concat(parent[splice:], new)``.
    """
    used = parent[:splice]
    new = np.asarray(new_ids, dtype=np.int64)
    new = new[~np.isin(new, used)]
    rest = np.concatenate([parent[splice:], new])
    return np.concatenate([used, np.random.default_rng(seed).permutation(rest)])


def epoch_order(
    parent: np.ndarray, sources: tuple[SourceEntry, ...], batch_size: int, seq_len: int, seed
) -> np.ndarray:
    """``parent`` then the next epoch of every source (one past its highest epoch in ``parent``), shuffled."""
    src, ep, _ = unpack_ids(parent)
    fresh = []
    for s in sources:
        mine = ep[src == s.id]
        fresh.append(epoch_ids(s, int(mine.max()) + 1 if mine.size else 0, batch_size, seq_len))
    return np.concatenate([parent, np.random.default_rng(seed).permutation(np.concatenate(fresh))])


def derive_delta(
    parent: BatchList | None, op: dict[str, Any], sources: tuple[SourceEntry, ...], batch_size: int, seq_len: int
) -> tuple[np.ndarray, Delta | None]:
    """The order that ``op`` makes from ``parent`` (None for ``create``), and its delta from the parent's (None
    where the operation rewrites it: ``create`` and the ``add`` of format /1): the one rule replay follows."""
    kind, seed = op["kind"], op["seed"]
    if kind == "create":
        return create_order(sources[0], batch_size, seq_len, seed), None
    assert parent is not None, op
    if kind == "add":
        new = np.concatenate(
            [np.zeros(0, np.int64), *(epoch_ids(sources[i], 0, batch_size, seq_len) for i in op["sources"])]
        )
        if op.get("mix") == "insert":
            return insert_order(parent.order, op["splice"], new, seed)
        return add_order(parent.order, op["splice"], new, seed), None
    if kind == "epoch":
        order = epoch_order(parent.order, sources, batch_size, seq_len, seed)
        n = len(parent.order)
        return order, Delta(np.arange(n, len(order), dtype=np.int64), order[n:])
    raise ValueError(f"unknown batch list operation {kind!r}")


def derive(
    parent: BatchList | None, op: dict[str, Any], sources: tuple[SourceEntry, ...], batch_size: int, seq_len: int
) -> np.ndarray:
    """The order that ``op`` makes from ``parent`` (:func:`derive_delta` without the delta)."""
    return derive_delta(parent, op, sources, batch_size, seq_len)[0]


def make_version(
    parent: BatchList | None, op: dict[str, Any], sources: tuple[SourceEntry, ...], batch_size: int, seq_len: int
) -> BatchList:
    """The next version: ``op`` applied to ``parent`` (version 1 when ``parent`` is None).  It is stored as its
    delta unless it has none or :data:`WHOLE_EVERY` versions passed since the parent's last whole order."""
    order, delta = derive_delta(parent, op, sources, batch_size, seq_len)
    order.flags.writeable = False
    depth = 0
    if parent is not None and delta is not None and parent.depth + 1 < WHOLE_EVERY:
        depth = parent.depth + 1
    return BatchList(
        version=1 if parent is None else parent.version + 1,
        parent=None if parent is None else parent.version,
        op=op,
        batch_size=batch_size,
        seq_len=seq_len,
        sources=sources,
        order=order,
        created=time.time(),
        delta=delta,
        depth=depth,
        previous=None if parent is None else parent.change_record(),
    )


def epoch_seed(create_seed: int, version: int) -> list[int]:
    """Seed of the ``epoch`` operation that makes ``version``: fixed by the run's data seed."""
    return [int(create_seed), 0x45504F43, int(version)]  # 0x45504F43 = "EPOC": keeps it apart from other seeds

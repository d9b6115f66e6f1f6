"""Who writes which bytes of a checkpoint: the balanced write plan (pure, no devices).

Every array of the train state is split into *pieces*; each piece is written
by exactly one process.  The rules, array by array:

* a shard held by one process (one device, as under ``fsdp``/``tensor``
  sharding, or several devices of that process) is written by that process
  from one device (``owner``): one device-to-host copy, no slicing;
* a shard held by R > 1 devices (replicated parameters under ``data``) is cut
  into R equal slices along the first dimension R divides, replica r writing
  slice r: orbax's replica-parallel writing, which jaxdist switches on
  (``orbax``);
* where R divides no dimension (a scalar, ``data=6`` with power-of-two
  widths), jaxdist cuts the shard into the largest k <= R equal slices some
  dimension allows and gives each slice to the replica-holding process with
  the fewest bytes so far, biggest slices first (``jaxdist``: greedy
  longest-processing-time on top of the loads the first two rules fixed).

``strategy="replica0"`` is the naive baseline: replica 0 of every shard writes
all of it (for a fully replicated array that is process 0).

Indices are tuples of ``(start, stop)`` per dimension; sizes are in bytes.
:func:`plan_writes` is deterministic, so every process computes the same
plan from the same layouts.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

Index = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Shard:
    """One device's copy of part of an array: ``device`` id, owning ``process``, global ``index``, ``replica`` id."""

    device: int
    process: int
    index: Index
    replica: int


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """An array's name, global shape, element size (bytes) and its shards (one per device)."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    shards: tuple[Shard, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def replicas(self) -> int:
        """Devices holding each distinct shard (1: fully sharded)."""
        counts: dict[Index, int] = defaultdict(int)
        for s in self.shards:
            counts[s.index] += 1
        return max(counts.values())


@dataclasses.dataclass(frozen=True)
class Piece:
    """A block of one array written by one process: global ``index``, source ``device``, bytes, rule used."""

    array: str
    index: Index
    process: int
    device: int
    nbytes: int
    rule: str  # "owner" | "orbax" | "jaxdist" | "replica0"


@dataclasses.dataclass(frozen=True)
class ArrayPlan:
    """How one array is written: ``rule``, the piece shape all writers agree on (the chunk shape), the pieces."""

    name: str
    rule: str
    piece_shape: tuple[int, ...]
    pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class WritePlan:
    """The pieces of every array and the processes that write them."""

    arrays: tuple[ArrayPlan, ...]
    num_processes: int
    strategy: str

    def bytes_per_process(self) -> list[int]:
        """Array bytes (uncompressed) each process writes, indexed by process."""
        out = [0] * self.num_processes
        for a in self.arrays:
            for p in a.pieces:
                out[p.process] += p.nbytes
        return out

    def imbalance(self) -> float:
        """max / mean of :meth:`bytes_per_process` (1.0 is perfectly even)."""
        return max_over_mean(self.bytes_per_process())

    def for_array(self, name: str) -> ArrayPlan:
        return next(a for a in self.arrays if a.name == name)

    def table(self, top: int = 0) -> str:
        """A printable table: per array the rule and bytes per process, then the totals."""
        n = self.num_processes
        head = f"{'array':<48} {'rule':<8} {'bytes':>12} " + " ".join(f"{'p' + str(i):>10}" for i in range(n))
        lines = [head, "-" * len(head)]
        arrays = sorted(self.arrays, key=lambda a: -sum(p.nbytes for p in a.pieces))
        for a in arrays[: top or None]:
            per = [0] * n
            for p in a.pieces:
                per[p.process] += p.nbytes
            lines.append(f"{a.name[:48]:<48} {a.rule:<8} {sum(per):>12,} " + " ".join(f"{b:>10,}" for b in per))
        if top and len(arrays) > top:
            lines.append(f"... {len(arrays) - top} more arrays")
        per = self.bytes_per_process()
        lines.append("-" * len(head))
        lines.append(
            f"{'total (' + self.strategy + ')':<48} {'':<8} {sum(per):>12,} " + " ".join(f"{b:>10,}" for b in per)
        )
        lines.append(f"max/mean bytes per process: {self.imbalance():.4f}")
        return "\n".join(lines)


def max_over_mean(values: Sequence[float]) -> float:
    """max / mean of non-negative numbers (1.0 for all-zero input)."""
    total = sum(values)
    return 1.0 if total == 0 else max(values) * len(values) / total


def _piece_bytes(shape: Sequence[int], itemsize: int) -> int:
    return math.prod(shape) * itemsize


def _split(index: Index, axis: int, k: int) -> list[Index]:
    if k == 1:
        return [index]
    start, stop = index[axis]
    size = (stop - start) // k
    return [index[:axis] + ((start + i * size, start + (i + 1) * size),) + index[axis + 1 :] for i in range(k)]


def _shard_shape(index: Index) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in index)


def _orbax_axis(shape: tuple[int, ...], replicas: int) -> int | None:
    """The axis orbax's replica-parallel writing splits (first one ``replicas`` divides), else None."""
    if math.prod(shape) == 0:
        return None
    return next((a for a, n in enumerate(shape) if n % replicas == 0), None)


def _jaxdist_split(shape: tuple[int, ...], replicas: int) -> tuple[int, int]:
    """(axis, k): the largest k <= replicas that divides some dimension (k=1, axis 0 for scalars)."""
    for k in range(replicas, 1, -1):
        for a, n in enumerate(shape):
            if n % k == 0:
                return a, k
    return 0, 1


def plan_writes(layouts: Iterable[ArrayLayout], num_processes: int, strategy: str = "balanced") -> WritePlan:
    """The write plan for ``layouts`` over ``num_processes`` processes.

    ``strategy``: ``"balanced"`` (owners, orbax replica-parallel slices, then
    jaxdist's greedy slices; see the module docstring) or ``"replica0"``
    (replica 0 of each shard writes it whole: the naive baseline).
    """
    if strategy not in ("balanced", "replica0"):
        raise ValueError(f"unknown write strategy '{strategy}': use balanced or replica0")
    layouts = list(layouts)
    load = [0] * num_processes
    plans: dict[str, ArrayPlan] = {}
    greedy: list[tuple[ArrayLayout, tuple[int, ...], list[tuple[Index, list[Shard]]]]] = []

    for lay in layouts:
        holders: dict[Index, list[Shard]] = defaultdict(list)
        for s in lay.shards:
            holders[s.index].append(s)
        for v in holders.values():
            v.sort(key=lambda s: s.replica)
        first = next(iter(holders))
        shard_shape = _shard_shape(first)
        replicas = len(holders[first])
        pieces: list[Piece] = []
        one_process = all(len({h.process for h in hs}) == 1 for hs in holders.values())
        if strategy == "replica0" or one_process:
            rule = "owner" if one_process else "replica0"
            for index, hs in holders.items():
                pieces.append(
                    Piece(lay.name, index, hs[0].process, hs[0].device, _piece_bytes(shard_shape, lay.itemsize), rule)
                )
            piece_shape = shard_shape
        elif (axis := _orbax_axis(shard_shape, replicas)) is not None:
            rule = "orbax"
            for index, hs in holders.items():
                for h, part in zip(hs, _split(index, axis, replicas)):
                    pieces.append(
                        Piece(lay.name, part, h.process, h.device, _piece_bytes(_shard_shape(part), lay.itemsize), rule)
                    )
            piece_shape = _shard_shape(_split(first, axis, replicas)[0])
        else:
            axis, k = _jaxdist_split(shard_shape, replicas)
            piece_shape = _shard_shape(_split(first, axis, k)[0])
            greedy.append(
                (lay, piece_shape, [(part, hs) for index, hs in holders.items() for part in _split(index, axis, k)])
            )
            plans[lay.name] = ArrayPlan(lay.name, "jaxdist", piece_shape, ())
            continue
        for p in pieces:
            load[p.process] += p.nbytes
        plans[lay.name] = ArrayPlan(lay.name, rule, piece_shape, tuple(pieces))

    # Greedy LPT over the leftover slices: biggest first, each to the least loaded holder process.
    jobs = [(lay, shape, part, hs) for lay, shape, parts in greedy for part, hs in parts]
    jobs.sort(key=lambda j: (-_piece_bytes(j[1], j[0].itemsize), j[0].name, j[2]))
    extra: dict[str, list[Piece]] = defaultdict(list)
    heaps: dict[int, list[tuple[int, int, int, Shard]]] = {}  # per holder list: (load, process, replica, holder)
    for lay, shape, part, hs in jobs:
        nbytes = _piece_bytes(shape, lay.itemsize)
        h = _least_loaded(heaps, hs, load)
        load[h.process] += nbytes
        extra[lay.name].append(Piece(lay.name, part, h.process, h.device, nbytes, "jaxdist"))
    for name, pieces in extra.items():
        plans[name] = dataclasses.replace(plans[name], pieces=tuple(sorted(pieces, key=lambda p: p.index)))

    return WritePlan(tuple(plans[lay.name] for lay in layouts), num_processes, strategy)


def _least_loaded(heaps: dict[int, list], hs: list[Shard], load: list[int]) -> Shard:
    """``min(hs, key=(load[process], process, replica))``, in O(log P) amortised instead of O(len(hs)).

    The slices of one shard share its holder list, so each list keeps a heap of its processes (each with its
    lowest replica, the one the key picks within a process).  Loads only grow: an entry whose recorded load
    is stale is pushed again with the current one until the top is current.  With replicated state over
    1,024 processes the scan over every holder of every slice made the plan quadratic (49 s for
    mixtral-8x7b, benchmarks/scale.py).
    """
    heap = heaps.get(id(hs))
    if heap is None:
        lowest: dict[int, Shard] = {}
        for s in hs:
            if s.process not in lowest or s.replica < lowest[s.process].replica:
                lowest[s.process] = s
        heap = [(load[s.process], s.process, s.replica, s) for s in lowest.values()]
        heapq.heapify(heap)
        heaps[id(hs)] = heap
    while heap[0][0] != load[heap[0][1]]:
        _, proc, rep, s = heapq.heappop(heap)
        heapq.heappush(heap, (load[proc], proc, rep, s))
    return heap[0][3]


def assign_bytes(sizes: dict[str, int], num_processes: int) -> dict[str, int]:
    """Greedy LPT: each item (e.g. a file to verify) to a process so that bytes per process are even.

    Returns item -> process.  Deterministic: biggest first, ties by name.
    """
    load = [0] * num_processes
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        p = min(range(num_processes), key=lambda i: (load[i], i))
        load[p] += sizes[name]
        out[name] = p
    return out


# --------------------------------------------------------------------------- layouts from specs


def layout_from_spec(
    name: str,
    shape: Sequence[int],
    itemsize: int,
    spec: Sequence,
    axis_names: Sequence[str],
    device_grid: Sequence,
    process_of: dict[int, int],
) -> ArrayLayout:
    """The layout of a NamedSharding-ed array from its PartitionSpec, without devices.

    ``spec``: one entry per dimension, None, an axis name or a tuple of names;
    ``device_grid``: nested lists (mesh shape) of device ids in ``axis_names``
    order; ``process_of``: device id -> process.  Replica ids are numbered in
    the grid's row-major order, as JAX numbers them.
    """

    grid = np.asarray(device_grid, dtype=np.int64)
    mesh_shape = dict(zip(axis_names, grid.shape))
    shape = tuple(int(n) for n in shape)
    spec = list(spec) + [None] * (len(shape) - len(spec))
    seen: dict[Index, int] = defaultdict(int)
    shards = []
    for coord in np.ndindex(*grid.shape):
        at = dict(zip(axis_names, coord))
        index = []
        for dim, entry in zip(shape, spec):
            axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
            parts, pos = 1, 0
            for a in axes:
                pos = pos * mesh_shape[a] + at[a]
                parts *= mesh_shape[a]
            size = dim // parts
            index.append((pos * size, (pos + 1) * size))
        index = tuple(index)
        device = int(grid[coord])
        shards.append(Shard(device, process_of[device], index, seen[index]))
        seen[index] += 1
    return ArrayLayout(name, shape, int(itemsize), tuple(shards))

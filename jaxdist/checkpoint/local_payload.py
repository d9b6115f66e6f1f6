"""The local tier's payload: the distinct pieces of the train state a process's devices hold, in a fixed
order, packed with the step's metadata into one byte array, and unpacked and rebuilt into arrays again.

Shared by the tier (:mod:`jaxdist.checkpoint.local`: same layout) and the restore onto another layout
(:mod:`jaxdist.checkpoint.local_reshard`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import numpy as np

from jaxdist.checkpoint.writer import named_leaves

HEADER = 8  # bytes: length of the JSON metadata that opens a payload

Index = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    index: Index
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def index_of(slices: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    return tuple(s.indices(n)[:2] for s, n in zip(slices, shape))


def held_pieces(tree: Any, process: int | None = None) -> list[Entry]:
    """The distinct pieces ``process``'s (default: this one's) devices hold, in a fixed order."""
    process = jax.process_index() if process is None else process
    out = []
    for name, leaf in named_leaves(tree):
        shape = tuple(leaf.shape)
        idx = {
            index_of(s, shape)
            for d, s in leaf.sharding.devices_indices_map(shape).items()
            if d.process_index == process
        }
        for i in sorted(idx):
            out.append(Entry(name, i, tuple(b - a for a, b in i), np.dtype(leaf.dtype)))
    return out


def signature(tree: Any) -> str:
    """A hash of every array's name, shape, dtype and placement (mesh axes, device ids, spec) and the process count."""
    parts: list[Any] = [jax.process_count()]
    for name, leaf in named_leaves(tree):
        sh = leaf.sharding
        devices = [[d.id, d.process_index] for d in np.ravel(sh.mesh.devices)] if hasattr(sh, "mesh") else []
        parts.append(
            [
                name,
                list(leaf.shape),
                str(np.dtype(leaf.dtype)),
                str(getattr(sh, "spec", sh)),
                list(getattr(getattr(sh, "mesh", None), "axis_names", ())),
                devices,
            ]
        )
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def pack(meta: dict[str, Any], arrays: list[np.ndarray]) -> np.ndarray:
    head = json.dumps(meta).encode()
    head += b" " * (-(len(head) + HEADER) % 16)  # arrays start 16-byte aligned
    parts = [np.frombuffer(len(head).to_bytes(HEADER, "little"), np.uint8), np.frombuffer(head, np.uint8)]
    parts += [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays]
    return np.concatenate(parts)


def unpack(payload: np.ndarray, entries: list[Entry]) -> tuple[dict[str, Any], dict[tuple[str, Index], np.ndarray]]:
    n = int.from_bytes(payload[:HEADER].tobytes(), "little")
    meta = json.loads(payload[HEADER : HEADER + n].tobytes())
    off, arrays = HEADER + n, {}
    for e in entries:
        arrays[(e.name, e.index)] = payload[off : off + e.nbytes].view(e.dtype).reshape(e.shape)
        off += e.nbytes
    if off != payload.size:
        raise ValueError(f"a local checkpoint payload holds {payload.size} bytes where this layout needs {off}")
    return meta, arrays


def build_state(abstract_state: Any, arrays: dict[tuple[str, Index], np.ndarray]) -> Any:
    names = iter(name for name, _ in named_leaves(abstract_state))

    def one(leaf):
        name, shape = next(names), tuple(leaf.shape)
        return jax.make_array_from_callback(shape, leaf.sharding, lambda s: arrays[(name, index_of(s, shape))])

    return jax.tree.map(one, abstract_state)

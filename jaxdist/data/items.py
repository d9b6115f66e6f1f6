"""A random-access dataset as the batch list's source: item ``w`` is window ``w``.

Any object with ``__len__`` and ``__getitem__(int)`` returning a dict of arrays (``datasets.Dataset``, Grain's
``MapDataset``, a list of dicts) trains through the batch list as the built-in token sources do: each epoch
is a seeded permutation of the items, batch ``(source, epoch, index)`` is items ``perm[index*B:(index+1)*B]``,
so the order holds across restarts and resizes, and every item is trained once per epoch.

``collate(items) -> dict of arrays`` with a leading dimension of ``len(items)`` (default: each key's values
stacked) makes a batch's rows.  Every batch must have the first batch's keys, trailing shapes and dtypes: the
step is compiled for them.  A dataset whose length or sampled content changed since the run registered it
is refused on resume (:func:`jaxdist.data.catalog.read_source`), as a changed token file is.

No JAX here: the Trainer makes the global arrays (:func:`jaxdist.data.loader.global_batch_array`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxdist.config import ConfigError

QUICK_SAMPLES = 17  # items hashed at every start (the first, the last and evenly between)


def stack(items: list[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """The default collate: each key's values stacked into one array [len(items), ...]."""
    return {k: np.stack([np.asarray(item[k]) for item in items]) for k in items[0]}


class ItemSource:
    """``dataset`` (``__len__``, ``__getitem__``) and ``collate`` as rows of batches; ``name`` is what the batch
    list records (default: the dataset's type).  ConfigError (one sentence) for a dataset that is empty, not
    random-access, or whose items are not dicts of arrays."""

    def __init__(self, dataset: Any, collate: Callable | None = None, name: str | None = None):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise ConfigError(
                f"data={type(dataset).__name__} is not a random-access dataset: pass one with __len__ and "
                "__getitem__(int) returning a dict of arrays (a datasets.Dataset, a Grain MapDataset, a list)."
            )
        self.dataset, self.collate = dataset, collate or stack
        self.n = len(dataset)
        if self.n == 0:
            raise ConfigError(f"data={type(dataset).__name__} holds no items: give it at least one batch of them.")
        self.name = name or f"python:{type(dataset).__name__}"
        self._quick: str | None = None
        first = self._collated(np.array([0]))
        self.spec = {k: (v.shape[1:], v.dtype) for k, v in first.items()}

    def __len__(self) -> int:
        return self.n

    def _collated(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        items = [self.dataset[int(i)] for i in rows]
        if not all(isinstance(item, Mapping) for item in items):
            bad = next(type(item).__name__ for item in items if not isinstance(item, Mapping))
            raise ConfigError(
                f"data[{int(rows[0])}] is a {bad}, not a dict of arrays: return {{name: array}} from __getitem__ "
                "(or wrap the dataset)."
            )
        try:
            out = self.collate(items)
        except ValueError as e:  # numpy's stack of unequal shapes
            raise ConfigError(
                f"the items {int(rows.min())}..{int(rows.max())} of data cannot be collated ({e}): make every item "
                "the same shape (pad or crop them) or pass a collate function that does."
            ) from None
        return {k: np.asarray(v) for k, v in dict(out).items()}

    def read(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Items ``rows`` collated: {key: array [len(rows), ...]}, checked against the first item's shapes."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out = self._collated(rows)
        one = len(rows) == 1
        which = f"item {int(rows[0])}" if one else f"the items {int(rows.min())}..{int(rows.max())}"
        if set(out) != set(self.spec):
            raise ConfigError(
                f"{which} of data {'has' if one else 'have'} the keys {sorted(out)}, item 0 {sorted(self.spec)}: give every item the "
                "same keys."
            )
        for k, v in out.items():
            shape, dtype = self.spec[k]
            if v.shape != (len(rows), *shape) or v.dtype != dtype:
                raise ConfigError(
                    f"{which} of data {'gives' if one else 'give'} {k!r} as {v.dtype}{list(v.shape[1:])} per row, item 0 as "
                    f"{dtype}{list(shape)}: make every item the same shape and dtype (pad or crop them), since the "
                    "step is compiled for one."
                )
        return out

    def _digest(self, rows) -> str:
        h = hashlib.sha256(f"{self.n}".encode())
        for i in rows:
            for k, v in sorted(self.read(np.array([i])).items()):
                h.update(k.encode())
                h.update(str(v.dtype).encode())
                h.update(np.ascontiguousarray(v).tobytes())
        return h.hexdigest()

    def fingerprint(self) -> str:
        """SHA-256 of the length and every item (reads them all once: when the run registers the dataset)."""
        return self._digest(range(self.n))

    def quick(self) -> str:
        """SHA-256 of the length and :data:`QUICK_SAMPLES` items spread over the dataset (every start), read once
        per ItemSource: every lookup of a resume (jaxdist.data.catalog.given_items) compares it."""
        if self._quick is None:
            self._quick = self._digest(sorted({int(i) for i in np.linspace(0, self.n - 1, QUICK_SAMPLES)}))
        return self._quick

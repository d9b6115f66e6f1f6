"""Read a Hugging Face checkpoint straight into its sharded place on the mesh.

Every parameter is built with ``jax.make_array_from_callback``: each process
reads, for each of its own devices, only the rows and columns of the
Hugging Face tensors that device's shard holds (jaxdist.hf.safetensors_io), one
parameter at a time.  No process holds the full model, no device more than
its shard.  Every tensor's presence and shape is checked against config.json
before anything is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxdist.config import ModelConfig
from jaxdist.errors import ConfigError
from jaxdist.hf.safetensors_io import StoredTensor, open_tensors
from jaxdist.hf.tensors import TensorMap, hf_shape, read_block, tensor_maps


def _at(tree: dict, path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _block_shape(tm: TensorMap, shape: tuple[int, ...]) -> tuple[int, ...]:
    lead = (1 if tm.layers else 0) + (1 if tm.experts else 0)
    return tuple(shape[lead:])


def checked_tensors(hf_dir: str | Path, m: ModelConfig, abstract_params: dict) -> dict[str, StoredTensor]:
    """The checkpoint's tensors, every one jaxdist needs present with the shape config.json implies.

    ConfigError (one sentence) naming the first missing tensor or the first shape that differs.
    """
    tensors = open_tensors(hf_dir)
    for tm in tensor_maps(m):
        want = hf_shape(tm.kind, _block_shape(tm, _at(abstract_params, tm.path).shape))
        for name in tm.names():
            if name not in tensors:
                raise ConfigError(
                    f"tensor {name} is missing from the checkpoint in {hf_dir}: its config.json needs it "
                    "(download the whole checkpoint, or fix config.json)."
                )
            if not tensors[name].is_float:
                raise ConfigError(
                    f"tensor {name} in {hf_dir} holds {tensors[name].dtype} values, not floating point: weights "
                    "must be F32, BF16, F16 or F64; convert the checkpoint's weights to floats."
                )
            if tensors[name].shape != want:
                raise ConfigError(
                    f"tensor {name} has shape {list(tensors[name].shape)} but the checkpoint's config.json implies "
                    f"{list(want)}: the config.json does not belong to these weights."
                )
    return tensors


def _read_part(tm: TensorMap, tensors: dict[str, StoredTensor], ix: tuple[slice, ...], block, dtype) -> np.ndarray:
    """The part ``ix`` of parameter ``tm`` (whole-array index), assembled from its Hugging Face tensors.

    ConfigError (one sentence) naming the tensor when the part read holds a NaN or an infinity.
    """

    def read(name: str, part: tuple[slice, ...]) -> np.ndarray:
        out = read_block(tm.kind, tensors[name], part, block)
        if not np.isfinite(out).all():
            raise ConfigError(
                f"tensor {name} in {tensors[name].path.parent} holds NaN or infinite values: "
                "these weights cannot be used, download or export them again."
            )
        return out.astype(dtype)

    if not tm.layers:
        return read(tm.hf, ix)
    inner = ix[2:] if tm.experts else ix[1:]
    rows = []
    for li in range(ix[0].start, ix[0].stop):
        layer = tm.layers[li]
        if tm.experts:
            rows.append(
                np.stack([read(tm.hf.format(layer=layer, expert=e), inner) for e in range(ix[1].start, ix[1].stop)])
            )
        else:
            rows.append(read(tm.hf.format(layer=layer), inner))
    return np.stack(rows)


def load_params(hf_dir: str | Path, m: ModelConfig, abstract_params: dict) -> dict:
    """jaxdist parameters (a pure dict of global arrays) read from the Hugging Face checkpoint in ``hf_dir``.

    ``abstract_params``: ``jax.ShapeDtypeStruct`` leaves with ``sharding`` set (the Trainer's abstract state's
    ``params``); each array is created with that sharding and dtype.  Call it on every process of a job.
    """
    tensors = checked_tensors(hf_dir, m, abstract_params)
    out: dict = {}
    for tm in tensor_maps(m):
        target = _at(abstract_params, tm.path)
        block = _block_shape(tm, target.shape)
        dtype = np.dtype(target.dtype)
        parts: dict[tuple, np.ndarray] = {}  # replicated shards are read once per process

        def part(index, tm=tm, block=block, dtype=dtype, shape=target.shape, parts=parts):
            ix = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
            key = tuple((s.start, s.stop) for s in ix)
            if key not in parts:
                parts[key] = _read_part(tm, tensors, ix, block, dtype)
            return parts[key]

        node = out
        for p in tm.path[:-1]:
            node = node.setdefault(p, {})
        node[tm.path[-1]] = jax.make_array_from_callback(target.shape, target.sharding, part)
        parts.clear()
    # Every parameter of the model has a Hugging Face tensor (a new parameter needs its TensorMap).
    assert jax.tree.structure(out) == jax.tree.structure(abstract_params), (out.keys(), abstract_params.keys())
    return out

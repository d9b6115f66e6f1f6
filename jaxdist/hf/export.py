"""Write jaxdist parameters as a Hugging Face checkpoint: ``*.safetensors`` shards, their index, ``config.json``.

Every process takes part (each Hugging Face tensor is gathered from the mesh
by one small jitted program), process 0 writes.  Tensors are gathered one at a
time and a shard is written as soon as it is full, so a process's host memory
holds at most one shard (``max_shard_bytes``) plus one tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxdist import optional
from jaxdist.config import ModelConfig
from jaxdist.config.hf import hf_from_model
from jaxdist.errors import ConfigError
from jaxdist.hf.safetensors_io import TORCH_DTYPES, plan_shards, shard_names, write_index
from jaxdist.hf.tensors import hf_shape, tensor_maps, to_hf

# Bytes per safetensors shard by default (transformers' default is 5 GB; smaller shards download in parallel).
DEFAULT_SHARD_BYTES = 2 * 1024**3


def _at(tree: dict, path: tuple[str, ...]):
    for p in path:
        tree = tree[p]
    return tree


def export_params(
    params: dict,
    m: ModelConfig,
    hf_dir: str | Path,
    torch_dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    base_config: dict | None = None,
) -> list[Path]:
    """Write ``params`` (global arrays, any sharding) of model ``m`` to ``hf_dir``; returns the files written.

    ``torch_dtype``: float32, bfloat16 or float16 (default: the parameters' dtype), recorded in config.json
    (``dtype`` and 4.x's ``torch_dtype``).
    ``base_config``: a config.json (the one the model was imported from) whose other keys (token ids,
    generation settings) are kept; the keys jaxdist maps are written from ``m``.  Call on every process.
    """
    torch_dtype = torch_dtype or str(np.dtype(jax.tree.leaves(params)[0].dtype))
    if torch_dtype not in TORCH_DTYPES:
        raise ConfigError(f"export dtype '{torch_dtype}' is not supported: use {', '.join(TORCH_DTYPES)}.")
    dtype = np.dtype(TORCH_DTYPES[torch_dtype])
    # Refuses a model with no Hugging Face form before anything is written; every key jaxdist maps (both config
    # generations' rotary and dtype keys among them) comes from ``m``, so none of the source's can go stale.
    config = {**(base_config or {}), **hf_from_model(m, torch_dtype, base_config)}
    hf_dir = Path(hf_dir)
    save_file = optional.require("safetensors.numpy", "writing a Hugging Face checkpoint").save_file
    main = jax.process_index() == 0
    if main:
        hf_dir.mkdir(parents=True, exist_ok=True)

    # (HF name, jaxdist parameter, kind, index along the stacked axes), in writing order, with their byte sizes.
    jobs, sizes = [], []
    for tm in tensor_maps(m):
        arr = _at(params, tm.path)
        lead = (1 if tm.layers else 0) + (1 if tm.experts else 0)
        nbytes = int(np.prod(arr.shape[lead:])) * dtype.itemsize
        assert hf_shape(tm.kind, arr.shape[lead:])  # every kind known
        for k, name in enumerate(tm.names()):
            at = () if not tm.layers else (k // tm.experts, k % tm.experts) if tm.experts else (k,)
            jobs.append((name, arr, tm.kind, at))
            sizes.append((name, nbytes))
    shards = plan_shards(sizes, max_shard_bytes)
    files = shard_names(len(shards))
    shard_of = {name: i for i, names in enumerate(shards) for name in names}

    sharding = jax.tree.leaves(params)[0].sharding
    rep = NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else sharding
    take = jax.jit(lambda a, at: a[tuple(at)], out_shardings=rep)  # one layer (and expert), whole, everywhere

    written, pending, mapping = [], {}, {}
    for j, (name, arr, kind, at) in enumerate(jobs):
        whole = take(arr, tuple(np.int32(i) for i in at))
        if main:
            pending[name] = to_hf(kind, np.asarray(whole.addressable_data(0))).astype(dtype)
            mapping[name] = files[shard_of[name]]
        del whole
        last = j + 1 == len(jobs) or shard_of[jobs[j + 1][0]] != shard_of[name]
        if main and last:
            path = hf_dir / files[shard_of[name]]
            save_file(pending, str(path), metadata={"format": "pt"})
            written.append(path)
            pending = {}
    if main:
        write_index(hf_dir, mapping, sum(n for _, n in sizes))
        (hf_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        written += [hf_dir / "config.json"]
    return written

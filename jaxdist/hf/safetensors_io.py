"""Reading parts of ``*.safetensors`` files and writing them, with the shard index (no JAX).

A safetensors file is an 8-byte little-endian header length, a JSON header
(``name -> {dtype, shape, data_offsets}``) and the raw tensors.  Reading maps
one tensor (``np.memmap``) and copies out only the rows and columns asked
for; the mapping is dropped when the caller lets go of the tensor, so a
process's resident memory holds what it reads, not the file.  (The
``safetensors`` package's own numpy ``get_slice`` cannot read BF16, the dtype
of most published checkpoints, hence this reader; files are written with
``safetensors.numpy.save_file``.)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxdist.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
}
# Names of the numpy dtypes a checkpoint may be exported in (config.json's torch_dtype).
TORCH_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class StoredTensor:
    """One tensor of a safetensors file: ``shape``, ``dtype`` and ``tensor[rows, cols]`` reads."""

    def __init__(self, path: Path, offset: int, dtype: str, shape: tuple[int, ...]):
        self.path, self.offset, self.shape = path, offset, shape
        if dtype not in DTYPES:
            raise ConfigError(f"tensor dtype {dtype} in {path} is not supported: jaxdist reads {', '.join(DTYPES)}.")
        self.dtype = np.dtype(DTYPES[dtype])
        self.is_float = dtype.startswith(("F", "BF"))  # integer tensors (I64, I32) are never weights

    def __getitem__(self, ix) -> np.ndarray:
        mapped = np.memmap(self.path, self.dtype, "r", offset=self.offset, shape=self.shape)
        return np.array(mapped[ix])  # a copy: the mapping closes when `mapped` goes


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of one safetensors file by name (ConfigError for a file that is not one)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ConfigError(f"{path} named by the shard index does not exist: download the checkpoint again.") from None
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"{path} is not a readable safetensors file ({e}): download it again.") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a readable safetensors file (its header is not a table): download it again.")
    start, size = 8 + n, path.stat().st_size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            shape = tuple(int(x) for x in info["shape"])
            dtype = info["dtype"]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(
                f"tensor {name} in {path} has a malformed header entry ({e!r}): download the file again."
            ) from None
        tensor = StoredTensor(path, start + begin, dtype, shape)
        want = int(np.prod(shape, dtype=np.int64)) * tensor.dtype.itemsize
        if begin < 0 or end - begin != want:
            raise ConfigError(
                f"tensor {name} in {path} has {end - begin} bytes of data but its shape {list(shape)} of {dtype} "
                f"needs {want}: the file is damaged, download it again."
            )
        if start + end > size:
            raise ConfigError(
                f"{path} is truncated ({size} bytes, tensor {name} ends at byte {start + end}): download it again."
            )
        out[name] = tensor
    return out


def weight_map(hf_dir: Path) -> dict[str, str]:
    """Tensor name -> file name from ``model.safetensors.index.json`` (or a lone ``model.safetensors``)."""
    index = hf_dir / INDEX
    if not index.exists() and (hf_dir / SINGLE).exists():
        return {name: SINGLE for name in read_header(hf_dir / SINGLE)}
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
        mapping = data["weight_map"]
        if not isinstance(mapping, dict):
            raise ValueError("weight_map is not an object")
    except FileNotFoundError:
        raise ConfigError(
            f"{index} does not exist (nor {SINGLE}): point to a directory with the model's safetensors files."
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{index} is not a readable shard index ({e!r}): download it again.") from None
    out = {str(k): str(v) for k, v in mapping.items()}
    for name, f in out.items():
        if Path(f).is_absolute() or ".." in Path(f).parts:
            raise ConfigError(
                f"{index} maps tensor {name} to '{f}', outside the model directory: the index must name files "
                "beside it; download it again."
            )
    return out


def open_tensors(hf_dir: str | Path) -> dict[str, StoredTensor]:
    """Every tensor of a Hugging Face checkpoint by name, headers read once per file (no data read)."""
    hf_dir = Path(hf_dir)
    mapping = weight_map(hf_dir)
    headers = {f: read_header(hf_dir / f) for f in sorted(set(mapping.values()))}
    out = {}
    for name, f in mapping.items():
        if name not in headers[f]:
            raise ConfigError(f"tensor {name} is not in {hf_dir / f} although the shard index says so.")
        out[name] = headers[f][name]
    return out


def shard_names(count: int) -> list[str]:
    """File names of ``count`` safetensors shards, as ``transformers`` writes them."""
    if count == 1:
        return [SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into consecutive shards of at most ``max_bytes`` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def write_index(hf_dir: Path, mapping: dict[str, str], total_bytes: int, metadata: dict[str, Any] | None = None):
    """``model.safetensors.index.json`` for the files written (skipped for a single file, as transformers does)."""
    if set(mapping.values()) == {SINGLE}:
        return
    data = {"metadata": {"total_size": total_bytes, **(metadata or {})}, "weight_map": dict(sorted(mapping.items()))}
    (hf_dir / INDEX).write_text(json.dumps(data, indent=2) + "\n")

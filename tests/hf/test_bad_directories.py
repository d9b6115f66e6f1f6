"""Malformed Hugging Face directories: one sentence, exit code 2, and nothing written where the output would go.

Each row damages a good two-shard Llama directory (``tests.hf.reference``)
one way and runs ``jaxdist convert`` in this process; the command must
return 2, say a phrase naming the problem on one line of stderr, and leave
the output path absent.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxdist.cli import main
from tests.hf.reference import LLAMA, hf_tensors, write_checkpoint

ARGS = ["model.max_seq_len=64", "train.seq_len=32", "mesh.cluster=cpu-8", "data.max_bytes=20000"]
SHARD = "model-00001-of-00002.safetensors"


def _config(**changes):
    def damage(d: Path) -> None:
        c = json.loads((d / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                del c[k]
            else:
                c[k] = v
        (d / "config.json").write_text(json.dumps(c))

    return damage


def _truncate(d: Path) -> None:
    p = d / SHARD
    p.write_bytes(p.read_bytes()[:-100])


def _tensor(name: str, value: np.ndarray):
    """Rewrite the shard holding ``name`` with ``name`` replaced by ``value``."""

    def damage(d: Path) -> None:
        f = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
        tensors = hf_tensors(LLAMA)
        held = {n: tensors[n] for n, g in _weight_map(d).items() if g == f}
        held[name] = value
        save_file(held, str(d / f), metadata={"format": "pt"})

    return damage


def _weight_map(d: Path) -> dict[str, str]:
    return json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]


def _nan(d: Path) -> None:
    w = hf_tensors(LLAMA)["model.layers.1.mlp.up_proj.weight"].copy()
    w[3, 5] = np.nan
    _tensor("model.layers.1.mlp.up_proj.weight", w)(d)


def _integers(d: Path) -> None:
    w = hf_tensors(LLAMA)["model.layers.0.self_attn.q_proj.weight"]
    _tensor("model.layers.0.self_attn.q_proj.weight", (w * 100).astype(np.int32))(d)


def _short_offsets(d: Path) -> None:
    """Shrink the first tensor's data_offsets end by 4 bytes (header length kept, padded with spaces)."""
    p = d / SHARD
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] -= 4
    text = json.dumps(header, separators=(",", ":")).encode()
    p.write_bytes(raw[:8] + text.ljust(n) + raw[8 + n :])


def _outside_index(d: Path) -> None:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../../" + SHARD
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


LLAMA3_NO_FACTORS = {"rope_type": "llama3", "factor": 8.0}

# (case, damage, phrase of the message); every row: exit code 2, nothing written.
ROWS = [
    ("no hidden_size", _config(hidden_size=None), "has no 'hidden_size'"),
    ("zero heads", _config(num_attention_heads=0), "'num_attention_heads' in config.json is 0"),
    ("string vocab_size", _config(vocab_size="272"), "'vocab_size' in config.json is '272', not a whole number"),
    ("rope_scaling a string", _config(rope_scaling="llama3"), "'rope_scaling' in config.json is 'llama3', not a table"),
    ("llama3 rope without its factors", _config(rope_scaling=LLAMA3_NO_FACTORS), "low_freq_factor"),
    ("truncated shard", _truncate, "is truncated"),
    (
        "integer weights",
        _integers,
        (
            "tensor model.layers.0.self_attn.q_proj.weight in ",
            " holds int32 values, not floating point: weights must be F32, BF16, F16 or F64; convert the "
            "checkpoint's weights to floats.",
        ),
    ),
    (
        "NaN weights",
        _nan,
        (
            "tensor model.layers.1.mlp.up_proj.weight in ",
            " holds NaN or infinite values: these weights cannot be used, download or export them again.",
        ),
    ),
    ("offsets shorter than shape x dtype", _short_offsets, "bytes of data but its shape"),
    ("index pointing outside", _outside_index, "outside the model directory"),
]


@pytest.mark.parametrize("case,damage,phrase", ROWS, ids=[r[0] for r in ROWS])
def test_bad_directory_one_sentence_exit_2_nothing_written(tmp_path, capsys, case, damage, phrase):
    hf_dir = write_checkpoint(tmp_path / "m", LLAMA, hf_tensors(LLAMA))
    damage(hf_dir)
    out = tmp_path / "run"
    assert main(["convert", "hf-to-jaxdist", str(hf_dir), str(out), *ARGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and all(p in err[-1] for p in (phrase if isinstance(phrase, tuple) else (phrase,))), (
        case,
        err,
    )
    assert err[-1].startswith("jaxdist: ") and err[-1].endswith("."), err[-1]
    assert not out.exists(), sorted(p.name for p in out.iterdir())


def test_export_override_without_equals_writes_nothing(tmp_path, capsys):
    hf_dir = write_checkpoint(tmp_path / "m", LLAMA, hf_tensors(LLAMA))
    run = tmp_path / "run"
    assert main(["convert", "hf-to-jaxdist", str(hf_dir), str(run), *ARGS]) == 0
    out = tmp_path / "exported"
    assert main(["convert", "jaxdist-to-hf", str(run), str(out), "mesh.tensor"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "jaxdist: override 'mesh.tensor' is not KEY=VALUE: write it like train.steps=200."
    assert not out.exists()

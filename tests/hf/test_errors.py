"""Bad Hugging Face checkpoints get one sentence (ConfigError; exit code 2 from the CLI) that names the problem."""

from __future__ import annotations

import json

import jax
import pytest

from jaxdist.cli import main
from jaxdist.errors import ConfigError
from jaxdist.hf.load import load_params
from tests.hf.helpers import config_for, sharded_abstract
from tests.hf.reference import LLAMA, MIXTRAL, hf_tensors, write_checkpoint


def _load(hf_dir, *overrides):
    cfg = config_for(hf_dir, *overrides)
    _, _, abstract = sharded_abstract(cfg, jax.devices()[:1])
    return load_params(hf_dir, cfg.model, abstract)


def _one_sentence(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and text.endswith(".")
    return text


def test_missing_tensor_is_named(tmp_path):
    tensors = hf_tensors(MIXTRAL)
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    hf_dir = write_checkpoint(tmp_path / "m", MIXTRAL, tensors)
    with pytest.raises(ConfigError) as e:
        _load(hf_dir)
    assert _one_sentence(e) == (
        f"tensor model.layers.1.block_sparse_moe.experts.3.w2.weight is missing from the checkpoint in {hf_dir}: its "
        "config.json needs it (download the whole checkpoint, or fix config.json)."
    )


def test_shape_that_does_not_match_config_json(tmp_path):
    hf_dir = write_checkpoint(tmp_path / "m", dict(LLAMA, intermediate_size=80), hf_tensors(LLAMA))
    with pytest.raises(ConfigError) as e:
        _load(hf_dir)
    text = _one_sentence(e)
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape [96, 64]" in text and "[80, 64]" in text


def test_unsupported_architecture_names_the_supported(tmp_path):
    hf_dir = write_checkpoint(tmp_path / "m", dict(LLAMA, architectures=["GPT2LMHeadModel"]), hf_tensors(LLAMA))
    with pytest.raises(ConfigError) as e:
        config_for(hf_dir)
    text = _one_sentence(e)
    assert "GPT2LMHeadModel" in text and "LlamaForCausalLM" in text and "MixtralForCausalLM" in text


@pytest.mark.parametrize("damage", ["missing", "garbage", "no_weight_map"])
def test_missing_or_unreadable_index(tmp_path, damage):
    hf_dir = write_checkpoint(tmp_path / "m", LLAMA, hf_tensors(LLAMA))
    index = hf_dir / "model.safetensors.index.json"
    if damage == "missing":
        index.unlink()
    else:
        index.write_text("{not json" if damage == "garbage" else json.dumps({"metadata": {}}))
    with pytest.raises(ConfigError) as e:
        _load(hf_dir)
    assert "model.safetensors.index.json" in _one_sentence(e)


def test_rope_type_sliding_window_and_conflicting_shape(tmp_path):
    yarn = dict(LLAMA, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ConfigError) as e:
        config_for(write_checkpoint(tmp_path / "y", yarn, {}, shards=1))
    assert "rope_scaling type 'yarn'" in _one_sentence(e)
    windowed = dict(MIXTRAL, sliding_window=32)
    hf_dir = write_checkpoint(tmp_path / "w", windowed, {}, shards=1)
    with pytest.raises(ConfigError) as e:
        config_for(hf_dir)  # model.max_seq_len=64 > 32
    assert "sliding_window=32" in _one_sentence(e)
    assert config_for(hf_dir, "model.max_seq_len=32").model.moe.experts == 4  # a window that does not matter
    with pytest.raises(ConfigError) as e:
        config_for(hf_dir, "model.max_seq_len=32", "model.d_model=48")
    assert "model.d_model=48 conflicts with d_model=32" in _one_sentence(e)


def test_cli_exit_code_2(tmp_path, capsys):
    tensors = hf_tensors(LLAMA)
    del tensors["lm_head.weight"]
    hf_dir = write_checkpoint(tmp_path / "m", LLAMA, tensors)
    args = ["model.max_seq_len=64", "train.seq_len=32", "mesh.cluster=cpu-8", "data.max_bytes=100000"]
    assert main(["convert", "hf-to-jaxdist", str(hf_dir), str(tmp_path / "run"), *args]) == 2
    assert "tensor lm_head.weight is missing" in capsys.readouterr().err

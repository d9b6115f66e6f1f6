"""Reading ``config.json`` of both transformers generations, refusing what jaxdist does not compute, writing it back.

The configs are the ones transformers 5.24 writes (``save_pretrained``) and
their 4.x spellings; no torch needed.  The conformance tests
(tests/hf/conformance/) check the same readings against transformers' logits.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxdist.cli import main
from jaxdist.config import ModelConfig
from jaxdist.config.hf import hf_architecture, hf_from_model, model_fields, model_from_hf, rope_fields
from jaxdist.errors import ConfigError

LLAMA_5X = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "dtype": "bfloat16",
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 2048,
    "mlp_bias": False,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 500000.0,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "vocab_size": 512,
}
LLAMA_4X = {
    **{k: v for k, v in LLAMA_5X.items() if k not in ("rope_parameters", "dtype")},
    "rope_theta": 500000.0,
    "rope_scaling": {k: v for k, v in LLAMA_5X["rope_parameters"].items() if k != "rope_theta"},
    "torch_dtype": "bfloat16",
}
QWEN3_MOE_5X = {
    **{k: v for k, v in LLAMA_5X.items() if k not in ("mlp_bias",)},
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "norm_topk_prob": False,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,  # the name transformers 5 writes for num_experts
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "sliding_window": None,
    "use_sliding_window": False,
}
QWEN2_5X = {
    **{k: v for k, v in LLAMA_5X.items() if k not in ("mlp_bias", "attention_bias")},
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "layer_types": ["full_attention", "full_attention"],
    "max_window_layers": 28,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "sliding_window": None,
    "use_sliding_window": False,
}


def _refused(hf: dict) -> str:
    with pytest.raises(ConfigError) as e:
        model_from_hf(hf, ModelConfig())
    text = str(e.value)
    assert "\n" not in text and text.endswith(".")
    return text


def test_both_generations_read_the_same_model():
    fields = model_fields(LLAMA_5X)
    assert fields == model_fields(LLAMA_4X)
    assert fields["rope_theta"] == 500000.0 and fields["rope_scaling"] == "llama3"
    assert (fields["rope_factor"], fields["rope_original_max_len"]) == (8.0, 256)
    linear = dict(LLAMA_5X, rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0})
    old = dict(LLAMA_4X, rope_theta=1e6, rope_scaling={"type": "linear", "factor": 4.0})
    assert model_fields(linear) == model_fields(old)
    assert rope_fields(linear) == {"rope_theta": 1e6, "rope_scaling": "linear", "rope_factor": 4.0}
    default_4x = dict(LLAMA_4X, rope_theta=1e6, rope_scaling=None)
    default_5x = dict(LLAMA_5X, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert rope_fields(default_4x) == rope_fields(default_5x) == {"rope_theta": 1e6, "rope_scaling": "none"}


def test_precedence_as_transformers_5():
    """rope_scaling wins over rope_parameters; a theta inside the table over the top-level one; llama3's
    original length defaults to max_position_embeddings."""
    both = dict(LLAMA_5X, rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=1234.0)
    assert rope_fields(both) == {"rope_theta": 1234.0, "rope_scaling": "linear", "rope_factor": 2.0}
    inner = dict(LLAMA_4X, rope_scaling={"rope_type": "linear", "factor": 2.0, "rope_theta": 99.0})
    assert rope_fields(inner)["rope_theta"] == 99.0
    table = {k: v for k, v in LLAMA_5X["rope_parameters"].items() if k != "original_max_position_embeddings"}
    assert rope_fields(dict(LLAMA_5X, rope_parameters=table))["rope_original_max_len"] == 2048


def test_qwen3_moe_fields():
    f = model_fields(QWEN3_MOE_5X)
    assert f["qk_norm"] and not f["qkv_bias"]
    assert (f["moe.experts"], f["moe.top_k"], f["moe.d_ff"], f["moe.every"]) == (8, 2, 32, 1)
    assert f["moe.renormalize"] is False and f["moe.router"] == "softmax" and f["d_ff"] == 128
    step2 = model_fields(dict(QWEN3_MOE_5X, decoder_sparse_step=2, norm_topk_prob=True, num_experts=8))
    assert step2["moe.every"] == 2 and step2["moe.renormalize"] is True


@pytest.mark.parametrize(
    "change,named",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters type 'yarn'"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8]}}, "'mrope_section'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "beta_fast": 32}}, "beta_fast"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "per layer type"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "lacks 'low_freq_factor'"),
        ({"partial_rotary_factor": 0.25}, "partial_rotary_factor=0.25"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_llama_keys_that_change_the_math_are_refused(change, named):
    assert named in _refused({**LLAMA_5X, **change})


@pytest.mark.parametrize(
    "base,change,named",
    [
        (QWEN3_MOE_5X, {"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
        (QWEN3_MOE_5X, {"decoder_sparse_step": 3}, "decoder_sparse_step=3"),
        (QWEN3_MOE_5X, {"attention_bias": True}, "attention_bias=true"),
        (QWEN3_MOE_5X, {"use_sliding_window": True, "sliding_window": 512}, "sliding_window=512"),
        (QWEN2_5X, {"layer_types": ["full_attention", "chunked_attention"]}, "'chunked_attention'"),
        (
            QWEN2_5X,
            {"use_sliding_window": True, "sliding_window": 512, "layer_types": ["full_attention", "sliding_attention"]},
            "sliding_window=512",
        ),
    ],
)
def test_qwen_keys_that_change_the_math_are_refused(base, change, named):
    assert named in _refused({**base, **change})


def test_sliding_window_only_where_a_layer_slides():
    """Qwen2's window is used only by layers marked sliding (5.x layer_types, 4.x max_window_layers)."""
    on = {"use_sliding_window": True, "sliding_window": 512}
    assert model_from_hf({**QWEN2_5X, **on}, ModelConfig()).max_seq_len == 2048  # every layer full_attention
    old = {k: v for k, v in QWEN2_5X.items() if k != "layer_types"}
    assert model_from_hf({**old, **on, "max_window_layers": 2}, ModelConfig()).qkv_bias  # no layer from 2 on
    assert "sliding_window=512" in _refused({**old, **on, "max_window_layers": 1})
    assert model_from_hf({**QWEN2_5X, "sliding_window": 512}, ModelConfig()).qkv_bias  # use_sliding_window false
    mistral = dict(LLAMA_5X, architectures=["MistralForCausalLM"], sliding_window=4096)
    assert model_from_hf(mistral, ModelConfig()).max_seq_len == 2048  # a window longer than the sequences


def test_unknown_rope_type_exits_2_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(dict(LLAMA_5X, rope_parameters={"rope_type": "su", "rope_theta": 1.0})))
    run = tmp_path / "run"
    assert main(["convert", "hf-to-jaxdist", str(src), str(run), "mesh.cluster=cpu-8"]) == 2
    err = capsys.readouterr().err
    assert "rope_parameters type 'su' in config.json is not supported" in err
    assert not run.exists()


def test_export_config_has_no_stale_rotary_keys():
    """Imported, then given another theta: both generations' keys carry the new one, read back the same."""
    m = model_from_hf(LLAMA_5X, ModelConfig())
    m = dataclasses.replace(m, rope_theta=1e6)
    written = {**LLAMA_5X, **hf_from_model(m, "float32", base=LLAMA_5X)}
    assert written["rope_parameters"]["rope_theta"] == written["rope_theta"] == 1e6
    assert written["dtype"] == written["torch_dtype"] == "float32"
    back = model_fields(written)
    assert back["rope_theta"] == 1e6 and back["rope_scaling"] == "llama3"
    assert rope_fields({**written, "rope_scaling": None}) == rope_fields({**written, "rope_parameters": None})
    old = {**LLAMA_4X, **hf_from_model(model_from_hf(LLAMA_4X, ModelConfig()), "bfloat16", base=LLAMA_4X)}
    assert old["rope_scaling"] == LLAMA_4X["rope_scaling"] and model_fields(old) == model_fields(LLAMA_4X)


def test_architecture_of_a_model():
    m = model_from_hf(QWEN3_MOE_5X, ModelConfig())
    assert hf_architecture(m) == "Qwen3MoeForCausalLM"
    assert hf_architecture(dataclasses.replace(m, moe=dataclasses.replace(m.moe, experts=0))) == "Qwen3ForCausalLM"
    plain = dataclasses.replace(m, qk_norm=False)
    with pytest.raises(ConfigError, match="written as Mixtral"):
        hf_architecture(plain)  # renormalize=false: Mixtral cannot say that
    with pytest.raises(ConfigError, match="qk_norm and model.qkv_bias"):
        hf_architecture(dataclasses.replace(m, qkv_bias=True))
    written = hf_from_model(m)
    assert (written["num_experts"], written["moe_intermediate_size"], written["norm_topk_prob"]) == (8, 32, False)
    assert model_fields(written) == {**model_fields(QWEN3_MOE_5X), "max_seq_len": m.max_seq_len}

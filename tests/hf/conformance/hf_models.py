"""Tiny random models built and saved by ``transformers`` itself, and jaxdist's import of them (shared, cached).

Each case is a model directory written by ``save_pretrained`` (float32 or
bfloat16 safetensors, one file or several shards) whose ``config.json`` is
the 5.x one ``transformers`` writes or a 4.x-style rewrite of it (top-level
``rope_theta`` / ``rope_scaling`` / ``torch_dtype``, no ``rope_parameters``,
``dtype`` or ``layer_types``).  The reference logits are those of
``AutoModelForCausalLM.from_pretrained(dir, dtype=float32)``: what
``transformers`` computes for that very directory.  Every weight is redrawn
(norm scales around 1, routers random) so that a weight mapped to the wrong
place changes the logits.  Built once per test session (``functools.cache``);
this module imports torch: test modules import it after ``pytest.importorskip``.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import jax
import numpy as np
import torch
import transformers

from jaxdist.config import load_config
from jaxdist.hf.load import load_params
from tests.hf.helpers import logits, sharded_abstract

VOCAB = 512
SEQ = 1024  # tokens per row of the logits comparison (short prompts miss rotary bugs)
ROWS = 4  # rows: a multiple of every mesh's token shards
REL_TOL = 1e-4
# Every case shares these shapes: 2 layers of width 64, 4 query heads and 2 key/value heads of 16 features.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    bos_token_id=None,
    eos_token_id=None,  # generate() then runs its whole length, as the Sampler does without EOS
    pad_token_id=None,
)
MESHES = {
    "one": [],
    "fsdp4_tensor2": ["mesh.fsdp=4", "mesh.tensor=2"],
    "expert4_tensor2": ["mesh.expert=4", "mesh.tensor=2"],
}


@dataclass(frozen=True)
class Case:
    """One saved model: its config class and arguments, the config.json generation, file dtype and sharding."""

    config: str
    args: dict = field(default_factory=dict)
    generation: str = "5.x"  # or "4.x": config.json rewritten with the 4.x keys
    dtype: str = "float32"  # of the safetensors files
    shards: bool = False  # several files and an index (max_shard_size) or one model.safetensors


LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,  # shorter than SEQ: the scaling matters
}
CASES = {
    "llama-tied": Case("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama-llama3": Case("LlamaConfig", dict(rope_parameters=LLAMA3), "4.x", shards=True),
    "llama-linear": Case(
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
        "5.x",
        "bfloat16",
        True,
    ),
    "mistral": Case(
        "MistralConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "4.x", "bfloat16"
    ),
    "qwen2": Case(
        "Qwen2Config",
        dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        shards=True,
    ),
    "qwen3": Case(
        "Qwen3Config", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "4.x", "bfloat16", True
    ),
    "mixtral": Case(
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        shards=True,
    ),
    "qwen3-moe": Case(
        "Qwen3MoeConfig",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False),
        "4.x",
        shards=True,
    ),
    "qwen3-moe-step2": Case(
        "Qwen3MoeConfig",
        dict(
            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2
        ),
        "5.x",
        "bfloat16",
    ),
    # Every third block sparse (layer 2 of 3): decoder_sparse_step=3 is model.moe.every=3.
    "qwen3-moe-step3": Case(
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=3
        ),
    ),
}

_ROOT = Path(tempfile.mkdtemp(prefix="jaxdist-hf-conformance-"))
atexit.register(shutil.rmtree, _ROOT, True)


def to_4x(config: dict) -> dict:
    """A transformers 5.x config.json rewritten as 4.x wrote it: top-level rope_theta, rope_scaling, torch_dtype."""
    out = {k: v for k, v in config.items() if k not in ("rope_parameters", "dtype", "layer_types")}
    rope = dict(config["rope_parameters"])
    out["rope_theta"] = rope.pop("rope_theta")
    out["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    out["torch_dtype"] = config["dtype"]
    return out


@functools.cache
def hf_dir(name: str) -> Path:
    """The directory of case ``name``, saved by transformers (built once)."""
    case = CASES[name]
    torch.manual_seed(sorted(CASES).index(name))
    config = getattr(transformers, case.config)(**{**SHAPE, **case.args})  # a case may change a shared shape
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.08 * torch.randn_like(p))
    out = _ROOT / name
    model.to(getattr(torch, case.dtype)).save_pretrained(out, max_shard_size="100KB" if case.shards else "1GB")
    assert (out / "model.safetensors.index.json").exists() == case.shards
    if case.generation == "4.x":
        path = out / "config.json"
        path.write_text(json.dumps(to_4x(json.loads(path.read_text())), indent=2))
    return out


@functools.cache
def tokens() -> np.ndarray:
    """[ROWS, SEQ] random token ids (int64)."""
    return np.random.default_rng(0).integers(0, VOCAB, size=(ROWS, SEQ))


@functools.cache
def reference_model(name: str):
    """transformers' own model read from the case's directory, float32, eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(hf_dir(name), dtype=torch.float32).eval()


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    """Logits [B, T, V] float32 of a transformers model for ids [B, T]."""
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


@functools.cache
def reference_logits(name: str) -> np.ndarray:
    """transformers' logits for :func:`tokens` of case ``name``."""
    return torch_logits(reference_model(name), tokens())


def config(name: str, mesh: str, *extra: str):
    """The config a user gets with model.init_from = the case's directory, on ``mesh``."""
    return load_config(
        None, [f"model.init_from={hf_dir(name)}", f"train.seq_len={SEQ}", "mesh.cluster=cpu-8", *MESHES[mesh], *extra]
    )


@functools.cache
def imported(name: str, mesh: str):
    """(config, parallelism, graphdef, params): case ``name`` imported onto ``mesh`` (jaxdist.hf.load)."""
    cfg = config(name, mesh)
    devices = jax.devices()[:1] if mesh == "one" else jax.devices()
    par, graphdef, abstract = sharded_abstract(cfg, devices)
    return cfg, par, graphdef, load_params(hf_dir(name), cfg.model, abstract)


def jaxdist_logits(name: str, mesh: str) -> np.ndarray:
    """jaxdist's logits for :func:`tokens` of case ``name`` imported onto ``mesh``."""
    _, par, graphdef, params = imported(name, mesh)
    return logits(par, graphdef, params, tokens())


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|."""
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))

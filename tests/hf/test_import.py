"""Importing Hugging Face checkpoints: jaxdist's logits equal a NumPy forward pass of the format's definition.

Llama (GQA, llama3 rope scaling, untied head), Qwen2 (q/k/v biases, linear rope
scaling, tied embeddings) and Mixtral (4 experts, top-2) checkpoints written
by tests/hf/reference.py as two safetensors shards with an index; the logits
of jaxdist on one device and on fsdp=4 x tensor=2 match the float64 NumPy
reference to 1e-4 relative (float32 compute).  Each parameter shard is also
checked to hold only its own slice.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdist.hf.load import load_params
from jaxdist.models.arithmetic import param_count
from tests.hf.helpers import config_for, logits, sharded_abstract
from tests.hf.reference import LLAMA, MIXTRAL, QWEN2, forward, hf_tensors, write_checkpoint
from tests.trees import leaf_pairs

REL_TOL = 1e-4
CASES = {"llama": LLAMA, "qwen2": QWEN2, "mixtral": MIXTRAL}


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(1).integers(0, vocab, size=(8, 24))


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("mesh", ["one", "fsdp4_tensor2"])
@pytest.mark.parametrize("arch", list(CASES))
def test_logits_match_reference(tmp_path, arch, mesh):
    c = CASES[arch]
    tensors = hf_tensors(c, seed=3)
    hf_dir = write_checkpoint(tmp_path / arch, c, tensors)
    if mesh == "one":
        cfg, devices = config_for(hf_dir), jax.devices()[:1]
    else:
        cfg, devices = config_for(hf_dir, "mesh.fsdp=4", "mesh.tensor=2"), jax.devices()
    par, graphdef, abstract = sharded_abstract(cfg, devices)
    params = load_params(hf_dir, cfg.model, abstract)
    tokens = _tokens(c["vocab_size"])
    got = logits(par, graphdef, params, tokens)
    want = forward(c, tensors, tokens)
    assert _rel_err(got, want) < REL_TOL
    assert param_count(cfg.model) == sum(t.size for t in tensors.values())  # the biases counted too
    for leaf, target in leaf_pairs(params, abstract):
        assert leaf.sharding == target.sharding
        for shard in leaf.addressable_shards:  # each device holds exactly its slice, nothing more
            assert shard.data.shape == target.sharding.shard_shape(target.shape)


def test_llama3_scaling_matters(tmp_path):
    """The reference with unscaled frequencies differs: the test above would catch a missing rope scaling."""
    c = dict(LLAMA, rope_scaling=None)
    tensors = hf_tensors(LLAMA, seed=3)
    tokens = _tokens(LLAMA["vocab_size"])
    assert _rel_err(forward(c, tensors, tokens), forward(LLAMA, tensors, tokens)) > 100 * REL_TOL

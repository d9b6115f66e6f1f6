"""Greedy decoding with jaxdist's Sampler (key/value cache, temperature 0) equals ``transformers``' ``generate()``.

Models saved by ``transformers`` (tests/hf/conformance/hf_models.py), imported
with ``model.init_from``; 32 new tokens after two 24-token prompts, token for
token, on one device and on the meshes.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the transformers conformance tests are skipped")
pytest.importorskip("transformers", reason="transformers is not installed: the conformance tests are skipped")

from jaxdist.sample.sampler import Sampler  # noqa: E402
from tests.hf.conformance.hf_models import VOCAB, imported, reference_model  # noqa: E402

NEW = 32
RUNS = [
    ("llama-llama3", "one"),
    ("qwen3", "fsdp4_tensor2"),
    ("qwen3-moe-step2", "expert4_tensor2"),
]


class IdsOnly:
    """A tokenizer of the models' whole vocabulary that is never asked for text: the test feeds ids."""

    vocab_size, pad_id, eos_id, bos_id, add_bos = VOCAB, 0, None, None, False


@pytest.mark.parametrize("name,mesh", RUNS, ids=[f"{n}-{m}" for n, m in RUNS])
def test_greedy_tokens_equal_generate(name, mesh):
    prompts = np.random.default_rng(7).integers(0, VOCAB, size=(2, 24))
    with torch.no_grad():
        out = reference_model(name).generate(
            torch.as_tensor(prompts),
            attention_mask=torch.ones(prompts.shape, dtype=torch.long),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
        )
    want = out[:, prompts.shape[1] :].numpy()
    cfg, par, _, params = imported(name, mesh)
    got = Sampler(cfg, params, par, tokenizer=IdsOnly()).decode(list(prompts), NEW, temperature=0.0, stop_at_eos=False)
    assert want.shape == (2, NEW)
    np.testing.assert_array_equal(np.stack(got.tokens), want)
    assert len(set(want[0].tolist())) > 1  # not one token repeated: the comparison can tell models apart

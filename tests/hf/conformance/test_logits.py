"""jaxdist's logits of models saved by ``transformers`` equal ``transformers``' own, on one device and on meshes.

Every architecture and both config.json generations on one device; each
architecture again on ``fsdp=4 x tensor=2`` (the 4.x and the 5.x files among
them), the MoE ones also on ``expert=4 x tensor=2``.  Rows of 1,024 tokens,
float32, max relative error (max abs error / max abs logit) at most 1e-4.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed: the transformers conformance tests are skipped")
pytest.importorskip("transformers", reason="transformers is not installed: the conformance tests are skipped")

from jaxdist.models.arithmetic import param_count  # noqa: E402
from tests.hf.conformance.hf_models import (  # noqa: E402
    CASES,
    REL_TOL,
    imported,
    jaxdist_logits,
    reference_logits,
    reference_model,
    rel_err,
)

RUNS = [(name, "one") for name in CASES] + [
    ("llama-llama3", "fsdp4_tensor2"),
    ("qwen2", "fsdp4_tensor2"),
    ("qwen3", "fsdp4_tensor2"),
    ("mixtral", "fsdp4_tensor2"),
    ("qwen3-moe", "fsdp4_tensor2"),
    ("mixtral", "expert4_tensor2"),
    ("qwen3-moe-step2", "expert4_tensor2"),
]


@pytest.mark.parametrize("name,mesh", RUNS, ids=[f"{n}-{m}" for n, m in RUNS])
def test_logits_equal_transformers(name, mesh):
    err = rel_err(jaxdist_logits(name, mesh), reference_logits(name))
    print(f"\nREL_ERR {name} {CASES[name].generation} {CASES[name].dtype} {mesh} {err:.2e}")
    assert err <= REL_TOL
    hf_params = sum(p.numel() for p in reference_model(name).parameters())  # a tied head counted once
    assert param_count(imported(name, mesh)[0].model) == hf_params

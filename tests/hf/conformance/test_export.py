"""Models imported from ``transformers`` and written back by jaxdist load into ``AutoModelForCausalLM`` unchanged.

The exported directory's logits (``transformers`` reading jaxdist's
``config.json`` and shards) equal those of the source directory, for 4.x and
5.x sources; one case goes the user's way, ``jaxdist convert hf-to-jaxdist``
then ``jaxdist convert jaxdist-to-hf``.  The written ``config.json`` carries
both generations' rotary keys, consistent with each other.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch", reason="torch is not installed: the transformers conformance tests are skipped")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: the conformance tests are skipped"
)

from jaxdist.cli import main  # noqa: E402
from jaxdist.config.hf import model_fields, read_hf_config  # noqa: E402
from jaxdist.hf.export import export_params  # noqa: E402
from tests.hf.conformance.hf_models import (  # noqa: E402
    REL_TOL,
    hf_dir,
    imported,
    reference_logits,
    rel_err,
    tokens,
    torch_logits,
)


def _same_as_source(name, out):
    """The exported directory read by transformers gives the source's logits, its config.json the same model."""
    back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="float32")
    err = rel_err(torch_logits(back.eval(), tokens()), reference_logits(name))
    print(f"\nEXPORT_REL_ERR {name} {err:.2e}")
    assert err <= REL_TOL
    written, source = read_hf_config(out), read_hf_config(hf_dir(name))
    assert model_fields(written) == model_fields(source)
    rope = dict(written["rope_parameters"])
    assert rope.pop("rope_theta") == written["rope_theta"]  # 5.x and 4.x keys say the same
    assert (written["rope_scaling"] or {"rope_type": "default"}) == rope
    assert written["dtype"] == written["torch_dtype"] == "float32"


@pytest.mark.parametrize("name", ["llama-llama3", "qwen3", "mixtral"])
def test_export_loads_into_transformers(tmp_path, name):
    cfg, _, _, params = imported(name, "one")
    export_params(
        params, cfg.model, tmp_path / "out", max_shard_bytes=100_000, base_config=read_hf_config(hf_dir(name))
    )
    _same_as_source(name, tmp_path / "out")


def test_convert_commands_round_trip(tmp_path):
    name = "qwen3-moe-step2"  # bfloat16 files, 5.x config.json, dense and MoE blocks
    args = ["train.seq_len=32", "train.batch_size=8", "mesh.cluster=cpu-8", "mesh.expert=4", "mesh.tensor=2"]
    args += ["data.max_bytes=100000", "train.progress=false"]
    assert main(["convert", "hf-to-jaxdist", str(hf_dir(name)), str(tmp_path / "run"), *args]) == 0
    assert main(["convert", "jaxdist-to-hf", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    _same_as_source(name, tmp_path / "out")

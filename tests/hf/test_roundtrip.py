"""Hugging Face round trips: import then export is bit for bit; train, export, import gives the same parameters.

Also the convert commands end to end: ``hf-to-jaxdist`` writes a run whose step-0
checkpoint ``jaxdist train`` resumes from, ``jaxdist-to-hf`` writes that run back.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

from jaxdist.cli import main
from jaxdist.config.hf import model_fields
from jaxdist.hf.export import export_params
from jaxdist.hf.load import load_params
from jaxdist.resolve import resolve
from jaxdist.train.trainer import Trainer
from tests.hf.helpers import config_for, sharded_abstract
from tests.hf.reference import LLAMA, MIXTRAL, QWEN2, hf_tensors, write_checkpoint
from tests.trees import leaf_pairs


def _read_all(hf_dir) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("c", [LLAMA, QWEN2, MIXTRAL], ids=["llama", "qwen2", "mixtral"])
def test_import_export_is_bit_exact(tmp_path, c):
    tensors = hf_tensors(c, seed=5)
    src = write_checkpoint(tmp_path / "src", c, tensors)
    cfg = config_for(src, f"model.max_seq_len={c['max_position_embeddings']}", "mesh.fsdp=4", "mesh.tensor=2")
    _, _, abstract = sharded_abstract(cfg, jax.devices())
    params = load_params(src, cfg.model, abstract)
    out = tmp_path / "new" / "out"  # neither folder exists yet
    files = export_params(params, cfg.model, out, max_shard_bytes=60_000, base_config=c)
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) >= 2  # several shards (and their index)
    assert files == [*shards, out / "config.json"] and sorted(out.iterdir()) == sorted(
        [*files, out / "model.safetensors.index.json"]
    )  # what it returns is what it wrote
    for f in shards:  # each at most the limit, unless one tensor alone is larger
        held = [a.nbytes for a in load_file(str(f)).values()]
        assert sum(held) <= 60_000 or len(held) == 1, f
        with safe_open(str(f), "np") as opened:  # what transformers' save_pretrained writes
            assert opened.metadata() == {"format": "pt"}
    back = _read_all(out)
    assert sorted(back) == sorted(tensors)
    for name, a in tensors.items():
        assert back[name].dtype == a.dtype and back[name].shape == a.shape
        assert back[name].tobytes() == a.tobytes(), name
    written = json.loads((out / "config.json").read_text())
    assert {k: written[k] for k in c} == c  # every key of the source, same value
    assert model_fields(written) == model_fields(c)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert {(out / f).exists() for f in index["weight_map"].values()} == {True}
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())  # transformers' meaning


def test_a_pipeline_mesh_reads_each_stages_layers(tmp_path):
    """pipeline=3 x tensor=2: each stage reads its own layer of the 3 (a part starting at layer 1 or 2), the same
    values as one device reads."""
    src = write_checkpoint(tmp_path / "src", LLAMA, hf_tensors(LLAMA))
    cfg = config_for(
        src, "model.max_seq_len=256", "mesh.pipeline=3", "mesh.tensor=2", "train.microbatches=3", "train.batch_size=6"
    )
    _, _, abstract = sharded_abstract(cfg, jax.devices()[:6])
    staged = load_params(src, cfg.model, abstract)
    assert staged["layers"]["wq"].sharding.spec[0] == "pipeline" and staged["layers"]["wq"].shape[0] == 3
    one = config_for(src, "model.max_seq_len=256")
    _, _, abstract = sharded_abstract(one, jax.devices()[:1])
    for a, b in leaf_pairs(staged, load_params(src, one.model, abstract)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_bfloat16_parameters_are_the_files_float32_values_rounded(tmp_path):
    """model.param_dtype=bfloat16 from float32 files: each array has the abstract's dtype, and exporting it as
    float32 gives ml_dtypes' own rounding of the source tensors."""
    import ml_dtypes

    tensors = hf_tensors(LLAMA)
    src = write_checkpoint(tmp_path / "src", LLAMA, tensors)
    cfg = config_for(src, "model.max_seq_len=256", "model.param_dtype=bfloat16", "mesh.tensor=2")
    _, _, abstract = sharded_abstract(cfg, jax.devices()[:2])
    params = load_params(src, cfg.model, abstract)
    assert {str(a.dtype) for a in jax.tree.leaves(params)} == {"bfloat16"}
    export_params(params, cfg.model, tmp_path / "out", torch_dtype="float32")
    back = _read_all(tmp_path / "out")
    for name, a in tensors.items():
        assert back[name].tobytes() == a.astype(ml_dtypes.bfloat16).astype(np.float32).tobytes(), name


def test_export_refuses_an_unknown_dtype_or_a_missing_safetensors_before_writing(tmp_path, monkeypatch):
    from jaxdist import optional
    from jaxdist.errors import ConfigError

    src = write_checkpoint(tmp_path / "src", LLAMA, hf_tensors(LLAMA))
    cfg = config_for(src, "model.max_seq_len=256")
    _, _, abstract = sharded_abstract(cfg, jax.devices()[:1])
    params = load_params(src, cfg.model, abstract)
    with pytest.raises(ConfigError) as e:
        export_params(params, cfg.model, tmp_path / "out", torch_dtype="int8")
    assert str(e.value) == "export dtype 'int8' is not supported: use float32, bfloat16, float16."
    real = optional._import
    monkeypatch.setattr(optional, "_import", lambda m: None if m == "safetensors.numpy" else real(m))
    with pytest.raises(ConfigError) as e:
        export_params(params, cfg.model, tmp_path / "out")
    assert str(e.value) == (
        "writing a Hugging Face checkpoint needs the Python package safetensors, which is not installed: "
        "pip install safetensors."
    )
    assert not (tmp_path / "out").exists()  # nothing written either time


def test_export_without_base_is_equivalent(tmp_path):
    """Exported without the source config.json, config.json still maps to the same model.  The parameters are
    plain single-device arrays (no mesh) and the folder exists already (empty)."""
    tensors = hf_tensors(LLAMA)
    src = write_checkpoint(tmp_path / "src", LLAMA, tensors)
    cfg = config_for(src, "model.max_seq_len=256")
    _, _, abstract = sharded_abstract(cfg, jax.devices()[:1])
    params = jax.device_put(jax.tree.map(np.asarray, load_params(src, cfg.model, abstract)), jax.devices()[0])
    assert not isinstance(jax.tree.leaves(params)[0].sharding, jax.sharding.NamedSharding)
    (tmp_path / "out").mkdir()
    export_params(params, cfg.model, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert model_fields(written) == model_fields(LLAMA)
    assert (tmp_path / "out" / "model.safetensors").exists()  # one file, no index, as transformers does
    back = _read_all(tmp_path / "out")
    assert sorted(back) == sorted(tensors) and all(back[n].tobytes() == a.tobytes() for n, a in tensors.items())


def test_train_export_import_gives_same_params(tmp_path):
    src = write_checkpoint(tmp_path / "src", LLAMA, hf_tensors(LLAMA))
    cfg = config_for(
        src,
        f"train.runs_dir={tmp_path / 'runs'}",
        "train.steps=3",
        "train.batch_size=8",
        "train.progress=false",
        "train.tensorboard=false",
        "data.max_bytes=100000",
        "checkpoint.enabled=false",
    )
    one = jax.devices()[:1]  # compiles fastest; the sharded export is tested above and in test_convert_commands
    with Trainer(resolve(cfg, one), devices=one) as trainer:
        trainer.init_state()
        before = jax.tree.map(np.asarray, trainer.state["params"])
        history = trainer.fit()
        trained = trainer.state["params"]
        export_params(trained, cfg.model, tmp_path / "out", max_shard_bytes=200_000)
        trained = jax.tree.map(np.asarray, trained)
    assert len(history) == 3
    assert not np.array_equal(before["layers"]["wq"], trained["layers"]["wq"])  # training moved the weights
    cfg2 = config_for(tmp_path / "out", "mesh.fsdp=2", "mesh.tensor=4")  # another mesh on the way back
    _, _, abstract = sharded_abstract(cfg2, jax.devices())
    again = jax.tree.map(np.asarray, load_params(tmp_path / "out", cfg2.model, abstract))
    assert jax.tree.structure(again) == jax.tree.structure(trained)
    for a, b in leaf_pairs(again, trained):
        assert a.tobytes() == b.tobytes()


def test_convert_commands(tmp_path):
    """hf-to-jaxdist, then train resumes from step 0 of that run, then jaxdist-to-hf of the trained step."""
    tensors = hf_tensors(LLAMA)
    src = write_checkpoint(tmp_path / "src", LLAMA, tensors)
    run = tmp_path / "run"
    common = ["model.max_seq_len=64", "train.seq_len=32", "train.batch_size=8", "mesh.cluster=cpu-8"]
    common += ["mesh.fsdp=4", "mesh.tensor=2", "data.max_bytes=100000", "train.progress=false"]
    assert main(["convert", "hf-to-jaxdist", str(src), str(run), *common]) == 0
    assert (run / "checkpoints" / "0").is_dir()
    # The step-0 checkpoint exported again is the source, bit for bit.
    assert main(["convert", "jaxdist-to-hf", str(run), str(tmp_path / "back0"), "--step", "0"]) == 0
    back = _read_all(tmp_path / "back0")
    assert {n: back[n].tobytes() for n in tensors} == {n: a.tobytes() for n, a in tensors.items()}
    train = [f"train.runs_dir={tmp_path}", "train.name=run", "train.steps=2", "train.tensorboard=false", *common]
    assert main(["train", f"model.init_from={src}", *train]) == 0
    assert main(["convert", "jaxdist-to-hf", str(run), str(tmp_path / "back")]) == 0
    trained = _read_all(tmp_path / "back")
    assert sorted(trained) == sorted(tensors)
    assert (
        trained["model.layers.0.self_attn.q_proj.weight"].tobytes()
        != tensors["model.layers.0.self_attn.q_proj.weight"].tobytes()
    )

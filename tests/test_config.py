"""Config loading, overrides, presets and every user-facing validation message."""

import dataclasses

import pytest

from jaxdist.config import (
    MODEL_PRESETS,
    Config,
    ConfigError,
    from_dict,
    load_config,
    parse_overrides,
    reference_markdown,
    validate,
)
from jaxdist.models.arithmetic import param_count


def test_defaults_are_valid_and_small():
    cfg = load_config()
    assert cfg.model.preset == "small"
    assert param_count(cfg.model) < 2_000_000
    validate(cfg, n_devices=8)
    assert cfg.mesh.resolved(8) == {"data": 8, "fsdp": 1, "context": 1, "tensor": 1, "expert": 1, "pipeline": 1}


def test_overrides_types_and_order(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nsteps = 7\nname = "x"\n[model]\npreset = "tiny"\nd_model = 96\n')
    cfg = load_config(f, ["train.steps=9", "--mesh.tensor", "2", "train.progress=false", "train.learning_rate=1e-4"])
    assert cfg.train.steps == 9 and cfg.train.name == "x"
    assert cfg.mesh.tensor == 2 and cfg.train.progress is False and cfg.train.learning_rate == 1e-4
    # the preset applies first, then model.* keys on top of it
    assert cfg.model.n_layers == MODEL_PRESETS["tiny"]["n_layers"] and cfg.model.d_model == 96


def test_model_preset_override_then_field():
    cfg = load_config(None, ["model.d_ff=256", "model=llama-8b", "train.seq_len=64"])
    assert cfg.model.d_model == 4096 and cfg.model.d_ff == 256 and cfg.model.dtype == "bfloat16"
    assert cfg.model.n_layers == 32 and cfg.model.preset == "llama-8b"


def test_llama_presets_have_their_published_sizes():
    for name, billions in (("llama-1b", 1.24), ("llama-8b", 8.03), ("llama-70b", 70.6)):
        cfg = load_config(None, [f"model={name}"])
        assert abs(param_count(cfg.model) / 1e9 - billions) / billions < 0.02, name


def test_roundtrip_dict():
    cfg = load_config(None, ["model=tiny", "train.steps=3", "mesh.fsdp=2"])
    assert from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "overrides, n_devices, message",
    [
        (["train.stpes=3"], None, "unknown config key 'train.stpes'; did you mean 'train.steps'?"),
        (["nosuch.key=1"], None, "unknown config key 'nosuch.key'"),
        (["train.steps=abc"], None, "config key 'train.steps' needs an int, got 'abc'."),
        (["model=gpt-17"], None, "unknown model preset 'gpt-17'"),
        (  # smaller than the devices runs on the first ones (tests/remat/test_edges.py); larger is refused
            ["mesh.data=3", "mesh.fsdp=4"],
            8,
            "mesh data=3 x fsdp=4 has 12 devices but 8 are available: make the axis sizes multiply to 8",
        ),
        (["mesh.fsdp=3"], 8, "fsdp*tensor*expert*pipeline = 3 does not divide the 8 devices"),
        (["mesh.tensor=0"], None, "mesh.tensor=0 is not a valid axis size"),
        (["train.batch_size=12", "mesh.data=8"], 8, "is not divisible by the data axes data*fsdp=8"),
        (["model=tiny", "mesh.tensor=8"], None, "model.n_heads=4 is not divisible by mesh.tensor=8"),
        (["model.n_kv_heads=3"], None, "model.n_heads=4 is not divisible by model.n_kv_heads=3"),
        (
            ["train.batch_size=10", "train.microbatches=4"],
            None,
            "train.batch_size=10 is not divisible by train.microbatches=4",
        ),
        (["train.seq_len=4096"], None, "train.seq_len=4096 is longer than model.max_seq_len=128"),
        (["data.source=text_dir"], None, "data.source='text_dir' needs data.path"),
        (["data.source=tokens", "data.path=/no/such/file.bin"], None, "data.path '/no/such/file.bin' does not exist"),
        (["data.source=text_dir", "data.path=/no/such/dir"], None, "data.path '/no/such/dir' is not a directory"),
        (["model.dtype=float16"], None, "model.dtype='float16' is not supported"),
        (["train.steps=1", "=3"], None, "override '=3' has no key"),
    ],
)
def test_validation_messages(overrides, n_devices, message):
    with pytest.raises(ConfigError) as e:
        cfg = load_config(None, overrides)
        validate(cfg, n_devices)
    assert message in str(e.value)
    assert str(e.value).count("\n") == 0  # one sentence, one line


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="config file '.*nope.toml' does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    unknown = tmp_path / "u.toml"
    unknown.write_text("[train]\nbatchsize = 4\n")
    with pytest.raises(ConfigError, match="did you mean 'train.batch_size'"):
        load_config(unknown)


def test_parse_overrides_forms():
    assert parse_overrides(["a.b=1", "--c.d", "2", "--e.f=3"]) == [("a.b", "1"), ("c.d", "2"), ("e.f", "3")]
    with pytest.raises(ConfigError, match="is not KEY=VALUE"):
        parse_overrides(["train.steps"])


def test_reference_lists_every_field():
    ref = reference_markdown()
    for section in ("model", "mesh", "train", "data", "checkpoint"):
        sub = getattr(Config(), section)
        for f in dataclasses.fields(sub):
            assert f"`{section}.{f.name}`" in ref
            assert f.metadata["help"]


def test_sections_are_frozen_and_replace_is_checked_like_overrides():
    cfg = load_config(None, ["model=moe-tiny"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 5
    changed = cfg.replace(**{"train.steps": 5, "model.moe.top_k": 1, "pipeline.chunks": 4})
    assert (changed.train.steps, changed.model.moe.top_k, changed.pipeline.chunks) == (5, 1, 4)
    assert (cfg.train.steps, cfg.model.moe.top_k, cfg.pipeline.chunks) == (300, 2, 2)  # the original is untouched
    with pytest.raises(ConfigError, match="unknown config key 'train.stepz'; did you mean 'train.steps'"):
        cfg.replace(**{"train.stepz": 5})
    with pytest.raises(ConfigError, match="train.b1=1.5 is outside its range"):  # the whole config is validated
        cfg.replace(**{"train.b1": 1.5})
    with pytest.raises(ConfigError, match="is longer than model.max_seq_len"):
        cfg.replace(**{"train.seq_len": 4096})


def test_a_section_key_takes_a_whole_section_and_the_whole_config_is_still_checked():
    cfg, tiny = Config(), load_config(None, ["model=tiny"]).model
    changed = cfg.replace(model=tiny, **{"train.seq_len": 32})
    assert changed.model == tiny and changed.train.seq_len == 32 and changed.mesh == cfg.mesh
    assert cfg.replace(model="tiny").model == tiny  # a preset's name, as on the command line
    short = cfg.replace(model=tiny, **{"train.seq_len": 32}).model.max_seq_len
    with pytest.raises(ConfigError, match="is longer than model.max_seq_len"):
        cfg.replace(model=tiny, **{"train.seq_len": short * 2})
    with pytest.raises(ConfigError, match="model.moe"):  # the wrong section's type is a value, checked as one
        cfg.replace(**{"model.moe": cfg.mesh})


@pytest.mark.parametrize(
    "old, new, value",
    [
        ("model.moe_experts", "model.moe.experts", 4),
        ("model.moe_capacity_factor", "model.moe.capacity_factor", 2.0),
        ("train.pipeline_schedule", "pipeline.schedule", "gpipe"),
        ("train.pipeline_chunks", "pipeline.chunks", 4),
        ("train.pipeline_chunk_split", "pipeline.chunk_split", "equal"),
    ],
)
def test_a_moved_key_names_its_new_home(tmp_path, old, new, value):
    with pytest.raises(ConfigError, match=f"config key '{old}' is now '{new}': rename it"):
        load_config(None, [f"{old}={value}"])
    section, key = old.split(".")
    path = tmp_path / "old.toml"
    path.write_text(f"[{section}]\n{key} = {value!r}\n".replace("'", '"'))
    with pytest.raises(ConfigError, match=f"'{old}' is now '{new}'"):
        load_config(path)
    # A config stored with a run before the move still reads back: from_dict translates its keys.
    assert from_dict({section: {key: value}}) == load_config(None, [f"{new}={value}"])


def test_toml_round_trip_with_the_nested_moe_table(tmp_path):
    cfg = load_config(None, ["model=deepseek-moe-16b", "pipeline.schedule=gpipe", "train.remat=save:attn_out"])
    text = cfg.to_toml()
    assert "[model.moe]\nexperts = 64\n" in text and '[pipeline]\nschedule = "gpipe"\n' in text
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_config(path) == cfg
    assert from_dict(cfg.to_dict()) == cfg


def test_remat_is_parsed_once_into_one_value():
    from jaxdist.config import Remat

    t = load_config(None, ["train.remat=save:attn_out,mlp_norm"]).train
    assert t.remat_spec == Remat("names", names=("attn_out", "mlp_norm")) and t.remat_spec is t.remat_spec
    assert str(t.remat_spec) == t.remat
    for value, kind in (("none", "none"), ("full", "full"), ("auto", "auto"), ("dots_saveable", "policy")):
        assert Remat.parse(value).kind == kind and str(Remat.parse(value)) == value
    for bad, message in (("save:", "names no checkpoint tags"), ("dots saveable", "is unknown")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"train.remat={bad}"])


def test_validation_is_one_pass_of_section_checks_and_cross_section_rules():
    cfg = Config()
    for section in (
        cfg.model,
        cfg.model.moe,
        cfg.mesh,
        cfg.train,
        cfg.pipeline,
        cfg.data,
        cfg.checkpoint,
        cfg.controller,
    ):
        section.check()  # each section checks itself
    bad = cfg.set(**{"train.seq_len": 4096})  # fine by itself, too long for the model (set: not validated)
    bad.train.check()
    with pytest.raises(ConfigError, match="train.seq_len=4096 is longer than model.max_seq_len=128"):
        validate(bad)

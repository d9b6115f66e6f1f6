"""An MoE model on pipeline stages (jaxdist/parallel/pipeline_blocks.py, the gpipe schedule by autodiff): the
loss, the router's losses and figures and the parameters of the same model on one device with the same
microbatches, fp32, with dropless and capacity dispatch and the expert, data and tensor axes inside the stages."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxdist.config import ConfigError, load_config
from jaxdist.train.metrics import read_metrics
from jaxdist.train.trainer import Trainer
from tests.trees import leaf_pairs


def run(tmp_path, name, extra, devices=None):
    cfg = load_config(
        None,
        [
            "model=moe-tiny",
            "model.dtype=float32",
            "train.steps=3",
            "train.seq_len=32",
            "train.batch_size=8",
            "train.log_every=1",
            "train.progress=false",
            "train.tensorboard=false",
            "data.max_bytes=300000",
            "checkpoint.enabled=false",
            f"train.runs_dir={tmp_path}",
            f"train.name={name}",
            *extra,
        ],
    )
    with Trainer(cfg, devices) as t:
        t.fit()
        return jax.device_get(t.state["params"]), read_metrics(tmp_path / name), t


@pytest.mark.parametrize(
    "dispatch, micro, mesh",
    [
        ("dropless", 2, ["mesh.data=2", "mesh.expert=2", "mesh.fsdp=1"]),
        # the 1f1b executor's stages (jaxdist.parallel.pipeline), the planned dispatch inside them
        ("dropless", 2, ["mesh.fsdp=2", "mesh.expert=2", "mesh.data=1", "pipeline.schedule=1f1b"]),
        # fsdp inside the stages: each layer's weights gathered in the stage, the gradients reduce-scattered
        ("dropless", 2, ["mesh.fsdp=2", "mesh.expert=2", "mesh.data=1"]),
        ("capacity", 4, ["mesh.tensor=2", "mesh.expert=2", "mesh.fsdp=1", "mesh.data=1"]),
        # the expert view: each expert on one device of the tensor pair (its weights over expert x tensor_ep)
        ("dropless", 2, ["mesh.tensor=2", "mesh.expert=2", "mesh.expert_tensor=1", "mesh.fsdp=1", "mesh.data=1"]),
        # the same on the executor's seq1f1b stages (XLA partitions the experts there too)
        (
            "dropless",
            2,
            [
                "mesh.tensor=2",
                "mesh.expert=2",
                "mesh.expert_tensor=1",
                "mesh.fsdp=1",
                "mesh.data=1",
                "pipeline.schedule=seq1f1b",
                "pipeline.chunks=4",
            ],
        ),
    ],
)
def test_moe_stages_equal_one_device(tmp_path, dispatch, micro, mesh):
    """pipeline=2 (one MoE block per stage, gpipe, and cases on 1f1b and seq1f1b) with the expert axis and data or tensor
    (or the expert view, mesh.expert_tensor=1) inside the stages (with dropless dispatch on data x expert,
    jaxdist's planned dispatch inside them) against one
    device running the microbatches one after the other: every step's loss, each block's router losses, token
    counts and drop rate, and the parameters after 3 AdamW steps (1e-5)."""
    common = [f"model.moe.dispatch={dispatch}", f"train.microbatches={micro}"]
    one, ref, _ = run(tmp_path, "one", [*common, "mesh.data=1", "mesh.fsdp=1"], [jax.devices()[0]])
    schedule = [] if any(m.startswith("pipeline.schedule=") for m in mesh) else ["pipeline.schedule=gpipe"]
    staged, rows, t = run(tmp_path, "staged", [*common, *mesh, "mesh.pipeline=2", *schedule])
    spec = t.param_shardings["layers"]["we_up"].spec  # a stage's blocks' experts
    assert spec[0] == "pipeline" and "expert" in (spec[1] if isinstance(spec[1], tuple) else (spec[1],)), spec
    hlo = t.compile_train_step().as_text()
    assert "collective-permute" in hlo  # activations go stage to stage
    # Dropless dispatch runs jaxdist's planned dispatch inside the stages (its all-to-all over expert, the
    # shard_map manual over data, fsdp and expert too); capacity and the expert view leave it to XLA.
    planned = dispatch == "dropless" and "mesh.expert_tensor=1" not in mesh
    manual = tuple(a for a in ("data", "fsdp", "expert") if f"mesh.{a}=2" in mesh)
    assert t.stage_rows == (manual if planned else ())
    assert ("all-to-all" in hlo) == planned
    for a, b in zip(ref, rows, strict=True):
        assert a["step"] == b["step"]
        figures = [k for k in a if k == "loss" or k.startswith("moe")]
        assert len(figures) > 10
        for k in figures:
            np.testing.assert_allclose(b[k], a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    if dispatch == "capacity":
        assert any(r["moe_drop_rate"] > 0 for r in ref)  # the capacity dropped tokens, in both alike
    assert ref[-1]["loss"] < ref[0]["loss"]
    for a, b in leaf_pairs(staged, one):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_moe_stages_refuse_what_they_cannot_run(tmp_path):
    """On gpipe stages a batch whose rows the data axes times the stages do not divide (the embedding and head
    run on every stage's rows) is refused in one sentence before anything is written (what the 1f1b and seq1f1b
    stages refuse: tests/parallel/test_moe_pipeline_executor.py)."""
    with pytest.raises(ConfigError) as e:
        run(tmp_path, "odd", ["mesh.pipeline=2", "mesh.expert=2", "mesh.data=2", "mesh.fsdp=1",
                              "pipeline.schedule=gpipe", "train.batch_size=12"])  # fmt: skip
    msg = str(e.value)
    assert "train.batch_size=12 does not split over the data axes and the 2 pipeline stages (8 ways)" in msg, msg
    assert msg.count(". ") == 0 and msg.endswith(".")
    assert not (tmp_path / "odd").exists()


def test_moe_stages_reduce_the_gradients_once_a_step(tmp_path):
    """With data inside the stages the weights' gradients are summed over data once, after the backward loop,
    and the microbatches' cotangent over the stages once too: inside the tick loops (counted in the compiled
    step, pipeline=2 x data=2 x expert=2) the only all-reduce is of the router's statistics, the tokens and
    probabilities per expert and two sums of the stage's MoE block, (2 x experts + 2) floats a tick."""
    from jaxdist.parallel.hlo import parse_collectives

    cfg = load_config(
        None,
        [
            "model=moe-tiny",
            "train.seq_len=32",
            "train.batch_size=16",
            "mesh.pipeline=2",
            "mesh.data=2",
            "mesh.expert=2",
            "mesh.fsdp=1",
            "pipeline.schedule=gpipe",
            "train.microbatches=2",
            "checkpoint.enabled=false",
            f"train.runs_dir={tmp_path}",
        ],
    )
    with Trainer(cfg) as t:
        collectives = parse_collectives(t.compile_train_step().as_text())
    loop = [c for c in collectives if c.kind == "all-reduce" and c.count > 1]  # count: the loop's trips (ticks)
    assert loop and {c.count for c in loop} == {3}, [(c.bytes, c.count) for c in loop]
    assert sum(c.bytes for c in loop) <= (2 * cfg.model.moe.experts + 2) * 4, [(c.bytes, c.op_name) for c in loop]

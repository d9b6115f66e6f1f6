"""Pipeline stages for your own model (jaxdist/models/blocks.py, jaxdist/parallel/pipeline_blocks.py): the mixer
language model of test_custom_model.py, its stack run by run_blocks, on pipeline x data x tensor and pipeline x
fsdp meshes against one device running the model's own nnx.scan, resumed bit for bit after a SIGKILL, and what
the stages cannot do refused in one sentence."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxdist.config import ConfigError
from jaxdist.models.blocks import run_blocks
from jaxdist.models.hooks import constrain
from jaxdist.train.metrics import read_metrics
from jaxdist.train.trainer import Trainer
from tests.train.test_custom_model import MixerLM, config, lm_loss
from tests.trees import leaf_pairs

LAYERS = 4


class StagedLM(MixerLM):
    """MixerLM (the same parameters from the same seed) whose blocks run through run_blocks."""

    def __call__(self, batch):
        x = constrain(self.embed(batch[:, :-1]), ("batch", "seq", "embed"))
        return self.out(run_blocks(self.blocks, x))


def build(rngs):
    return StagedLM(layers=LAYERS, rngs=rngs)


def build_scanned(rngs):  # the reference: the model's own nnx.scan, no run_blocks
    return MixerLM(layers=LAYERS, rngs=rngs)


STAGES = ["pipeline.schedule=gpipe", "checkpoint.enabled=false"]


def train(cfg, devices=None, model=build):
    with Trainer(cfg, devices, model=model, loss=lm_loss, optimizer=optax.adamw(1e-2)) as t:
        t.fit()
        return jax.device_get(t.state), t


def test_stages_train_it_with_the_loss_and_parameters_of_one_device(tmp_path):
    """pipeline=2 x data=2 x tensor=2 (2 microbatches) and pipeline=4 x fsdp=2 (4 microbatches, one block per
    stage) against one device running MixerLM's nnx.scan: the same losses and parameters to 1e-5 after 4 AdamW
    steps.  Each stage holds its blocks only and sends activations to the next stage; the layers outside the
    stack take their rows over the stages too (no stage repeats the head)."""
    one, _ = train(config(tmp_path, "one", extra=[*STAGES, "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]),
                   [jax.devices()[0]], build_scanned)  # fmt: skip
    ref = [r["loss"] for r in read_metrics(tmp_path / "one")]
    meshes = {
        "p2": (["mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=1", "train.microbatches=2"], P("pipeline", None, "tensor")),
        "p4": (["mesh.pipeline=4", "mesh.fsdp=2", "mesh.data=1", "mesh.tensor=1", "train.microbatches=4"],
               P("pipeline", "fsdp", None)),
    }  # fmt: skip
    for name, (extra, spec) in meshes.items():
        state, t = train(config(tmp_path, name, extra=[*STAGES, *extra]))
        kernel = t.param_shardings["blocks"]["up"]["kernel"]
        assert kernel.spec == spec, (name, kernel.spec)
        stages = t.mesh.shape["pipeline"]
        assert kernel.shard_shape((LAYERS, 32, 64))[0] == LAYERS // stages  # a stage holds its blocks only
        assert "pipeline" in t.batch_sharding.spec[0]  # the embedding and head run on every stage's rows
        hlo = t.compile_train_step().as_text()
        assert "collective-permute" in hlo, name  # activations (and their gradients) go stage to stage
        losses = [r["loss"] for r in read_metrics(tmp_path / name)]
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=name)
        for a, b in leaf_pairs(state["params"], one["params"]):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5, err_msg=name)
    assert ref[-1] < ref[0]


def test_remat_applies_to_the_blocks_inside_the_stages(tmp_path):
    """train.remat=full on pipeline=2 x data=2 x tensor=2: each block in a stage is recomputed, so the compiled
    step's temporary memory is below train.remat=none's, and the loss is the same."""
    peaks, losses = {}, {}
    for remat in ("none", "full"):
        extra = [*STAGES, "mesh.pipeline=2", "mesh.fsdp=1", "train.microbatches=2", f"train.remat={remat}",
                 "train.seq_len=128", "train.steps=1"]  # fmt: skip
        state, t = train(config(tmp_path, remat, steps=1, extra=extra))
        peaks[remat] = t.compile_train_step().memory_analysis().temp_size_in_bytes
        losses[remat] = read_metrics(tmp_path / remat)[0]["loss"]
    assert peaks["full"] < peaks["none"], peaks
    np.testing.assert_allclose(losses["full"], losses["none"], rtol=1e-6)


KILLED = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests.train import test_custom_pipeline as m
cfg = m.config({tmp!r}, "split", 8, m.RESUMED)
from jaxdist.train.trainer import Trainer
import optax
with Trainer(cfg, model=m.build, loss=m.lm_loss, optimizer=optax.adamw(1e-2)) as t:
    t.add_hook(lambda t, step, _: os.kill(os.getpid(), signal.SIGKILL) if step == 5 else None)
    t.fit()
"""
RESUMED = ["checkpoint.every=2", "pipeline.schedule=gpipe", "mesh.pipeline=2", "mesh.fsdp=1", "train.microbatches=2"]


def test_a_killed_pipelined_run_resumes_bit_for_bit(tmp_path):
    """SIGKILL at step 5 of 8 on pipeline=2 x data=2 x tensor=2 (saves every 2 steps, the default asynchronous
    writer), then the same command: the parameters, the optimizer's state and every step's loss of the
    uninterrupted run."""
    root = str(Path(__file__).resolve().parents[2])
    script = KILLED.format(root=root, tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=os.environ.copy(), capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    full, _ = train(config(tmp_path, "full", 8, RESUMED))
    resumed, t = train(config(tmp_path, "split", 8, RESUMED))
    assert t.resumed_from is not None and t.resumed_from[1] in (2, 4), t.resumed_from
    for a, b in leaf_pairs(full, resumed):
        np.testing.assert_array_equal(a, b)
    losses = {n: {r["step"]: r["loss"] for r in read_metrics(tmp_path / n)} for n in ("full", "split")}
    assert losses["split"] == losses["full"] and sorted(losses["full"]) == list(range(1, 9))


class Unstacked(nnx.Module):
    """Named parameters, but no stack: nothing leads with 'layers'."""

    def __init__(self, *, rngs):
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (260, 8)), sharding_names=("vocab", "embed"))

    def __call__(self, batch):
        return self.w[batch[:, :-1]] @ self.w.T


PIPE = ["mesh.pipeline=2", "mesh.fsdp=1"]


@pytest.mark.parametrize(
    "model, extra, words",
    [
        (build, ["mesh.pipeline=2", "mesh.fsdp=1"], "pipeline.schedule=seq1f1b needs the loss inside the last stage"),
        (
            build,
            [*PIPE, "pipeline.schedule=1f1b", "train.microbatches=2"],
            "set pipeline.schedule=gpipe for mesh.pipeline=2",
        ),
        (build_scanned, [*PIPE, *STAGES], "and it gives none: call x = run_blocks(self.blocks, x)"),
        (lambda rngs: StagedLM(layers=3, rngs=rngs), [*PIPE, *STAGES], "stack of 3 blocks does not split"),
        (lambda rngs: Unstacked(rngs=rngs), [*PIPE, *STAGES], "lead with the axis 'layers', and your model has none"),
        (build, [*PIPE, *STAGES, "train.batch_size=6", "train.microbatches=1"], "train.batch_size=6 does not split"),
        (build, [*STAGES, "mesh.pipeline=2", "mesh.context=2", "mesh.fsdp=1", "mesh.data=1"], "mesh.context=2 does"),
    ],
)
def test_what_the_stages_cannot_do_is_refused_in_one_sentence(tmp_path, model, extra, words):
    with pytest.raises(ConfigError) as e:
        Trainer(config(tmp_path, "bad", extra=extra), model=model, loss=lm_loss)
    msg = str(e.value)
    assert words in msg, msg
    assert msg.count(". ") == 0 and msg.endswith("."), msg  # one sentence
    assert not (tmp_path / "bad").exists()  # refused before anything is written

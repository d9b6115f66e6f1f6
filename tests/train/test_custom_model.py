"""Your own model, loss and optimizer (jaxdist/train/custom.py): a causal mixer language model defined only in
this file, trained on data=2 fsdp=2 tensor=2 with the loss and parameters of one device, resumed bit for bit
after a SIGKILL, and the one-sentence refusals of what it cannot do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxdist.config import ConfigError, load_config
from jaxdist.models.hooks import constrain, remat_block
from jaxdist.train.metrics import read_metrics
from jaxdist.train.trainer import Trainer
from tests.trees import leaf_pairs

VOCAB = 260  # the byte tokenizer's ids (the default data source)


class MixerBlock(nnx.Module):
    """Each position adds the running mean of the positions so far (the token mixing), then an MLP."""

    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs):
        init, named = nnx.initializers, nnx.with_partitioning
        self.up = nnx.Linear(
            width,
            hidden,
            kernel_init=named(init.lecun_normal(), ("embed", "mlp")),
            bias_init=named(init.zeros, ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            hidden, width, use_bias=False, kernel_init=named(init.lecun_normal(), ("mlp", "embed")), rngs=rngs
        )
        self.scale = nnx.Param(jnp.ones((width,)), sharding_names=("norm",))

    def __call__(self, x):
        seen = jnp.arange(1, x.shape[1] + 1, dtype=x.dtype)[None, :, None]
        x = x + checkpoint_name(jnp.cumsum(x, axis=1) / seen, "mix")
        h = checkpoint_name(jax.nn.gelu(self.up(x * self.scale)), "hidden")
        return constrain(x + self.down(h), ("batch", "seq", "embed"))


class MixerLM(nnx.Module):
    """Embedding, a stack of ``layers`` mixer blocks run by a scan (each marked for remat), output projection."""

    def __init__(self, vocab: int = VOCAB, width: int = 32, hidden: int = 64, layers: int = 2, *, rngs: nnx.Rngs):
        init, named = nnx.initializers, nnx.with_partitioning
        self.embed = nnx.Embed(vocab, width, embedding_init=named(init.normal(0.1), ("vocab", "embed")), rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs):  # the blocks' parameters stacked on a leading axis named "layers"
            return MixerBlock(width, hidden, rngs=rngs)

        self.blocks = stack(rngs)
        self.out = nnx.Linear(
            width, vocab, use_bias=False, kernel_init=named(init.lecun_normal(), ("embed", "vocab")), rngs=rngs
        )

    def __call__(self, batch):
        x = constrain(self.embed(batch[:, :-1]), ("batch", "seq", "embed"))  # where the activations live

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, x):
            return remat_block(block)(x)  # recomputed in the backward pass as train.remat says

        return self.out(run(self.blocks, x))


def build(rngs):
    return MixerLM(rngs=rngs)


def lm_loss(logits, batch):
    labels = batch[:, 1:]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return ce, {"accuracy": (logits.argmax(-1) == labels).mean()}


def config(tmp_path, name, steps=4, extra=()):
    """The defaults but for a short run of small batches (train.seq_len 32, batch 8) in ``tmp_path``."""
    return load_config(
        None,
        [
            f"train.steps={steps}",
            "train.seq_len=32",
            "train.batch_size=8",
            "train.log_every=1",
            "train.progress=false",
            "train.tensorboard=false",
            "data.max_bytes=400000",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            f"train.runs_dir={tmp_path}",
            f"train.name={name}",
            *extra,
        ],
    )


def train(cfg, devices=None, **kw):
    with Trainer(cfg, devices, model=build, loss=lm_loss, optimizer=optax.adamw(1e-2), **kw) as t:
        t.fit()
        return jax.device_get(t.state), t


def test_a_mesh_trains_it_with_the_loss_and_parameters_of_one_device(tmp_path):
    """data=2 fsdp=2 tensor=2 against one device, fp32: the same losses and parameters to 1e-5 after 4 AdamW
    steps; the names put the MLP's kernel on fsdp x tensor and the embedding's vocabulary on tensor."""
    mesh_state, t = train(config(tmp_path, "mesh", extra=["checkpoint.enabled=false"]))
    assert t.param_shardings["blocks"]["up"]["kernel"].spec == P(None, "fsdp", "tensor")  # layers: pipeline=1
    assert t.param_shardings["embed"]["embedding"].spec == P("tensor", "fsdp")
    assert "yours" in t.describe() and "0.03M params" in t.describe()  # 8,320 x 2 + 4,192 x 2 blocks
    one = config(tmp_path, "one", extra=["checkpoint.enabled=false", "mesh.fsdp=1", "mesh.tensor=1", "mesh.data=1"])
    one_state, _ = train(one, [jax.devices()[0]])
    rows = {n: read_metrics(tmp_path / n) for n in ("mesh", "one")}
    assert [r["step"] for r in rows["mesh"]] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in rows["mesh"]], [r["loss"] for r in rows["one"]], rtol=1e-5)
    np.testing.assert_allclose([r["accuracy"] for r in rows["mesh"]], [r["accuracy"] for r in rows["one"]])
    assert rows["mesh"][-1]["loss"] < rows["mesh"][0]["loss"]  # it learns
    assert "lr" not in rows["mesh"][0] and "mfu" not in rows["mesh"][0]  # the user's optimizer; no FLOP count given
    for a, b in leaf_pairs(mesh_state["params"], one_state["params"]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)

    # data=2 context=2 tensor=2: the activations constrained with "seq" split over context (XLA moves what the
    # running mean over positions needs); the same losses and parameters again
    ctx = config(tmp_path, "context", extra=["checkpoint.enabled=false", "mesh.fsdp=1", "mesh.context=2"])
    ctx_state, t = train(ctx)
    lowered = t._train_step.lower(t.abstract_state(), t.abstract_batch()).as_text()
    assert '[{"data"}, {"context"}, {}]' in lowered  # the activations' sequence axis is split over context
    np.testing.assert_allclose(
        [r["loss"] for r in read_metrics(tmp_path / "context")], [r["loss"] for r in rows["one"]], rtol=1e-5
    )
    for a, b in leaf_pairs(ctx_state["params"], one_state["params"]):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def padded_loss(logits, batch):
    """Cross-entropy over the tokens that are not the byte 0 (a padding), and how many there are: a weighted mean."""
    labels = batch[:, 1:]
    keep = labels != 0
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    weight = keep.sum()
    return jnp.sum(jnp.where(keep, ce, 0.0)) / jnp.maximum(weight, 1), {"weight": weight.astype(jnp.float32)}


def test_microbatches_combine_by_the_losss_weight(tmp_path, monkeypatch):
    """Two microbatches of different token counts give the step of one batch: the loss's ``weight`` combines
    them (equal weights would not).  A quarter of the tokens are made padding, unevenly over the rows."""
    from jaxdist.train import custom

    rng = np.random.default_rng(0)
    batch = rng.integers(1, VOCAB, size=(8, 33)).astype(np.int32)
    batch[0::2, 8:] = 0  # rows 0, 2, 4, 6 (microbatch 0 of 2) are mostly padding
    graphdef, abstract, _ = custom.abstract_module(custom.UserModel(build, padded_loss), 0)
    params = custom.init_params(custom.UserModel(build, padded_loss), 0)
    fn = custom.objective(custom.UserModel(build, padded_loss), graphdef)
    loss1, m1, g1 = jax.jit(custom.grads_fn(fn, 1))(params, batch)
    loss2, m2, g2 = jax.jit(custom.grads_fn(fn, 2))(params, batch)
    np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
    assert float(m1["weight"]) == float(m2["weight"]) == float((batch[:, 1:] != 0).sum())
    for a, b in leaf_pairs(g1, g2):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # equal weights (the mean of the two microbatches' means) would be another loss
    halves = [fn(params, batch[k::2])[0] for k in (0, 1)]
    assert abs(float(np.mean(halves)) - float(loss1)) > 1e-3


KILLED = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tests.train import test_custom_model as m
cfg = m.config({tmp!r}, "split", 8, ["checkpoint.every=2"])
from jaxdist.train.trainer import Trainer
import optax
with Trainer(cfg, model=m.build, loss=m.lm_loss, optimizer=optax.adamw(1e-2)) as t:
    t.add_hook(lambda t, step, _: os.kill(os.getpid(), signal.SIGKILL) if step == 5 else None)
    t.fit()
"""


def test_a_killed_run_resumes_bit_for_bit(tmp_path):
    """SIGKILL at step 5 of 8 (saves every 2 steps, asynchronous as by default), then the same command: the
    parameters, the optimizer's state and every step's loss of the uninterrupted run."""
    root = str(Path(__file__).resolve().parents[2])
    script = KILLED.format(root=root, tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=os.environ.copy(), capture_output=True, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    full, _ = train(config(tmp_path, "full", 8, ["checkpoint.every=2"]))
    resumed, t = train(config(tmp_path, "split", 8, ["checkpoint.every=2"]))
    assert t.resumed_from is not None and t.resumed_from[1] in (2, 4), t.resumed_from
    for a, b in leaf_pairs(full, resumed):
        np.testing.assert_array_equal(a, b)
    losses = {n: {r["step"]: r["loss"] for r in read_metrics(tmp_path / n)} for n in ("full", "split")}
    assert losses["split"] == losses["full"] and sorted(losses["full"]) == list(range(1, 9))


class Unnamed(nnx.Module):
    def __init__(self, *, rngs):
        self.w = nnx.Linear(4, VOCAB, rngs=rngs)

    def __call__(self, batch):
        return self.w(jnp.ones(batch[:, :-1].shape + (4,)))


class WithStats(MixerLM):
    def __init__(self, *, rngs):
        super().__init__(rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)


class NoTensor(nnx.Module):
    def __init__(self, *, rngs):
        self.w = nnx.Param(jnp.zeros((VOCAB, 8)), sharding_names=("embed", None))

    def __call__(self, batch):
        return self.w[batch[:, :-1]] @ self.w.T


@pytest.mark.parametrize(
    "kw, extra, words",
    [
        ({"model": lambda rngs: Unnamed(rngs=rngs)}, [], "carry no logical axis names"),
        ({"model": lambda rngs: WithStats(rngs=rngs)}, [], "BatchStat"),
        ({"model": lambda rngs: NoTensor(rngs=rngs)}, [], "mesh.tensor=2 splits no parameter"),
        ({"model": lambda rngs: 3}, [], "not a flax.nnx.Module"),
        (
            {"loss": lambda out, batch: optax.softmax_cross_entropy_with_integer_labels(out, batch[:, 1:])},
            [],
            "float32[8, 32], not a float scalar",
        ),
        ({"loss": lambda out, batch: (out.mean(), {"per_row": out.mean(-1)})}, [], "metric 'per_row'"),
        ({"optimizer": "adam"}, [], "not an optax.GradientTransformation"),
        ({"loss": None}, [], "model= and loss= go together"),
        (
            {"model": lambda rngs: NoTensor(rngs=rngs)},
            ["mesh.context=2", "mesh.tensor=1"],
            "mesh.context=2 splits the sequence axis your model names, and it names none",
        ),
        ({}, ["mesh.pipeline=2", "mesh.data=1"], "set pipeline.schedule=gpipe for mesh.pipeline=2"),
        ({}, ["train.grad_sync=per_block"], "train.grad_sync=per_block works with jaxdist's own transformer"),
        (
            {"model": lambda rngs: NoTensor(rngs=rngs)},
            ["train.remat=full", "mesh.tensor=1", "mesh.data=4"],
            "marks none",
        ),
    ],
)
def test_what_it_cannot_do_is_refused_in_one_sentence(tmp_path, kw, extra, words):
    args = {"model": build, "loss": lm_loss, "optimizer": optax.adamw(1e-3), **kw}
    with pytest.raises(ConfigError) as e:
        Trainer(config(tmp_path, "bad", extra=extra), **args)
    msg = str(e.value)
    assert words in msg, msg
    assert msg.count(". ") == 0 and msg.endswith("."), msg  # one sentence
    assert not (tmp_path / "bad").exists()  # refused before anything is written


def test_a_run_of_your_model_is_never_mistaken_for_jaxdists_transformer(tmp_path, capsys):
    """Its run directory says it trained your model (own_model.json): jaxdist sample, jaxdist convert and a
    Trainer without model= refuse it in one sentence, exit code 2 for the commands; your model on a run of
    jaxdist's transformer is refused too.  Nothing in either run is changed."""
    from jaxdist.cli import main

    cfg = config(tmp_path, "yours", steps=1, extra=["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"])
    train(cfg)
    run = tmp_path / "yours"
    own = json.loads((run / "own_model.json").read_text())
    assert own["build"].endswith(":build") and own["entry"] is None
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    capsys.readouterr()
    for args in (["sample", str(run), "--prompt", "a"], ["convert", "jaxdist-to-hf", str(run), str(tmp_path / "hf")]):
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "trained your own model" in err[0] and err[0].count(". ") == 0, err
    with pytest.raises(ConfigError, match="not jaxdist's transformer, which a Trainer without model="):
        Trainer(config(tmp_path, "yours", extra=["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]))
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before
    assert not (tmp_path / "hf").exists()

    # a run of jaxdist's transformer: its checkpoints (one step of the tiny model) and no own_model.json
    with Trainer(load_config(None, ["model=tiny", "train.steps=1", "train.seq_len=32", "train.batch_size=8",
                                    "train.progress=false", "train.tensorboard=false", "data.max_bytes=200000",
                                    f"train.runs_dir={tmp_path}", "train.name=theirs"])) as t:  # fmt: skip
        t.fit()
    theirs = tmp_path / "theirs"

    def files():  # every file and when it was written, but the lock (each holder writes its name there)
        return {
            str(p.relative_to(theirs)): p.stat().st_mtime_ns for p in theirs.rglob("*") if p.name != ".jaxdist.lock"
        }

    before = files()
    with pytest.raises(ConfigError, match="holds a run of jaxdist's transformer, not of your own model"):
        train(config(tmp_path, "theirs", steps=1))
    assert files() == before

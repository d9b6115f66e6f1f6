"""train.grad_sync=ordered (jaxdist.parallel.ordered_sum): the step's gradients have the same bits on every
data-parallel group size, where XLA's all-reduce (the default ``end``) does not, and a run shrunk mid-way from 8
to 4 devices ends bit-identical to the uninterrupted one.  These tests set train.grad_sync=ordered: it is their
point."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.config import ConfigError, load_config
from jaxdist.models import create_abstract, init_params
from jaxdist.parallel.layout import Parallelism
from jaxdist.parallel.ordered_sum import counter_sum, ordered_grads_fn, tree_sum
from jaxdist.train.step import loss_metrics_and_grads
from jaxdist.train.trainer import Trainer
from tests.trees import leaf_pairs

pytestmark = pytest.mark.default_emitters  # the same bits from programs of different meshes (tests/conftest.py)


def _np_tree(x: np.ndarray) -> np.ndarray:
    while len(x) > 1:
        x = x[0::2] + x[1::2]
    return x[0]


def test_the_counter_adds_in_the_tree_order():
    """One unit at a time, the binary counter gives the pairwise tree's bits (not the running sum's)."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((16, 64)) * 10.0 ** rng.integers(-6, 6, (16, 64))).astype(np.float32)
    want = _np_tree(x)
    got, aux = jax.jit(lambda u: counter_sum(lambda v: ({"g": v * 1.0}, v[0]), u))(x)
    np.testing.assert_array_equal(np.asarray(got["g"]), want)
    np.testing.assert_array_equal(np.asarray(aux), x[:, 0])
    np.testing.assert_array_equal(np.asarray(jax.jit(tree_sum)(x)), want)
    running = x[0].copy()
    for row in x[1:]:
        running = running + row
    assert not np.array_equal(running, want)  # the data tells the two orders apart
    for n in (1, 2):  # no level, one level
        np.testing.assert_array_equal(np.asarray(counter_sum(lambda v: (v, v), jnp.asarray(x[:n]))[0]), _np_tree(x[:n]))


MESHES = {"data4-fsdp2": ["mesh.data=4", "mesh.fsdp=2"], "data2-fsdp2": ["mesh.data=2", "mesh.fsdp=2"], "one": []}


def test_the_gradients_have_the_same_bits_on_every_mesh():
    """8, 4 and 1 devices: ordered's loss, norm and gradients agree to the bit (and with the plain sum to 1e-6);
    the plain sum's do not agree across meshes (what the option is for)."""
    tokens = None
    ordered, plain = {}, {}
    for name, mesh in MESHES.items():
        cfg = load_config(None, ["model=tiny", "train.batch_size=16", "train.seq_len=16", "mesh.data=1", *mesh])
        par = Parallelism.build(cfg)
        graphdef, abstract, names = create_abstract(cfg.model)
        shardings = par.param_shardings(names, abstract)
        params = jax.jit(lambda: init_params(cfg.model, 0), out_shardings=shardings)()  # noqa: B023 (used in this iteration)
        if tokens is None:
            tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (16, 17)).astype(np.int32)
        fn = ordered_grads_fn(graphdef, par.mesh, par.rules, shardings, unit_rows=2)
        ordered[name] = jax.device_get(
            jax.jit(par.bind(fn), in_shardings=(shardings, par.batch_sharding))(params, tokens)
        )
        if name != "one":
            end = jax.jit(
                par.bind(lambda p, t: loss_metrics_and_grads(graphdef, p, t)),  # noqa: B023 (used in this iteration)
                in_shardings=(shardings, par.batch_sharding),
            )
            plain[name] = jax.device_get(end(params, tokens))
    first = ordered["data4-fsdp2"]
    for name in ("data2-fsdp2", "one"):
        for a, b in leaf_pairs(first, ordered[name]):
            np.testing.assert_array_equal(a, b, err_msg=name)
    loss, metrics, grads = first
    want_loss, _, want = plain["data4-fsdp2"]
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for a, b in leaf_pairs(grads, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(np.max(np.abs(b))))
    np.testing.assert_allclose(
        metrics["grad_norm"], np.sqrt(sum(float(np.sum(g**2.0)) for g in jax.tree.leaves(want))), rtol=1e-5
    )
    pairs = leaf_pairs(plain["data4-fsdp2"], plain["data2-fsdp2"])
    assert not all(np.array_equal(a, b) for a, b in pairs), "the plain sum happened to agree: the test shows nothing"


def _config(tmp_path, name: str, mesh: list[str], extra=()):
    return load_config(
        None,
        [
            "model=tiny",
            "train.steps=6",
            "train.seq_len=32",
            "train.batch_size=8",
            "train.log_every=3",
            "train.eval_every=0",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.every=3",
            "data.max_bytes=200000",
            "train.grad_sync=ordered",
            f"train.runs_dir={tmp_path}",
            f"train.name={name}",
            *mesh,
            *extra,
        ],
    )


def test_a_run_shrunk_from_8_to_4_devices_ends_bit_identical(tmp_path):
    with Trainer(_config(tmp_path, "full", MESHES["data4-fsdp2"])) as t:
        t.fit()
        full = jax.device_get(t.state)
    with Trainer(_config(tmp_path, "shrunk", MESHES["data4-fsdp2"])) as t:
        t.fit(steps=3)
        t.checkpointer.wait()
    with Trainer(_config(tmp_path, "shrunk", MESHES["data2-fsdp2"])) as t:
        assert t.mesh.devices.size == 4
        t.init_state()
        assert int(t.state["step"]) == 3
        t.fit()
        shrunk = jax.device_get(t.state)
    for a, b in leaf_pairs(full, shrunk):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["mesh.data=4", "mesh.tensor=2"],
            "^train.grad_sync=ordered runs on the data and fsdp axes only, not with mesh.tensor=2",
        ),
        (["mesh.data=8", "train.microbatches=2"], "set train.microbatches=1"),
        (["mesh.data=8", "train.batch_size=24"], "24 / train.grad_unit_rows=1 = 24: make the batch a power of two"),
        (
            ["mesh.data=8", "train.grad_unit_rows=4"],
            "each of the 8 devices on the data axes whole units, but there are 4 units",
        ),
        (["mesh.data=8", "train.grad_unit_rows=3"], "train.grad_unit_rows=3 does not divide train.batch_size=16"),
    ],
)
def test_what_ordered_cannot_split_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model=tiny", "train.batch_size=16", "train.grad_sync=ordered", *overrides])

"""Logical axis rules: specs, parameter shardings and activation constraints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdist.config import MeshConfig
from jaxdist.parallel.mesh import build_mesh
from jaxdist.parallel.rules import (
    DEFAULT_RULES,
    activation_sharding,
    constrain,
    logical_to_spec,
    state_shardings,
)


@pytest.fixture(scope="module")
def mesh222():
    return build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))


# --------------------------------------------------------------------------- logical_to_spec


def test_default_rules_cover_the_model_names():
    names = {n for n, _ in DEFAULT_RULES}
    assert {
        "batch",
        "seq",
        "embed",
        "heads",
        "kv_heads",
        "head_dim",
        "mlp",
        "vocab",
        "expert",
        "layers",
        "norm",
    } <= names


def test_activations_and_params_without_mesh():
    # batch takes fsdp, so embed of the same activation is left unsplit
    assert logical_to_spec(("batch", "seq", "embed")) == P(("data", "fsdp", "expert"), "context", None)
    assert logical_to_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert logical_to_spec(("mlp", "embed")) == P("tensor", "fsdp")
    assert logical_to_spec(("layers", "embed", "heads", "head_dim")) == P("pipeline", "fsdp", "tensor", None)
    assert logical_to_spec(("vocab", None)) == P("tensor", None)
    assert logical_to_spec(("norm",)) == P(None)
    assert logical_to_spec(()) == P()


def test_size_one_axes_are_dropped_with_a_mesh():
    mesh = build_mesh(MeshConfig(data=2, tensor=4))
    assert logical_to_spec(("batch", "seq", "embed"), mesh=mesh) == P("data", None, None)
    assert logical_to_spec(("embed", "mlp"), mesh=mesh) == P(None, "tensor")
    assert logical_to_spec(("layers", "embed"), mesh=mesh) == P(None, None)


def test_axes_that_do_not_divide_the_dimension_are_dropped():
    mesh = build_mesh(MeshConfig(data=2, tensor=4))
    # 2 kv heads over tensor=4 would be an uneven split: replicate instead
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), mesh=mesh, shape=(64, 2, 16)) == P(None, None, None)
    assert logical_to_spec(("embed", "heads", "head_dim"), mesh=mesh, shape=(64, 8, 16)) == P(None, "tensor", None)
    mesh24 = build_mesh(MeshConfig(data=2, fsdp=4))
    # batch 4: data (2) divides it, data*fsdp (8) does not
    assert logical_to_spec(("batch", "seq"), mesh=mesh24, shape=(4, 16)) == P("data", None)
    assert logical_to_spec(("batch", "seq"), mesh=mesh24, shape=(16, 16)) == P(("data", "fsdp"), None)
    # batch 2: data divides it; fsdp is then free for embed
    assert logical_to_spec(("batch", "embed"), mesh=mesh24, shape=(2, 8)) == P("data", "fsdp")


def test_unknown_name_and_rank_mismatch():
    with pytest.raises(ValueError, match="logical axis name 'hiddn' has no rule"):
        logical_to_spec(("batch", "hiddn"))
    with pytest.raises(ValueError, match="do not match the array's 3 dimensions"):
        logical_to_spec(("batch", "seq"), shape=(2, 3, 4))


def test_rules_are_data_you_can_swap():
    rules = {"batch": ("data",), "embed": ("tensor",), "mlp": ()}
    assert logical_to_spec(("batch", "embed", "mlp"), rules) == P("data", "tensor", None)
    # a mesh without an axis named in the rules treats it as size 1
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    assert logical_to_spec(("batch", "embed"), DEFAULT_RULES, mesh) == P("data", None)


# --------------------------------------------------------------------------- state_shardings


class TwoParam(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 32)), sharding_names=("embed", "mlp"))
        self.b = nnx.Param(jnp.zeros((32,)))  # no names: replicated


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layer = TwoParam(rngs)
        self.kv = nnx.Param(jnp.ones((16, 2, 8)), sharding_names=("embed", "kv_heads", "head_dim"))


def test_state_shardings_create_params_sharded(mesh222):
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Tiny(nnx.Rngs(0)))
    _, state = nnx.split(abstract)
    shardings = state_shardings(state, mesh222)
    assert jax.tree.structure(shardings) == jax.tree.structure(nnx.get_partition_spec(state))
    specs = {jax.tree_util.keystr(k): s.spec for k, s in jax.tree.leaves_with_path(shardings)}
    assert specs == {
        "['kv'].value": P("fsdp", "tensor", None),
        "['layer']['b'].value": P(),
        "['layer']['w'].value": P("fsdp", "tensor"),
    }

    def init():
        with nnx.use_eager_sharding(False):
            return nnx.state(Tiny(nnx.Rngs(0)))

    sharded = jax.jit(init, out_shardings=shardings)()
    w = sharded["layer"]["w"].get_value()
    assert w.sharding.is_equivalent_to(NamedSharding(mesh222, P("fsdp", "tensor")), 2)
    assert w.addressable_shards[0].data.shape == (8, 16)
    reference = init()  # unsharded
    np.testing.assert_array_equal(np.asarray(w), np.asarray(reference["layer"]["w"].get_value()))


def test_state_shardings_of_plain_pytree_is_replicated(mesh222):
    out = state_shardings({"a": jnp.zeros((4, 4)), "n": None}, mesh222)
    assert out["a"].spec == P() and out["n"] is None


# --------------------------------------------------------------------------- constrain


def test_constrain_is_identity_outside_the_context():
    x = jnp.ones((8, 4, 16))
    assert constrain(x, ("batch", "seq", "embed")) is x


def test_constrain_inside_jit_sets_the_output_sharding(mesh222):
    x = jax.device_put(jnp.arange(8 * 4 * 16, dtype=jnp.float32).reshape(8, 4, 16), NamedSharding(mesh222, P()))

    def make_f():  # a new function each time: jit's trace cache does not see the context
        return lambda x: constrain(x * 2, ("batch", "seq", "embed"))

    plain = jax.jit(make_f())(x)
    assert plain.sharding.is_fully_replicated
    with activation_sharding(mesh222):
        constrained = jax.jit(make_f())(x)
    assert constrained.sharding.is_equivalent_to(NamedSharding(mesh222, P(("data", "fsdp"), None, None)), 3)
    assert constrained.addressable_shards[0].data.shape == (2, 4, 16)
    np.testing.assert_array_equal(np.asarray(constrained), np.asarray(plain))


def test_activation_sharding_nests_and_restores(mesh222):
    x = jnp.ones((8, 16))
    with activation_sharding(mesh222):
        with activation_sharding(None):
            assert constrain(x, ("batch", "embed")) is x
        y = jax.jit(lambda x: constrain(x, ("batch", "mlp")))(x)
        assert y.sharding.spec == P(("data", "fsdp"), "tensor")
    assert constrain(x, ("batch", "embed")) is x

"""jaxdist checkpoints and plain orbax: orbax reads them, and jaxdist's one reach inside orbax is guarded."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxdist.checkpoint import RunCheckpointer, writer
from tests.trees import leaf_pairs


def test_the_installed_orbax_has_what_jaxdist_replaces_inside_it():
    """Fails, with OrbaxChanged's one sentence, on an orbax version whose private slice choice changed."""
    module, original = writer.orbax_slices()  # checks the installed orbax (check_orbax_slices)
    assert original.__name__ == "get_replica_slices" and original is not writer._get_replica_slices
    writer.install()  # replacing it there is what makes orbax's writer call jaxdist's choice
    assert module.get_replica_slices is writer._get_replica_slices


def _fake_orbax(**change):
    """A replica_slices module and a jax_array_handlers module like orbax 0.12.8's, with ``change`` applied."""

    @dataclasses.dataclass
    class ReplicaSlice:
        index: tuple
        unsliced_data: object
        slice_args: object

    @dataclasses.dataclass
    class SliceArgs:
        start_index: int
        limit_index: int
        axis: int

    @dataclasses.dataclass
    class ReplicaSlices:
        global_shape: tuple
        local_shape: tuple
        sharding: object
        dtype: object
        is_on_host: bool
        replica_slices: list

    def get_replica_slices(
        arr,
        replica_id,
        use_replica_parallel,
        min_slice_bytes_for_replica_parallel=None,
        max_replicas_for_replica_parallel=None,
    ):
        return None

    module = types.ModuleType("replica_slices")
    module.__dict__.update(
        ReplicaSlice=ReplicaSlice,
        SliceArgs=SliceArgs,
        ReplicaSlices=ReplicaSlices,
        get_replica_slices=get_replica_slices,
    )
    handlers = types.ModuleType("jax_array_handlers")
    handlers.replica_slices = module
    exec(  # like orbax's: the function is looked up in the module at each call
        "def _get_replica_slices(arrays, r, p):\n"
        "    return [replica_slices.get_replica_slices(a, r, p) for a in arrays]\n",
        handlers.__dict__,
    )
    for name, value in change.items():
        target = handlers if name == "_get_replica_slices" else module
        if value is None:
            delattr(target, name)
        else:
            setattr(target, name, value)
    return module, handlers


def _renamed_arg(arr, replica_id, parallel, min_slice_bytes_for_replica_parallel=None):
    return None


@dataclasses.dataclass
class _NewSliceArgs:
    start: int
    stop: int
    axis: int


def _copied_in(arrays, r, p):  # a writer that imported the function by name: replacing it in the module is not seen
    return [get_replica_slices(a, r, p) for a in arrays]  # noqa: F821


@pytest.mark.parametrize(
    "change, says",
    [
        ({"get_replica_slices": None}, "has no replica_slices.get_replica_slices"),
        ({"get_replica_slices": _renamed_arg}, "has get_replica_slices(arr, replica_id, parallel, min_slice_bytes"),
        ({"SliceArgs": _NewSliceArgs}, "has no dataclass replica_slices.SliceArgs with the fields start_index"),
        ({"_get_replica_slices": _copied_in}, "no longer calls replica_slices.get_replica_slices through that module"),
    ],
    ids=["function gone", "arguments renamed", "fields renamed", "imported by name"],
)
def test_an_orbax_that_changed_what_jaxdist_replaces_is_named_in_one_sentence(change, says):
    module, handlers = _fake_orbax()
    writer.check_orbax_slices(module, handlers)  # as orbax 0.12.8 has it: accepted
    module, handlers = _fake_orbax(**change)
    with pytest.raises(writer.OrbaxChanged) as e:
        writer.check_orbax_slices(module, handlers)
    msg = str(e.value)
    assert says in msg and f"orbax-checkpoint {ocp.__version__} " in msg and "tested with orbax-checkpoint" in msg
    assert "\n" not in msg and msg.count(". ") == 0, msg  # one sentence


def _state():
    """fsdp-sharded, replicated (split by the balanced plan over the 8 devices of one process) and scalar leaves."""
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
    key = jax.random.split(jax.random.key(3), 2)
    return {
        "params": {
            "w": jax.device_put(jax.random.normal(key[0], (64, 48)), NamedSharding(mesh, P("fsdp"))),
            "r": jax.device_put(jax.random.normal(key[1], (24, 40)), NamedSharding(mesh, P())),
        },
        "step": jax.device_put(jnp.int32(11), NamedSharding(mesh, P())),
    }


def test_plain_orbax_restores_a_jaxdist_checkpoint_onto_the_same_and_another_sharding(tmp_path):
    """What the checkpoint guide shows: ``ocp.StandardCheckpointer().restore(<dir>/<step>/state, target)``."""
    state = _state()
    ck = RunCheckpointer(tmp_path / "ck")
    ck.save(5, state, {"step": 5})
    ck.close()
    step_dir = tmp_path / "ck" / "5"

    same = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    other_mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    other_spec = {"params": {"w": P(None, "tensor"), "r": P("data", "tensor")}, "step": P()}
    other = jax.tree.map(
        lambda a, spec: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(other_mesh, spec)),
        state,
        other_spec,
    )
    with ocp.StandardCheckpointer() as plain:
        for target in (same, other):
            got = plain.restore(step_dir / "state", target)
            pairs = leaf_pairs(state, got)
            assert len(pairs) == 3
            for want, have in pairs:
                assert np.array_equal(np.asarray(want), np.asarray(have))
            for have, t in zip(jax.tree.leaves(got), jax.tree.leaves(target)):
                assert have.sharding == t.sharding


def test_a_checkpoint_of_the_earlier_layout_still_restores(tmp_path):
    """Before 2026-12-07 a step was one orbax composite checkpoint of two items (``state``, ``meta``; its
    ``_CHECKPOINT_METADATA`` in the step folder); now orbax writes ``<step>/state`` alone and jaxdist the JSON
    beside it. Both layouts restore, values and meta alike."""
    from jaxdist.checkpoint import integrity

    state = _state()
    ck = RunCheckpointer(tmp_path / "ck")
    ck.save(1, state, {"step": 1, "data": "new"})
    ck.wait()
    made = ("format", "algorithm", "num_processes", "bytes_written_per_process", "files", "marker_crc32", "step")
    info = {k: v for k, v in integrity.read_commit(tmp_path / "ck" / "1").items() if k not in made}
    old = tmp_path / "ck" / "2"
    with ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(state=ocp.PyTreeCheckpointHandler(), meta=ocp.JsonCheckpointHandler())
    ) as c:
        c.save(
            old,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave({"step": 2, "data": "old"})
            ),
        )
    assert (old / "_CHECKPOINT_METADATA").is_file() and (old / "meta" / "metadata").is_file()
    integrity.record_own_checksums(old, 0)
    integrity.commit(old, 1, {**info, "step": 2})
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    for step, data in ((2, "old"), (1, "new")):
        got, meta = ck.restore(target, step=step)
        assert meta == {"step": step, "data": data} and ck.restore_meta(step) == meta
        for want, have in leaf_pairs(state, got):
            assert np.array_equal(np.asarray(want), np.asarray(have))
    assert sorted(p.name for p in (tmp_path / "ck" / "1").iterdir()) == [
        "jaxdist_checksums",
        "jaxdist_commit.json",
        "meta",
        "state",
    ]
    ck.close()

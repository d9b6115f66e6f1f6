"""Making orbax write a checkpoint the way :mod:`jaxdist.checkpoint.plan` says.

Orbax decides per array which slices this process writes in
``replica_slices.get_replica_slices``.  jaxdist switches orbax's
replica-parallel writing on (the ``orbax`` rule; off by default on GPUs) and,
for the arrays where orbax would fall back to "replica 0 writes it all" (the
``jaxdist`` rule), hands orbax the slices of the plan instead.  The hook is
installed once and only acts on the arrays of a save in progress (matched by
identity), so any other orbax use in the process is unaffected.  Arrays whose
replicas all live in one process (``owner``) are copied from one device
whole instead of sliced R ways: the same bytes, fewer device-to-host copies.

Orbax's public options (``use_replica_parallel``, ``min_slice_bytes_for_replica_parallel``,
``max_replicas_for_replica_parallel``, ``enable_replica_parallel_separate_folder``) choose
one rule for every array of a save; the plan needs one per array (whole shards
from one device for ``owner``, k < R slices for ``jaxdist``), which orbax has no
public way to take.  That one reach inside orbax is :func:`orbax_slices`, which
checks what jaxdist relies on and says in one sentence what changed if an orbax
version differs (``tests/checkpoint/test_orbax_compat.py``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxdist.checkpoint.plan import ArrayLayout, ArrayPlan, Index, Shard, WritePlan, plan_writes

TESTED_ORBAX = "0.12.8"  # the orbax-checkpoint version orbax_slices was written against
_SIGNATURE = (
    "arr",
    "replica_id",
    "use_replica_parallel",
    "min_slice_bytes_for_replica_parallel",
    "max_replicas_for_replica_parallel",
)
_FIELDS = {
    "ReplicaSlice": ("index", "unsliced_data", "slice_args"),
    "SliceArgs": ("start_index", "limit_index", "axis"),
    "ReplicaSlices": ("global_shape", "local_shape", "sharding", "dtype", "is_on_host", "replica_slices"),
}
_lock = threading.Lock()
_active: dict[int, tuple[jax.Array, ArrayPlan]] = {}


class OrbaxChanged(RuntimeError):
    """The installed orbax-checkpoint no longer has what :func:`orbax_slices` relies on."""


def _names_in(code: types.CodeType) -> set[str]:
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names_in(c)
    return out


@functools.cache
def orbax_slices() -> tuple[Any, Any]:
    """(orbax's private ``replica_slices`` module, its original ``get_replica_slices``), checked.

    The only place jaxdist reaches inside orbax; :class:`OrbaxChanged` (one
    sentence) if the installed orbax no longer has what :func:`check_orbax_slices` checks.
    """
    try:
        # orbax's private modules, here only: a version without them gets OrbaxChanged, not an ImportError
        from orbax.checkpoint._src.serialization import jax_array_handlers as handlers, replica_slices as module
    except ImportError as e:
        module, handlers = None, e
    check_orbax_slices(module, handlers)
    return module, module.get_replica_slices


def check_orbax_slices(module: Any, handlers: Any) -> None:
    """Raise :class:`OrbaxChanged` (one sentence) unless ``module`` is orbax's ``replica_slices`` as jaxdist knows it.

    That is: ``get_replica_slices`` exists with the arguments jaxdist passes;
    ``ReplicaSlice``, ``SliceArgs`` and ``ReplicaSlices`` are dataclasses with
    the fields jaxdist fills; and orbax's array writer (``handlers``, its
    ``jax_array_handlers`` module) looks the function up in ``module`` at call
    time, so replacing it there takes effect.  ``module`` None: it could not be
    imported (``handlers`` is then the ImportError).
    """
    fn = getattr(module, "get_replica_slices", None)
    if module is None or not callable(fn):
        problem = f"has no replica_slices.get_replica_slices ({handlers if module is None else 'not in the module'})"
    elif (got := tuple(inspect.signature(fn).parameters)) != _SIGNATURE:
        problem = f"has get_replica_slices({', '.join(got)}), not get_replica_slices({', '.join(_SIGNATURE)})"
    else:
        problem = None
        for cls, fields in _FIELDS.items():
            have = getattr(getattr(module, cls, None), "__dataclass_fields__", None)
            if have is None or not set(fields) <= set(have):
                problem = f"has no dataclass replica_slices.{cls} with the fields {', '.join(fields)}"
                break
    if problem is None:
        caller = getattr(handlers, "_get_replica_slices", None)
        names = _names_in(caller.__code__) if hasattr(caller, "__code__") else set()
        if (
            getattr(handlers, "replica_slices", None) is not module
            or not {"replica_slices", "get_replica_slices"} <= names
        ):
            problem = "no longer calls replica_slices.get_replica_slices through that module when it writes an array"
    if problem:
        raise OrbaxChanged(
            f"orbax-checkpoint {ocp.__version__} {problem}, so jaxdist cannot make it follow the balanced write plan "
            f"(jaxdist was tested with orbax-checkpoint {TESTED_ORBAX}: install that version)"
        )


def _index(slices: Sequence[slice], shape: Sequence[int]) -> Index:
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(slices, shape))


def layouts_from_arrays(named: Sequence[tuple[str, jax.Array]]) -> list[ArrayLayout]:
    """The :class:`ArrayLayout` of live (possibly multi-process) arrays, from their shardings.

    Replica ids are numbered per distinct shard in the sharding's device
    order, as JAX numbers ``Shard.replica_id``.
    """
    out = []
    for name, arr in named:
        seen: dict[Index, int] = {}
        shards = []
        for device, slices in arr.sharding.devices_indices_map(arr.shape).items():
            index = _index(slices, arr.shape)
            replica = seen.get(index, 0)
            seen[index] = replica + 1
            shards.append(Shard(int(device.id), int(device.process_index), index, replica))
        out.append(ArrayLayout(name, tuple(arr.shape), int(np.dtype(arr.dtype).itemsize), tuple(shards)))
    return out


def _jaxdist_slices(arr: jax.Array, plan: ArrayPlan) -> Any:
    """This process's pieces of ``arr`` under a ``jaxdist``-rule plan, as orbax ReplicaSlices."""
    _rs = orbax_slices()[0]
    me = jax.process_index()
    shards = {s.device.id: s for s in arr.addressable_shards}
    out = []
    for piece in plan.pieces:
        if piece.process != me:
            continue
        shard = shards[piece.device]
        whole = _index(shard.index, arr.shape)
        args = None
        if piece.index != whole:
            axis = next(a for a, (p, w) in enumerate(zip(piece.index, whole)) if p != w)
            args = _rs.SliceArgs(piece.index[axis][0] - whole[axis][0], piece.index[axis][1] - whole[axis][0], axis)
        out.append(
            _rs.ReplicaSlice(
                index=tuple(slice(a, b) for a, b in piece.index), unsliced_data=shard.data, slice_args=args
            )
        )
    return _rs.ReplicaSlices(
        global_shape=arr.shape,
        local_shape=plan.piece_shape,
        sharding=arr.sharding,
        dtype=arr.dtype,
        is_on_host=False,
        replica_slices=out,
    )


def _get_replica_slices(
    arr,
    replica_id,
    use_replica_parallel,
    min_slice_bytes_for_replica_parallel=None,
    max_replicas_for_replica_parallel=None,
):
    original = orbax_slices()[1]
    entry = _active.get(id(arr))
    if entry is not None and entry[0] is arr:
        if entry[1].rule == "jaxdist":
            return _jaxdist_slices(arr, entry[1])
        if entry[1].rule == "owner":  # replica 0 (in the one holding process) copies each shard whole
            return original(arr, 0, False)
    return original(
        arr, replica_id, use_replica_parallel, min_slice_bytes_for_replica_parallel, max_replicas_for_replica_parallel
    )


def install() -> None:
    """Route orbax's per-array slice choice through jaxdist (idempotent); :class:`OrbaxChanged` if it cannot."""
    orbax_slices()[0].get_replica_slices = _get_replica_slices


@contextlib.contextmanager
def following(plan: WritePlan, named: Sequence[tuple[str, jax.Array]]) -> Iterator[None]:
    """While inside, orbax writes the arrays ``named`` (name, array) as ``plan`` says."""
    install()
    by_name = {a.name: a for a in plan.arrays}
    with _lock:
        for name, arr in named:
            _active[id(arr)] = (arr, by_name[name])
    try:
        yield
    finally:
        with _lock:
            for _, arr in named:
                _active.pop(id(arr), None)


def array_handler(strategy: str) -> ocp.type_handlers.ArrayHandler:
    """Orbax's jax.Array handler for ``strategy``: replica-parallel on for balanced, off for replica0."""
    return ocp.type_handlers.ArrayHandler(replica_id=0, use_replica_parallel=strategy == "balanced")


def type_registry(strategy: str) -> Any:
    """A type-handler registry like orbax's default, with :func:`array_handler` for jax.Array."""
    th = ocp.type_handlers
    return th.create_type_handler_registry(
        (int, th.ScalarHandler()),
        (float, th.ScalarHandler()),
        (bytes, th.ScalarHandler()),
        (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()),
        (str, th.StringHandler()),
        (jax.Array, array_handler(strategy)),
    )


def named_leaves(tree: Any) -> list[tuple[str, Any]]:
    """(``a.b.c`` name, leaf) for every leaf of ``tree``, names as orbax keys them on disk."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(".".join(_key(k) for k in path), leaf) for path, leaf in flat]


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def plan_for(state: Any, strategy: str = "balanced") -> WritePlan:
    """The write plan of the jax.Array leaves of ``state`` over all processes."""
    named = [(n, a) for n, a in named_leaves(state) if isinstance(a, jax.Array)]
    return plan_writes(layouts_from_arrays(named), jax.process_count(), strategy)

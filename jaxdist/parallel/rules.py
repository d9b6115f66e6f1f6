"""Logical axis names -> mesh axes, kept as data.

The model tags every parameter dimension (``nnx.Param(..., sharding_names=
("embed", "mlp"))``) and every activation it constrains (``constrain(x,
("batch", "seq", "embed"))``, :mod:`jaxdist.models.hooks`) with logical names;
the rules below say which mesh axes each name is split over, and
:func:`activation_sharding` installs them as the model's constraint function.  Swapping the rules changes the parallelism
without touching model code.

Within one array a mesh axis is used at most once: a dimension skips the axes
an earlier dimension already took.  So activations ``("batch", "seq", "embed")``
become ``P(("data", "fsdp"), None, None)`` (batch took fsdp) while parameters
``("embed", "mlp")`` become ``P("fsdp", "tensor")``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxdist.models import hooks

Rules = Sequence[tuple[str, tuple[str, ...]]]

DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp", "expert")),  # examples: every data-parallel axis; attention also uses expert as one
    ("seq", ("context",)),  # tokens of one sequence: split over context (ring attention, parallel/context.py)
    ("embed", ("fsdp",)),  # model width: FSDP shards parameters along it
    ("heads", ("tensor",)),  # attention heads: Megatron column split
    ("kv_heads", ("tensor",)),  # GQA key/value heads; replicated when tensor does not divide them
    ("head_dim", ()),
    ("mlp", ("tensor",)),  # MLP hidden width: column split in, row split out
    ("vocab", ("tensor",)),  # embedding / output projection rows
    ("expert", ("expert", "tensor_ep")),  # MoE experts; tensor_ep exists only in the expert view (parallel/moe.py)
    ("expert_mlp", ("tensor",)),  # an expert's hidden width: its own tensor group (mesh.expert_tensor)
    ("layers", ("pipeline",)),  # stacked (scanned) blocks: one slice per pipeline stage
    ("norm", ()),  # norm scales: small, replicated
)


def _rule_table(rules: Rules | Mapping[str, Sequence[str]]) -> dict[str, tuple[str, ...]]:
    items = rules.items() if isinstance(rules, Mapping) else rules
    table: dict[str, tuple[str, ...]] = {}
    for name, axes in items:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        table.setdefault(name, axes)  # first rule for a name wins, as in flax
    return table


def logical_to_spec(
    names: Sequence[str | None],
    rules: Rules = DEFAULT_RULES,
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry logical ``names`` (None: replicated).

    Each dimension takes the mesh axes its rule lists, minus those an earlier
    dimension took.  With ``mesh``, axes of size 1 (or absent from the mesh)
    are dropped; with ``shape`` too, an axis is dropped from a dimension whose
    length it would not divide evenly (e.g. kv_heads=2 with tensor=4 is
    replicated).  Raises ValueError for a logical name the rules do not know.
    """
    table = _rule_table(rules)
    names = tuple(names)
    if shape is not None and len(shape) != len(names):
        raise ValueError(f"logical names {names} do not match the array's {len(shape)} dimensions {tuple(shape)}")
    used: set[str] = set()
    entries: list[Any] = []
    for i, name in enumerate(names):
        if name is None:
            entries.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis name '{name}' has no rule; known names: {', '.join(table)}")
        kept: list[str] = []
        for axis in table[name]:
            if axis in used:
                continue
            if mesh is not None:
                size = dict(mesh.shape).get(axis, 1)
                if size == 1:
                    continue
                if shape is not None and shape[i] % (math.prod(dict(mesh.shape)[a] for a in kept) * size):
                    continue
            kept.append(axis)
        used.update(kept)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*entries)


def _logical_names(variable: Any) -> tuple[str | None, ...] | None:
    metadata = variable.get_metadata()
    # flax 0.12 stores sharding_names=... as out_sharding; older releases used these keys.
    for key in ("out_sharding", "sharding_names", "sharding"):
        names = metadata.get(key)
        if names:
            return tuple(names)
    return None


def state_shardings(abstract_state: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """NamedShardings for every leaf of an nnx State (or any pytree), same tree structure.

    Variables whose metadata carries logical names (``sharding_names=...``)
    are sharded by the rules; other Variables and plain array leaves are
    replicated.  Use the result as ``jax.jit(..., out_shardings=...)`` to
    create the state directly sharded.
    """

    def one(leaf: Any) -> Any:
        if isinstance(leaf, nnx.Variable):
            names = _logical_names(leaf)
            shape = getattr(leaf.get_value() if hasattr(leaf, "get_value") else leaf.value, "shape", ())
            spec = PartitionSpec() if names is None else logical_to_spec(names, rules, mesh, shape)
            return leaf.replace(NamedSharding(mesh, spec))
        if hasattr(leaf, "shape"):
            return NamedSharding(mesh, PartitionSpec())
        return None

    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


# --------------------------------------------------------------------------- activations

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "jaxdist_activation_sharding", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules: Rules = DEFAULT_RULES) -> Iterator[None]:
    """Within this block, :func:`constrain` (the model's too) pins activations to ``mesh`` by ``rules``.

    Nests: the innermost block wins and the outer one is restored on exit;
    ``activation_sharding(None)`` turns constraints off inside (e.g. in a
    ``shard_map`` body, where a whole-mesh constraint does not apply).

    The context is read while tracing and is not part of jit's cache key: enter
    it inside the function that is jitted (``jaxdist.parallel.layout.
    Parallelism.bind`` does), so every trace of that function sees it.
    """
    token = _ACTIVE.set(None if mesh is None else (mesh, rules))
    try:
        with hooks.constraining(None if mesh is None else partial(constrain_on, mesh, rules)):
            yield
    finally:
        _ACTIVE.reset(token)


def active_sharding() -> tuple[Mesh, Rules] | None:
    """(mesh, rules) of the innermost :func:`activation_sharding` block, or None outside one."""
    return _ACTIVE.get()


def constrain_on(mesh: Mesh, rules: Rules, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``x`` with a sharding constraint on ``mesh`` from its logical ``names`` by ``rules``."""
    spec = logical_to_spec(names, rules, mesh, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# The model's constraint (jaxdist.models.hooks): pins x inside activation_sharding, else returns it.
constrain = hooks.constrain

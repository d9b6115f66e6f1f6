"""Operator costs of one block: bytes per device, forward FLOPs and time, dependencies.

    profile = profile_block(model_cfg, batch=32, seq_len=2048, mesh_shape={"fsdp": 8},
                            peak_flops=989e12)
    print(profile.table())

A block is profiled as ``jax.checkpoint`` sees it (:mod:`jaxdist.remat.trace`):
every forward equation of its JVP, with

* ``bytes``: its outputs' size per device under the mesh sharding (global
  size times the share one device holds, from the propagated specs);
* ``flops``: XLA's cost analysis of the equation alone, at global shapes,
  times the share of the work one device does (the smallest share held of
  any operand or output);
* ``time``: measured on the present backend (median of ``repeats`` calls
  minus the dispatch overhead of an empty call, scaled by the same share),
  or ``flops / peak_flops`` when not measured;
* ``inputs``, ``needed`` (the backward pass reads it) and ``invariant``
  (depends only on layer-invariant inputs such as the rotary tables: JAX
  hoists such values out of the layer scan, so saving one costs its bytes
  once, ``bytes / n_layers`` per block).

Equations are grouped under the ``checkpoint_name`` tag that follows them
(everything from one tag to the next belongs to the later tag).
"""

from __future__ import annotations

import statistics
import time as _time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from jaxdist.config import MESH_AXES, ModelConfig
from jaxdist.models.moe import group_member, split_group
from jaxdist.models.transformer import block_forward, create_abstract
from jaxdist.parallel.layout import sharded_tracing
from jaxdist.parallel.rules import DEFAULT_RULES, Rules, logical_to_spec
from jaxdist.remat.graph import Evaluation, OperatorGraph, evaluate
from jaxdist.remat.trace import (
    Equation,
    nbytes,
    propagate_shardings,
    shard_fraction,
    signature,
    spec_from_partition,
    trace_checkpointed,
)

# Equations that move no data and do no arithmetic: cost 0, never compiled.
IDENTITY_PRIMITIVES = frozenset(
    {
        "name",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "pvary",
        "stop_gradient",
        "reduce_precision",
        "optimization_barrier",
    }
)


@dataclass(frozen=True)
class Operator:
    """One forward equation of a block.  Bytes, FLOPs and seconds are per device."""

    index: int
    primitive: str
    group: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    flops: float
    time: float
    inputs: tuple[int, ...]
    needed: bool
    invariant: bool
    signature: str
    tag: str | None = None

    @property
    def label(self) -> str:
        """Short description, e.g. ``dot_general f32[8,128,4,32]``."""
        short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32", "bool": "bool"}
        return f"{self.primitive} {short.get(self.dtype, self.dtype)}{list(self.shape)}".replace(", ", ",")


@dataclass(frozen=True)
class BlockProfile:
    """The forward operators of one scanned block and what the layer scan keeps anyway.

    ``input_bytes``: bytes per device of the block's activation input (saved
    for every layer by the scan whatever the policy); ``n_layers``: blocks in
    the stack; ``timing``: how ``Operator.time`` was obtained.
    """

    operators: tuple[Operator, ...]
    input_bytes: int
    n_layers: int
    mesh_shape: tuple[tuple[str, int], ...]
    timing: str
    equations: tuple[tuple[Any, tuple, dict], ...] = field(repr=False, compare=False)

    @property
    def tags(self) -> tuple[str, ...]:
        """The checkpoint_name tags of the block, in order."""
        return tuple(op.tag for op in self.operators if op.tag)

    def graph(self) -> tuple[OperatorGraph, tuple[str, ...]]:
        """The selection problem: one decision unit per distinct signature; and the unit signatures.

        Identity operators other than checkpoint_name tags (sharding
        constraints, stop_gradient, ...) are never saved: recomputing them
        is free, and a policy that does not refer to them works whether or
        not the block is traced with sharding constraints.
        """
        ops = self.operators
        saveable = [op.primitive not in IDENTITY_PRIMITIVES or op.primitive == "name" for op in ops]
        sigs = list(dict.fromkeys(op.signature for op, ok in zip(ops, saveable) if ok))
        unit_of = {s: u for u, s in enumerate(sigs)}
        # A layer-invariant value is hoisted out of the scan: stored once for all layers.
        bytes_ = [op.bytes / self.n_layers if op.invariant else op.bytes for op in ops]
        g = OperatorGraph(
            bytes_,
            [op.time for op in ops],
            [op.inputs for op in ops],
            [op.needed for op in ops],
            [unit_of[op.signature] if ok else -1 for op, ok in zip(ops, saveable)],
        )
        return g, tuple(sigs)

    def saveable(self, policy: Callable | None) -> np.ndarray:
        """Which operators ``policy`` (a jax.checkpoint policy; None: save everything) marks saveable."""
        if policy is None:
            return np.ones(len(self.operators), dtype=bool)
        return np.array([_is_saveable(policy(prim, *avals, **params)) for prim, avals, params in self.equations])

    def evaluate(self, policy: Callable | None) -> Evaluation:
        """Saved bytes per block (beyond the input; hoisted values count 1/n_layers) and recompute time of a policy."""
        g, _ = self.graph()
        mask = self.saveable(policy)
        own = OperatorGraph(g.bytes, g.time, g.inputs, g.needed, np.where(mask, np.cumsum(mask) - 1, -1))
        return evaluate(own, range(own.n_units))

    def recompute_flops(self, recomputed: np.ndarray) -> float:
        """FLOPs per device of the recomputed operators (a mask over operators)."""
        return float(sum(op.flops for op, r in zip(self.operators, recomputed) if r))

    def table(self) -> str:
        """Every operator: group, primitive and shape, bytes, FLOPs, time, read by the backward pass."""
        rows = [f"{'#':>4} {'group':<14} {'operator':<40} {'MiB':>9} {'MFLOP':>10} {'us':>9} needed"]
        for op in self.operators:
            rows.append(
                f"{op.index:>4} {op.group:<14} {op.label[:40]:<40} {op.bytes / 2**20:>9.3f} "
                f"{op.flops / 1e6:>10.3f} {op.time * 1e6:>9.2f} {'yes' if op.needed else ''}"
                + (" (layer-invariant)" if op.invariant else "")
            )
        return "\n".join(rows)


def _is_saveable(decision: Any) -> bool:
    kind = type(decision).__name__  # jax's Saveable / Recompute / Offloadable markers, else a truth value
    if kind in ("SaveableType", "RecomputeType", "OffloadableType", "Offloadable"):
        return kind == "SaveableType"
    return bool(decision)


# --------------------------------------------------------------------------- costs


def _bind_fn(eqn: Equation) -> tuple[Callable, list[jax.ShapeDtypeStruct]]:
    lits = {k: r[1] for k, r in enumerate(eqn.inputs) if r[0] == "lit"}
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in enumerate(eqn.in_avals) if k not in lits]

    def fn(*args):
        it = iter(args)
        vals = [lits[k] if k in lits else next(it) for k in range(len(eqn.inputs))]
        return eqn.primitive.bind(*vals, **eqn.params)

    return fn, avals


def _example(a: jax.ShapeDtypeStruct) -> jax.Array:
    if jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.ones(a.shape, a.dtype)
    return jnp.zeros(a.shape, a.dtype)  # in-range indices, False masks


def _median_seconds(f: Callable, args: Sequence[Any], repeats: int) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = _time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(_time.perf_counter() - t0)
    return statistics.median(times)


def _equation_cost(eqn: Equation, measure: bool, repeats: int, overhead: float) -> tuple[float, float]:
    """(FLOPs, seconds) of one equation alone at its (global) shapes; (0, 0) if it cannot run alone."""
    if eqn.name in IDENTITY_PRIMITIVES:
        return 0.0, 0.0
    fn, avals = _bind_fn(eqn)
    try:
        lowered = jax.jit(fn).lower(*avals)
        cost = lowered.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float((cost or {}).get("flops", 0.0))
        if not measure:
            return max(flops, 0.0), 0.0
        compiled = lowered.compile()
        seconds = _median_seconds(compiled, [_example(a) for a in avals], repeats)
        return max(flops, 0.0), max(seconds - overhead, 0.0)
    except Exception:  # collectives outside their shard_map, effects, opaque types: no cost known
        return 0.0, 0.0


def _dispatch_overhead(repeats: int) -> float:
    f = jax.jit(lambda a: a + 1).lower(jax.ShapeDtypeStruct((1,), jnp.float32)).compile()
    return _median_seconds(f, [jnp.ones((1,), jnp.float32)], max(repeats, 5))


# --------------------------------------------------------------------------- profiling


def profile_function(
    fn: Callable,
    params: Any,
    x: Any,
    invariants: Sequence[Any] = (),
    *,
    param_specs: Any = None,
    x_spec: Any = None,
    invariant_specs: Sequence[Any] | None = None,
    mesh_shape: Mapping[str, int] | None = None,
    n_layers: int = 1,
    measure: bool = False,
    peak_flops: float | None = None,
    repeats: int = 5,
    trace_context: Callable[[], Any] | None = None,
) -> BlockProfile:
    """Profile ``fn(params, x, *invariants) -> x'``, one scanned block, as ``jax.checkpoint`` sees it.

    ``params``, ``x``, ``invariants``: pytrees of ShapeDtypeStruct at global
    shapes; ``*_specs``: matching PartitionSpecs (None: replicated) on a
    mesh of ``mesh_shape`` axis sizes.  ``measure=False`` needs
    ``peak_flops`` (FLOP/s per device) and sets time = FLOPs / peak_flops.
    ``trace_context``: a context manager factory entered while tracing
    (e.g. the activation-sharding rules the model reads).
    """
    if not measure and not peak_flops:
        raise ValueError("profile without measurement needs peak_flops (FLOP/s per device)")
    sizes = dict(mesh_shape or {})

    def specs_of(tree, spec_tree):
        n = len(jax.tree.leaves(tree))
        if spec_tree is None:
            return [()] * n
        flat = jax.tree.leaves(spec_tree, is_leaf=lambda s: s is None or isinstance(s, jax.sharding.PartitionSpec))
        return [() if s is None else spec_from_partition(s, len(a.shape)) for s, a in zip(flat, jax.tree.leaves(tree))]

    leaf_specs = (
        specs_of(params, param_specs)
        + specs_of(x, x_spec)
        + specs_of(tuple(invariants), tuple(invariant_specs) if invariant_specs is not None else None)
    )
    with trace_context() if trace_context is not None else _null():
        eqns, kinds, origins = trace_checkpointed(fn, params, x, invariants)
    input_specs = [leaf_specs[o] if o is not None else () for o in origins]
    propagate_shardings(eqns, input_specs, sizes)

    known = [i for i, e in enumerate(eqns) if e.known]
    new_index = {i: k for k, i in enumerate(known)}
    overhead = _dispatch_overhead(repeats) if measure else 0.0
    costs: dict[str, tuple[float, float]] = {}
    groups = _groups([eqns[i] for i in known])
    operators, equations = [], []
    for k, i in enumerate(known):
        e = eqns[i]
        sig = signature(e.primitive, e.in_avals, e.params)
        if sig not in costs:
            costs[sig] = _equation_cost(e, measure, repeats, overhead)
        flops, seconds = costs[sig]
        fracs = [1.0] * len(e.out_avals) if e.local else [shard_fraction(s, sizes) for s in e.out_specs]
        out_bytes = sum(nbytes(a) * f for a, f in zip(e.out_avals, fracs))
        work = min(fracs + [_input_fraction(eqns, e, r, input_specs, sizes) for r in e.inputs if r[0] != "lit"])
        a0 = e.out_avals[0] if e.out_avals else None
        operators.append(
            Operator(
                index=k,
                primitive=e.name,
                group=groups[k],
                shape=tuple(getattr(a0, "shape", ())),
                dtype=str(getattr(a0, "dtype", "")),
                bytes=int(round(out_bytes)),
                flops=flops * work,
                time=seconds * work if measure else flops * work / peak_flops,
                inputs=tuple(sorted({new_index[r[1]] for r in e.inputs if r[0] == "op"})),
                needed=e.needed,
                invariant=e.invariant,
                signature=sig,
                tag=e.params.get("name") if e.name == "name" else None,
            )
        )
        equations.append((e.primitive, tuple(e.in_avals), e.params))
    x_bytes = sum(nbytes(a) * shard_fraction(s, sizes) for a, s in zip(jax.tree.leaves(x), specs_of(x, x_spec)))
    backend = jax.default_backend()
    timing = (
        f"measured on {backend} (median of {repeats}, minus {overhead * 1e6:.1f} us dispatch)"
        if measure
        else f"XLA FLOPs / {peak_flops:.3g} FLOP/s"
    )
    return BlockProfile(
        tuple(operators), int(round(x_bytes)), n_layers, tuple(sorted(sizes.items())), timing, tuple(equations)
    )


def _input_fraction(eqns, e, ref, input_specs, sizes) -> float:
    if e.local:
        return 1.0
    spec = input_specs[ref[1]] if ref[0] == "in" else eqns[ref[1]].out_specs[ref[2]]
    return shard_fraction(spec, sizes)


def _groups(eqns: list[Equation]) -> list[str]:
    labels, pending = [], 0
    for e in eqns:
        pending += 1
        if e.name == "name":
            labels += [e.params["name"]] * pending
            pending = 0
    return labels + ["(block output)"] * pending


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def abstract_mesh(mesh_shape: Mapping[str, int]) -> AbstractMesh:
    """An AbstractMesh with jaxdist's five axes (missing ones of size 1), all Auto."""
    sizes = tuple(int(mesh_shape.get(a, 1)) for a in MESH_AXES)
    return AbstractMesh(sizes, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def scan_unit(cfg: ModelConfig, layers: dict, names: dict, block_fn: Callable):
    """(fn(p, x, cos, sin), one scan step's abstract weights, their logical names): what the model scans.

    Dense model: one block per step.  MoE model (``model.moe.experts``): a
    group of ``moe.every`` blocks per step, the last an MoE block, as
    :class:`~jaxdist.models.transformer.Transformer` scans it.
    """
    if not cfg.moe.experts:
        step = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in layers.items()}
        return (lambda p, x, cos, sin: block_fn(p, x, cos, sin, cfg)), step, {k: tuple(names[k][1:]) for k in layers}
    grouped = jax.eval_shape(lambda s: split_group(s, cfg), layers)
    step = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in grouped.items()}
    # A weight reshaped to [groups, blocks, ...] gains an unsplit blocks axis.
    step_names = {k: (None,) * (len(step[k].shape) - len(names[k][1:])) + tuple(names[k][1:]) for k in step}

    def fn(p, x, cos, sin):
        aux = {}
        for j in range(cfg.moe.every):
            x, a = block_fn(group_member(p, j, cfg), x, cos, sin, cfg, with_aux=True)
            aux = a or aux
        return x, aux

    return fn, step, step_names


def profile_block(
    cfg: ModelConfig,
    batch: int,
    seq_len: int,
    mesh_shape: Mapping[str, int] | None = None,
    rules: Rules = DEFAULT_RULES,
    *,
    measure: bool = False,
    peak_flops: float | None = None,
    repeats: int = 5,
    block_fn: Callable | None = None,
) -> BlockProfile:
    """Profile one step of the model's layer scan at batch x seq_len tokens (global) on a mesh of ``mesh_shape``.

    One step is one block (a group of ``moe.every`` blocks for an MoE model).
    Weights come from ``create_abstract`` (one step's slice), shardings from
    ``logical_to_spec`` with ``rules``; the activations are constrained as in
    training (``sharded_tracing``; MoE experts run their single-device
    path: the expert-parallel layout is not active while profiling).
    ``block_fn(p, x, cos, sin, cfg)`` defaults to
    :func:`jaxdist.models.transformer.block_forward`.
    """
    block_fn = block_fn or block_forward
    mesh = abstract_mesh(mesh_shape or {})
    _, abstract, names = create_abstract(cfg)
    fn, layer, layer_names = scan_unit(cfg, abstract["layers"], names["layers"], block_fn)
    specs = {k: logical_to_spec(layer_names[k], rules, mesh, layer[k].shape) for k in layer}
    dt = jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32
    x = jax.ShapeDtypeStruct((batch, seq_len, cfg.d_model), dt)
    x_spec = logical_to_spec(("batch", "seq", "embed"), rules, mesh, x.shape)
    table = jax.ShapeDtypeStruct((seq_len, cfg.head_dim // 2), jnp.float32)
    steps = cfg.n_layers // cfg.moe.every if cfg.moe.experts else cfg.n_layers
    return profile_function(
        fn,
        layer,
        x,
        (table, table),
        param_specs=specs,
        x_spec=x_spec,
        mesh_shape=dict(mesh.shape),
        n_layers=steps,
        measure=measure,
        peak_flops=peak_flops,
        repeats=repeats,
        trace_context=lambda: sharded_tracing(mesh, rules),
    )  # as the Trainer traces the model

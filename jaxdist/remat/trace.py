"""The forward operators that ``jax.checkpoint`` decides about, read from a jaxpr.

``jax.checkpoint`` applies its policy to the equations of the *JVP* of the
checkpointed function (primal equations next to tangent equations); an
equation whose inputs are all primal ("known") is forward computation, and
the known values that tangent equations read are what the backward pass
needs.  :func:`trace_checkpointed` traces exactly that jaxpr (it takes it
from the ``remat`` equation that ``jax.jvp(jax.checkpoint(fn))`` produces),
inlines nested calls (``jit``, ``custom_jvp`` / ``custom_vjp`` bodies,
``shard_map`` bodies, whose shapes are already per device) and returns a flat
list of equations with their dependencies.  Control flow inside the block
(``scan``, ``while``, ``cond``) stays one opaque equation.

:func:`propagate_shardings` then estimates each value's split over the mesh
(a small GSPMD: input and ``with_sharding_constraint`` specs carried through
elementwise ops, broadcasts, reductions, dot_general, reshapes and
transposes), which gives bytes per device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

Spec = tuple[tuple[str, ...], ...]  # mesh axes per dimension

# Call-like primitives whose body is inlined (their partial-eval rules recurse with the same policy).
_INLINE = {
    "pjit": "jaxpr",
    "jit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "shard_map": "jaxpr",
}
# Parameters that say where a value lives, not what is computed: left out of signatures.
_PLACEMENT_PARAMS = {
    "sharding",
    "out_sharding",
    "out_shardings",
    "in_shardings",
    "mesh",
    "context_mesh",
    "layout",
    "unconstrained_dims",
    "resource_env",
    "donated_invars",
    "ctx_mesh",
}


@dataclass
class Equation:
    """One flattened equation.  ``inputs`` entries: ("in", k), ("op", i, j), ("lit", value)."""

    primitive: Any
    params: dict
    inputs: list[tuple]
    in_avals: list[Any]
    out_avals: list[Any]
    local: bool  # inside a shard_map body: shapes are per device already
    known: bool = False
    live: bool = False
    needed: bool = False
    invariant: bool = False
    out_specs: list[Spec] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.primitive.name


def signature(primitive: Any, in_avals: Sequence[Any], params: dict) -> str:
    """What a ``jax.checkpoint`` policy can see of an equation: primitive, input shapes and dtypes, parameters."""
    avals = ",".join(f"{getattr(a, 'dtype', '?')}{list(getattr(a, 'shape', ()))}" for a in in_avals)
    kept = []
    for k in sorted(params):
        v = params[k]
        if k in _PLACEMENT_PARAMS or isinstance(v, (Jaxpr, ClosedJaxpr)) or callable(v):
            continue
        kept.append(f"{k}={v!r}")
    return f"{primitive.name}({avals}){{{';'.join(kept)}}}"


def _sub_jaxpr(eqn) -> tuple[Jaxpr, list] | None:
    key = _INLINE.get(eqn.primitive.name)
    sub = eqn.params.get(key) if key else None
    if sub is None:
        return None
    if isinstance(sub, ClosedJaxpr):
        return sub.jaxpr, [("lit", c) for c in sub.consts]
    return sub, []


def _flatten(jaxpr: Jaxpr, inputs: list[tuple], consts: list[tuple], out: list[Equation], local: bool) -> list[tuple]:
    env: dict[Any, tuple] = {}
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, inputs))

    def read(v):
        return ("lit", v.val) if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn)
        if sub is not None and len(sub[0].invars) == len(ins):
            body, body_consts = sub
            outs = _flatten(body, ins, body_consts, out, local or eqn.primitive.name == "shard_map")
        else:
            idx = len(out)
            out.append(
                Equation(
                    eqn.primitive,
                    dict(eqn.params),
                    ins,
                    [v.aval for v in eqn.invars],
                    [v.aval for v in eqn.outvars],
                    local,
                )
            )
            outs = [("op", idx, j) for j in range(len(eqn.outvars))]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _find_remat(jaxpr: Jaxpr):
    for eqn in jaxpr.eqns:
        if "policy" in eqn.params and "jaxpr" in eqn.params:
            return eqn
    raise AssertionError("jax.jvp(jax.checkpoint(fn)) produced no remat equation")


def trace_checkpointed(
    fn: Callable, params: Any, x: Any, invariants: Sequence[Any] = ()
) -> tuple[list[Equation], list[str], list[int | None]]:
    """Flat forward/backward equations of ``jax.checkpoint(fn)`` under differentiation.

    ``fn(params, x, *invariants)``; ``params`` and ``x`` (pytrees of
    ShapeDtypeStruct) are differentiated, ``invariants`` are not (like the
    rotary tables, closed over by the scanned block).  Returns the equations
    and, for each input reference ``("in", k)``, its kind (``"param"``,
    ``"x"``, ``"invariant"`` or ``"tangent"``) and its position among the
    leaves of (params, x, invariants), tangents mapped to their primal
    (None for a constant the trace created).  Marks each equation
    ``known`` (forward), ``live`` and ``needed`` (its value is read by the
    backward pass) and ``invariant`` (depends on invariant inputs only).
    """
    p_leaves, x_leaves = jax.tree.leaves(params), jax.tree.leaves(x)

    def outer(p, xx, inv, tp, tx):
        body = jax.checkpoint(lambda p_, x_: fn(p_, x_, *inv))
        return jax.jvp(body, (p, xx), (tp, tx))

    closed = jax.make_jaxpr(outer)(params, x, tuple(invariants), params, x)
    top = closed.jaxpr
    kinds_of, origin_of = {}, {}
    n_p, n_x, n_inv = len(p_leaves), len(x_leaves), len(jax.tree.leaves(tuple(invariants)))
    n_primal = n_p + n_x + n_inv
    for k, v in enumerate(top.invars):
        kinds_of[v] = "param" if k < n_p else "x" if k < n_p + n_x else "invariant" if k < n_primal else "tangent"
        origin_of[v] = k if k < n_primal else k - n_primal  # tangents follow (params, x) order
    remat = _find_remat(top)
    kinds, origins, inputs = [], [], []
    for k, v in enumerate(remat.invars):
        known_var = not isinstance(v, Literal) and v in kinds_of
        kinds.append(kinds_of[v] if known_var else "invariant")  # a constant made by the trace
        origins.append(origin_of[v] if known_var else None)
        inputs.append(("in", k))
    eqns: list[Equation] = []
    outs = _flatten(remat.params["jaxpr"], inputs, [], eqns, False)
    _classify(eqns, kinds, outs)
    return eqns, kinds, origins


def _classify(eqns: list[Equation], kinds: list[str], outs: list[tuple]) -> None:
    def unknown(ref):
        return (ref[0] == "in" and kinds[ref[1]] == "tangent") or (ref[0] == "op" and not eqns[ref[1]].known)

    def invariant(ref):
        return (
            ref[0] == "lit"
            or (ref[0] == "in" and kinds[ref[1]] == "invariant")
            or (ref[0] == "op" and eqns[ref[1]].invariant)
        )

    for e in eqns:
        e.known = not any(unknown(r) for r in e.inputs)
        e.invariant = e.known and all(invariant(r) for r in e.inputs)
    # Liveness: what the outputs depend on (jax DCEs the rest of the backward pass).
    stack = [r[1] for r in outs if r[0] == "op"]
    while stack:
        i = stack.pop()
        if eqns[i].live:
            continue
        eqns[i].live = True
        stack.extend(r[1] for r in eqns[i].inputs if r[0] == "op")
    for e in eqns:
        if e.live and not e.known:
            for r in e.inputs:
                if r[0] == "op" and eqns[r[1]].known:
                    eqns[r[1]].needed = True


# --------------------------------------------------------------------------- sharding


def spec_from_partition(pspec: Any, rank: int) -> Spec:
    """A PartitionSpec as mesh axes per dimension, padded to ``rank``."""
    dims = []
    for entry in tuple(pspec)[:rank]:
        dims.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(dims) + ((),) * (rank - len(dims))


def shard_fraction(spec: Spec, mesh_sizes: dict[str, int]) -> float:
    """Share of a global array one device holds under ``spec`` (1 = replicated)."""
    return 1.0 / math.prod(mesh_sizes.get(a, 1) for dim in spec for a in dim)


def _fit(spec: Sequence[Sequence[str]], shape: Sequence[int], sizes: dict[str, int]) -> Spec:
    """Drop mesh axes used twice, of size 1, or that do not divide their dimension."""
    used: set[str] = set()
    out = []
    for dim, n in zip(spec, shape):
        kept: list[str] = []
        for a in dim:
            s = sizes.get(a, 1)
            if a in used or s == 1 or n % (math.prod(sizes[b] for b in kept) * s):
                continue
            kept.append(a)
        used.update(kept)
        out.append(tuple(kept))
    return tuple(out) + ((),) * (len(shape) - len(out))


def _reshape_spec(spec: Spec, old: Sequence[int], new: Sequence[int]) -> list[tuple[str, ...]]:
    # Walk both shapes in groups of equal product; the major input dim's axes go to the major output dim.
    out: list[tuple[str, ...]] = [() for _ in new]
    i = j = 0
    while i < len(old) and j < len(new):
        gi, gj, pi, pj = [i], [j], old[i], new[j]
        while pi != pj:
            if pi < pj:
                i += 1
                if i >= len(old):
                    return out
                gi.append(i)
                pi *= old[i]
            else:
                j += 1
                if j >= len(new):
                    return out
                gj.append(j)
                pj *= new[j]
        major = next((k for k in gi if old[k] != 1), gi[0])
        target = next((k for k in gj if new[k] != 1), gj[0])
        out[target] = spec[major]
        i, j = i + 1, j + 1
    return out


def _out_spec(e: Equation, in_specs: list[Spec], sizes: dict[str, int]) -> list[Spec]:
    name, p = e.name, e.params
    shapes = [tuple(getattr(a, "shape", ())) for a in e.out_avals]
    out0 = shapes[0] if shapes else ()
    first = in_specs[0] if in_specs else ()
    in_shapes = [tuple(getattr(a, "shape", ())) for a in e.in_avals]
    if name == "sharding_constraint" and hasattr(p.get("sharding"), "spec"):
        spec = spec_from_partition(p["sharding"].spec, len(out0))
    elif name == "broadcast_in_dim":
        spec = [() for _ in out0]
        for k, d in enumerate(p["broadcast_dimensions"]):
            if in_shapes[0][k] == out0[d]:
                spec[d] = first[k]
    elif name == "transpose":
        spec = [first[k] for k in p["permutation"]]
    elif name == "reshape":
        spec = _reshape_spec(first, in_shapes[0], out0)
    elif name == "squeeze":
        spec = [s for k, s in enumerate(first) if k not in set(p["dimensions"])]
    elif name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        ls, rs = in_specs[0], in_specs[1]
        spec = [ls[a] or rs[b] for a, b in zip(lb, rb)]
        spec += [ls[k] for k in range(len(ls)) if k not in lc and k not in lb]
        spec += [rs[k] for k in range(len(rs)) if k not in rc and k not in rb]
    elif "axes" in p and name.startswith(("reduce_", "argm")):
        spec = [s for k, s in enumerate(first) if k not in set(p["axes"])]
    else:
        # Elementwise and shape-preserving ops: per dimension, the first input that splits it.
        same = [s for s, sh in zip(in_specs, in_shapes) if sh == out0]
        if same:
            spec = [next((s[k] for s in same if s[k]), ()) for k in range(len(out0))]
        elif in_shapes and len(in_shapes[0]) == len(out0):  # slices, pads, concatenation, gathers
            spec = list(first)
        else:
            spec = [() for _ in out0]
    spec = _fit(spec, out0, sizes)
    return [spec if sh == out0 else ((),) * len(sh) for sh in shapes]


def propagate_shardings(eqns: list[Equation], input_specs: list[Spec], mesh_sizes: dict[str, int]) -> None:
    """Fill ``out_specs`` of every equation from the inputs' specs (``input_specs[k]`` for ("in", k))."""
    for e in eqns:
        if e.local:  # inside shard_map: shapes are already per device
            e.out_specs = [((),) * len(getattr(a, "shape", ())) for a in e.out_avals]
            continue
        ins = []
        for r, aval in zip(e.inputs, e.in_avals):
            rank = len(getattr(aval, "shape", ()))
            spec = input_specs[r[1]] if r[0] == "in" else eqns[r[1]].out_specs[r[2]] if r[0] == "op" else ()
            ins.append(tuple(spec) + ((),) * (rank - len(spec)))
        e.out_specs = _out_spec(e, ins, mesh_sizes)


def nbytes(aval: Any) -> int:
    """Global bytes of an abstract value."""
    shape = getattr(aval, "shape", None)
    if shape is None:
        return 0
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize

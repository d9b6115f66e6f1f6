"""Pipeline stages for a model of your own: its stack of identical blocks (``jaxdist.models.blocks.run_blocks``)
split over the ``pipeline`` mesh axis, the gpipe schedule, the backward by autodiff.

The stack's parameters lead with the logical axis ``layers``, which the rules map to ``pipeline``: stage k holds
blocks ``k*L/p .. (k+1)*L/p - 1``.  :func:`blocks_pipeline` returns the function ``run_blocks`` calls instead of
its scan.  It splits the rows of the stack's input into ``m`` microbatches (microbatch i: rows i, i+m, ..., as
the microbatches of ``jaxdist.train.custom.grads_fn``) and runs a ``shard_map`` manual over ``pipeline`` only,
so ``data``, ``fsdp`` and ``tensor`` stay automatic inside a stage and the model's own constraints apply there.

A stage's program is a ``lax.scan`` over ``m + p - 1`` ticks.  At tick t stage s runs its blocks on microbatch
``t - s`` (stage 0 reads it from the input, the others receive it from stage s - 1 by ``ppermute``), so the
last stage's outputs at ticks ``p - 1 .. m + p - 2`` are the stack's output, microbatch by microbatch.  At the
other ticks a stage computes on an input no output depends on (the schedule's bubble, ``(p - 1) / (m + p -
1)`` of a stage's ticks): its cotangent is zero, so the gradients are the scan's.  The backward is JAX's
transpose of that loop (``ppermute`` sends each cotangent back a stage): every forward, then every backward,
which is gpipe's order; a stage keeps the residuals its blocks' remat policy saves for each of its ticks.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdist.models.blocks import scan_blocks, stack_length
from jaxdist.models.hooks import StackRun
from jaxdist.parallel.grad_sync import without_axes
from jaxdist.parallel.rules import DEFAULT_RULES, Rules, activation_sharding, logical_to_spec

AXIS = "pipeline"


def blocks_pipeline(mesh: Mesh, microbatches: int, rules: Rules = DEFAULT_RULES) -> StackRun:
    """``run(graphdef, stacked state, x) -> x``: the stack's blocks as ``mesh.shape['pipeline']`` stages over
    ``microbatches`` microbatches of ``x``'s rows (see the module docstring); call under jit.  ValueError (one
    sentence) for a stack the stages do not divide or rows the microbatches do not divide."""
    p, m = dict(mesh.shape).get(AXIS, 1), microbatches
    inner = without_axes(rules, (AXIS,))  # the constraints inside a stage name the automatic axes only

    def on_rows(a):  # [m, rows, ...]: a microbatch's rows split as inside a stage
        spec = logical_to_spec((None, "batch"), inner, mesh, a.shape[:2])
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    def run(graphdef, state, x):
        n = stack_length(state)
        if n % p:
            raise ValueError(
                f"your model's stack of {n} blocks does not split into mesh.pipeline={p} stages: use a number of "
                f"stages that divides {n}."
            )
        rows = {leaf.shape[0] if leaf.ndim else 0 for leaf in jax.tree.leaves(x)}
        if len(rows) != 1 or rows.pop() % m:
            raise ValueError(
                f"run_blocks' input has leading axes {sorted({a.shape[:1] for a in jax.tree.leaves(x)})}, which "
                f"train.microbatches={m} cannot split into microbatches: pass arrays whose leading axis is the "
                "batch's rows."
            )
        b = jax.tree.leaves(x)[0].shape[0]
        # [m, rows, ...], the rows on the data axes only: the stages' all-gather said to XLA, not left to guess
        xs = jax.tree.map(lambda a: on_rows(a.reshape(b // m, m, *a.shape[1:]).swapaxes(0, 1)), x)
        fn = jax.shard_map(
            partial(_stage, graphdef, p=p, m=m, inner=inner),
            mesh=mesh,
            in_specs=(jax.tree.map(lambda _: P(AXIS), state), P()),
            out_specs=P(AXIS),
            axis_names={AXIS},
        )
        ys = fn(state, xs)
        return jax.tree.map(lambda y: on_rows(y[p - 1]).swapaxes(0, 1).reshape(b, *y.shape[3:]), ys)

    return run


def _stage(graphdef, state, xs, *, p: int, m: int, inner: Rules):
    """One stage's ticks (inside shard_map): see the module docstring."""
    s = jax.lax.axis_index(AXIS)
    sends = [(i, i + 1) for i in range(p - 1)]

    def tick(received, t):
        fresh = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.minimum(t, m - 1), 0, False), xs)
        h = jax.tree.map(lambda a, b: jnp.where(s == 0, a, b), fresh, received)
        out = scan_blocks(graphdef, state, h)
        return jax.tree.map(lambda o: jax.lax.ppermute(o, AXIS, sends), out), out

    # Before a stage's first microbatch arrives it runs on microbatch 0's input: finite, and unused.
    first = jax.tree.map(lambda a: jax.lax.pcast(a[0], (AXIS,), to="varying"), xs)
    with activation_sharding(jax.sharding.get_abstract_mesh(), inner):
        _, outs = jax.lax.scan(tick, first, jnp.arange(m + p - 1))
    return jax.tree.map(lambda o: o[p - 1 :][None], outs)  # [1, m, rows, ...]: the last stage's are the output

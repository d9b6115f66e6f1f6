"""Pipeline stages by autodiff: a stack of layers (a user's ``jaxdist.models.blocks.run_blocks``, or an MoE
transformer's blocks) split over the ``pipeline`` mesh axis, the gpipe schedule, the backward by JAX's transpose.

The stack's parameters lead with the logical axis ``layers``, which the rules map to ``pipeline``: stage k holds
layers ``k*L/p .. (k+1)*L/p - 1``.  :func:`pipelined_scan` returns the function a model calls instead of
``jax.lax.scan(body, x, stacked)`` (installed with :func:`jaxdist.models.hooks.scanning_layers`).  It splits
the rows of ``x`` into ``m`` microbatches (microbatch i: rows i, i+m, ..., as the microbatches of
``jaxdist.train.step.loss_metrics_and_grads``) and runs a ``shard_map`` manual over ``pipeline`` only, so
``data``, ``fsdp``, ``tensor`` and ``expert`` stay automatic inside a stage and the model's own constraints (and
an MoE layer's expert dispatch) apply there.

A stage's program is a ``lax.scan`` over ``m + p - 1`` ticks.  At tick t stage s runs its layers on microbatch
``t - s`` (stage 0 reads it from the input, the others receive it from stage s - 1 by ``ppermute``), so the
last stage's outputs at ticks ``p - 1 .. m + p - 2`` are the stack's output, microbatch by microbatch, and stage
s's per-layer outputs ``ys`` at ticks ``s .. s + m - 1`` are its layers' for each microbatch.  At the other
ticks a stage computes on an input no output depends on (the schedule's bubble, ``(p - 1) / (m + p - 1)`` of a
stage's ticks): its cotangent is zero, so the gradients are the scan's.  The backward is JAX's transpose of that
loop (``ppermute`` sends each cotangent back a stage): every forward, then every backward, which is gpipe's
order; a stage keeps the residuals its layers' remat policy saves for each of its ticks.

An MoE transformer's stages with dropless dispatch run jaxdist's planned expert dispatch inside them
(``rows``, from :func:`jaxdist.parallel.moe.stage_row_axes`): the ``shard_map`` is then manual over the axes the
dispatch splits the tokens and the experts over too (data, expert), each device's tokens reach their experts by
the all-to-all over ``expert`` (jaxdist.parallel.moe.run_experts runs the dispatch's body on the local arrays),
and the router's statistics are summed over those axes (jaxdist.models.hooks.token_totals).  A weight the same
on every device of those axes is cast to varying once, before the tick loop, so that its gradient is summed
over them once a step, after the backward loop, rather than at every tick; with fsdp each layer's weights are
gathered as its step begins (their gradients reduce-scattered at every tick, as ZeRO-3 does per microbatch).
The microbatches are cast to varying over the stages once as well (stage 0 picks them each tick; their
cotangent, zero on the other stages, is summed once).
Without it XLA partitions the experts itself, gathering a stage's tokens over its data axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdist.config import ConfigError
from jaxdist.models.hooks import LayerScan, totalling_tokens
from jaxdist.parallel.grad_sync import fsdp_dim, keep_axes, spec_axes, token_total, without_axes
from jaxdist.parallel.rules import DEFAULT_RULES, Rules, activation_sharding, logical_to_spec

AXIS = "pipeline"


def stack_length(stacked: Any) -> int:
    """The number of layers a stacked pytree holds (its leaves' leading axis); ValueError if they disagree."""
    lengths = {leaf.shape[0] if leaf.ndim else 0 for leaf in jax.tree.leaves(stacked)}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(
            f"the stack's parameters lead with {sorted(lengths)} layers: stack identical blocks with nnx.vmap, "
            "every parameter on a leading axis of the same length."
        )
    return lengths.pop()


def check_rows_over_stages(batch_size: int, sizes: dict[str, int], outside: str) -> None:
    """ConfigError (one sentence) for a batch whose rows the data axes times the stages do not divide: outside
    the stack (``outside``: what runs there) the rows split over the stages too."""
    ways = math.prod(sizes.get(a, 1) for a in ("data", "fsdp", "expert", AXIS))
    if batch_size % ways:
        raise ConfigError(
            f"train.batch_size={batch_size} does not split over the data axes and the {sizes.get(AXIS, 1)} pipeline "
            f"stages ({ways} ways), where {outside} run: make it a multiple of {ways}."
        )


def pipelined_scan(
    mesh: Mesh,
    microbatches: int,
    rules: Rules = DEFAULT_RULES,
    rows: tuple[str, ...] = (),
    specs: dict[str, P] | None = None,
) -> LayerScan:
    """``run(body, x, stacked) -> (x, ys)``: ``jax.lax.scan(body, x, stacked)`` as ``mesh.shape['pipeline']``
    stages over ``microbatches`` microbatches of ``x``'s rows (see the module docstring); ``ys`` are stacked
    [microbatches, layers, ...].  ``rows``: further axes the stages hold manual, the rows split over them in
    this order (an MoE model's planned dispatch, see the module docstring; ``specs``: the stacked weights' full
    specs by name, ``stacked`` then a dict of them).  Call under jit.  ValueError (one sentence) for a stack the
    stages do not divide or rows the microbatches do not divide."""
    p, m = dict(mesh.shape).get(AXIS, 1), microbatches
    manual = (AXIS, *rows)
    inner = without_axes(rules, manual)  # the constraints inside a stage name the automatic axes only
    totals = partial(token_total, axes=rows, varying=True) if rows else None
    outer = without_axes(rules, (AXIS,))  # a microbatch's rows as a stage holds them: over the data axes

    def on_rows(a):  # [m, rows, ...]: a microbatch's rows split as inside a stage
        spec = logical_to_spec((None, "batch"), outer, mesh, a.shape[:2])
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec))

    def run(body: Callable, x: Any, stacked: Any):
        n = stack_length(stacked)
        if n % p:
            raise ValueError(
                f"a stack of {n} layers does not split into mesh.pipeline={p} stages: use a number of stages that "
                f"divides {n}."
            )
        lengths = {leaf.shape[0] if leaf.ndim else 0 for leaf in jax.tree.leaves(x)}
        b = lengths.pop() if len(lengths) == 1 else 0
        if b == 0 or b % m:
            raise ValueError(
                f"the stack's input has leading axes of {sorted(lengths | {b})} rows, which train.microbatches={m} "
                "cannot split into microbatches: pass arrays whose leading axis is the batch's rows."
            )
        # [m, rows, ...], the rows on the data axes only: the stages' all-gather said to XLA, not left to guess
        xs = jax.tree.map(lambda a: on_rows(a.reshape(b // m, m, *a.shape[1:]).swapaxes(0, 1)), x)
        ys_shape = jax.eval_shape(lambda st, h: jax.lax.scan(body, h, st)[1], stacked, jax.tree.map(lambda a: a[0], xs))
        stage_body, replicated = body, None
        if rows:  # each weight split over the stages and, an expert's, over expert; the rows over ``rows``
            weights = {k: _stacked_spec(keep_axes(specs[k], manual), stacked[k].ndim) for k in stacked}
            row_spec = P(None, rows)
            replicated = {
                k: tuple(a for a in rows if a != "fsdp" and a not in spec_axes(w)) for k, w in weights.items()
            }
            if "fsdp" in rows:
                stage_body = _gathering(body, _slice_fsdp_dims(stacked, specs))
        else:
            weights, row_spec = jax.tree.map(lambda _: P(AXIS), stacked), P()
        fn = jax.shard_map(
            partial(_stage, stage_body, p=p, m=m, inner=inner, totals=totals, replicated=replicated),
            mesh=mesh,
            in_specs=(weights, row_spec),
            out_specs=(P(AXIS, *row_spec), jax.tree.map(lambda _: P(None, AXIS), ys_shape)),
            axis_names=set(manual),
        )
        out, ys = fn(stacked, xs)
        out = jax.tree.map(lambda y: on_rows(y[p - 1]).swapaxes(0, 1).reshape(b, *y.shape[3:]), out)
        return out, ys

    return run


GATHERED = "fsdp_gathered"  # the checkpoint name of a layer's weights gathered over fsdp inside a stage


def _stacked_spec(spec: P, ndim: int) -> P:
    """``spec`` of a weight [layers, ...] for its stacked form with ``ndim`` dimensions: [groups, blocks per
    group, ...] (an MoE transformer's, one more) splits the groups as the layers were."""
    return P(spec[0], None, *spec[1:]) if ndim == len(spec) + 1 else spec


def _slice_fsdp_dims(stacked: dict, specs: dict[str, P]) -> dict[str, int | None]:
    """Each weight's fsdp dimension in one layer's slice of ``stacked`` (the scan's step), from its full spec
    (``specs``: as long as the weight's dimensions; ``stacked`` may hold it with one more leading axis, an MoE
    transformer's groups of blocks), or None."""
    out = {}
    for k, leaf in stacked.items():
        dim = fsdp_dim(specs[k])
        extra = leaf.ndim - len(specs[k])  # 1: [groups, blocks per group, ...] for [layers, ...]
        out[k] = None if dim is None else dim - 1 + extra
    return out


def _gathering(body: Callable, dims: dict[str, int | None]) -> Callable:
    """``body`` with each step's weights all-gathered over fsdp first (their transpose reduce-scatters the
    gradients).  The gathered weights are never kept for the backward: each tick's backward gathers again, so a
    stage holds one layer's whole weights at a time, not every tick's."""

    def gather(layer):
        return {
            k: w if dims[k] is None else jax.lax.all_gather(w, "fsdp", axis=dims[k], tiled=True)
            for k, w in layer.items()
        }

    def step(h, layer):
        return body(h, checkpoint_name(gather(layer), GATHERED))

    return jax.checkpoint(step, policy=jax.checkpoint_policies.save_anything_except_these_names(GATHERED))


def _stage(
    body: Callable,
    stacked,
    xs,
    *,
    p: int,
    m: int,
    inner: Rules,
    totals: Callable | None,
    replicated: dict[str, tuple[str, ...]] | None,
):
    """One stage's ticks (inside shard_map): see the module docstring.  ``replicated``: per weight the manual
    row axes it is the same on (data, and expert for a dense weight): cast to varying once, before the tick
    loop, so that the transpose sums its gradient over them once, after the backward loop, not every tick."""
    if replicated:
        stacked = {k: jax.lax.pcast(w, replicated[k], to="varying") if replicated[k] else w for k, w in stacked.items()}
    # The microbatches as varying over the stages once, too: stage 0 picks them each tick, and the cotangent
    # (zero on the other stages) is summed over the stages once, after the backward loop.
    xs = jax.tree.map(lambda a: jax.lax.pcast(a, (AXIS,), to="varying"), xs)
    s = jax.lax.axis_index(AXIS)
    sends = [(i, i + 1) for i in range(p - 1)]

    def tick(received, t):
        fresh = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.minimum(t, m - 1), 0, False), xs)
        h = jax.tree.map(lambda a, b: jnp.where(s == 0, a, b), fresh, received)
        out, ys = jax.lax.scan(body, h, stacked)
        return jax.tree.map(lambda o: jax.lax.ppermute(o, AXIS, sends), out), (out, ys)

    # Before a stage's first microbatch arrives it runs on microbatch 0's input: finite, and unused.
    first = jax.tree.map(lambda a: a[0], xs)
    with activation_sharding(jax.sharding.get_abstract_mesh(), inner), totalling_tokens(totals):
        _, (outs, ys) = jax.lax.scan(tick, first, jnp.arange(m + p - 1))
    outs = jax.tree.map(lambda o: o[p - 1 :][None], outs)  # [1, m, rows, ...]: the last stage's are the output
    ys = jax.tree.map(lambda y: jax.lax.dynamic_slice_in_dim(y, s, m, 0), ys)  # [m, L/p, ...]: its microbatches'
    return outs, ys

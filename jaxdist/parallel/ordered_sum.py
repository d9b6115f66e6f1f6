"""Gradients summed in one fixed order, the same bits whatever the data-parallel group size
(``train.grad_sync=ordered``).

XLA's all-reduce adds the devices' partial gradients in an order that depends on how many devices hold rows,
and each device's matmuls add over however many rows it holds: after a shrink from 8 to 4 devices the same
batch gives gradients that differ in the last bits, and the run drifts from the uninterrupted one.  Here the
global batch of ``B`` rows is cut into ``U = B / train.grad_unit_rows`` units of consecutive rows, and the step's
gradient is the sum of the units' gradients over one binary tree::

    ((u0 + u1) + (u2 + u3)) + ((u4 + u5) + (u6 + u7))

Each unit's gradient is computed alone, with the same shapes on every mesh (the weights gathered whole), so it
has the same bits whatever device computes it.  A device holding units ``[d*n, (d+1)*n)`` (``n = U / N`` for
``N`` devices over ``data`` x ``fsdp``, a power of two) adds its units in the tree's order as it goes (a binary
counter of ``log2(n)`` partial sums: unit ``i`` is added to the partial sums its trailing one bits name); the
``N`` subtree sums are then all-gathered and added pairwise in device order, the tree's upper levels.  Float
addition is commutative, so every grouping of the tree gives the same result: the sum, the loss, the gradient
norm (from the whole summed gradients on each device) and with them the update are bit-identical for every
``N`` that divides ``U``.

The cost, against XLA's all-reduce (``end``): the units run one after the other on each device (a unit of one
row uses the hardware less than the device's whole slice), the weights are gathered whole on every device
(as with ``fsdp=1``), the device keeps ``log2(n) + 1`` whole-gradient buffers, and the all-gather moves ``N``
whole gradients per device instead of an all-reduce's ~2 (``benchmarks/ordered_sum.py`` measures it).
Dense models on the ``data`` and ``fsdp`` axes only; ``train.microbatches`` must be 1 (the units take their place).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxdist.models import apply_with_aux
from jaxdist.parallel.grad_sync import MANUAL, fsdp_dim, keep_axes, without_axes
from jaxdist.parallel.rules import Rules, activation_sharding


def tree_sum(x: jax.Array) -> jax.Array:
    """The sum over axis 0 (a power of two long) as a binary tree: adjacent pairs first, in index order."""
    n = x.shape[0]
    assert n & (n - 1) == 0, n
    while x.shape[0] > 1:
        x = x[0::2] + x[1::2]
    return x[0]


def counter_sum(unit_fn: Callable, units: jax.Array):
    """(sum of ``unit_fn(units[i])`` over i as :func:`tree_sum` adds them, the per-unit auxiliary outputs),
    computed one unit at a time: the scan keeps one partial sum per tree level (``len(units)`` a power of two).

    ``unit_fn(unit) -> (tree, aux)``: ``tree`` is summed, ``aux`` stacked."""
    n = units.shape[0]
    assert n & (n - 1) == 0, n
    levels = n.bit_length() - 1
    shapes = jax.eval_shape(lambda u: unit_fn(u)[0], units[0])
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def body(carry, xs):
        stack, _ = carry
        i, unit = xs
        v, aux = unit_fn(unit)
        carrying = jnp.bool_(True)
        new_stack = []
        for level in range(levels):
            one = ((i >> level) & 1) == 1
            merge, store = carrying & one, carrying & ~one
            # A merged slot is left as it was: the counter stores into it again before it is read again.
            new_stack.append(jax.tree.map(lambda s, x, store=store: jnp.where(store, x, s), stack[level], v))
            v = jax.tree.map(lambda s, x, merge=merge: jnp.where(merge, s + x, x), stack[level], v)
            carrying = merge
        return (new_stack, v), aux

    (_, total), aux = jax.lax.scan(body, ([zeros] * levels, zeros), (jnp.arange(n), units))
    return total, aux


def ordered_grads_fn(graphdef, mesh, rules: Rules, param_shardings: dict, unit_rows: int) -> Callable:
    """``fn(params, tokens) -> (loss, {"grad_norm": ...}, grads)`` for jaxdist.train.step.make_train_step's
    ``grads_fn``: the mean next-token cross-entropy of ``tokens`` [B, T+1], its gradients summed over units of
    ``unit_rows`` rows in one fixed tree (see the module docstring) and their global norm.  Call under jit."""
    specs = jax.tree.map(lambda s: s.spec, param_shardings)
    manual = jax.tree.map(lambda s: keep_axes(s, MANUAL), specs, is_leaf=lambda x: isinstance(x, P))
    sizes = dict(mesh.shape)
    fsdp = sizes.get("fsdp", 1)
    dims = jax.tree.map(lambda s: fsdp_dim(s) if fsdp > 1 else None, specs, is_leaf=lambda x: isinstance(x, P))
    inner_rules = without_axes(rules, MANUAL)

    def gather(w, dim):
        return w if dim is None else jax.lax.all_gather(w, "fsdp", axis=dim, tiled=True)

    def own_shard(g, dim):
        if dim is None:
            return g
        n = g.shape[dim] // fsdp
        return jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index("fsdp") * n, n, dim)

    def local(params, tokens, n_tokens):
        whole = jax.tree.map(gather, params, dims, is_leaf=lambda x: x is None)
        units = tokens.reshape(tokens.shape[0] // unit_rows, unit_rows, tokens.shape[1])

        def unit_fn(unit):
            def loss_fn(p):
                logits, _ = apply_with_aux(graphdef, p, unit[:, :-1])
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, unit[:, 1:])
                return jnp.sum(ce) / n_tokens  # this unit's share of the global mean

            loss, grads = jax.value_and_grad(loss_fn)(whole)
            return grads, loss

        with activation_sharding(jax.sharding.get_abstract_mesh(), inner_rules):
            subtree, losses = counter_sum(unit_fn, units)
        gathered = jax.lax.all_gather(subtree, MANUAL)  # [N, ...] in device order: the subtrees left to right
        grads = jax.tree.map(tree_sum, gathered)
        loss = tree_sum(jax.lax.all_gather(losses, MANUAL).reshape(-1))
        norm = optax.global_norm(grads)  # from the whole sum on every device: the same bits everywhere
        return loss, norm, jax.tree.map(own_shard, grads, dims, is_leaf=lambda x: x is None)

    def fn(params, tokens):
        b, t1 = tokens.shape
        run = jax.shard_map(
            partial(local, n_tokens=b * (t1 - 1)),
            mesh=mesh,
            in_specs=(manual, P(MANUAL)),
            out_specs=(P(), P(), manual),
            axis_names=set(MANUAL),
            check_vma=False,
        )
        loss, norm, grads = run(params, tokens)
        return loss, {"grad_norm": norm}, grads

    return fn

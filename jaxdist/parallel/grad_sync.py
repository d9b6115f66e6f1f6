"""Gradient reductions issued at their planned points in the backward pass (``train.grad_sync=per_block``).

The step's gradients are computed in ``shard_map`` manual over the data axes (``data`` and ``fsdp``; ``tensor``
stays automatic): each device differentiates the loss of its own rows, and the model passes its weights through
:class:`BucketSync` where they enter the computation (:mod:`jaxdist.models.hooks`): the embedding table at the
lookup, each scan step's group of ``k`` layers (one bucket of :func:`jaxdist.parallel.comm.plan_comm`), the
output head (with tied embeddings the table again: its head gradient is reduced there, apart from the lookup's).
``BucketSync`` is an identity with a custom VJP:

* forward: the weights' ``fsdp`` shards all-gathered (nothing with ``fsdp=1``);
* backward: each fsdp-sharded gradient reduce-scattered over ``fsdp``, then one all-reduce over ``data`` of the
  bucket's scattered gradients together (weights not sharded over fsdp, the norms, over ``data`` and ``fsdp``);
* the lookup's table gradient: one sum over ``data`` x ``fsdp`` (a reduce-scatter over both, the table's columns
  ordered so that each device receives part of its own fsdp shard), then an all-gather over ``data``.

Because the identity sits at the start of the group's forward, its backward runs right after the backward of
the group's last block: the reduction of bucket i is issued before the backward of the blocks below it, and
XLA may overlap the two.  Every device traces the same program, so the order is the same everywhere.

The sums are grouped as automatic sharding (``train.grad_sync=end``) groups them on XLA:CPU, so the gradients
are bit-identical to it: a layer's gradient over fsdp then over data, the final norm's over all devices at once,
the tied table's lookup and head gradients each reduced on its own and added after (the lookup's in one sum over
data x fsdp, as the partitioner reduces a scatter-add).  The collectives themselves run on each device's
``tensor`` shard: inside a nested ``shard_map`` over ``tensor`` (XLA's partitioner would otherwise gather the
tensor-split dimension before a collective over a manual axis, doubling its bytes at tensor=2).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxdist.models import apply_with_aux
from jaxdist.models.hooks import GradSync, syncing_grads, totalling_tokens
from jaxdist.models.moe import MOE_METRICS
from jaxdist.parallel.comm import CommPlan
from jaxdist.parallel.rules import Rules, activation_sharding

MANUAL = ("data", "fsdp")
AUTO = "tensor"  # the one axis that stays automatic inside per_block's shard_map
SCOPE = "grad_sync"  # named scope of the bucket collectives (their HLO op_name contains it)


def _axes(entry) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def keep_axes(spec: P, axes: tuple[str, ...]) -> P:
    """``spec`` with only ``axes`` kept (shard_map's in/out specs name only its own manual axes)."""

    def keep(entry):
        kept = tuple(a for a in _axes(entry) if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(keep(e) for e in spec))


def spec_axes(spec: P) -> set[str]:
    """The mesh axes ``spec`` splits any dimension over."""
    return {a for entry in spec for a in _axes(entry)}


def fsdp_dim(spec: P) -> int | None:
    """The dimension of a parameter's spec that ``fsdp`` shards (its gradient is reduce-scattered there), or None."""
    for i, entry in enumerate(spec):
        if "fsdp" in _axes(entry):
            return i
    return None


def without_axes(rules: Rules, axes: tuple[str, ...]) -> tuple:
    """The rules with ``axes`` removed: inside the shard_map only the automatic axes are constrained."""
    return tuple((name, tuple(a for a in mesh_axes if a not in axes)) for name, mesh_axes in rules)


class Weight(NamedTuple):
    """What :class:`BucketSync` needs of one weight: ``dim`` its fsdp-sharded dimension (None: not sharded over
    fsdp), ``spec`` its spec over ``tensor``, ``transposed``: gathered as its transpose (the tied table at the
    head, which projects with ``table.T``: the layout automatic sharding gathers, so XLA:CPU picks the same
    matmul kernel for the head's backward and the sums agree to the bit); ``replicas``: the axes besides fsdp
    its gradient is summed over (``data``; an MoE model's rows are split over ``expert`` too, which replicates
    its dense weights but splits its experts')."""

    dim: int | None
    spec: P
    transposed: bool = False
    replicas: tuple[str, ...] = ("data",)


class Site(NamedTuple):
    """The devices over the rows' axes besides fsdp (``data``, x ``expert`` for an MoE model), the ``fsdp`` and
    ``tensor`` sizes, whether the weights are the lookup's table, and those axes (``replicas``)."""

    data: int
    fsdp: int
    tensor: int
    lookup: bool
    replicas: tuple[str, ...] = ("data",)


def on_tensor_shards(fn: Callable, tree: dict, specs: dict, tensor: int) -> dict:
    """``fn(tree)`` run on each device's ``tensor`` shard of every array (a nested shard_map over ``tensor``;
    ``specs``: each array's spec over ``tensor``, the same for ``fn``'s result).  Without it XLA's partitioner
    replicates the tensor-split dimension before a collective over a manual axis (2x its bytes at tensor=2)."""
    if tensor == 1:
        return fn(tree)
    return jax.shard_map(fn, in_specs=(specs,), out_specs=specs, axis_names={AUTO}, check_vma=False)(tree)


def gather_weight(w: jax.Array, weight: Weight) -> jax.Array:
    """``w`` all-gathered over ``fsdp`` along ``weight.dim`` (transposed first if ``weight.transposed``)."""
    if weight.dim is None:
        return w
    if weight.transposed:
        assert w.ndim == 2, w.shape
        return jax.lax.all_gather(w.T, "fsdp", axis=1 - weight.dim, tiled=True).T
    return jax.lax.all_gather(w, "fsdp", axis=weight.dim, tiled=True)


def _lookup_reduce(c: jax.Array, dim: int, site: Site) -> jax.Array:
    """The lookup's table gradient ``c`` (whole along ``dim``) summed over the rows' axes (data x fsdp, with an
    MoE model's expert axis beside data) in one sum (device order, as automatic sharding all-reduces a
    scatter-add), each device left with its fsdp shard of ``dim``.

    A reduce-scatter over (data, fsdp) of the columns reordered [fsdp, data, n] -> [data, fsdp, n] hands device
    (i, j) the i-th part of fsdp shard j; an all-gather over data completes the shard.  XLA:CPU sums a
    reduce-scatter in the same device order as an all-reduce (tests/parallel/test_grad_sync.py checks it)."""
    data, fsdp, axes = site.data, site.fsdp, (*site.replicas, "fsdp")
    if fsdp == 1:
        return jax.lax.psum(c, axes)
    if data == 1:
        return jax.lax.psum_scatter(c, "fsdp", scatter_dimension=dim, tiled=True)
    n = c.shape[dim]
    if n % (data * fsdp):  # columns do not split evenly: all-reduce the whole table, keep the own shard
        whole = jax.lax.psum(c, axes)
        return jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index("fsdp") * (n // fsdp), n // fsdp, dim)
    parts = c.reshape(*c.shape[:dim], fsdp, data, n // (fsdp * data), *c.shape[dim + 1 :])
    c = jnp.swapaxes(parts, dim, dim + 1).reshape(c.shape)
    part = jax.lax.psum_scatter(c, axes, scatter_dimension=dim, tiled=True)
    return jax.lax.all_gather(part, site.replicas, axis=dim, tiled=True)


def reduce_bucket(g: dict, dims: dict, site: Site, replicas: dict | None = None) -> dict:
    """One bucket's gradients ``g`` reduced (see the module docstring), on this device's tensor shard: ``dims``
    the fsdp dimension of each (None: not sharded over fsdp), ``site`` the mesh sizes and the lookup's rule,
    ``replicas`` the axes besides fsdp each is summed over (default ``site.replicas``: an MoE model's experts
    are summed over ``data`` only, its dense weights over ``data`` and ``expert``)."""
    if site.lookup:
        return {
            n: jax.lax.psum(c, (*site.replicas, "fsdp")) if dims[n] is None else _lookup_reduce(c, dims[n], site)
            for n, c in g.items()
        }
    over = {n: (replicas or {}).get(n, site.replicas) for n in g}
    out = {}
    for axes in dict.fromkeys(over.values()):  # one all-reduce per set of axes, in a fixed order
        names = [n for n in g if over[n] == axes]
        scattered = {
            n: jax.lax.psum_scatter(g[n], "fsdp", scatter_dimension=dims[n], tiled=True)
            for n in names
            if dims[n] is not None
        }
        if scattered:
            out.update(jax.lax.psum(scattered, axes))
        whole = {n: g[n] for n in names if dims[n] is None}
        if whole:
            out.update(jax.lax.psum(whole, (*axes, "fsdp")))
    return {n: out[n] for n in g}


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _bucket(params: dict, before, weights: tuple, site: Site) -> dict:
    return _bucket_fwd(params, before, weights, site)[0]


def _bucket_fwd(params, before, weights, site):
    w = dict(weights)
    gather = lambda p: {n: gather_weight(x, w[n]) for n, x in p.items()}  # noqa: E731
    return on_tensor_shards(gather, params, {n: x.spec for n, x in w.items()}, site.tensor), before


def _bucket_bwd(weights, site, before, g):
    w = dict(weights)
    dims, replicas = {n: x.dim for n, x in w.items()}, {n: x.replicas for n, x in w.items()}
    with jax.named_scope(SCOPE):
        reduce = lambda g: reduce_bucket(g, dims, site, replicas)  # noqa: E731
        out = on_tensor_shards(reduce, g, {n: x.spec for n, x in w.items()}, site.tensor)
    if before is None:
        return out, None
    # ``before``'s cotangent: zero, computed from this bucket's reductions so that it waits for them (see
    # BucketSync; XLA folds a constant zero, never x * 0 of a float: x may be inf or NaN).
    dep = sum(leaf.reshape(-1)[0] * 0 for leaf in jax.tree.leaves(out))
    return out, dep.astype(before.dtype)


_bucket.defvjp(_bucket_fwd, _bucket_bwd)


class BucketSync(GradSync):
    """The model's gradient sync inside the shard_map (see the module docstring).

    ``weights[where][name]``: the :class:`Weight` of each weight the model passes at ``where`` (``embed``,
    ``layers``, ``head``); ``sizes``: the mesh's axis sizes; ``layers_per_step``: the plan's k (layers; a
    multiple of ``moe.every`` for an MoE model); ``replicas``: the axes besides fsdp the rows are split over.

    XLA's all-reduce combiner merges all-reduces that do not depend on each other, which would move the head
    bucket's (issued first) to the embedding's (issued last, outside the layer loop too).  So the head bucket
    takes one element of the gathered table as an extra input and returns its cotangent, zero, through an
    optimization barrier with its reductions: the lookup's reduction then depends on the head's, and each
    stays at its planned point.  Nothing else waits for the head's reductions, so they still overlap the
    layers' backward.  (The embedding's call comes first in the model's forward, in the same trace.)"""

    def __init__(
        self,
        weights: dict[str, dict[str, Weight]],
        sizes: dict[str, int],
        layers_per_step: int,
        replicas: tuple[str, ...] = ("data",),
    ):
        self.weights, self.layers_per_step, self.replicas = weights, layers_per_step, replicas
        self.sizes = (math.prod(sizes.get(a, 1) for a in replicas), sizes.get("fsdp", 1), sizes.get(AUTO, 1))
        self._lookup = None  # one element of the embedding's gathered table, for the head's call

    def __call__(self, params: dict, where: str) -> dict:
        weights = tuple(sorted((n, self.weights[where][n]) for n in params))
        before, self._lookup = (self._lookup, None) if where == "head" else (None, self._lookup)
        out = _bucket(params, before, weights, Site(*self.sizes, where == "embed", self.replicas))
        if where == "embed":
            self._lookup = out["embed"].reshape(-1)[0]
        return out


def bucket_weights(
    specs: dict, fsdp: int, tied: bool, replicas: tuple[str, ...] = ("data",)
) -> dict[str, dict[str, Weight]]:
    """:class:`BucketSync`'s ``weights`` from the parameters' full specs (``fsdp``: the mesh's fsdp size,
    ``replicas``: the axes besides fsdp the rows are split over; a weight split over one of them, an MoE
    model's experts over ``expert``, is summed over the others)."""

    def weight(spec: P, transposed: bool = False) -> Weight:
        summed = tuple(a for a in replicas if a not in spec_axes(spec))
        return Weight(fsdp_dim(spec) if fsdp > 1 else None, keep_axes(spec, (AUTO,)), transposed, summed)

    head = {"final_norm": weight(specs["final_norm"])}
    if tied:
        head["embed"] = weight(specs["embed"], transposed=True)
    else:
        head["lm_head"] = weight(specs["lm_head"])
    return {
        "layers": {n: weight(s) for n, s in specs["layers"].items()},
        "embed": {"embed": weight(specs["embed"])},
        "head": head,
    }


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def token_total(tree, axes: tuple[str, ...], varying: bool = False):
    """``tree`` summed over the manual ``axes`` the tokens are split over; the backward hands each device its
    own share (the cotangent as it is): every device holds the whole sum in its objective, so the devices'
    gradients add up to the whole batch's.  The model's token totals (jaxdist.models.hooks.token_totals): every
    leaf computed from the device's own tokens.  ``varying``: in a shard_map that checks varying axes (the
    cotangent is cast back to varying over ``axes``)."""
    return jax.lax.psum(tree, axes)


def _token_total_fwd(tree, axes, varying):
    return jax.lax.psum(tree, axes), None


def _token_total_bwd(axes, varying, _, ct):
    if varying:
        ct = jax.tree.map(lambda c: jax.lax.pcast(c, axes, to="varying"), ct)
    return (ct,)


token_total.defvjp(_token_total_fwd, _token_total_bwd)


def row_axes(model, sizes: dict[str, int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the axes per_block's shard_map makes manual, in the batch rule's order; the rows' axes besides fsdp):
    (data, fsdp) and data, or for an MoE model on ``expert`` > 1, whose rows are split over expert too and
    whose dispatch then runs on the local tokens, (data, fsdp, expert) and (data, expert)."""
    if model.moe.experts and sizes.get("expert", 1) > 1:
        return (*MANUAL, "expert"), ("data", "expert")
    return MANUAL, ("data",)


def per_block_grads_fn(graphdef, model, mesh, rules: Rules, param_shardings: dict, plan: CommPlan) -> Callable:
    """``fn(params, tokens) -> (objective, metrics, grads)`` for jaxdist.train.step.make_train_step's
    ``grads_fn``: the mean next-token cross-entropy of ``tokens`` [B, T+1] (an MoE model's plus its router
    losses, and its metrics as jaxdist.train.step.objective gives them) and its gradients, reduced at
    ``plan``'s points.  Call under jit, with the expert layout installed (``Parallelism.bind``).

    An MoE model's dispatch runs on each device's tokens (the shard_map is manual over the axes it would
    split the tokens over, jaxdist.parallel.moe.run_experts), and its router statistics are summed over the
    devices (:func:`token_total`), so its losses are the whole batch's."""
    specs = jax.tree.map(lambda s: s.spec, param_shardings)
    sizes = dict(mesh.shape)
    manual_axes, replicas = row_axes(model, sizes)
    manual = jax.tree.map(lambda s: keep_axes(s, manual_axes), specs, is_leaf=lambda x: isinstance(x, P))
    weights = bucket_weights(specs, sizes.get("fsdp", 1), model.tie_embeddings, replicas)
    sync = BucketSync(weights, sizes, plan.layers_per_bucket, replicas)
    inner_rules = without_axes(rules, manual_axes)
    totals = partial(token_total, axes=manual_axes) if model.moe.experts else None

    def local(params, tokens, n_tokens):
        def loss_fn(p):
            logits, aux = apply_with_aux(graphdef, p, tokens[:, :-1])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
            ce = jnp.sum(ce) / n_tokens  # the global mean's share of these rows: the same 1/N cotangent
            # The router losses are the whole batch's on every device (token_total): each device's backward
            # carries its own tokens' share of them.
            return ce + aux.get("moe_loss", 0.0), (ce, aux)

        with (
            activation_sharding(jax.sharding.get_abstract_mesh(), inner_rules),
            syncing_grads(sync),
            totalling_tokens(totals),
        ):
            (_, (ce, aux)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        ce = jax.lax.psum(ce, manual_axes)
        if not aux:
            return ce, {}, grads
        metrics = {"loss": ce, **{k: aux[k] for k in MOE_METRICS}, "moe_layers": aux["moe_layers"]}
        return ce + aux["moe_loss"], metrics, grads

    def fn(params, tokens):
        b, t1 = tokens.shape
        body = partial(local, n_tokens=b * (t1 - 1))
        run = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(manual, P(manual_axes)),
            out_specs=(P(), P(), manual),
            axis_names=set(manual_axes),
            check_vma=False,
        )
        return run(params, tokens)

    fn.plan = plan
    return fn

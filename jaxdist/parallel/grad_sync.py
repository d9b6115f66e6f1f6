"""Gradient reductions issued at their planned points in the backward pass (``train.grad_sync=per_block``).

The step's gradients are computed in ``shard_map`` manual over the data axes (``data`` and ``fsdp``; ``tensor``
stays automatic): each device differentiates the loss of its own rows, and the model passes its weights through
:class:`BucketSync` where they enter the computation (:mod:`jaxdist.models.hooks`): the embedding table, each
scan step's group of ``k`` layers (one bucket of :func:`jaxdist.parallel.comm.plan_comm`), the output head.
``BucketSync`` is an identity with a custom VJP:

* forward: the weights' ``fsdp`` shards all-gathered (nothing with ``fsdp=1``);
* backward: each fsdp-sharded gradient reduce-scattered over ``fsdp``, then one all-reduce over ``data`` of the
  bucket's scattered gradients together (weights not sharded over fsdp, the norms, over ``data`` and ``fsdp``).

Because the identity sits at the start of the group's forward, its backward runs right after the backward of
the group's last block: the reduction of bucket i is issued before the backward of the blocks below it, and
XLA may overlap the two.  Every device traces the same program, so the order is the same everywhere.

``reduce_at="end"`` keeps the fsdp gathers (their transposes reduce-scatter per block, as automatic sharding
does) and reduces over ``data`` once after the whole backward: the reference the tests compare against.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxdist.models import apply_with_aux
from jaxdist.models.hooks import GradSync, syncing_grads
from jaxdist.parallel.comm import CommPlan
from jaxdist.parallel.rules import Rules, activation_sharding

MANUAL = ("data", "fsdp")
SCOPE = "grad_sync"  # named scope of the bucket collectives (their HLO op_name contains it)


def _manual_spec(spec: P) -> P:
    """``spec`` with only the manual axes kept (shard_map's in/out specs name no automatic axis)."""

    def keep(entry):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in axes if a in MANUAL)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(keep(e) for e in spec))


def _fsdp_dim(spec: P) -> int | None:
    for i, entry in enumerate(spec):
        if entry == "fsdp" or (isinstance(entry, tuple) and "fsdp" in entry):
            return i
    return None


def _without_manual(rules: Rules) -> tuple:
    """The rules with the manual axes removed: inside the shard_map only the automatic axes are constrained."""
    return tuple((name, tuple(a for a in axes if a not in MANUAL)) for name, axes in rules)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _bucket(params: dict, dims: tuple, reduce: bool) -> dict:
    return _gather(params, dict(dims))


def _gather(params: dict, dims: dict) -> dict:
    return {
        n: w if dims[n] is None else jax.lax.all_gather(w, "fsdp", axis=dims[n], tiled=True) for n, w in params.items()
    }


def _bucket_fwd(params, dims, reduce):
    return _gather(params, dict(dims)), None


def _bucket_bwd(dims, reduce, _, g):
    dims = dict(dims)
    with jax.named_scope(SCOPE):
        scattered = {
            n: jax.lax.psum_scatter(c, "fsdp", scatter_dimension=dims[n], tiled=True)
            for n, c in g.items()
            if dims[n] is not None
        }
        if not reduce:  # reduce_at="end": the fsdp transpose only; the data all-reduce comes after the backward
            return ({n: scattered.get(n, c) for n, c in g.items()},)
        out = jax.lax.psum(scattered, "data") if scattered else {}
        whole = {n: c for n, c in g.items() if dims[n] is None}
        if whole:
            out = {**out, **jax.lax.psum(whole, MANUAL)}
    return ({n: out[n] for n in g},)


_bucket.defvjp(_bucket_fwd, _bucket_bwd)


class BucketSync(GradSync):
    """The model's gradient sync inside the shard_map (see the module docstring): ``dims[where][name]`` is the
    fsdp-sharded dimension of each weight (None: not sharded over fsdp), ``layers_per_step`` the plan's k."""

    def __init__(self, dims: dict[str, dict[str, int | None]], layers_per_step: int, reduce: bool):
        self.dims, self.layers_per_step, self.reduce = dims, layers_per_step, reduce

    def __call__(self, params: dict, where: str) -> dict:
        dims = tuple(sorted((n, self.dims[where][n]) for n in params))
        return _bucket(params, dims, self.reduce)


def per_block_grads_fn(
    graphdef, model, mesh, rules: Rules, param_shardings: dict, plan: CommPlan, reduce_at: str = "per_block"
) -> Callable:
    """``fn(params, tokens) -> (loss, {}, grads)`` for jaxdist.train.step.make_train_step's ``grads_fn``: the
    mean next-token cross-entropy of ``tokens`` [B, T+1] and its gradients, reduced at ``plan``'s points
    (``reduce_at="per_block"``) or after the whole backward (``"end"``).  Dense models; call under jit."""
    assert reduce_at in ("per_block", "end"), reduce_at
    specs = jax.tree.map(lambda s: s.spec, param_shardings)
    manual = jax.tree.map(_manual_spec, specs, is_leaf=lambda x: isinstance(x, P))
    fsdp = dict(mesh.shape).get("fsdp", 1)
    dim = lambda s: _fsdp_dim(s) if fsdp > 1 else None
    dims = {
        "layers": {n: dim(s) for n, s in specs["layers"].items()},
        "embed": {"embed": dim(specs["embed"])},
        "head": {n: dim(specs[n]) for n in ("final_norm", "lm_head") if n in specs},
    }
    sync = BucketSync(dims, plan.layers_per_bucket, reduce_at == "per_block")
    inner_rules = _without_manual(rules)

    def local(params, tokens, n_tokens):
        def loss_fn(p):
            logits, _ = apply_with_aux(graphdef, p, tokens[:, :-1])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
            return jnp.sum(ce) / n_tokens  # the global mean's share of these rows: the same 1/N cotangent

        with activation_sharding(jax.sharding.get_abstract_mesh(), inner_rules), syncing_grads(sync):
            loss, grads = jax.value_and_grad(loss_fn)(params)
        if reduce_at == "end":
            with jax.named_scope(SCOPE):
                sharded = jax.tree.map(lambda s: _fsdp_dim(s) is not None and fsdp > 1, specs)
                grads = jax.tree.map(lambda g, s: jax.lax.psum(g, "data" if s else MANUAL), grads, sharded)
        return jax.lax.psum(loss, MANUAL), grads

    def fn(params, tokens):
        b, t1 = tokens.shape
        body = partial(local, n_tokens=b * (t1 - 1))
        run = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(manual, P(MANUAL)),
            out_specs=(P(), manual),
            axis_names=set(MANUAL),
            check_vma=False,
        )
        loss, grads = run(params, tokens)
        return loss, {}, grads

    fn.plan = plan
    return fn

"""``train.grad_sync=per_block`` with pipeline stages: each stage reduces its blocks' gradients once, as soon
as its last backward of the step is done (:class:`StageSync`, used by :mod:`jaxdist.parallel.pipeline_stage`).

Without it the stage's ``data`` and ``fsdp`` axes stay automatic and XLA reduces each block's weight
gradient after every backward unit (every microbatch, every chunk): ``m x s`` reductions per step.  With it
the executor's ``shard_map`` is manual over ``pipeline``, ``data`` and ``fsdp`` (``tensor`` stays automatic):

* the stage's weights are all-gathered over ``fsdp`` once, at the start of the step (the shared embedding,
  final norm and head too);
* each device accumulates the unreduced gradients of its own rows over the units, as the executor already
  accumulates them over the ticks;
* at the tick of the stage's last backward (a per-stage condition inside the tick loop: stages finish at
  different ticks) the accumulated gradients are reduced in the plan's buckets of ``k`` layers, last layer
  first: reduce-scatter over ``fsdp``, all-reduce over ``data`` (norms over both), on each device's tensor
  shard, as :mod:`jaxdist.parallel.grad_sync` reduces them.  The stages still running overlap it, and the
  stage itself has nothing left to do that step;
* the shared weights' gradients (embedding, final norm, head) are complete only when the first stage's last
  backward and the last stage's last forward are both done: they are summed over ``pipeline`` and reduced
  after the tick loop, the tied table's lookup and head gradients apart, as ``grad_sync`` reduces them.

Every device of a stage takes the same branch at the same tick and the reductions' groups lie within one
stage, so the collectives are issued in the same order on every device of a group.

An MoE model's stages (with dropless dispatch, each expert on all of ``tensor``) run this way under either
``train.grad_sync``: its rows are split over ``expert`` too, so the shard_map is manual over ``expert`` as well
and jaxdist's planned dispatch runs inside the stage (the all-to-all over ``expert``,
jaxdist.parallel.moe.run_experts); its dense weights' gradients are summed over data x expert, its experts'
over data only (jaxdist.parallel.grad_sync.bucket_weights), in buckets of whole groups of ``moe.every`` blocks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxdist.parallel.grad_sync import (
    AUTO,
    MANUAL,
    SCOPE,
    Site,
    Weight,
    bucket_weights,
    gather_weight,
    keep_axes,
    on_tensor_shards,
    reduce_bucket,
    row_axes,
)

PIPELINE = "pipeline"


class StageSync:
    """What a pipeline stage does under ``train.grad_sync=per_block`` (see the module docstring).

    ``specs``: the parameters' full PartitionSpecs; ``sizes``: the mesh's axis sizes; ``layers_per_bucket``:
    the plan's k (a divisor of the stage's layer count; a multiple of ``moe.every`` for an MoE model);
    ``tied``: tied embeddings; ``model``: the ModelConfig (an MoE model's rows and buckets, see the module
    docstring).
    """

    def __init__(self, specs: dict, sizes: dict[str, int], layers_per_bucket: int, tied: bool, model=None):
        self.specs, self.k, self.tied = specs, layers_per_bucket, tied
        moe = model is not None and model.moe.experts
        self.every = model.moe.every if moe else 1  # layers per group (a bucket holds whole groups)
        # The axes the rows are split over (an MoE model's over expert too), and those besides fsdp.
        self.rows, self.replicas = row_axes(model, sizes) if moe else (MANUAL, ("data",))
        self.manual = (PIPELINE, *self.rows)
        self.row_devices = math.prod(sizes.get(a, 1) for a in self.rows)
        self.data = math.prod(sizes.get(a, 1) for a in self.replicas)
        self.fsdp, self.tensor = sizes.get("fsdp", 1), sizes.get(AUTO, 1)
        self.weights = bucket_weights(specs, self.fsdp, tied, self.replicas)
        # The shared weights as they enter a stage: each gathered once (the tied table serves lookup and head).
        head = {n: w for n, w in self.weights["head"].items() if n != "embed"}
        self.shared_weights = {"embed": self.weights["embed"]["embed"], **head}

    # ------------------------------------------------------------------ the executor's shard_map

    def in_specs(self) -> tuple[dict, dict, P]:
        """shard_map specs of (layers, shared weights, microbatched tokens [m, B/m, T+1]) over the manual axes."""
        keep = lambda s: keep_axes(s, self.manual)  # noqa: E731
        shared = {n: keep(s) for n, s in self.specs.items() if n != "layers"}
        return {n: keep(s) for n, s in self.specs["layers"].items()}, shared, P(None, self.rows)

    # ------------------------------------------------------------------ forward: gather once per step

    def gather(self, tree: dict, weights: dict[str, Weight]) -> dict:
        """The fsdp shards of ``tree``'s weights all-gathered (on each device's tensor shard)."""
        specs = {n: weights[n].spec for n in tree}
        plain = {n: weights[n]._replace(transposed=False) for n in tree}
        return on_tensor_shards(
            lambda t: {n: gather_weight(x, plain[n]) for n, x in t.items()}, tree, specs, self.tensor
        )

    def gather_layers(self, layers: dict) -> dict:
        """The stage's blocks [L/p, ...] with their weights whole along fsdp."""
        return self.gather(layers, self.weights["layers"])

    def gather_shared(self, shared: dict) -> dict:
        """The embedding table, final norm (and lm_head), whole along fsdp."""
        return self.gather(shared, self.shared_weights)

    # ------------------------------------------------------------------ backward: reduce once per step

    def reduce_layers(self, grads: dict) -> dict:
        """The stage's accumulated block gradients [L/p, ...] (unreduced, whole along fsdp; an MoE model's dense
        MLP and expert weights with their own leading lengths) reduced in buckets of k layers, the last
        layer's bucket first; each device keeps its fsdp shard."""
        w = self.weights["layers"]
        dims, specs = {n: w[n].dim for n in grads}, {n: w[n].spec for n in grads}
        replicas = {n: w[n].replicas for n in grads}
        site = Site(self.data, self.fsdp, self.tensor, False, self.replicas)
        groups, per = grads["wq"].shape[0] // self.every, self.k // self.every  # groups of blocks; per bucket
        assert groups % per == 0, (groups, per)
        share = {n: g.shape[0] // groups for n, g in grads.items()}  # each weight's entries per group
        out = []
        with jax.named_scope(SCOPE):
            for top in range(groups - per, -1, -per):
                bucket = {n: g[top * share[n] : (top + per) * share[n]] for n, g in grads.items()}
                reduce = lambda b: reduce_bucket(b, dims, site, replicas)  # noqa: E731
                out.append(on_tensor_shards(reduce, bucket, specs, self.tensor))
        return {n: jnp.concatenate([b[n] for b in reversed(out)]) for n in grads}

    def gather_rows(self, dx: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The first stage's embedding backward of one unit: the output gradient rows ``dx`` [b, t, d] and
        their ``tokens`` [b, t] of every device of the stage (gathered over data x fsdp in batch order), so
        each device forms the table's lookup gradient whole, summed over the stage's rows as XLA partitions
        the lookup inside a stage (``train.grad_sync=end``) -- b t d numbers a device instead of the V d table."""
        with jax.named_scope(SCOPE):
            return tuple(jax.lax.all_gather(x, self.rows, axis=0, tiled=True) for x in (dx, tokens))

    def reduce_shared(self, head: dict, lookup: jax.Array) -> dict:
        """The shared weights' gradients, summed over the stages: ``head`` (final norm, lm_head or the tied
        table's head gradient) then reduced as the head bucket; ``lookup`` (the table's lookup gradient, whole
        already: :meth:`gather_rows`) cut to this device's fsdp shard; with tied embeddings the two table
        gradients are added after."""
        head, lookup = jax.lax.psum((head, lookup), PIPELINE)
        hw, dim = self.weights["head"], self.weights["embed"]["embed"].dim
        site = Site(self.data, self.fsdp, self.tensor, False, self.replicas)
        with jax.named_scope(SCOPE):
            out = dict(
                on_tensor_shards(
                    lambda h: reduce_bucket(h, {n: hw[n].dim for n in h}, site),
                    head,
                    {n: hw[n].spec for n in head},
                    self.tensor,
                )
            )
        if dim is not None:
            n = lookup.shape[dim] // self.fsdp
            lookup = jax.lax.dynamic_slice_in_dim(lookup, jax.lax.axis_index("fsdp") * n, n, dim)
        out["embed"] = out["embed"] + lookup if self.tied else lookup
        return out

"""Gradient communication plan: which blocks' gradients are reduced together, by which collective, and when.

In data-parallel and FSDP training every replica must reduce each block's gradient.  Reducing them all after
the backward pass leaves the links idle while the devices compute, then the devices idle while the links
work; reducing them block by block overlaps the two, but only if every device issues the same collectives in
the same order.  :func:`plan_comm` decides that order, from the model alone (so it is the same everywhere):

* **Blocks in backward order**: the output head (final norm and ``lm_head``, or with tied embeddings the
  table's head gradient, reduced apart from its lookup gradient as automatic sharding reduces them), the layers
  from last to first, the embedding (the lookup's table gradient).
* **Buckets**: consecutive layers whose gradients together stay within a size threshold travel as one
  collective.  The layers are scanned, so every bucket holds the same number ``k`` of layers (the largest
  divisor of ``n_layers`` whose bucket fits the threshold; at least one).
* **Threshold** (``train.grad_bucket_bytes``; 0 = default): ``10 x n x latency x bandwidth`` of the link the
  data axes use, n the devices in the reduction.  A ring all-reduce of S bytes over n devices costs about
  ``2 (n-1) latency + 2 (n-1)/n S / bandwidth``; at ``S = 10 n latency bandwidth`` the latency term is about a
  tenth of the transfer term, so a bucket pays little for being small while the overlap gains from many.
* **Collective**: all-reduce over ``data`` (one, of the bucket's weights together); with ``fsdp > 1`` first a
  reduce-scatter over ``fsdp`` per weight (the transpose of the forward's all-gather), then the all-reduce
  over ``data`` of the scattered shards.  The embedding's lookup gradient is summed over ``data`` x ``fsdp`` at
  once, as automatic sharding sums a scatter-add (so the sums agree to the bit): a reduce-scatter over both,
  then an all-gather over ``data`` of each fsdp shard's parts (the same bytes on the wire as the pair above).
* **Mixture of experts**: the scanned unit is a group of ``moe.every`` layers (the last an MoE layer), so a
  bucket holds ``k`` groups.  The rows are split over ``expert`` as well, so the dense weights' gradients are
  reduced over ``data`` x ``expert`` (and fsdp); the experts' own weights, split over ``expert``, over ``data``
  (and fsdp) only.
* **Issue point**: right after the backward of the bucket's last block (in backward order).  With pipeline
  stages each stage reduces its blocks' gradients, accumulated over the step's microbatches, once, right after
  its last backward (``k`` then divides the stage's layers); the shared weights' (head, embedding), summed over
  the stages first, after the tick loop (:mod:`jaxdist.parallel.pipeline_sync`).

Nothing here imports JAX: ``jaxdist comm plan`` prints the table before any device starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from jaxdist.cluster import ClusterSpec
from jaxdist.config import ConfigError, ModelConfig
from jaxdist.models.arithmetic import DTYPE_BYTES
from jaxdist.models.names import DENSE_MLP_KEYS, block_param_specs, moe_param_specs

# Logical names split over the tensor axis, over fsdp and over expert (jaxdist.parallel.rules.DEFAULT_RULES says
# the same; an expert's hidden width takes all of tensor, mesh.expert_tensor's default).
_TENSOR_NAMES = ("heads", "kv_heads", "mlp", "vocab", "expert_mlp")
_FSDP_NAMES = ("embed",)
_EXPERT_NAMES = ("expert",)
# Multiplies n x latency x bandwidth in the default threshold (the latency term ~ a tenth of the transfer).
THRESHOLD_FACTOR = 10


@dataclass(frozen=True)
class Bucket:
    """One gradient collective of a step.

    ``blocks``: the blocks whose gradients it carries, in backward order (``head``, ``layer 31``, ...,
    ``embed``); ``bytes``: gradient bytes per device entering it (fsdp-gathered, tensor-split);
    ``reduced_bytes``: what each device holds after it (``bytes / fsdp``); ``collective``: e.g.
    ``reduce-scatter(fsdp) + all-reduce(data)``; ``issue_after``: the backward step after which it is issued.
    """

    index: int
    blocks: tuple[str, ...]
    bytes: int
    reduced_bytes: int
    collective: str
    issue_after: str


@dataclass(frozen=True)
class CommPlan:
    """The gradient collectives of one step, in the order every device issues them (:func:`plan_comm`).

    ``threshold_bytes``: the bucket size limit used; ``layers_per_bucket``: k, layers per layer bucket
    (a multiple of ``moe.every`` for an MoE model);
    ``link``: ``intra`` or ``inter`` (node link the data axes use); ``bandwidth`` (bytes/s), ``latency`` (s);
    ``reduce_devices``: devices in one gradient reduction (data x fsdp; x expert for an MoE model's dense
    weights).
    """

    buckets: tuple[Bucket, ...]
    threshold_bytes: int
    threshold_rule: str
    layers_per_bucket: int
    link: str
    bandwidth: float
    latency: float
    reduce_devices: int
    axis_sizes: tuple[tuple[str, int], ...]

    def table(self) -> str:
        """The plan as a printable table, one row per bucket, with the threshold and its rule above it."""
        sizes = " ".join(f"{a}={n}" for a, n in self.axis_sizes if n > 1) or "one device"
        wide = max(len(b.collective) for b in self.buckets)
        lines = [
            f"gradient collectives per step: {len(self.buckets)} buckets, {self.layers_per_bucket} layer(s) per "
            f"layer bucket; mesh {sizes}; {self.reduce_devices} devices per reduction over the {self.link}-node "
            f"link ({self.bandwidth / 1e9:.4g} GB/s, {self.latency * 1e6:.4g} us)",
            f"threshold {_fmt_bytes(self.threshold_bytes)}: {self.threshold_rule}",
            f"{'#':>3}  {'blocks':<22} {'bytes in':>10} {'bytes out':>10}  {'collective':<{wide}} issued after",
        ]
        for b in self.buckets:
            names = b.blocks[0] if len(b.blocks) == 1 else f"{b.blocks[0]} .. {b.blocks[-1].split()[-1]}"
            lines.append(
                f"{b.index:>3}  {names:<22} {_fmt_bytes(b.bytes):>10} {_fmt_bytes(b.reduced_bytes):>10}  "
                f"{b.collective:<{wide}} {b.issue_after}"
            )
        return "\n".join(lines)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


def local_elements(shape: tuple[int, ...], names: tuple[str, ...], sizes: Mapping[str, int]) -> tuple[int, int]:
    """(elements per device before the gradient reduction, after it) of one weight of ``shape`` with logical
    ``names``: tensor-split dimensions (heads, kv_heads, mlp, vocab) divided by ``tensor`` where it divides
    them; after a reduce-scatter the ``embed`` dimension is also divided by ``fsdp`` where it divides it."""
    tensor, fsdp, expert = sizes.get("tensor", 1), sizes.get("fsdp", 1), sizes.get("expert", 1)
    before, after = 1, 1
    for n, name in zip(shape, names):
        if name in _TENSOR_NAMES and n % tensor == 0:
            n //= tensor
        if name in _EXPERT_NAMES and n % expert == 0:
            n //= expert
        before *= n
        after *= n // fsdp if name in _FSDP_NAMES and n % fsdp == 0 else n
    return before, after


def block_grad_bytes(m: ModelConfig, sizes: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """Gradient bytes per device (before, after the reduction) of each block kind: ``layer`` (one dense
    layer; with experts one group of ``moe.every`` layers, the last an MoE layer: the unit the model scans),
    ``head`` (final norm + lm_head, or the table's head gradient with tied embeddings), ``embed`` (the table's
    lookup gradient)."""
    width = DTYPE_BYTES[m.param_dtype]
    every = m.moe.every if m.moe.experts else 1  # layers per unit
    dense_mlps = every - 1 if m.moe.experts else 1  # the unit's MoE layer has no dense MLP
    layer = [
        tuple(x * (dense_mlps if name in DENSE_MLP_KEYS else every) for x in local_elements(s, n, sizes))
        for name, (s, n) in block_param_specs(m).items()
    ]
    layer += [local_elements(s, n, sizes) for s, n in moe_param_specs(m).values()]
    d, v = m.d_model, m.vocab_size
    head = [local_elements((d,), ("norm",), sizes)]
    embed = local_elements((v, d), ("vocab", "embed"), sizes)
    head.append(embed if m.tie_embeddings else local_elements((d, v), ("embed", "vocab"), sizes))
    return {
        "layer": (sum(b for b, _ in layer) * width, sum(a for _, a in layer) * width),
        "head": (sum(b for b, _ in head) * width, sum(a for _, a in head) * width),
        "embed": (embed[0] * width, embed[1] * width),
    }


def default_threshold(bandwidth: float, latency: float, devices: int) -> int:
    """Bucket size limit (bytes): ``THRESHOLD_FACTOR x devices x latency x bandwidth`` (see the module docstring)."""
    return int(THRESHOLD_FACTOR * max(devices, 2) * latency * bandwidth)


def plan_comm(
    m: ModelConfig,
    sizes: Mapping[str, int],
    cluster: ClusterSpec,
    threshold_bytes: int = 0,
) -> CommPlan:
    """The gradient collectives of one training step of model ``m`` on a mesh of axis ``sizes`` (data, fsdp,
    tensor, ...) on ``cluster``; ``threshold_bytes`` 0 = :func:`default_threshold`.  Pure."""
    data, fsdp = sizes.get("data", 1), sizes.get("fsdp", 1)
    # An MoE model's rows are split over expert too: its dense weights are reduced over data x expert (the
    # experts' own weights over data only, the axis that replicates them).
    replicas = ("data", "expert") if m.moe.experts and sizes.get("expert", 1) > 1 else ("data",)
    n = fsdp * math.prod(sizes.get(a, 1) for a in replicas)
    # The data axes are the ones allowed to cross nodes (jaxdist.cluster.NODE_LOCAL_AXES): over the inter-node
    # link when the cluster has several nodes and the reduction spans more devices than a node holds.
    inter = cluster.nodes > 1 and n * math.prod(v for a, v in sizes.items() if a not in ("fsdp", *replicas)) > (
        cluster.devices_per_node
    )
    bw = cluster.inter_node_bandwidth if inter else cluster.intra_node_bandwidth
    lat = cluster.inter_node_latency if inter else cluster.intra_node_latency
    if threshold_bytes < 0:
        raise ConfigError(f"train.grad_bucket_bytes={threshold_bytes} must be 0 (the default rule) or positive.")
    if threshold_bytes:
        threshold, rule = threshold_bytes, "train.grad_bucket_bytes"
    else:
        threshold = default_threshold(bw, lat, n)
        rule = (
            f"{THRESHOLD_FACTOR} x {max(n, 2)} devices x {lat * 1e6:.4g} us x {bw / 1e9:.4g} GB/s "
            "(latency about a tenth of the transfer time)"
        )
    grads = block_grad_bytes(m, sizes)
    unit_in, unit_out = grads["layer"]
    every = m.moe.every if m.moe.experts else 1  # layers per scanned unit (block_grad_bytes' ``layer``)
    units, stages = m.n_layers // every, sizes.get("pipeline", 1)
    per_stage = units // stages if units % stages == 0 else units  # the config check says why not
    fits = [d for d in range(1, per_stage + 1) if per_stage % d == 0 and d * unit_in <= threshold]
    k = max(fits, default=1)
    over = ", ".join(replicas)
    kind = f"all-reduce({over})" if fsdp == 1 else f"reduce-scatter(fsdp) + all-reduce({over})"
    buckets: list[Bucket] = []

    def add(blocks: tuple[str, ...], nbytes: int, reduced: int, after: str, collective: str = kind) -> None:
        buckets.append(Bucket(len(buckets), blocks, nbytes, reduced, collective, after))

    def layer_buckets(top_unit: int, bottom_unit: int, after) -> None:
        for top in range(top_unit, bottom_unit - 1, -k):
            low = (top - k + 1) * every  # the bucket's first layer
            blocks = tuple(f"layer {i}" for i in range((top + 1) * every - 1, low - 1, -1))
            add(blocks, k * unit_in, k * unit_out, after(low))

    lookup = lookup_collective(data, fsdp, replicas)
    if stages == 1:
        add(("head",), *grads["head"], "backward of head")
        layer_buckets(units - 1, 0, lambda low: f"backward of layer {low}")
        add(("embed",), *grads["embed"], "backward of embed", lookup)
    else:  # each stage's buckets after its last backward; the shared weights' after the tick loop
        for s in range(stages - 1, -1, -1):
            layer_buckets((s + 1) * per_stage - 1, s * per_stage, lambda low, s=s: f"last backward of stage {s}")
        add(("head",), *grads["head"], "the tick loop", "all-reduce(pipeline) + " + kind)
        add(("embed",), *grads["embed"], "the tick loop", "all-reduce(pipeline) + " + lookup)
    return CommPlan(
        tuple(buckets),
        threshold,
        rule,
        k * every,
        "inter" if inter else "intra",
        bw,
        lat,
        n,
        tuple(sorted(sizes.items())),
    )


def lookup_collective(data: int, fsdp: int, replicas: tuple[str, ...] = ("data",)) -> str:
    """The collective of the embedding's lookup gradient (see the module docstring; ``replicas``: the axes
    besides fsdp the rows are split over, ``data`` and with experts ``expert``)."""
    over = ", ".join(replicas)
    if fsdp == 1:
        return f"all-reduce({over})"
    if data == 1 and replicas == ("data",):
        return "reduce-scatter(fsdp)"
    return f"reduce-scatter({over}, fsdp) + all-gather({over})"


def plan_for_config(config, cluster: ClusterSpec) -> CommPlan:
    """:func:`plan_comm` of a whole Config: its model, ``mesh`` axis sizes (``data=-1`` filled from the cluster's
    devices) and ``train.grad_bucket_bytes``; ConfigError if the mesh does not fit the cluster."""
    sizes = config.mesh.resolved(cluster.n_devices)
    return plan_comm(config.model, sizes, cluster, config.train.grad_bucket_bytes)


def xla_gpu_options(plan: CommPlan) -> dict[str, bool | int]:
    """XLA compiler options for a GPU train step, from ``plan`` (the Trainer sets them under either grad_sync).

    * ``xla_gpu_enable_latency_hiding_scheduler``: schedule each asynchronous collective's start as early and
      its done as late as the data allow, so a bucket's reduction runs under the backward of the blocks below
      it.  Under ``end`` that is XLA's own form of ``per_block``; under ``per_block`` it is what lets the
      collectives issued at the plan's points overlap at all (without it a start may sit next to its done);
    * ``xla_gpu_all_reduce_combine_threshold_bytes``, ``..._reduce_scatter_...`` and ``..._all_gather_...``:
      the combiner passes merge independent collectives up to this size; the plan's largest bucket.  Under
      ``end`` XLA then forms buckets of the plan's size rather than its defaults (which may merge the whole
      backward's reductions into one at the end); under ``per_block`` a bucket's per-weight reduce-scatters
      merge into one, but two buckets (each up to the threshold) do not.

    Options go to ``jax.jit(...).lower(...).compile(compiler_options=...)``: per program, no XLA_FLAGS needed.
    """
    largest = max(b.bytes for b in plan.buckets)
    return {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_all_reduce_combine_threshold_bytes": largest,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": largest,
        "xla_gpu_all_gather_combine_threshold_bytes": largest,
    }


def describe_xla_options(options: dict) -> str:
    """One line for the console: the XLA options the plan set (or that none were)."""
    if not options:
        return "XLA collective options: none set (only GPU train steps of dense models take them)"
    return "XLA collective options from the gradient plan: " + " ".join(f"--{k}={v}" for k, v in options.items())

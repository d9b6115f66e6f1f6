"""Cost model: predicted step time, per-device memory and collectives of one strategy.

Pure functions of (computation view, cluster view, strategy, batch): nothing
here touches a device.  :func:`estimate` returns an :class:`Estimate` whose
parts can be printed: compute time (FLOPs / peak / efficiency, plus a fixed
cost per block pass), every collective (:class:`CommItem`: kind, mesh axes,
bytes, count, seconds), the pipeline bubble ``(p-1)/(s*m+p-1)`` (s sequence
chunks for seq1f1b, else 1), and memory
per device (parameters, optimizer state, gradients, kept activations,
working buffers).

The collective list follows what XLA's SPMD partitioner emits for the
jaxdist transformer under the default sharding rules (checked against
compiled programs in tests/planner): FSDP gathers each block's weights in the
forward and again in the backward pass and all-reduces its gradients at full
size over ``fsdp`` before reducing the shard over ``data``; tensor parallelism
all-reduces the block output twice forward and once per input projection
(q, k, v, gate, up) backward; gradients are reduced once per microbatch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from jaxdist.models.arithmetic import TrainStateBytes, train_flops_per_token, train_state_bytes
from jaxdist.parallel.rules import DEFAULT_RULES, logical_to_spec
from jaxdist.planner.candidates import RematChoice, Strategy, remat_choice
from jaxdist.planner.cluster import ClusterView
from jaxdist.planner.computation import BlockKind, ComputationView
from jaxdist.planner.expert_cost import ExpertRows, expert_rows, expert_view_sizes, stage_sync  # noqa: F401 (re-exported)
from jaxdist.planner.ring import ring_buffer_bytes, ring_collectives, ring_view


@dataclass(frozen=True)
class MemoryCoefficients:
    """Working-buffer terms of the memory model (multiples of the named quantity).

    ``layer_working``: buffers live while one block is differentiated, as a
    multiple of that block's activations without remat, per remat choice
    (a choice not listed uses ``default_working``).  ``microbatch_working``:
    added to it when the step loops over microbatches.  ``logits_working``:
    multiple of one microbatch's float32 logits.  ``gathered_weights``:
    multiple of one block's weights gathered over fsdp.  ``grad_copies``:
    gradient buffers beyond the parameters' size with microbatches > 1 (the
    running sum and one microbatch's gradients).  ``gathered_embedding``:
    multiple of the whole embedding (and untied head) when fsdp or tensor
    splits it.  ``fixed``: bytes.

    The MoE terms (see :class:`ExpertRows`; their quantities are 0 for a dense model, their defaults 0) are
    XLA:CPU's, set in :data:`XLA_CPU_MEMORY` only: on a GPU ``ragged_dot`` is a grouped matmul and the
    dispatch's scatters are native, so another backend's table leaves them at 0 until it is measured there.
    ``expert_weight_copies``: multiple of the expert weights on a device (every MoE block of its stage):
    XLA:CPU copies each stacked weight for the forward and for the backward layer scan (the dense weights'
    copies are inside the fitted multiples above, small at the fit's shapes; an MoE block's experts are
    ``experts`` MLPs).  ``ragged_dot_working``: multiple of local experts x expert rows x (d_model + expert
    width / etp) elements, dropless only: XLA:CPU emulates a ``jax.lax.ragged_dot`` of [rows, k] by
    [experts, k, n] as a dense matmul of a masked copy of the rows per expert ([experts, rows, k]) into every
    expert's output ([rows, experts x n]), and the backward of the three expert matmuls holds several at once.
    ``dispatch_working``: multiple of one block's expert rows x d_model (the rows gathered, exchanged and
    scattered back, and the scatters' index buffers).  Their values are simple multiples chosen on the
    settings of benchmarks/moe_memory.py (the smallest worst error there); the table and its worst are in
    benchmarks/README.md.

    Under ``remat=full`` (and in the executor's pipeline stages, whose backward recomputes what a unit did not
    stash) an MoE block's terms are counted from the buffers XLA:CPU holds at the peak, which is inside the
    backward layer scan while one block's experts are recomputed and differentiated (XLA's live buffers there,
    benchmarks/README.md): ``ragged_full`` multiplies the emulation's buffers, local experts x
    rows x (6 x expert width + 2 x d_model) elements (three masked copies of the rows at the expert width and
    two at d_model, three [rows, experts x width] outputs; none with one local expert, whose ``ragged_dot``
    XLA turns into a plain matmul), ``dispatch_full`` the [rows, d_model] buffers of the recomputed routed
    rows and the dispatch (10 to 13 f32 ones counted, and u32 indices and a mask), and ``expert_weight_copies`` the one copy of the stacked
    expert weights the scan holds.  The block's dense part is recomputed after its experts' backward, and the
    head's logits are gone before the layer scan's backward starts, so ``layer_working:full`` (of the block's
    dense activations only), ``logits_working`` and those two are not live together: the largest counts
    (:meth:`MemoryTerms.memory`).
    """

    layer_working: tuple[tuple[str, float], ...] = (("full", 1.022), ("names", 0.8356), ("none", 0.6258))
    default_working: float = 1.0
    microbatch_working: float = 0.0437
    logits_working: float = 2.0
    gathered_weights: float = 1.3976
    grad_copies: float = 1.4501
    gathered_embedding: float = 2.0
    fixed: float = 0.0
    expert_weight_copies: float = 0.0
    ragged_dot_working: float = 0.0
    dispatch_working: float = 0.0
    ragged_full: float = 0.0
    dispatch_full: float = 0.0

    def working(self, remat: str) -> float:
        """The ``layer_working`` multiple for a remat choice name."""
        return dict(self.layer_working).get(remat, self.default_working)


DISPATCH_FULL = 14.0  # [rows, d_model]-sized buffers at a recomputing MoE peak: 10-13 f32 counted, + index, mask
ROUTED_FULL = ("ragged_full", "dispatch_full")  # live before (not beside) the dense part's backward
# The MoE terms are not in the fit: chosen on benchmarks/moe_memory.py's settings (MemoryCoefficients).
XLA_CPU_MEMORY = MemoryCoefficients(
    expert_weight_copies=1.0, ragged_dot_working=2.5, dispatch_working=2.0, ragged_full=1.0, dispatch_full=DISPATCH_FULL
)


@dataclass(frozen=True)
class Memory:
    """Predicted bytes per device, by what they hold."""

    params: float
    optimizer: float
    grads: float
    activations: float
    working: float
    batch: float

    @property
    def total(self) -> float:
        """Bytes per device at the peak of the step."""
        return self.params + self.optimizer + self.grads + self.activations + self.working + self.batch


@dataclass(frozen=True)
class CommItem:
    """One collective, ``count`` times per step: ``bytes`` is the whole buffer per device (see hlo.py).

    ``axes`` are the mesh axes of its group (``group`` devices), ``link`` is
    ``"intra"`` or ``"inter"`` (node), ``seconds`` the time of all ``count``
    executions, ``overlappable`` whether it can hide behind compute (FSDP
    gathers, gradient reductions) or sits on the critical path (tensor and
    pipeline activations).
    """

    name: str
    kind: str
    axes: tuple[str, ...]
    group: int
    bytes: float
    count: int
    link: str = "intra"
    seconds: float = 0.0
    overlappable: bool = True
    overlap_flops: float = 0.0  # compute (FLOPs) each execution hides behind; only the excess is exposed

    @property
    def total_bytes(self) -> float:
        """Bytes over the step: ``bytes * count``."""
        return self.bytes * self.count


@dataclass(frozen=True)
class Estimate:
    """The predicted cost of one strategy (seconds, bytes, FLOPs); ``fits`` false with a ``reason`` if rejected."""

    strategy: Strategy
    step_time: float
    compute_time: float
    comm_time: float
    bubble_time: float
    memory: Memory
    comm: tuple[CommItem, ...]
    flops_per_device: float
    tokens_per_step: int
    peak_flops: float
    memory_limit: float
    fits: bool = True
    reason: str = ""
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the whole job."""
        return self.tokens_per_step / self.step_time

    @property
    def mfu(self) -> float:
        """Model FLOPs (no recomputation) per second over the devices' peak."""
        return self.extra.get("model_flops_per_device", self.flops_per_device) / self.step_time / self.peak_flops

    @property
    def comm_bytes(self) -> float:
        """Collective bytes per device per step (whole-buffer convention)."""
        return sum(c.total_bytes for c in self.comm)

    @property
    def dominant(self) -> str:
        """What the step spends most time on: compute, a named collective, or the bubble."""
        parts = {"compute": self.compute_time, "pipeline bubble": self.bubble_time}
        for c in self.comm:
            parts[c.name] = parts.get(c.name, 0.0) + c.seconds
        return max(parts, key=parts.get)


class _Sizes:  # what logical_to_spec reads from a Mesh: .shape
    def __init__(self, sizes: dict[str, int]):
        self.shape = sizes


@functools.lru_cache(maxsize=65536)
def _shards(axes: tuple[str, ...], shape: tuple[int, ...], sizes: tuple[tuple[str, int], ...]) -> tuple[int, ...]:
    """Per dimension, how many ways the rules split it on a mesh of these sizes."""
    table = dict(sizes)
    spec = logical_to_spec(axes, DEFAULT_RULES, _Sizes(table), shape)
    out = []
    for entry in tuple(spec) + (None,) * (len(axes) - len(tuple(spec))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        out.append(math.prod(table[n] for n in names))
    return tuple(out)


def collective_seconds(
    kind: str, nbytes: float, group: int, bandwidth: float, latency: float, overhead: float = 0.0
) -> float:
    """Ring-algorithm time of one collective over ``group`` devices (bytes, bytes/s, s -> s), plus a fixed ``overhead``."""
    if group <= 1:
        return 0.0
    n = group
    if kind == "all-reduce":
        return overhead + 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth
    if kind == "collective-permute":
        return overhead + latency + nbytes / bandwidth
    return overhead + (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


def crosses_nodes(axes: tuple[str, ...], s: Strategy, nodes: int) -> bool:
    """Whether a collective over these mesh axes uses the links between nodes (hybrid_shapes' layout)."""
    if nodes <= 1:
        return False
    dcn_data = math.gcd(s.data, nodes)
    spans = {"data": dcn_data > 1, "fsdp": nodes // dcn_data > 1}
    return any(spans.get(a, False) for a in axes)


def _local(p, sizes: tuple) -> float:
    return p.size / math.prod(_shards(p.axes, p.shape, sizes))


@functools.lru_cache(maxsize=65536)
def _block_weights(block: BlockKind, sizes: tuple) -> tuple[float, float, float]:
    """(matmul weight elements, norm elements, matmul weight elements after the fsdp gather) of one block per device."""
    fsdp = dict(sizes)["fsdp"]
    matmul = norms = 0.0
    for p in block.params:
        if p.axes == ("norm",):
            norms += _local(p, sizes)
        else:
            matmul += _local(p, sizes)
    return matmul, norms, matmul * fsdp


def _per_token_bytes(
    view: ComputationView, block: BlockKind, names, sizes: tuple, rows: int, routed: tuple = (1.0, None)
) -> float:
    """Bytes per token on one device of the named activations of ``block`` (tensor-split dimensions divided out).

    ``routed``: (routed rows per top-k copy of a token, mesh sizes of the expert view) for the block's routed
    tensors (:func:`expert_rows`); (1.0, None) counts top-k rows per token on the model's mesh."""
    return _activation_bytes(block, tuple(names), sizes, rows, view.seq_len, routed)


@functools.lru_cache(maxsize=65536)
def _activation_bytes(
    block: BlockKind, names: tuple[str, ...], sizes: tuple, rows: int, seq_len: int, routed: tuple = (1.0, None)
) -> float:
    # Many strategies of one search share the block, the mesh sizes and the rows: computed once for them.
    total = 0.0
    factor, expert_sizes = routed
    for n in names:
        a = block.activation(n)
        on = expert_sizes if a.routed and expert_sizes is not None else sizes
        shards = _shards(("batch", "seq") + a.axes, (rows, seq_len) + a.shape, on)
        total += a.elements_per_token * a.dtype_bytes / math.prod(shards[2:]) * (factor if a.routed else 1.0)
    return total


def _kept(block: BlockKind, remat: RematChoice) -> tuple[str, ...]:
    if remat.saved is None:
        return block.saved_without_remat
    return ("layer_input",) + tuple(
        a.name for a in block.activations if a.checkpoint_name in remat.saved and a.read_by_backward
    )


def _batch_ways(s: Strategy) -> int:
    return s.data * s.fsdp * s.expert


@dataclass(frozen=True)
class MemoryTerms:
    """Per-device memory of one strategy split into what is known exactly and what the coefficients scale.

    ``state``, ``activations``, ``batch``: bytes that need no coefficient
    (the parameters, one copy of the gradients and the optimizer state, from
    :func:`jaxdist.models.arithmetic.train_state_bytes`; the kept activations;
    the batch).  ``scaled``:
    per :class:`MemoryCoefficients` field name (``layer_working:<remat>`` for
    the per-remat entries), the quantity that field multiplies.  The
    prediction is linear in the coefficients, which is what lets
    :func:`jaxdist.planner.fit.fit_memory_coefficients` fit them exactly; only an MoE model's
    :data:`ROUTED_FULL` terms (remat=full, not in the fit) count as the largest of them, the block's
    ``layer_working`` term and ``logits_working``.
    """

    state: TrainStateBytes
    activations: float
    batch: float
    scaled: dict
    ring: float = 0.0  # bytes of the context ring's buffers (planner/ring.py), exact: no coefficient
    # An MoE model's executor stages with the planned dispatch inside (jaxdist.parallel.pipeline_sync), exact:
    # the stage's weights gathered over fsdp for the whole step, and its gradients accumulated whole along fsdp
    # until they are reduced after the stage's last backward.
    stage_weights: float = 0.0
    stage_grads: float = 0.0

    def memory(self, coeff: MemoryCoefficients) -> Memory:
        """Bytes per device under ``coeff``."""

        def c(name: str) -> float:
            if name.startswith("layer_working:"):
                return coeff.working(name.split(":", 1)[1])
            return getattr(coeff, name)

        extra_grads = c("grad_copies") * self.scaled.get("grad_copies", 0.0)
        working = sum(c(k) * v for k, v in self.scaled.items() if k != "grad_copies" and k not in ROUTED_FULL)
        routed = sum(c(k) * self.scaled.get(k, 0.0) for k in ROUTED_FULL)
        if routed:  # the head's backward, the experts', then the dense part's: the largest is live at the peak
            layer, logits = (
                sum(c(k) * v for k, v in self.scaled.items() if k.startswith(n)) for n in ("layer_", "logits")
            )
            working += max(layer, logits, routed) - layer - logits
        return Memory(
            params=self.state.params + self.stage_weights,
            optimizer=self.state.optimizer,
            grads=self.state.grads + extra_grads + self.stage_grads,
            activations=self.activations,
            working=working + self.ring,
            batch=self.batch,
        )


def memory_terms(view: ComputationView, s: Strategy, batch_size: int) -> MemoryTerms:
    """The :class:`MemoryTerms` of strategy ``s`` at global batch ``batch_size`` sequences."""
    view = ring_view(view, s)
    sizes = tuple(s.mesh.items())
    pb, T = view.param_bytes, view.seq_len
    remat = remat_choice(s.remat)
    rows_mb = batch_size // s.microbatches  # sequences per microbatch, whole job
    tokens = rows_mb // _batch_ways(s) * T // s.context  # tokens per microbatch on one device
    chunks, units = in_flight(s)  # units of 1/chunks of a microbatch on stage 0
    held = math.ceil(units / chunks)  # microbatches with a chunk in flight
    # MoE gpipe stages by autodiff (jaxdist.parallel.pipeline_blocks); the other schedules run in the executor
    stacked = s.pipeline > 1 and view.n_experts > 0 and s.schedule == "gpipe"
    if stacked:  # the transposed loop keeps every tick's residuals, the bubble's too: m + p - 1 of them
        units = held = s.microbatches + s.pipeline - 1
    # The tokens an MoE block's forward and backward work on: in the executor (jaxdist.parallel.pipeline) one
    # unit, 1/chunks of a microbatch.  (A dense model's working set keeps the microbatch's, as fitted.)
    executor = s.pipeline > 1 and not stacked
    unit = tokens // chunks if executor and view.n_experts else tokens
    local = sum(_local(p, sizes) for p in view.other_params)  # parameter elements on one device
    stage_whole = 0.0  # the stage's block weights whole along fsdp (elements), for stage_sync below
    activations = working_layer = gathered = 0.0
    expert_weights = ragged = dispatch = 0.0  # the MoE terms of MemoryCoefficients
    # MoE terms counted at a recomputing backward's peak: remat=full in a loop (one scan step is none: XLA merges
    # the recomputation with the forward), and the executor's stages, whose backward recomputes what is not stashed
    recomputing = view.n_experts > 0 and (executor or remat.saved == () and (s.pipeline > 1 or not _one_trip(view)))
    # An executor stage's unit stashes what its policy saves (parallel/pipeline_stage.py): none: the names set.
    stash = remat_choice("names") if executor and view.n_experts and remat.saved is None else remat
    ragged_full = 0.0
    for b in view.blocks:
        layers = math.ceil(b.count / s.pipeline)  # blocks on one pipeline stage
        matmul, norms, full = _block_weights(b, sizes)
        local += layers * (matmul + norms)
        stage_whole += layers * (full + norms)
        routed = (1.0, None)
        if b.dispatch_rows:
            er = expert_rows(view, s, unit)
            routed = (er.rows / (tokens * b.dispatch_rows), expert_view_sizes(sizes, er.etp))
            expert_weights += layers * sum(_local(p, sizes) for p in b.params if "expert" in p.axes) * pb
            d, ab = view.model.d_model, view.act_bytes
            f = (view.model.moe.d_ff or view.model.d_ff) // er.etp
            if view.model.moe.dispatch == "dropless":
                ragged = max(ragged, er.local_experts * er.rows * (d + f) * ab)
                if er.local_experts > 1:
                    ragged_full = max(ragged_full, er.local_experts * er.rows * (6 * f + 2 * d) * ab)
            dispatch = max(dispatch, er.rows * d * ab)
        kept = _per_token_bytes(view, b, _kept(b, stash), sizes, rows_mb, routed)
        activations += layers * tokens / chunks * kept * units
        if chunks > 1:  # seq1f1b: a microbatch's earlier chunks' keys and values stay until its backward
            kv = [n for n in ("key_rotated", "value") if any(a.name == n for a in b.activations)]
            activations += layers * tokens * _per_token_bytes(view, b, kv, sizes, rows_mb) * held
        dense_only = (0.0, routed[1]) if recomputing and b.dispatch_rows else routed  # routed: dispatch_full
        one_layer = unit * _per_token_bytes(view, b, b.saved_without_remat, sizes, rows_mb, dense_only)
        working_layer = max(working_layer, one_layer)
        gathered = max(gathered, full * pb)
    state = train_state_bytes(local, view.model.param_dtype)
    vocab_local = view.model.vocab_size / _shards(("vocab",), (view.model.vocab_size,), sizes)[0]
    embedding = sum(p.size for p in view.other_params if p.axes != ("norm",)) * pb  # embedding (+ head), whole
    scaled = {
        f"layer_working:{s.remat}": working_layer,
        "microbatch_working": working_layer if s.microbatches > 1 else 0.0,
        "logits_working": tokens * vocab_local * 4,
        "gathered_weights": gathered if s.fsdp > 1 else 0.0,
        "grad_copies": state.params if s.microbatches > 1 else 0.0,
        "gathered_embedding": embedding if s.fsdp * s.tensor > 1 else 0.0,
        "fixed": 1.0,
    }
    if any(b.dispatch_rows for b in view.blocks) and recomputing:
        scaled.update(expert_weight_copies=expert_weights, ragged_full=ragged_full, dispatch_full=dispatch)
    elif any(b.dispatch_rows for b in view.blocks):  # a dense model's terms stay as they were
        scaled.update(expert_weight_copies=expert_weights, ragged_dot_working=ragged, dispatch_working=dispatch)
    stage_weights = stage_grads = 0.0
    if executor and view.n_experts and stage_sync(view, s):
        stage_grads = stage_whole * pb
        stage_weights = stage_grads if s.fsdp > 1 else 0.0  # fsdp=1: the weights are the local ones
    return MemoryTerms(
        state=state,
        activations=activations,
        batch=batch_size // _batch_ways(s) * (T + 1) * 4,
        scaled=scaled,
        ring=ring_buffer_bytes(view, s, rows_mb // _batch_ways(s)),
        stage_weights=stage_weights,
        stage_grads=stage_grads,
    )


def _one_trip(view: ComputationView) -> bool:
    """Whether the model's layer scan runs one step: one group of ``moe.every`` blocks (MoE) or one block."""
    every = view.model.moe.every if view.n_experts else 1
    return view.model.n_layers <= every


def in_flight(s: Strategy) -> tuple[int, int]:
    """(chunks per microbatch, chunks in flight on pipeline stage 0) of the schedule (1, 1 without a pipeline)."""
    if s.pipeline == 1:
        return 1, 1
    if s.schedule == "gpipe":
        return 1, s.microbatches
    if s.schedule == "seq1f1b":
        return s.chunks, min(s.chunks + s.pipeline - 1, s.chunks * s.microbatches)
    return 1, min(s.microbatches, s.pipeline)


def memory(view: ComputationView, s: Strategy, batch_size: int, coeff: MemoryCoefficients = XLA_CPU_MEMORY) -> Memory:
    """Predicted bytes per device of strategy ``s`` at global batch ``batch_size`` sequences."""
    return memory_terms(view, s, batch_size).memory(coeff)


def collectives(view: ComputationView, s: Strategy, batch_size: int) -> list[CommItem]:
    """The collectives of one step of ``s`` (times not filled in; see :func:`estimate`)."""
    view = ring_view(view, s)
    sizes = tuple(s.mesh.items())
    m, D, F, p = s.microbatches, s.data, s.fsdp, s.pipeline
    pb, ab, T, d = view.param_bytes, view.act_bytes, view.seq_len, view.model.d_model
    V = view.model.vocab_size
    local_rows = batch_size // m // _batch_ways(s)
    X = local_rows * T // s.context * d * ab  # one block's output on one device, per microbatch
    S = local_rows * T // s.context * 4  # one float32 per token
    remat = remat_choice(s.remat)
    items: list[CommItem] = []

    def add(name, kind, axes, nbytes, count, overlappable=True, overlap_flops=0.0):
        group = math.prod(s.mesh[a] for a in axes)
        if group > 1 and nbytes > 0 and count > 0:
            items.append(
                CommItem(
                    name,
                    kind,
                    tuple(axes),
                    group,
                    float(nbytes),
                    int(count),
                    overlappable=overlappable,
                    overlap_flops=overlap_flops,
                )
            )

    chunks = in_flight(s)[0]  # seq1f1b: every block pass is over 1/chunks of a sequence
    ctx = ("context",) if s.context > 1 else ()  # weights are replicated over context: reduce over it too
    X_chunk = X / chunks
    for b in view.blocks:
        per_layer = math.ceil(b.count / p) * m
        matmul, norms, gathered = _block_weights(b, sizes)
        # FSDP: gather each weight forward and backward (a recomputing backward reuses them).
        if F > 1:
            for w in b.params:
                if w.axes != ("norm",):
                    add("fsdp weight gather", "all-gather", ("fsdp",), _local(w, sizes) * F * pb, 2 * per_layer)
        # Tensor parallel: two forward all-reduces per block, one per input projection backward;
        # a full-remat backward recomputes the attention output (the MLP output is not needed).
        bwd = 5 + (1 if remat.recompute == 1.0 else 0)
        add(
            "tensor activation all-reduce",
            "all-reduce",
            ("tensor",),
            X_chunk,
            (2 + bwd) * per_layer * chunks,
            overlappable=False,
        )
        # Gradients, every microbatch: full size over fsdp, then the shard over data (and context: the
        # weights are replicated over it, each device differentiates its own tokens).
        if F > 1 and D * s.context > 1:
            add("gradient reduce (fsdp)", "all-reduce", ("fsdp",), gathered * pb, per_layer)
            add("gradient reduce (data)", "all-reduce", ("data", *ctx), matmul * pb, per_layer)
            add("gradient reduce (norms)", "all-reduce", ("data", "fsdp", *ctx), norms * pb, per_layer)
        else:
            add("gradient reduce", "all-reduce", ("data", "fsdp", *ctx), (gathered + norms) * pb, per_layer)
        if b.dispatch_rows:
            # Tokens to their experts and back, forward and backward.
            add("expert all-to-all", "all-to-all", ("expert",), X * b.dispatch_rows, 4 * per_layer, overlappable=False)
    # Embedding and output head.  Loop-invariant: XLA hoists the table gathers out of the microbatch loop.
    E = V * d * pb
    vocab_shards = _shards(("vocab",), (V,), sizes)[0]
    add("embedding gather (fsdp)", "all-gather", ("fsdp",), E / vocab_shards, 2)
    add("embedding lookup all-reduce", "all-reduce", ("tensor",), X, m, overlappable=False)
    add("logits softmax all-reduce", "all-reduce", ("tensor",), X + 4 * S, m, overlappable=False)
    add("embedding gradient reduce", "all-reduce", ("data", "fsdp", *ctx), E + E / vocab_shards + d * pb, m)
    for ring in ring_collectives(view, s, local_rows, remat.recompute == 1.0):
        add(**ring, overlappable=False)  # exposed: what a hop's transfer exceeds its block's compute
    if p > 1:
        # Stage boundaries: activations forward, their gradients backward, per microbatch.
        add("pipeline send/recv", "collective-permute", ("pipeline",), X_chunk, 2 * m * chunks, overlappable=False)
    return items


def recompute_flops(view: ComputationView, remat: RematChoice) -> dict[str, float]:
    """Forward FLOPs per token done again in the backward pass, per block kind name."""
    out = {}
    for b in view.blocks:
        r = remat.recompute
        out[b.name] = b.attention_flops_fwd if r == "attention_scores" else float(r) * b.flops_fwd
    return out


def _timed(c: CommItem, link: str, seconds: float) -> CommItem:
    """``c`` with its link and time: dataclasses.replace, without its introspection (the search calls this for
    every collective of every strategy it evaluates)."""
    return CommItem(**{**vars(c), "link": link, "seconds": seconds})


def estimate(
    view: ComputationView,
    cluster: ClusterView,
    s: Strategy,
    batch_size: int,
    memory_fraction: float = 0.9,
    coeff: MemoryCoefficients = XLA_CPU_MEMORY,
) -> Estimate:
    """Predicted step time, memory and collectives of ``s``; ``fits`` is false (with the reason)
    when the memory per device exceeds ``memory_fraction`` of the device's memory."""
    mem = memory(view, s, batch_size, coeff)
    view = ring_view(view, s)
    peak = cluster.peak_flops(view.model.dtype)
    timed = []
    for c in collectives(view, s, batch_size):
        inter = crosses_nodes(c.axes, s, cluster.nodes)
        bw = cluster.inter_node_bandwidth if inter else cluster.intra_node_bandwidth
        lat = cluster.inter_node_latency if inter else cluster.intra_node_latency
        one = collective_seconds(c.kind, c.bytes, c.group, bw, lat, cluster.collective_overhead)
        secs = c.count * max(0.0, one - c.overlap_flops / (peak * cluster.efficiency))
        timed.append(_timed(c, "inter" if inter else "intra", secs))
    tokens = batch_size * view.seq_len
    remat = remat_choice(s.remat)
    rec = recompute_flops(view, remat)
    # One device runs 1/pipeline of the blocks (the last stage also the head) on its share of the tokens.
    local_tokens = tokens / _batch_ways(s) / s.context
    layer_flops = sum(b.count / s.pipeline * (3.0 * b.flops_fwd + rec[b.name]) for b in view.blocks)
    flops_dev = local_tokens * (layer_flops + 3.0 * view.head_flops_fwd) / s.tensor
    # Fixed cost per block pass (forward, backward, recomputed forward) per microbatch, and the head's two.
    chunks = in_flight(s)[0]
    passes = s.microbatches * (
        2 + chunks * sum(b.count / s.pipeline * (2 + (1 if rec[b.name] else 0)) for b in view.blocks)
    )
    compute = flops_dev / (peak * cluster.efficiency) + passes * cluster.pass_overhead
    critical = sum(c.seconds for c in timed if not c.overlappable)
    hidden = sum(c.seconds for c in timed if c.overlappable)
    comm = critical + max(0.0, hidden - cluster.overlap * compute)
    bubble = (compute + critical) * (s.pipeline - 1) / (s.microbatches * chunks)  # (p-1)/(s*m+p-1) of the step
    step = compute + comm + bubble
    limit = memory_fraction * cluster.memory_bytes
    fits = mem.total <= limit
    reason = "" if fits else f"needs {mem.total / 2**30:.1f} GiB per device, {limit / 2**30:.1f} GiB usable"
    model_flops = tokens * train_flops_per_token(view.model, view.seq_len) / s.n_devices  # no recompute
    return Estimate(
        strategy=s,
        step_time=step,
        compute_time=compute,
        comm_time=comm,
        bubble_time=bubble,
        memory=mem,
        comm=tuple(timed),
        flops_per_device=flops_dev,
        tokens_per_step=tokens,
        peak_flops=peak,
        memory_limit=limit,
        fits=fits,
        reason=reason,
        extra={"model_flops_per_device": model_flops, "passes": passes, "collectives": sum(c.count for c in timed)},
    )

"""Expert parallelism: where the experts live and how tokens travel to them.

The MoE layers view the same devices as the rest of the model, possibly with a
different tensor-parallel size.  Attention and dense layers use the mesh as
built (heads over ``tensor``, tokens over ``data``, ``fsdp`` and ``expert``).
The experts are split over the ``expert`` axis and each expert's hidden width
over an expert tensor group of ``mesh.expert_tensor`` devices (0: the whole
``tensor`` axis).  When ``expert_tensor`` is a proper divisor of ``tensor``,
the tensor axis is viewed as (``tensor_ep``, ``tensor``) = (tensor /
expert_tensor, expert_tensor), neighbours inner, and ``tensor_ep`` joins
expert parallelism: e.g. tensor=4, expert=2, expert_tensor=2 on 8 devices runs
attention 4-way tensor-parallel (2 data replicas through the expert axis) and
the experts 4-way expert-parallel x 2-way tensor-parallel.  That view is a
second ``Mesh`` over the same devices in the same order (:class:`ExpertLayout`),
used for the expert weights' shardings and the dispatch ``shard_map``.

Dispatch (inside ``shard_map``, per device, tokens split over every axis but
the expert tensor group):

* dropless: assignments sorted by expert; each expert-parallel peer gets the
  rows for its experts through ``all_to_all`` over the expert-parallel axes;
  a grouped matmul (``ragged_dot``) per weight; one ``psum`` over the expert
  tensor group (column-split gate/up, row-split down); ``all_to_all`` back;
  the k outputs of a token are summed with the router weights.  The padded
  exchange (CPU and default) sends a fixed buffer of n * min(k, E_local) rows
  to each peer, enough for any routing, so no token is ever dropped; the ragged
  exchange (``ragged_all_to_all``, GPUs) sends only the rows routed there into
  the same receive layout.
* capacity: each expert has C = ceil(factor * n * k / E) slots per device's
  n tokens; overflow assignments are dropped (their output is 0); slot
  buffers [E, C, d] are exchanged with ``all_to_all`` and run as dense batched
  matmuls.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxdist.config import ConfigError, ModelConfig
from jaxdist.models import hooks
from jaxdist.models.moe import (
    capacity_slots,
    dense_expert_ffn,
    expert_capacity,
    expert_d_ff,
    grouped_ffn,
    local_experts,
)
from jaxdist.parallel import hlo, rules as _rules
from jaxdist.parallel.rules import DEFAULT_RULES, Rules, logical_to_spec

EXPERT_TENSOR_SPLIT_AXIS = "tensor_ep"


@dataclass(frozen=True)
class ExpertLayout:
    """How the MoE layers use the devices.

    ``mesh``: the expert view of the devices (the model's mesh, or the same
    devices with ``tensor`` split into ``tensor_ep`` x ``tensor``);
    ``ep_axes``: axes the experts are split over; ``etp_axes``: axes each
    expert's hidden width is split over; ``token_axes``: axes the tokens are
    split over in the MoE layer; ``exchange``: ``padded`` (all_to_all of
    fixed buffers), ``ragged`` (``ragged_all_to_all``, GPUs) or
    ``ragged-emulated`` (the ragged algorithm over padded all_to_all, to test
    it on CPU).
    """

    mesh: Mesh
    ep_axes: tuple[str, ...]
    etp_axes: tuple[str, ...]
    token_axes: tuple[str, ...]
    exchange: str = "padded"

    def size(self, axes: Sequence[str]) -> int:
        """Devices spanned by ``axes`` of the expert view."""
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def ep_size(self) -> int:
        """Expert-parallel size: the experts are split this many ways."""
        return self.size(self.ep_axes)

    @property
    def etp_size(self) -> int:
        """Expert tensor-parallel size: each expert's hidden width is split this many ways."""
        return self.size(self.etp_axes)

    def sharding(
        self,
        names: Sequence[str | None],
        shape: Sequence[int] | None = None,
        rules: Rules = DEFAULT_RULES,
        mesh: Mesh | None = None,
    ) -> NamedSharding:
        """Sharding of a parameter with logical ``names``: on the expert view if it has an ``expert`` dimension, else on ``mesh``."""
        target = self.mesh if "expert" in names or mesh is None else mesh
        return NamedSharding(target, logical_to_spec(names, rules, target, shape))


def _rule_axes(rules: Rules, name: str, mesh: Mesh) -> tuple[str, ...]:
    for rule_name, axes in rules:
        if rule_name == name:
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)
    raise ValueError(f"the sharding rules have no entry for logical axis '{name}'")


def expert_layout(
    mesh: Mesh, expert_tensor: int = 0, rules: Rules = DEFAULT_RULES, exchange: str | None = None
) -> ExpertLayout:
    """The :class:`ExpertLayout` for ``mesh`` with ``expert_tensor`` devices per expert (0: all of ``tensor``).

    ``exchange`` None picks ``ragged`` on GPUs and ``padded`` elsewhere.
    Raises ConfigError if ``expert_tensor`` does not divide the tensor axis.
    """
    tensor = mesh.shape.get("tensor", 1)
    etp = expert_tensor or tensor
    if etp <= 0 or tensor % etp:
        raise ConfigError(
            f"mesh.expert_tensor={expert_tensor} does not divide mesh.tensor={tensor}: "
            "choose a divisor of the tensor size (or 0 to use all of it)."
        )
    view = mesh
    if etp != tensor:
        names = list(mesh.axis_names)
        i = names.index("tensor")
        shape = list(mesh.devices.shape)
        shape[i : i + 1] = [tensor // etp, etp]
        names[i : i + 1] = [EXPERT_TENSOR_SPLIT_AXIS, "tensor"]
        view = Mesh(mesh.devices.reshape(shape), tuple(names), axis_types=(AxisType.Auto,) * len(names))
    ep = _rule_axes(rules, "expert", view)
    etp_axes = _rule_axes(rules, "expert_mlp", view)
    batch = _rule_axes(rules, "batch", view)
    seq = tuple(a for a in _rule_axes(rules, "seq", view) if a not in batch)
    # The layer's tokens [B*T] split as the activations [B, T] are (rows, then each row's sequence chunk over
    # context), then further over the expert axes the rows are not split over.
    tokens = tuple(a for a in batch + seq if a not in etp_axes) + tuple(a for a in ep if a not in batch)
    assert not set(ep) & set(etp_axes), f"expert axes {ep} and expert tensor axes {etp_axes} overlap"
    if exchange is None:
        exchange = "ragged" if jax.default_backend() == "gpu" else "padded"
    assert exchange in ("padded", "ragged", "ragged-emulated"), exchange
    return ExpertLayout(view, ep, etp_axes, tokens, exchange)


# --------------------------------------------------------------------------- tracing context

_LAYOUT: contextvars.ContextVar[ExpertLayout | None] = contextvars.ContextVar("jaxdist_expert_layout", default=None)


@contextlib.contextmanager
def expert_parallelism(layout: ExpertLayout | None) -> Iterator[None]:
    """Within this block, MoE layers traced under jit dispatch their experts by ``layout`` (:func:`run_experts`).

    ``layout`` None: an active :func:`~jaxdist.parallel.rules.activation_sharding`
    mesh implies the default layout (``expert_tensor`` = all of ``tensor``);
    with neither, the experts run on the local tokens without communication.
    Outside this block the model's MoE layers run their experts locally.
    """
    token = _LAYOUT.set(layout)
    try:
        with hooks.dispatching_experts(run_experts):
            yield
    finally:
        _LAYOUT.reset(token)


def current_layout() -> ExpertLayout | None:
    """The layout MoE layers traced now use (see :func:`expert_parallelism`)."""
    layout = _LAYOUT.get()
    if layout is not None:
        return layout
    active = _rules.active_sharding()
    if active is None:
        return None
    return expert_layout(active[0], 0, active[1])


# --------------------------------------------------------------------------- dispatch


def run_experts(
    x: jax.Array, experts: jax.Array, weights: jax.Array, params: dict[str, jax.Array], cfg: ModelConfig
) -> tuple[jax.Array, jax.Array]:
    """Routed expert outputs for tokens x [N, d] with expert ids / weights [N, k].

    ``params``: we_gate, we_up [E, d, f] and we_down [E, f, d].  Returns
    (y [N, d] = sum over a token's kept assignments of weight * expert FFN,
    keep [N, k] bool: False where capacity dispatch dropped the assignment).
    Under :func:`current_layout` this runs in ``shard_map`` over the expert
    view; otherwise on the local arrays.
    """
    layout = current_layout()
    if layout is None:
        return local_experts(x, experts, weights, params, cfg)
    manual = _manual_axes()
    if manual and _splits_as_dispatch(layout, manual):
        # A surrounding shard_map split the tokens and the experts as this dispatch would
        # (train.grad_sync=per_block, jaxdist.parallel.grad_sync): run its body on the local arrays; the
        # expert tensor axis, automatic there, is XLA's.
        return _dispatch(
            x,
            experts,
            weights,
            params,
            cfg=cfg,
            ep_axes=layout.ep_axes,
            ep_size=layout.ep_size,
            etp_axes=(),
            exchange=layout.exchange,
        )
    # Inside pipeline stages (jaxdist.parallel.pipeline_blocks) XLA partitions the experts: this dispatch's
    # shard_map, nested in the stages' shard_map, does not lower on JAX 0.10 (Shardy's verifier refuses it).
    if manual:
        return local_experts(x, experts, weights, params, cfg)
    n_shards = layout.size(layout.token_axes)
    if x.shape[0] % n_shards:
        raise ValueError(
            f"{x.shape[0]} tokens cannot be split over the {n_shards} token shards of the MoE "
            f"layer (axes {layout.token_axes}): make batch x seq a multiple of {n_shards}."
        )
    tok = P(layout.token_axes or None, None)
    w_in, w_out = (
        P(layout.ep_axes or None, None, layout.etp_axes or None),
        P(layout.ep_axes or None, layout.etp_axes or None, None),
    )
    fn = jax.shard_map(
        partial(
            _dispatch,
            cfg=cfg,
            ep_axes=layout.ep_axes,
            ep_size=layout.ep_size,
            etp_axes=layout.etp_axes,
            exchange=layout.exchange,
        ),
        mesh=layout.mesh,
        in_specs=(tok, tok, tok, {"we_gate": w_in, "we_up": w_in, "we_down": w_out}),
        out_specs=(tok, tok),
    )
    with _rules.activation_sharding(None):  # whole-mesh constraints do not apply inside shard_map
        y, keep = fn(x, experts, weights, params)
    # Back onto the model's mesh: tokens split over tensor_ep exist only in the expert view.
    return _tokens_on_model_mesh(y), _tokens_on_model_mesh(keep)


def _splits_as_dispatch(layout: ExpertLayout, manual: set[str]) -> bool:
    """Whether the ``manual`` axes are the dispatch's own: its token and expert axes, none of its expert tensor
    axes, on the model's mesh (no ``tensor_ep`` view)."""
    return (
        set(layout.token_axes) | set(layout.ep_axes) <= manual
        and not set(layout.etp_axes) & manual
        and EXPERT_TENSOR_SPLIT_AXIS not in layout.mesh.axis_names
    )


def stage_row_axes(layout: ExpertLayout | None, cfg: ModelConfig) -> tuple[str, ...]:
    """The axes an MoE model's pipeline stages hold manual beside ``pipeline`` so that the planned dispatch runs
    inside them (jaxdist.parallel.pipeline_blocks), in the batch rule's order; () where XLA partitions the
    experts instead: capacity dispatch (its groups would be each device's tokens rather than the microbatch's),
    the expert view (``mesh.expert_tensor`` < tensor), or tokens split over context.  Over fsdp the stages
    gather each layer's weights themselves (jaxdist.parallel.pipeline_blocks)."""
    if layout is None or not cfg.moe.experts or cfg.moe.dispatch != "dropless":
        return ()
    axes = set(layout.token_axes) | set(layout.ep_axes)
    if EXPERT_TENSOR_SPLIT_AXIS in layout.mesh.axis_names or "context" in axes:
        return ()
    return tuple(a for a in ("data", "fsdp", "expert") if a in axes)


def _manual_axes() -> set[str]:
    """The mesh axes a surrounding shard_map made manual (none outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return set()
    return {n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == jax.sharding.AxisType.Manual}


def _tokens_on_model_mesh(y: jax.Array) -> jax.Array:
    """Tokens [B*T, ...] constrained as the model's activations [B, T, ...] are split: rows over the batch axes,
    then (with mesh.context > 1) each row's sequence over context, so reshaping back to [B, T] moves nothing."""
    active = _rules.active_sharding()
    names = ("batch",) + (None,) * (y.ndim - 1)
    if active is None:
        return _rules.constrain(y, names)
    mesh, rules = active
    seq = tuple(a for a in _rule_axes(rules, "seq", mesh) if a not in _rule_axes(rules, "batch", mesh))
    rows = logical_to_spec(names, rules, mesh, y.shape)[0]
    rows = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
    axes = rows + seq
    if not seq or y.shape[0] % math.prod(mesh.shape[a] for a in axes):
        return _rules.constrain(y, names)
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(axes, *(None,) * (y.ndim - 1))))


def _dispatch(x, experts, weights, params, *, cfg: ModelConfig, ep_axes, ep_size, etp_axes, exchange):
    n_experts = cfg.moe.experts
    assert n_experts % ep_size == 0, (n_experts, ep_size)
    if ep_size == 1:  # every expert here: the model's own computation, summed over the expert tensor group
        return local_experts(x, experts, weights, params, cfg, reduce=partial(_psum, axes=etp_axes))
    wg, wu, wd = params["we_gate"], params["we_up"], params["we_down"]
    if cfg.moe.dispatch == "capacity":
        out, keep = _capacity(x, experts, wg, wu, wd, n_experts, cfg.moe.capacity_factor, ep_axes, ep_size, etp_axes)
    else:
        out = _dropless(x, experts, wg, wu, wd, n_experts, ep_axes, ep_size, etp_axes, exchange)
        keep = jnp.ones(experts.shape, bool)
    y = jnp.einsum("nk,nkd->nd", weights.astype(out.dtype), out)
    return y, keep


def _psum(y, axes):
    return jax.lax.psum(y, axes) if axes else y


def _dropless(x, experts, wg, wu, wd, n_experts, ep_axes, ep_size, etp_axes, exchange):
    """[n, k, d]: each assignment's expert output, before the router weights (ep_size > 1)."""
    n, d = x.shape
    k = experts.shape[1]
    n_local = n_experts // ep_size
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert (hence by peer)
    sorted_e = flat[order]
    rows = x[order // k]  # [n*k, d]
    dest = sorted_e // n_local
    counts = jnp.zeros((ep_size,), jnp.int32).at[dest].add(1)
    starts = jnp.cumsum(counts) - counts
    cap = n * min(k, n_local)  # most rows one peer can get from us
    local_e = sorted_e % n_local
    if exchange == "padded":
        pos = jnp.arange(n * k) - starts[dest]
        send = jnp.zeros((ep_size, cap, d), x.dtype).at[dest, pos].set(rows)
        send_e = jnp.full((ep_size, cap), n_local, jnp.int32).at[dest, pos].set(local_e)
        recv = jax.lax.all_to_all(send, ep_axes, 0, 0).reshape(ep_size * cap, d)
        recv_e = jax.lax.all_to_all(send_e, ep_axes, 0, 0).reshape(ep_size * cap)
        out = _psum(grouped_ffn(recv, recv_e, wg, wu, wd), etp_axes)
        back = jax.lax.all_to_all(out.reshape(ep_size, cap, d), ep_axes, 0, 0)
        y = back[dest, pos]
    else:
        a2a = jax.lax.ragged_all_to_all if exchange == "ragged" else partial(_emulated_ragged, n_peers=ep_size)
        recv_sizes = jax.lax.all_to_all(counts, ep_axes, 0, 0, tiled=True)
        me = jax.lax.axis_index(ep_axes)
        land = jnp.full((ep_size,), me * cap, jnp.int32)  # our block in every peer's receive buffer
        recv = a2a(rows, jnp.zeros((ep_size * cap, d), x.dtype), starts, counts, land, recv_sizes, axis_name=ep_axes)
        recv_e = a2a(
            local_e, jnp.full((ep_size * cap,), n_local, jnp.int32), starts, counts, land, recv_sizes, axis_name=ep_axes
        )
        out = _psum(grouped_ffn(recv, recv_e, wg, wu, wd), etp_axes)
        back_at = jax.lax.all_to_all(starts, ep_axes, 0, 0, tiled=True)  # where our rows sit at each source
        blocks = jnp.arange(ep_size, dtype=jnp.int32) * cap
        y = a2a(out, jnp.zeros((n * k, d), x.dtype), blocks, recv_sizes, back_at, counts, axis_name=ep_axes)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
    return y[inverse].reshape(n, k, d)


def _capacity(x, experts, wg, wu, wd, n_experts, factor, ep_axes, ep_size, etp_axes):
    """([n, k, d] kept assignments' expert outputs, zero where dropped; keep [n, k]) (ep_size > 1)."""
    n, d = x.shape
    k = experts.shape[1]
    n_local = n_experts // ep_size
    cap = expert_capacity(n, k, n_experts, factor)
    keep, slot = capacity_slots(experts, n_experts, cap)
    rows = jnp.broadcast_to(x[:, None, :], (n, k, d)).reshape(n * k, d)
    buf = jnp.zeros((n_experts * cap, d), x.dtype).at[slot.reshape(-1)].set(rows, mode="drop")
    # [peer, local expert, slot, d] -> our slots at each peer; concat over sources
    buf = jax.lax.all_to_all(buf.reshape(ep_size, n_local * cap, d), ep_axes, 0, 0)
    buf = buf.reshape(ep_size, n_local, cap, d).swapaxes(0, 1).reshape(n_local, ep_size * cap, d)
    out = _psum(dense_expert_ffn(buf, wg, wu, wd), etp_axes)
    out = out.reshape(n_local, ep_size, cap, d).swapaxes(0, 1).reshape(ep_size, n_local * cap, d)
    out = jax.lax.all_to_all(out, ep_axes, 0, 0)
    out = out.reshape(n_experts * cap, d)
    y = out[jnp.where(keep, slot, 0).reshape(-1)].reshape(n, k, d)
    return jnp.where(keep[..., None], y, 0), keep


def _emulated_ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, n_peers):
    """``ragged_all_to_all`` semantics built from a padded ``all_to_all`` (XLA:CPU lacks the op)."""
    rows = operand.shape[0]
    r = jnp.arange(rows)
    src = jnp.clip(input_offsets[:, None] + r[None, :], 0, rows - 1)  # [peers, rows]
    chunks = operand[src]
    valid = (r[None, :] < send_sizes[:, None]).reshape(n_peers, rows, *([1] * (operand.ndim - 1)))
    chunks = jnp.where(valid, chunks, jnp.zeros((), operand.dtype))
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0)  # [sources, rows, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source's rows land
    dst = jnp.where(r[None, :] < recv_sizes[:, None], at[:, None] + r[None, :], output.shape[0])
    return output.at[dst.reshape(-1)].set(got.reshape(n_peers * rows, *operand.shape[1:]), mode="drop")


# --------------------------------------------------------------------------- accounting


def dispatch_bytes(cfg: ModelConfig, layout: ExpertLayout, n_tokens: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes each device passes to ``all_to_all`` in one MoE layer's forward pass (padded exchange).

    ``n_tokens``: tokens of the whole batch.  Keys: ``rows`` (activation
    buffers: dispatch + return), ``ids`` (int32 expert ids, dropless only),
    ``total``.  Operand sizes, as XLA counts them: a device keeps 1/ep of its
    buffer, so the bytes on the wire are (ep-1)/ep of these.  0 when ep = 1.
    """
    ep = layout.ep_size
    if ep == 1:
        return {"rows": 0, "ids": 0, "total": 0}
    n = n_tokens // layout.size(layout.token_axes)
    k, e, d = cfg.moe.top_k, cfg.moe.experts, cfg.d_model
    if cfg.moe.dispatch == "capacity":
        slots = e * expert_capacity(n, k, e, cfg.moe.capacity_factor)
        return {"rows": 2 * slots * d * dtype_bytes, "ids": 0, "total": 2 * slots * d * dtype_bytes}
    buffer_rows = ep * n * min(k, e // ep)
    rows, ids = 2 * buffer_rows * d * dtype_bytes, buffer_rows * 4
    return {"rows": rows, "ids": ids, "total": rows + ids}


def expert_param_bytes(cfg: ModelConfig, layout: ExpertLayout, dtype_bytes: int) -> int:
    """Expert weight bytes per device per MoE layer: E * 3 * d * f * bytes / (ep * etp)."""
    return cfg.moe.experts * 3 * cfg.d_model * expert_d_ff(cfg) * dtype_bytes // (layout.ep_size * layout.etp_size)


def collective_bytes(hlo_text: str, op: str = "all-to-all") -> int:
    """Sum of the result bytes of every ``op`` instruction in an HLO module's text, each counted once.

    Reads the result shapes of lines like ``%a = f32[8,16]{1,0} all-to-all(...)``
    or tuple results ``(f32[..], s32[..]) all-to-all(...)``; for all-to-all
    (and all-reduce) the result has the operand's size.  The parser is
    :func:`jaxdist.parallel.hlo.instruction_bytes`.
    """
    return hlo.instruction_bytes(hlo_text, op)

"""Mixture-of-experts feed-forward block: router, top-k, auxiliary losses,
shared expert, and the per-shard expert computations.

Everything here is a pure function of arrays.  Parameters carry logical names
only (``expert`` for the expert dimension, ``expert_mlp`` for an expert's
hidden width).  Alone, an MoE layer runs every expert on the local tokens
(:func:`local_experts`); which devices hold which experts, and how tokens
travel to them, is decided outside this package: expert parallelism (``parallel/moe.py``)
hands the layer its dispatch (:mod:`jaxdist.models.hooks`), which calls the
per-shard kernels below (:func:`grouped_ffn`, :func:`capacity_slots`,
:func:`dense_expert_ffn`, :func:`local_experts`) inside ``shard_map``.

Shapes: ``N`` tokens (batch x seq flattened), ``d`` = d_model, ``E`` routed
experts, ``k`` experts per token, ``f`` = one expert's hidden width.

Routing (per token, float32):

* ``softmax`` router: p = softmax(x W_r); the k largest p are the experts and
  their weights (Mixtral).  ``sigmoid`` router: s = sigmoid(x W_r); the k
  largest s (DeepSeek-V3).  With ``moe.renormalize`` the k weights are rescaled
  to sum to 1.
* load-balancing loss (Switch / GShard): E * sum_e share_e * P_e, where
  share_e is the fraction of the N*k assignments that went to expert e (no
  gradient) and P_e the mean router probability of e (sigmoid scores are
  normalised per token first).  It is 1 when the load is perfectly even.
* z-loss (ST-MoE): mean over tokens of logsumexp(router logits)^2.

Both are means over the whole batch's tokens.  Where a surrounding ``shard_map`` split the tokens over devices
(``train.grad_sync=per_block``), the sums behind them go through the installed token totals
(:func:`jaxdist.models.hooks.token_totals`), and the same for the drop rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxdist.config import ModelConfig
from jaxdist.models import hooks
from jaxdist.models.names import (  # noqa: F401 (re-exported; they live there without JAX for the planner)
    DENSE_MLP_KEYS,
    EXPERT_KEYS,
    SHARED_KEYS,
    expert_d_ff,
    is_moe_layer,
    moe_layer_count,
    moe_param_specs,
)

# Scalar metrics the model reports per step (means over MoE layers).
MOE_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_drop_rate", "moe_load_max", "moe_load_min")


# --------------------------------------------------------------------------- routing


class Routing(NamedTuple):
    """A router's decision for N tokens."""

    experts: jax.Array  # [N, k] int32 expert ids, best first
    weights: jax.Array  # [N, k] float32 combine weights
    probs: jax.Array  # [N, E] float32 router distribution (for the balance loss)
    logits: jax.Array  # [N, E] float32 router logits (for the z-loss)


def route(x: jax.Array, w_router: jax.Array, cfg: ModelConfig) -> Routing:
    """Top-k routing of tokens x [N, d] with router weights [d, E], computed in float32."""
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), w_router.astype(jnp.float32))
    if cfg.moe.router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(scores, cfg.moe.top_k)
    if cfg.moe.renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), weights, probs, logits)


def expert_counts(experts: jax.Array, n_experts: int) -> jax.Array:
    """Assignments per expert [E] (float32) of expert ids [N, k]."""
    return jnp.zeros((n_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)


def router_losses(r: Routing, n_experts: int) -> dict[str, jax.Array]:
    """Load-balancing loss, z-loss (scalars), the per-expert share of assignments [E] (sums to 1) and their counts
    ``tokens`` [E] (float32: the tokens routed to each expert, before any capacity drop)."""
    tokens = expert_counts(r.experts, n_experts).astype(jnp.float32)
    total = hooks.token_totals()
    if total is not None:  # the tokens are split over devices: the losses of the whole batch's (module docstring)
        lse = jax.nn.logsumexp(r.logits, axis=-1)
        # Each sum from the tokens themselves (a count too: the same on every device, it must still be summed).
        tokens, probs, squares, n = total(
            (tokens, jnp.sum(r.probs, axis=0), jnp.sum(jnp.square(lse)), jnp.sum(jnp.ones_like(lse)))
        )
        share = tokens / (n * r.experts.shape[1])
        balance = n_experts * jnp.sum(jax.lax.stop_gradient(share) * (probs / n))
        return {"balance": balance, "z": squares / n, "share": share, "tokens": tokens}
    share = tokens / r.experts.size
    balance = n_experts * jnp.sum(jax.lax.stop_gradient(share) * jnp.mean(r.probs, axis=0))
    z = jnp.mean(jnp.square(jax.nn.logsumexp(r.logits, axis=-1)))
    return {"balance": balance, "z": z, "share": share, "tokens": tokens}


# --------------------------------------------------------------------------- expert kernels


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU FFN of rows x [..., d] with [d, f], [d, f], [f, d] weights."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def experts_reference(x: jax.Array, experts: jax.Array, weights: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    """Plain reference: every token through each of its k experts, weights gathered per token.

    x [N, d], experts/weights [N, k], p with we_gate [E, d, f], we_up, we_down.
    Returns [N, d].  Memory N*k*d*f: for tests and small shapes.
    """
    wg, wu, wd = (p[k][experts] for k in EXPERT_KEYS)  # [N, k, d, f], [N, k, d, f], [N, k, f, d]
    h = jax.nn.silu(jnp.einsum("nd,nkdf->nkf", x, wg)) * jnp.einsum("nd,nkdf->nkf", x, wu)
    y = jnp.einsum("nkf,nkfd->nkd", h, wd)
    return jnp.einsum("nk,nkd->nd", weights.astype(y.dtype), y)


def grouped_ffn(
    rows: jax.Array, expert: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array, rows_sorted: bool = False
) -> jax.Array:
    """SwiGLU of each row [R, d] through its expert (ids [R] in 0..E_local; E_local marks padding).

    Rows are grouped by expert and run through ``jax.lax.ragged_dot`` (one
    grouped matmul per weight); padding rows come out zero.  With
    ``rows_sorted`` the rows are already ordered by expert id.  The weights may
    be a column slice (gate, up) / row slice (down) of each expert's hidden
    width, in which case the result is a partial sum to be reduced by the caller.
    """
    n_local = wg.shape[0]
    sizes = jnp.zeros((n_local,), jnp.int32).at[expert].add(1, mode="drop")
    if rows_sorted:
        h = rows
    else:
        order = jnp.argsort(expert, stable=True)
        h = rows[order]
    g = jax.lax.ragged_dot(h, wg.astype(h.dtype), sizes)
    u = jax.lax.ragged_dot(h, wu.astype(h.dtype), sizes)
    y = jax.lax.ragged_dot(jax.nn.silu(g) * u, wd.astype(h.dtype), sizes)
    if rows_sorted:
        return y
    return jnp.zeros_like(y).at[order].set(y)


def expert_capacity(n_tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Slots per expert for one group of ``n_tokens`` tokens: ceil(factor * n_tokens * k / n_experts)."""
    return max(1, math.ceil(factor * n_tokens * k / n_experts - 1e-9))


def capacity_slots(experts: jax.Array, n_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """(keep [N, k] bool, slot [N, k] int32) for capacity dispatch of expert ids [N, k].

    Assignments claim their expert's slots in priority order: every token's
    first choice (in token order) before any second choice, and so on.  The
    first ``capacity`` claims of an expert are kept; ``slot`` = expert *
    capacity + position, or ``n_experts * capacity`` for a dropped assignment.
    """
    n, k = experts.shape
    by_choice = experts.T.reshape(-1)  # [k*N], choice-major
    onehot = jax.nn.one_hot(by_choice, n_experts, dtype=jnp.int32)
    position = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, by_choice[:, None], axis=1)[:, 0]
    position = position.reshape(k, n).T
    keep = position < capacity
    slot = jnp.where(keep, experts * capacity + position, n_experts * capacity)
    return keep, slot.astype(jnp.int32)


def dense_expert_ffn(buf: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array) -> jax.Array:
    """SwiGLU of slot buffers [E_local, C, d] through their experts' weights [E_local, d, f] / [E_local, f, d]."""
    dt = buf.dtype
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buf, wg.astype(dt))) * jnp.einsum("ecd,edf->ecf", buf, wu.astype(dt))
    return jnp.einsum("ecf,efd->ecd", h, wd.astype(dt))


def _no_reduce(y: jax.Array) -> jax.Array:
    return y


def local_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    params: dict[str, jax.Array],
    cfg: ModelConfig,
    reduce: Callable[[jax.Array], jax.Array] = _no_reduce,
) -> tuple[jax.Array, jax.Array]:
    """Routed expert outputs for tokens x [N, d] with expert ids / weights [N, k], every expert held here.

    ``params``: we_gate, we_up [E, d, f] and we_down [E, f, d].  Returns
    (y [N, d] = sum over a token's kept assignments of weight * expert FFN,
    keep [N, k] bool: False where capacity dispatch dropped the assignment).
    No communication: the MoE layer's default dispatch, and the per-device
    body of an exchange with one expert shard.  ``reduce`` is applied to the
    experts' FFN outputs: the caller's sum over an expert tensor group when the
    weights are slices of each expert's hidden width.
    """
    wg, wu, wd = (params[k] for k in EXPERT_KEYS)
    n, d = x.shape
    k = experts.shape[1]
    e = cfg.moe.experts
    if cfg.moe.dispatch == "capacity":  # each expert's first C assignments, as dense slot buffers
        cap = expert_capacity(n, k, e, cfg.moe.capacity_factor)
        keep, slot = capacity_slots(experts, e, cap)
        rows = jnp.broadcast_to(x[:, None, :], (n, k, d)).reshape(n * k, d)
        buf = jnp.zeros((e * cap, d), x.dtype).at[slot.reshape(-1)].set(rows, mode="drop")
        out = reduce(dense_expert_ffn(buf.reshape(e, cap, d), wg, wu, wd)).reshape(e * cap, d)
        out = out[jnp.where(keep, slot, 0).reshape(-1)].reshape(n, k, d)
        out = jnp.where(keep[..., None], out, 0)
    else:  # dropless: assignments sorted by expert through one grouped matmul per weight
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        out = reduce(grouped_ffn(x[order // k], flat[order], wg, wu, wd, rows_sorted=True))
        inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype))
        out = out[inverse].reshape(n, k, d)
        keep = jnp.ones(experts.shape, bool)
    return jnp.einsum("nk,nkd->nd", weights.astype(out.dtype), out), keep


# --------------------------------------------------------------------------- the block


def _routed(p: dict[str, jax.Array], tokens: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, Routing, jax.Array]:
    """(expert output [N, d] in the weights' handling of :func:`moe_forward`, the routing, keep [N, k]) of tokens
    [N, d]: the router, the installed dispatch and the shared expert."""
    r = route(tokens, p["router"], cfg)
    dispatch = hooks.expert_dispatch() or local_experts
    y, keep = dispatch(tokens, r.experts, r.weights, {k: p[k] for k in EXPERT_KEYS}, cfg)
    if cfg.moe.shared_d_ff:
        y = y + swiglu(tokens, *(p[k].astype(tokens.dtype) for k in SHARED_KEYS))
    return y, r, keep


def moe_forward(p: dict[str, jax.Array], x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MoE feed-forward of one block on normed activations x [B, T, d].

    ``p`` holds the block's weights (router, we_*, optional ws_*) in their
    storage dtype.  Returns (output [B, T, d] in x's dtype, aux) with aux
    scalars ``balance``, ``z``, ``drop_rate`` (share of the N*k assignments
    dropped; 0 in dropless mode) and ``share`` [E] (each expert's share of the
    assignments).  The experts run through the installed expert dispatch
    (:func:`jaxdist.models.hooks.expert_dispatch`, which the parallelism layer sets
    to spread them over the devices), else :func:`local_experts`.
    """
    b, t, d = x.shape
    y, r, keep = _routed(p, x.reshape(b * t, d), cfg)
    aux = router_losses(r, cfg.moe.experts)
    total = hooks.token_totals()
    if total is None:
        aux["drop_rate"] = 1.0 - jnp.mean(keep.astype(jnp.float32))
    else:
        kept, assigned = total((jnp.sum(keep.astype(jnp.float32)), jnp.sum(jnp.ones_like(keep, jnp.float32))))
        aux["drop_rate"] = 1.0 - kept / assigned
    return y.reshape(b, t, d).astype(x.dtype), aux


# The router's sums over a part of a microbatch's tokens (a sequence chunk of pipeline stages): the load-balancing
# and z losses are formed from them once every part has been routed (:func:`losses_from_sums`).
ROUTER_SUMS = ("probs", "squares", "tokens", "kept", "assigned")


def moe_forward_sums(p: dict[str, jax.Array], x: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`moe_forward` on a part of a microbatch's tokens (x [B, Tc, d]), with the router's sums over them in
    place of its losses: ``probs`` [E] (the router distribution summed over the tokens: the load-balancing loss's
    gradient flows through it), ``squares`` (logsumexp(router logits)^2 summed: the z-loss's), ``tokens`` [E]
    (assignments per expert), ``kept`` and ``assigned`` (assignments kept and made); all float32.  The losses of
    the whole microbatch are :func:`losses_from_sums` of the parts' sums added up."""
    b, t, d = x.shape
    y, r, keep = _routed(p, x.reshape(b * t, d), cfg)
    sums = {
        "probs": jnp.sum(r.probs, axis=0),
        "squares": jnp.sum(jnp.square(jax.nn.logsumexp(r.logits, axis=-1))),
        "tokens": expert_counts(r.experts, cfg.moe.experts),
        "kept": jnp.sum(keep.astype(jnp.float32)),
        "assigned": jnp.float32(keep.size),
    }
    return y.reshape(b, t, d).astype(x.dtype), sums


def losses_from_sums(sums: dict[str, jax.Array], n_tokens, cfg: ModelConfig) -> dict[str, jax.Array]:
    """:func:`moe_forward`'s aux (``balance``, ``z``, ``share``, ``tokens``, ``drop_rate``) of ``n_tokens`` tokens
    from their :func:`moe_forward_sums` added up (any leading axes: per microbatch and block, say).  The same
    numbers as one call on all the tokens: each is a sum over tokens divided once."""
    share = sums["tokens"] / (n_tokens * cfg.moe.top_k)
    return {
        "balance": cfg.moe.experts * jnp.sum(share * sums["probs"] / n_tokens, axis=-1),
        "z": sums["squares"] / n_tokens,
        "share": share,
        "tokens": sums["tokens"],
        "drop_rate": 1.0 - sums["kept"] / sums["assigned"],
    }


def sums_cotangent(tokens: jax.Array, n_tokens, weight, cfg: ModelConfig) -> dict[str, jax.Array]:
    """The cotangent of one block's :func:`moe_forward_sums` for an objective that adds ``weight`` x (aux_loss_coef
    x balance + z_loss_coef x z) of a microbatch of ``n_tokens`` tokens, ``tokens`` [E] that microbatch's
    assignments per expert in this block (all of its parts'): the balance's share takes no gradient, so each
    part's gradient needs only the counts of the whole microbatch."""
    share = tokens / (n_tokens * cfg.moe.top_k)
    zero = jnp.zeros((), jnp.float32)
    return {
        "probs": (weight * cfg.moe.aux_loss_coef * cfg.moe.experts / n_tokens) * share,
        "squares": jnp.asarray(weight * cfg.moe.z_loss_coef / n_tokens, jnp.float32),
        "tokens": jnp.zeros_like(tokens),
        "kept": zero,
        "assigned": zero,
    }


def summarize_aux(per_layer: dict[str, jax.Array], cfg: ModelConfig) -> dict[str, jax.Array]:
    """Model-level aux from per-MoE-layer aux stacked on a leading axis.

    Returns the scalars of MOE_METRICS (means over MoE layers; load_max and
    load_min are the largest / smallest expert share times E, 1 = even),
    ``moe_loss`` = aux_coef * moe_aux_loss + z_coef * moe_z_loss (the term the
    train step adds to the cross-entropy), ``moe_expert_share`` [E] and ``moe_layers``: per MoE block
    (``block<i>``, i its 0-based index), the tokens routed to each expert [E], its load-balancing and z losses and
    its drop rate (:func:`router_metrics` turns them into the step's scalars).
    """
    share = jnp.mean(per_layer["share"], axis=0)
    e = cfg.moe.experts
    blocks = [g * cfg.moe.every + cfg.moe.every - 1 for g in range(moe_layer_count(cfg))]
    layers = {
        f"block{b}": {
            "tokens": per_layer["tokens"][i],
            "aux_loss": per_layer["balance"][i],
            "z_loss": per_layer["z"][i],
            "drop_rate": per_layer["drop_rate"][i],
        }
        for i, b in enumerate(blocks)
    }
    out = {
        "moe_layers": layers,
        "moe_aux_loss": jnp.mean(per_layer["balance"]),
        "moe_z_loss": jnp.mean(per_layer["z"]),
        "moe_drop_rate": jnp.mean(per_layer["drop_rate"]),
        "moe_load_max": e * jnp.mean(jnp.max(per_layer["share"], axis=-1)),
        "moe_load_min": e * jnp.mean(jnp.min(per_layer["share"], axis=-1)),
        "moe_expert_share": share,
    }
    out["moe_loss"] = cfg.moe.aux_loss_coef * out["moe_aux_loss"] + cfg.moe.z_loss_coef * out["moe_z_loss"]
    return out


def summarize_microbatches(per_layer: dict[str, jax.Array], cfg: ModelConfig) -> dict[str, jax.Array]:
    """:func:`summarize_aux` of per-MoE-layer aux stacked [microbatches, layers, ...] (pipeline stages run the
    microbatches through one forward pass): each microbatch summarized, then their mean (a step of microbatches
    one after the other gives the same: ``jaxdist.train.step.loss_metrics_and_grads``), each block's ``tokens``
    summed."""
    each = jax.vmap(lambda a: summarize_aux(a, cfg))(per_layer)
    out = jax.tree.map(lambda v: jnp.mean(v, axis=0), each)
    for name, layer in out["moe_layers"].items():
        layer["tokens"] = jnp.sum(each["moe_layers"][name]["tokens"], axis=0)
    return out


def router_metrics(layers: dict[str, dict[str, jax.Array]]) -> dict[str, jax.Array]:
    """Per MoE block, the step's router figures as scalars named ``moe/block<i>/<figure>``: ``tokens_max``,
    ``tokens_min``, ``tokens_mean`` (tokens routed to one expert: the most and least loaded expert, and the mean
    over experts), ``aux_loss``, ``z_loss`` and ``drop_rate`` (the share of assignments capacity dispatch
    dropped; 0 for dropless).  ``layers``: :func:`summarize_aux`'s ``moe_layers`` with each block's ``tokens``
    summed over the step's microbatches (the other figures their mean)."""
    out = {}
    for name, d in layers.items():
        t = d["tokens"]
        out.update({f"moe/{name}/tokens_max": jnp.max(t), f"moe/{name}/tokens_min": jnp.min(t)})
        out[f"moe/{name}/tokens_mean"] = jnp.mean(t)
        out.update({f"moe/{name}/{k}": d[k] for k in ("aux_loss", "z_loss", "drop_rate")})
    return out


def split_group(stacked: dict[str, jax.Array], cfg: ModelConfig, groups: int = 0) -> dict[str, jax.Array]:
    """Stacked layer weights reshaped to a leading [groups] axis for scanning groups of ``moe.every`` blocks.

    Attention weights [L, ...] -> [G, k, ...]; dense MLP weights [G*(k-1), ...]
    -> [G, k-1, ...]; MoE weights [G, ...] stay.  G = ``groups``, default n_layers / moe.every (the weights
    of G consecutive groups: all of them by default).
    """
    k = cfg.moe.every
    g = groups or cfg.n_layers // k
    moe_keys = set(moe_param_specs(cfg))
    out = {}
    for name, v in stacked.items():
        if name in moe_keys:
            out[name] = v
        elif name in DENSE_MLP_KEYS:
            out[name] = v.reshape(g, k - 1, *v.shape[1:])
        else:
            out[name] = v.reshape(g, k, *v.shape[1:])
    return out


def group_member(group: dict[str, jax.Array], j: int, cfg: ModelConfig) -> dict[str, Any]:
    """Weights of block j (0-based) of one group from :func:`split_group` (one scan step)."""
    moe_keys = set(moe_param_specs(cfg))
    last = j == cfg.moe.every - 1
    out = {}
    for name, v in group.items():
        if name in moe_keys:
            if last:
                out[name] = v
        elif name in DENSE_MLP_KEYS:
            if not last:
                out[name] = v[j]
        else:
            out[name] = v[j]
    return out

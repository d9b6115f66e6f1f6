"""The train state and the pure train / eval step functions.

``TrainState`` is a plain dict pytree so that orbax, optax and printing all see
ordinary nested dicts::

    {"step": int32[], "params": {...}, "opt_state": optax state, "rng": uint32[2]}

The step functions here are pure (state, batch) -> (state, metrics); the
Trainer jits them with explicit shardings and buffer donation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxdist.data.batchlist import batch_digest
from jaxdist.models import apply, apply_with_aux, hooks
from jaxdist.models.hooks import LayerScan
from jaxdist.models.moe import MOE_METRICS, router_metrics
from jaxdist.models.packed import target_count, unpack
from jaxdist.parallel.rules import constrain

TrainState = dict[str, Any]


def next_token_loss(graphdef, params: dict, tokens: jax.Array, packed: bool = False) -> jax.Array:
    """Mean cross-entropy (nats per token) of predicting tokens[:, 1:] from tokens[:, :-1]; ``packed``: rows
    packed from documents, the mean over their targets (:func:`jaxdist.models.packed.unpack`)."""
    if packed:
        ids, segments, positions, labels, targets = unpack(tokens)
        logits, _ = apply_with_aux(graphdef, params, ids, segments, positions)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(jnp.where(targets, ce, 0.0)) / target_count(tokens)
    logits = apply(graphdef, params, tokens[:, :-1])
    labels = tokens[:, 1:]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def objective(
    graphdef, params: dict, tokens: jax.Array, packed: bool = False, scale: jax.Array | None = None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(training objective, metrics) for tokens [B, T+1].

    Dense model: (cross-entropy, {}).  MoE model: cross-entropy plus the
    weighted router losses (``moe.aux_loss_coef`` x load-balancing loss +
    ``moe.z_loss_coef`` x z-loss), and metrics ``loss`` (the cross-entropy,
    nats/token), the scalars of jaxdist.models.moe.MOE_METRICS and ``moe_layers`` (per MoE block: the tokens
    routed to each expert and the block's router losses and drop rate).

    ``packed`` (data.packing=documents): rows packed from documents, the cross-entropy summed over their
    targets and divided by ``scale`` (default: their count; the microbatch loop passes the whole batch's count
    over the number of microbatches, so the mean of the microbatches' values is the batch's mean).
    """
    if packed:
        ids, segments, positions, labels, targets = unpack(tokens)
        logits, aux = apply_with_aux(graphdef, params, ids, segments, positions)
        per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        ce = jnp.sum(jnp.where(targets, per_token, 0.0)) / (target_count(tokens) if scale is None else scale)
    else:
        logits, aux = apply_with_aux(graphdef, params, tokens[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    if not aux:
        return ce, {}
    return ce + aux["moe_loss"], {"loss": ce, **{k: aux[k] for k in MOE_METRICS}, "moe_layers": aux["moe_layers"]}


def loss_and_grads(graphdef, params: dict, tokens: jax.Array, microbatches: int = 1, packed: bool = False):
    """(loss, grads) of the global batch, accumulated over ``microbatches`` equal slices.

    ``loss`` is the objective the gradients belong to (the cross-entropy for a
    dense model; see :func:`objective`).
    """
    loss, _, grads = loss_metrics_and_grads(graphdef, params, tokens, microbatches, packed)
    return loss, grads


def loss_metrics_and_grads(graphdef, params: dict, tokens: jax.Array, microbatches: int = 1, packed: bool = False):
    """(objective, metrics, grads) of the global batch, accumulated over ``microbatches`` equal slices.

    Every microbatch has the same token count, so the mean of the microbatch
    means is the mean over the global batch (metrics too are microbatch means).
    Microbatch k holds rows k, k+m, k+2m, ...: each device keeps working on
    rows it already holds.  ``packed`` rows (data.packing=documents) hold different numbers of targets: each
    microbatch's sum is divided by the batch's count over ``microbatches``, so the mean is the batch's.
    """
    scale = target_count(tokens) / microbatches if packed and microbatches > 1 else None
    grad_fn = jax.value_and_grad(lambda p, t: objective(graphdef, p, t, packed, scale), has_aux=True)
    if microbatches == 1:
        (loss, metrics), grads = grad_fn(params, tokens)
        return loss, metrics, grads
    b, l = tokens.shape
    mb = tokens.reshape(b // microbatches, microbatches, l).swapaxes(0, 1)
    mb = constrain(mb, (None, "batch", "seq"))

    def body(carry, t):
        loss_sum, metric_sum, grad_sum = carry
        (loss, metrics), grads = grad_fn(params, t)
        return (
            loss_sum + loss,
            jax.tree.map(jnp.add, metric_sum, metrics),
            jax.tree.map(jnp.add, grad_sum, grads),
        ), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    metric_zeros = jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype),
        jax.eval_shape(lambda p, t: objective(graphdef, p, t, packed, scale)[1], params, mb[0]),
    )
    (loss_sum, metric_sum, grad_sum), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), metric_zeros, zeros), mb)
    scale = 1.0 / microbatches
    metrics = jax.tree.map(lambda m: m * scale, metric_sum)
    for name, layer in metrics.get("moe_layers", {}).items():  # counts: the step's, summed over microbatches
        layer["tokens"] = metric_sum["moe_layers"][name]["tokens"]
    return loss_sum * scale, metrics, jax.tree.map(lambda g: g * scale, grad_sum)


def staged_grads_fn(graphdef, stages: LayerScan, packed: bool = False) -> Callable:
    """``fn(params, tokens) -> (objective, metrics, grads)`` of an MoE model whose blocks run as gpipe pipeline
    stages (``stages``: jaxdist.parallel.pipeline_blocks.pipelined_scan, which splits the rows into the
    microbatches): one forward pass over the batch, its router losses and metrics those of the microbatches one
    after the other (:func:`loss_metrics_and_grads`)."""

    def fn(params, tokens):
        with hooks.scanning_layers(stages):
            return loss_metrics_and_grads(graphdef, params, tokens, 1, packed)

    return fn


def init_state(params: dict, optimizer: optax.GradientTransformation, seed: int) -> TrainState:
    """A fresh train state around ``params`` (call under jit to get it sharded)."""
    return {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": optimizer.init(params),
        "rng": jax.random.key_data(jax.random.key(seed)),
    }


def make_train_step(
    graphdef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule | None,
    microbatches: int = 1,
    grad_clip: float = 0.0,
    grads_fn: Callable | None = None,
    packed: bool = False,
) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict]]:
    """``train_step(state, tokens[B, T+1]) -> (state, metrics)``; metrics: loss, grad_norm, lr, batch_digest
    (the tokens' uint32 digest, jaxdist.data.batchlist.token_digest)
    (and for an MoE model the cross-entropy as loss plus MOE_METRICS, see :func:`objective`, and per MoE block
    the router's figures, jaxdist.models.moe.router_metrics).

    ``schedule`` gives the ``lr`` metric (None: none is logged).
    ``grad_clip`` > 0 scales the gradients to at most that global norm before the optimizer.
    A step whose loss or gradient norm is not finite leaves the parameters and the optimizer state as
    they were (the step count and the RNG advance); the host skips or stops on it (train.skip_nonfinite).
    ``grads_fn(params, tokens) -> (loss, metrics, grads)`` replaces the model's own
    (the pipeline executor does this, jaxdist.parallel.pipeline); a ``grad_norm`` in its metrics is the norm used.
    ``packed``: the rows are packed from documents (data.packing=documents; :func:`objective`), and the
    metrics add ``targets``, the predictions the loss counts.
    """

    def train_step(state: TrainState, tokens: jax.Array):
        params = state["params"]
        if grads_fn is not None:
            loss, model_metrics, grads = grads_fn(params, tokens)
        else:
            loss, model_metrics, grads = loss_metrics_and_grads(graphdef, params, tokens, microbatches, packed)
        # Clip here rather than in optax so the norm is computed (and all-reduced) once; a grads_fn may bring its
        # own (train.grad_sync=ordered computes it from the whole gradients, the same bits on every mesh).
        model_metrics = dict(model_metrics)
        model_metrics.update(router_metrics(model_metrics.pop("moe_layers", {})))  # per MoE block, scalars
        grad_norm = model_metrics.pop("grad_norm", None)
        if grad_norm is None:
            grad_norm = optax.global_norm(grads)
        if grad_clip > 0:
            scale = jnp.minimum(1.0, grad_clip / jnp.maximum(grad_norm, 1e-12))
            grads = jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        # A step whose logged loss or gradient norm is not finite changes nothing but the step count: no NaN
        # reaches the parameters or the optimizer state; the host skips or stops at its next sync (MetricsWindow).
        # A select keeps every finite step's numbers bit for bit.
        metrics = {"loss": loss, "grad_norm": grad_norm, **model_metrics}
        if schedule is not None:  # None: the user's own optimizer, whose schedule jaxdist does not know
            metrics["lr"] = schedule(state["step"])
        # The tokens this step trained on, as the log records them beside the batch id (jaxdist.data.audit).
        metrics["batch_digest"] = batch_digest(tokens, jnp)
        if packed:
            metrics["targets"] = target_count(tokens)
        ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
        new_params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(ok, new, old), (new_params, opt_state), (params, state["opt_state"])
        )
        # The key advances every step so a resumed run draws the same randomness.
        rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"]))
        new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state, "rng": rng}
        return new_state, metrics

    return train_step


def make_eval_step(graphdef, packed: bool = False) -> Callable[[dict, jax.Array], jax.Array]:
    """``eval_step(params, tokens[B, T+1]) -> mean loss`` (``packed``: over the targets of packed rows)."""
    return lambda params, tokens: next_token_loss(graphdef, params, tokens, packed)

"""The four decisions the model leaves to the parallelism layer, as functions it is handed while it traces.

* **constrain** ``(x, logical names) -> x``: where an activation lives.  The
  model calls :func:`constrain` on its activations with logical axis names
  only; without a constraint function installed it returns ``x`` unchanged.
* **sequence attention** ``(q, k, v, model config) -> out``: causal attention
  over a whole sequence when its tokens are split over devices (the context
  axis' ring attention, ``parallel/context.py``); without one installed the
  model runs ``model.attention``'s implementation.
* **expert dispatch** ``(tokens [N, d], expert ids [N, k], weights [N, k],
  expert params, model config) -> (y [N, d], keep [N, k] bool)``: how an MoE
  layer's tokens reach their experts.  Without one installed the MoE layer
  runs its experts on the local tokens (``jaxdist.models.moe.local_experts``).

* **gradient sync** ``(params, where) -> params``: an identity the model applies to its weights where they
  enter the computation (``where``: ``"embed"`` the table for the lookup, ``"layers"`` once per scan step on
  that step's group of ``layers_per_step`` blocks, ``"head"`` the final norm and the output projection, a tied
  table again); the parallelism layer's version reduces their gradients in its backward
  (``parallel/grad_sync.py``).  Without one installed nothing is applied and the scan runs one
  block per step.

* **token totals** ``tree -> tree``: a pytree of sums over the tokens this trace sees (an MoE router's
  assignment counts, probabilities and logits) summed over the shards a surrounding ``shard_map`` split the
  tokens into, so that the router's losses are the whole batch's (``train.grad_sync=per_block``); its
  backward hands each shard its own share.  Without one installed the tokens traced are all there are.

* **block remat** ``fn -> fn``: a user's model marks its blocks with :func:`remat_block`; the Trainer
  installs ``jax.checkpoint`` with ``train.remat``'s policy (``jaxdist.train.custom``).
* **layer scan** ``(body, x, stacked layers) -> (x, ys)``: how a stack of layers runs (a user's
  ``jaxdist.models.blocks.run_blocks``, and an MoE transformer's blocks): without one installed,
  ``jax.lax.scan``; with ``mesh.pipeline > 1`` the gpipe stages of ``parallel/pipeline_blocks.py``, whose
  ``ys`` lead with the microbatch axis.

The parallelism layer (``parallel/``) installs them (``activation_sharding``,
``context_parallelism``, ``expert_parallelism``; ``Parallelism.bind`` enters them inside the jitted
function), so this package never imports device code.  The functions are
read while tracing: what is installed when a function is traced is baked into
that trace.  No JAX import here.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

# (x, logical names) -> x with a sharding constraint.
Constrain = Callable[[Any, Sequence["str | None"]], Any]
# (x, experts, weights, expert params, ModelConfig) -> (y, keep).
ExpertDispatch = Callable[..., tuple[Any, Any]]

# (q [B,T,H,D], k, v [B,T,KV,D], ModelConfig) -> [B,T,H,D]: causal attention of a whole sequence.
SequenceAttention = Callable[..., Any]

_CONSTRAIN: contextvars.ContextVar[Constrain | None] = contextvars.ContextVar("jaxdist_constrain", default=None)
_DISPATCH: contextvars.ContextVar[ExpertDispatch | None] = contextvars.ContextVar(
    "jaxdist_expert_dispatch", default=None
)

_ATTENTION: contextvars.ContextVar[SequenceAttention | None] = contextvars.ContextVar(
    "jaxdist_sequence_attention", default=None
)


def constrain(x, names: Sequence[str | None]):
    """``x`` pinned by the installed constraint function from its logical ``names``, or ``x`` itself."""
    fn = _CONSTRAIN.get()
    return x if fn is None else fn(x, names)


def expert_dispatch() -> ExpertDispatch | None:
    """The installed expert dispatch, or None (the MoE layer then runs its experts locally)."""
    return _DISPATCH.get()


@contextlib.contextmanager
def constraining(fn: Constrain | None) -> Iterator[None]:
    """Within this block :func:`constrain` calls ``fn`` (None: no constraints).  Nests; the outer one is restored."""
    token = _CONSTRAIN.set(fn)
    try:
        yield
    finally:
        _CONSTRAIN.reset(token)


@contextlib.contextmanager
def dispatching_experts(fn: ExpertDispatch | None) -> Iterator[None]:
    """Within this block MoE layers send their tokens to experts with ``fn`` (None: local experts).  Nests."""
    token = _DISPATCH.set(fn)
    try:
        yield
    finally:
        _DISPATCH.reset(token)


def sequence_attention() -> SequenceAttention | None:
    """The installed attention over a whole sequence (context parallelism's ring), or None (the model's own)."""
    return _ATTENTION.get()


@contextlib.contextmanager
def attending(fn: SequenceAttention | None) -> Iterator[None]:
    """Within this block causal attention over a whole sequence (queries at positions 0..T-1 against keys
    0..T-1) runs ``fn`` (None: ``model.attention``'s implementation).  Nests; the outer one is restored."""
    token = _ATTENTION.set(fn)
    try:
        yield
    finally:
        _ATTENTION.reset(token)


class GradSync:
    """What the model asks of an installed gradient sync: ``layers_per_step`` blocks per scan step (a
    divisor of ``n_layers``) and ``__call__(params, where)``, an identity on a dict of weights."""

    layers_per_step: int = 1

    def __call__(self, params: dict, where: str) -> dict:  # pragma: no cover - an interface
        return params


_TOKEN_TOTALS: contextvars.ContextVar[Callable[[Any], Any] | None] = contextvars.ContextVar(
    "jaxdist_token_totals", default=None
)


def token_totals() -> Callable[[Any], Any] | None:
    """The installed token totals (see the module docstring), or None: the traced tokens are the batch."""
    return _TOKEN_TOTALS.get()


@contextlib.contextmanager
def totalling_tokens(fn: Callable[[Any], Any] | None) -> Iterator[None]:
    """Within this block sums over tokens go through ``fn`` (see the module docstring).  Nests."""
    token = _TOKEN_TOTALS.set(fn)
    try:
        yield
    finally:
        _TOKEN_TOTALS.reset(token)


_GRAD_SYNC: contextvars.ContextVar[GradSync | None] = contextvars.ContextVar("jaxdist_grad_sync", default=None)


def grad_sync() -> GradSync | None:
    """The installed gradient sync, or None (the model's weights are used as they are)."""
    return _GRAD_SYNC.get()


@contextlib.contextmanager
def syncing_grads(fn: GradSync | None) -> Iterator[None]:
    """Within this block the model passes its weights through ``fn`` (see :class:`GradSync`).  Nests."""
    token = _GRAD_SYNC.set(fn)
    try:
        yield
    finally:
        _GRAD_SYNC.reset(token)


# fn -> fn under the run's remat policy (jax.checkpoint): installed by the Trainer for a user's model.
BlockRemat = Callable[[Callable], Callable]
_BLOCK_REMAT: contextvars.ContextVar[BlockRemat | None] = contextvars.ContextVar("jaxdist_block_remat", default=None)


def remat_block(fn: Callable) -> Callable:
    """``fn`` (one block of your own model: ``x = remat_block(self.block)(x)``) recomputed in the backward pass
    as ``train.remat`` says, when jaxdist traces the model (jaxdist.train.custom); ``fn`` as it is otherwise.

    A block is the unit whose saved values are dropped and recomputed: only one block's are held again at once
    in the backward pass, so the step's peak falls with the policy."""

    def call(*args, **kwargs):
        wrap = _BLOCK_REMAT.get()
        return (fn if wrap is None else wrap(fn))(*args, **kwargs)

    return call


@contextlib.contextmanager
def rematerializing(wrap: BlockRemat | None) -> Iterator[None]:
    """Within this block :func:`remat_block` applies ``wrap`` to each block (None: nothing).  Nests."""
    token = _BLOCK_REMAT.set(wrap)
    try:
        yield
    finally:
        _BLOCK_REMAT.reset(token)


# (body, x, stacked layers) -> (x, ys): a stack of layers scanned as jax.lax.scan(body, x, stacked) would, but
# as pipeline stages over microbatches of x's rows (ys then lead with the microbatch axis).
LayerScan = Callable[[Callable, Any, Any], tuple[Any, Any]]
_LAYER_SCAN: contextvars.ContextVar[LayerScan | None] = contextvars.ContextVar("jaxdist_layer_scan", default=None)


def layer_scan() -> LayerScan | None:
    """The installed way to scan a stack of layers as pipeline stages, or None (``jax.lax.scan``)."""
    return _LAYER_SCAN.get()


@contextlib.contextmanager
def scanning_layers(fn: LayerScan | None) -> Iterator[None]:
    """Within this block the model's stacks of layers (jaxdist's transformer's, and a user's
    :func:`jaxdist.models.blocks.run_blocks`) run through ``fn`` (None: a scan).  Nests; the outer one is
    restored."""
    token = _LAYER_SCAN.set(fn)
    try:
        yield
    finally:
        _LAYER_SCAN.reset(token)

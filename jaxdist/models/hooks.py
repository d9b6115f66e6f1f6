"""The two decisions the model leaves to the parallelism layer, as functions it is handed while it traces.

* **constrain** ``(x, logical names) -> x``: where an activation lives.  The
  model calls :func:`constrain` on its activations with logical axis names
  only; without a constraint function installed it returns ``x`` unchanged.
* **expert dispatch** ``(tokens [N, d], expert ids [N, k], weights [N, k],
  expert params, model config) -> (y [N, d], keep [N, k] bool)``: how an MoE
  layer's tokens reach their experts.  Without one installed the MoE layer
  runs its experts on the local tokens (``jaxdist.models.moe.local_experts``).

The parallelism layer (``parallel/``) installs both (``activation_sharding``,
``expert_parallelism``; ``Parallelism.bind`` enters them inside the jitted
function), so this package never imports device code.  The functions are
read while tracing: what is installed when a function is traced is baked into
that trace.  No JAX import here.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

# (x, logical names) -> x with a sharding constraint.
Constrain = Callable[[Any, Sequence["str | None"]], Any]
# (x, experts, weights, expert params, ModelConfig) -> (y, keep).
ExpertDispatch = Callable[..., tuple[Any, Any]]

_CONSTRAIN: contextvars.ContextVar[Constrain | None] = contextvars.ContextVar("jaxdist_constrain", default=None)
_DISPATCH: contextvars.ContextVar[ExpertDispatch | None] = contextvars.ContextVar(
    "jaxdist_expert_dispatch", default=None
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

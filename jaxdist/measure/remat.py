"""What XLA reports for a remat policy: temp bytes and FLOPs of the compiled gradient program.

The check on a prediction is the gradient of the training loss (model,
cross-entropy, no optimizer) compiled on a real mesh with the policy applied
to every scanned block.  ``compiled.memory_analysis().temp_size_in_bytes``
holds the saved activations of all layers plus working space that barely
depends on the policy, so the difference against ``nothing_saveable`` is the
measured saved-activation memory; the difference of
``cost_analysis()["flops"]`` against ``everything_saveable`` is the
recomputed FLOPs.  Both are per device.  XLA's cost analysis counts a loop
body once, so recomputed FLOPs of the scanned blocks come out per block.

The programs are compiled with ``xla_backend_optimization_level=0``: the
memory plan (buffer assignment) and the HLO FLOP count do not depend on
LLVM's optimisation level, and compiling takes half the time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxdist.config import ModelConfig
from jaxdist.models.transformer import create_abstract
from jaxdist.parallel.layout import sharded_tracing
from jaxdist.parallel.rules import DEFAULT_RULES, Rules, logical_to_spec
from jaxdist.train.step import next_token_loss


@dataclass(frozen=True)
class CompiledCost:
    """Per-device figures of one compiled gradient program: temp bytes and FLOPs."""

    temp_bytes: int
    flops: float


def _cost(cost: Any) -> dict:
    return (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}


def gradient_program(cfg: ModelConfig, mesh: Mesh, batch: int, seq_len: int, policy: Any, rules: Rules = DEFAULT_RULES):
    """(jitted grad function, abstract sharded params, abstract sharded tokens) for ``policy`` on ``mesh``."""
    graphdef, abstract, names = create_abstract(cfg, remat_policy=policy)

    def sharded(a, n):
        return jax.ShapeDtypeStruct(
            a.shape, a.dtype, sharding=NamedSharding(mesh, logical_to_spec(n, rules, mesh, a.shape))
        )

    params = jax.tree.map(lambda n, a: sharded(a, n), names, abstract, is_leaf=lambda x: isinstance(x, tuple))
    tokens = sharded(jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32), ("batch", "seq"))
    grad = jax.jit(jax.grad(lambda p, t: next_token_loss(graphdef, p, t)))
    return grad, params, tokens


def compiled_cost(
    cfg: ModelConfig, mesh: Mesh, batch: int, seq_len: int, policy: Any, rules: Rules = DEFAULT_RULES
) -> CompiledCost:
    """Compile the gradient program with ``policy`` (None: no checkpointing) and read XLA's figures."""
    grad, params, tokens = gradient_program(cfg, mesh, batch, seq_len, policy, rules)
    with sharded_tracing(mesh, rules):
        lowered = grad.lower(params, tokens)
    compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    mem = compiled.memory_analysis()
    return CompiledCost(int(mem.temp_size_in_bytes), float(_cost(compiled.cost_analysis()).get("flops", 0.0)))


def measure_policies(
    cfg: ModelConfig, mesh: Mesh, batch: int, seq_len: int, policies: dict[str, Any], rules: Rules = DEFAULT_RULES
) -> dict[str, CompiledCost]:
    """:func:`compiled_cost` for each named policy; policies that save the same thing compile once.

    Two policies are the same when they are the same object, or both save
    exactly the same checkpoint names / signatures (plans at nearby budgets often do).
    """
    seen: dict[Any, CompiledCost] = {}
    out = {}
    for name, policy in policies.items():
        key = _policy_key(policy)
        if key not in seen:
            seen[key] = compiled_cost(cfg, mesh, batch, seq_len, policy, rules)
        out[name] = seen[key]
    return out


def _policy_key(policy: Any) -> Any:
    sigs = getattr(policy, "signatures", None)
    if sigs is not None:
        return ("signatures", frozenset(sigs))
    names = _closure_names(policy)
    return ("names", names) if names is not None else ("object", id(policy))


def _closure_names(policy: Any) -> frozenset | None:
    # save_only_these_names(*names) closes over a set of names; two with equal sets are the same policy.
    if getattr(policy, "__name__", "") != "policy" or not policy.__closure__:
        return None
    for cell in policy.__closure__:
        v = cell.cell_contents
        if isinstance(v, (set, frozenset)) and all(isinstance(s, str) for s in v):
            return frozenset(v) | {policy.__qualname__}
    return None


def dominated_by(
    point: tuple[float, float], others: dict[str, tuple[float, float]], tol: tuple[float, float] = (0.0, 0.0)
) -> str | None:
    """Name of the first of ``others`` that dominates ``point`` = (bytes, flops), or None.

    B dominates A when B is no worse in both (within ``tol``) and better in
    one by more than its ``tol``: measurement noise neither makes nor breaks
    domination.
    """
    m, f = point
    for name, (om, of) in others.items():
        if om <= m + tol[0] and of <= f + tol[1] and (om < m - tol[0] or of < f - tol[1]):
            return name
    return None

"""Fit the memory model's working-buffer coefficients to compiled programs.

The planner's memory prediction is linear in :class:`MemoryCoefficients`
(see :class:`~jaxdist.planner.cost.MemoryTerms`), so the coefficients that
minimise the largest relative error over a set of measured settings are the
solution of a linear programme::

    minimise t  subject to  |known_i + sum_j c_j x_ij - m_i| <= t m_i,  lower_j <= c_j <= c_max

(``m_i``: bytes from ``compiled.memory_analysis()``; ``known_i``: the bytes
no coefficient scales; ``fixed``, a constant in bytes, has no upper bound).
scipy's HiGHS solves it exactly.  ``benchmarks/planner_fit.py`` measures a
sample of settings, cross-validates the fit and prints the coefficients; the
shipped :data:`~jaxdist.planner.cost.XLA_CPU_MEMORY` comes from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from jaxdist.planner.cost import MemoryCoefficients, MemoryTerms


@dataclass(frozen=True)
class MemoryFit:
    """Fitted coefficients and the largest relative error over the fitted settings."""

    coefficients: MemoryCoefficients
    max_error: float


def _names(terms: list[MemoryTerms]) -> list[str]:
    names = sorted({k for t in terms for k, v in t.scaled.items() if v})
    if not names:
        raise ValueError("no memory term varies over the settings: measure settings with working buffers to fit")
    return names


# Physical floors: at the loss, a microbatch's float32 logits and their gradient are both live; with the
# embedding split over fsdp or tensor, the gathered table and its full-size gradient are.  Settings with
# small vocabularies cannot tell these terms apart; large-vocabulary models depend on them.
LOWER_BOUNDS = {"logits_working": 2.0, "gathered_embedding": 2.0}


def fit_memory_coefficients(
    terms: list[MemoryTerms],
    measured: list[float],
    c_max: float = 8.0,
    base: MemoryCoefficients | None = None,
    lower: dict[str, float] | None = None,
) -> MemoryFit:
    """Coefficients minimising the largest relative error of ``terms`` against ``measured`` bytes.

    Each coefficient lies in [``lower`` (default :data:`LOWER_BOUNDS`), ``c_max``];
    one whose term is zero in every setting keeps its value from ``base``
    (default: the shipped one).  Raises ValueError on mismatched or
    non-positive input.
    """
    lower = LOWER_BOUNDS if lower is None else lower
    if len(terms) != len(measured) or not terms:
        raise ValueError(f"need one measurement per setting, got {len(terms)} settings and {len(measured)} values")
    m = np.asarray(measured, dtype=float)
    if (m <= 0).any():
        raise ValueError("measured memory must be positive bytes")
    names = _names(terms)
    known = np.array([t.memory(_ZERO).total for t in terms])
    x = np.array([[t.scaled.get(n, 0.0) for n in names] for t in terms])
    k = len(names)
    # variables: c_1..c_k, t.  known + x c - m <= t m  and  m - known - x c <= t m
    a_ub = np.vstack([np.hstack([x, -m[:, None]]), np.hstack([-x, -m[:, None]])])
    b_ub = np.concatenate([m - known, known - m])
    cost = np.zeros(k + 1)
    cost[-1] = 1.0
    # scale each column so the solver sees numbers near 1 (bytes differ by orders of magnitude)
    scale = np.maximum(np.abs(a_ub).max(axis=0), 1e-30)
    bounds = [
        (lower.get(n, 0.0) * s, None if n == "fixed" else c_max * s)  # fixed: bytes, no upper bound
        for n, s in zip(names, scale[:k])
    ]
    from scipy.optimize import linprog  # scipy (~0.4 s to import) only for a memory fit

    res = linprog(cost, A_ub=a_ub / scale, b_ub=b_ub, bounds=bounds + [(0, None)], method="highs")
    if not res.success:
        raise RuntimeError(f"the memory fit did not solve: {res.message}")
    c = res.x[:k] / scale[:k]
    return MemoryFit(_with(base or MemoryCoefficients(), dict(zip(names, c))), float(res.x[-1] / scale[-1]))


def _with(base: MemoryCoefficients, values: dict[str, float]) -> MemoryCoefficients:
    working = dict(base.layer_working)
    plain = {}
    for name, v in values.items():
        v = round(float(v), 4)
        if name.startswith("layer_working:"):
            working[name.split(":", 1)[1]] = v
        else:
            plain[name] = v
    return dataclasses.replace(base, layer_working=tuple(sorted(working.items())), **plain)


def relative_errors(terms: list[MemoryTerms], measured: list[float], coeff: MemoryCoefficients) -> list[float]:
    """Per setting, predicted / measured - 1 under ``coeff``."""
    return [t.memory(coeff).total / m - 1 for t, m in zip(terms, measured)]


_ZERO = MemoryCoefficients(
    layer_working=(),
    default_working=0.0,
    microbatch_working=0.0,
    logits_working=0.0,
    gathered_weights=0.0,
    grad_copies=0.0,
    gathered_embedding=0.0,
    fixed=0.0,
)

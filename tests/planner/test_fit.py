"""The memory-coefficient fit: exact on data the model can express, minimax on data it cannot."""

import dataclasses
import random

import pytest

from jaxdist.config import load_config
from jaxdist.planner.candidates import Strategy
from jaxdist.planner.computation import computation_view
from jaxdist.planner.cost import XLA_CPU_MEMORY, MemoryCoefficients, memory, memory_terms
from jaxdist.planner.fit import fit_memory_coefficients, relative_errors

STRATEGIES = [
    Strategy(data=d, fsdp=f, tensor=t, expert=1, pipeline=1, microbatches=m, schedule="none", remat=r)
    for d, f, t in [(8, 1, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2), (1, 4, 2), (2, 4, 1)]
    for m in (1, 2, 4)
    for r in ("none", "names", "full")
]


def _settings():
    out = []
    for preset, seq in (("tiny", 32), ("small", 64)):
        view = computation_view(load_config(None, [f"model={preset}"]).model, seq)
        out += [(view, s, 64) for s in STRATEGIES]
    return out


def test_terms_reproduce_the_memory_model():
    for view, s, b in _settings()[::7]:
        assert memory_terms(view, s, b).memory(XLA_CPU_MEMORY) == memory(view, s, b)


def test_fit_recovers_known_coefficients():
    truth = MemoryCoefficients(
        layer_working=(("full", 1.4), ("names", 0.5), ("none", 0.9)),
        microbatch_working=0.7,
        logits_working=3.0,
        gathered_weights=1.5,
        grad_copies=1.0,
    )
    settings = _settings()
    terms = [memory_terms(*x) for x in settings]
    measured = [t.memory(truth).total for t in terms]
    fit = fit_memory_coefficients(terms, measured)
    assert fit.max_error < 1e-4
    assert max(abs(e) for e in relative_errors(terms, measured, fit.coefficients)) < 1e-3
    for name in ("microbatch_working", "logits_working", "gathered_weights", "grad_copies"):
        assert getattr(fit.coefficients, name) == pytest.approx(getattr(truth, name), rel=1e-3)
    for remat in ("none", "names", "full"):
        assert fit.coefficients.working(remat) == pytest.approx(truth.working(remat), rel=1e-3)


def test_fit_minimises_the_worst_relative_error():
    """With noise the model cannot express, the fit's worst error is no larger than any other coefficients'."""
    rng = random.Random(0)
    terms = [memory_terms(*x) for x in _settings()]
    measured = [t.memory(XLA_CPU_MEMORY).total * (1 + rng.uniform(-0.05, 0.05)) for t in terms]
    fit = fit_memory_coefficients(terms, measured)
    worst = max(abs(e) for e in relative_errors(terms, measured, fit.coefficients))
    assert worst == pytest.approx(fit.max_error, abs=1e-3)
    for _ in range(50):  # random other coefficients, the shipped ones among the candidates
        other = dataclasses.replace(
            XLA_CPU_MEMORY,
            logits_working=rng.uniform(2, 4),  # the fit keeps >= 2
            microbatch_working=rng.uniform(0, 1),
        )
        assert max(abs(e) for e in relative_errors(terms, measured, other)) >= worst - 1e-3
    assert max(abs(e) for e in relative_errors(terms, measured, XLA_CPU_MEMORY)) >= worst - 1e-3


def test_fit_refuses_bad_input():
    terms = [memory_terms(*x) for x in _settings()[:3]]
    with pytest.raises(ValueError, match="one measurement per setting"):
        fit_memory_coefficients(terms, [1.0])
    with pytest.raises(ValueError, match="positive"):
        fit_memory_coefficients(terms, [1.0, 0.0, 2.0])

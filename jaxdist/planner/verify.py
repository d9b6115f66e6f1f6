"""The budget is the compiled peak: ``jaxdist plan --verify`` (:func:`verify_plan`).

The plans in the planner's order are compiled one at a time (an injected ``compile_peak``, so this stays pure)
until one's compiled peak per device (arguments + outputs + temp - aliased) is within the budget; a plan whose
compiled peak exceeds it is never the one returned.  After each compile the remaining predictions are scaled by
what it showed (compiled / predicted), so a plan predicted to fit only by an optimistic model is passed over
without a compile.  Usually one compile; more only while compiles show the model optimistic, and each of those
moves the correction, so the next plan compiled is one the corrected model says fits (:class:`VerifyError` when
none is left).  The remat selector's own loop against the compiler is :mod:`jaxdist.remat.verify`, and what its
compiles teach is kept by :mod:`jaxdist.remat.working`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jaxdist.compile_check import Trial, Verified, least_peak
from jaxdist.config import ConfigError
from jaxdist.planner.cost import Estimate


class VerifyError(ConfigError):
    """No plan's compiled peak fits the budget."""


@dataclass(frozen=True)
class VerifiedPlan(Verified[Estimate]):
    """The fastest plan whose compiled peak fits the budget, and every compile it took (:class:`Trial` of
    :class:`Estimate`)."""

    def table(self) -> str:
        """Each compiled plan: predicted vs compiled peak, error, fits."""
        gib = 2**20  # MiB: small CPU plans stay readable, an 80 GiB device is 81920 MiB
        rows = [f"{'compiled plan':<52} {'predicted':>12} {'compiled':>12} {'error':>7}  fits"]
        for t in self.trials:
            rows.append(
                f"{t.candidate.strategy.describe()[:52]:<52} {t.predicted / gib:>8.2f} MiB {t.compiled / gib:>8.2f} MiB "
                f"{t.error:>+7.1%}  {'yes' if t.fits else 'no'}"
            )
        t = self.trial
        rows.append(
            f"verified: {t.candidate.strategy.describe()}, compiled peak {t.compiled / gib:.2f} MiB per device of "
            f"{self.budget_bytes / gib:.2f} MiB (predicted {t.predicted / gib:.2f} MiB, "
            f"{t.error:+.1%}); {len(self.trials)} compile(s) in {self.compile_seconds:.1f} s"
        )
        return "\n".join(rows)


def verify_plan(
    ranked: Sequence[Estimate],
    budget_bytes: float,
    compile_peak: Callable[[Estimate], tuple[float, float]],
) -> VerifiedPlan:
    """The first plan of ``ranked`` (best first) whose compiled peak is at most ``budget_bytes``.

    ``compile_peak(estimate) -> (peak bytes per device, seconds)``.  Plans are taken in order, skipping
    those the latest compile's correction (compiled / predicted) says will not fit.  Raises VerifyError when
    none fits.
    """
    trials: list[Trial[Estimate]] = []
    scale = 1.0
    for e in ranked:
        predicted = e.memory.total
        if predicted * scale > budget_bytes and (trials or predicted > budget_bytes):
            continue  # corrected by the compiles so far, it does not fit: no compile spent on it
        peak, secs = compile_peak(e)
        t = Trial(e, predicted, float(peak), secs, peak <= budget_bytes)
        trials.append(t)
        if t.fits:
            return VerifiedPlan(e, t, tuple(trials), float(budget_bytes))
        scale = peak / predicted
    least = least_peak(trials)
    seen = (
        f"; the least compiled peak was {least.compiled / 2**30:.3f} GiB ({least.candidate.strategy.describe()})"
        if least
        else ""
    )
    raise VerifyError(
        f"no plan's compiled train step fits {budget_bytes / 2**30:.3f} GiB per device{seen}: use more devices, "
        "a smaller train.batch_size or train.seq_len, or raise train.memory_budget_bytes."
    )

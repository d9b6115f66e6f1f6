"""What compiling a candidate against a memory budget showed: the types both compile-and-check loops return.

Two loops choose by compiling: ``jaxdist plan --verify`` (:func:`jaxdist.planner.verify.verify_plan`, over
parallelism plans) and ``train.remat=auto`` (:func:`jaxdist.remat.verify.choose`, over remat candidates).  Each
compile is a :class:`Trial` (the candidate, its predicted and compiled peak per device, the compiled FLOPs
where the loop asks for them, the seconds the compile took); each loop's answer is a :class:`Verified` (the
chosen candidate, its trial, every trial, the budget) or a subclass that adds what that loop learned.  The
peak is what ``compiled.memory_analysis()`` reports: arguments + outputs + temp - aliased, bytes per device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

C = TypeVar("C")  # what was compiled: a planner Estimate, a remat Candidate


@dataclass(frozen=True)
class Trial(Generic[C]):
    """One compiled candidate: predicted and compiled peak (bytes per device), compiled FLOPs (None where
    the loop does not ask for them), compile seconds, and whether the compiled peak is within the budget."""

    candidate: C
    predicted: float
    compiled: float
    seconds: float
    fits: bool
    flops: float | None = None

    @property
    def error(self) -> float:
        """The prediction's relative error against the compiled peak (0 when nothing was compiled)."""
        return self.predicted / self.compiled - 1 if self.compiled else 0.0


def least_peak(trials: Sequence[Trial[C]]) -> Trial[C] | None:
    """The trial of least compiled peak (what a "nothing fits" error names), None without trials."""
    return min(trials, key=lambda t: t.compiled, default=None)


@dataclass(frozen=True)
class Verified(Generic[C]):
    """The candidate a loop chose against the compiler: its trial, every trial in order, the budget (bytes per
    device)."""

    chosen: C
    trial: Trial[C]
    trials: tuple[Trial[C], ...]
    budget_bytes: float

    @property
    def compile_seconds(self) -> float:
        """Seconds the loop spent compiling."""
        return sum(t.seconds for t in self.trials)

"""``train.remat=auto`` for your own model: every candidate compiled, the fewest FLOPs that fit chosen.

jaxdist's transformer has a cost model per block (:mod:`jaxdist.remat.verify` predicts, then compiles a few);
a model it did not write has none, so the choice is made on the compiled programs alone:

The policy acts on the blocks the model marks with ``jaxdist.models.hooks.remat_block`` (a model that marks
none has one candidate, no remat).

1. **Candidates**: no remat, full recomputation, jax's ``dots_saveable`` and ``dots_with_no_batch_dims_saveable``,
   and ``save:`` policies over the checkpoint names the model's forward pass tags (found by tracing it: every
   non-empty subset up to :data:`ALL_SUBSETS` names, beyond that each name alone, all of them, and all but one).
2. **Measured**: each candidate's train step is compiled for the run's mesh (nothing runs): its peak bytes per
   device (``memory_analysis``: arguments + outputs + temp - aliased) and its FLOPs (``cost_analysis``).
3. **Chosen**: the least FLOPs among those whose peak fits ``train.memory_budget_bytes`` (default: the
   cluster's device memory less the reserve), the smaller peak between equal FLOPs.  None fits: ConfigError
   with the least peak seen.

Since the named policies are among the candidates, the choice executes no more FLOPs than the best of them
that fits.  A model with ``k`` names costs ``4 + 2**k - 1`` compiles up to :data:`ALL_SUBSETS` names.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from jaxdist.cluster import load_cluster, memory_budget
from jaxdist.config import ConfigError, Remat
from jaxdist.remat.named import remat_policy
from jaxdist.remat.plan import format_bytes
from jaxdist.train.aot import CompiledPeak, compiled_peak
from jaxdist.train.program import Program
from jaxdist.train.resolved import Resolved

log = logging.getLogger(__name__)

ALL_SUBSETS = 4  # names up to which every subset is a candidate
NAMED = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")


@dataclass(frozen=True)
class Trial:
    """One compiled candidate: its ``train.remat`` value, peak bytes per device and FLOPs per device."""

    value: str
    peak_bytes: int
    flops: float
    seconds: float


@dataclass(frozen=True)
class UserRematChoice:
    """What ``train.remat=auto`` chose for a user's model: ``value`` (a train.remat string), within ``budget``
    bytes per device, and every candidate compiled (``trials``)."""

    value: str
    budget: float
    trials: tuple[Trial, ...]

    def policy(self):
        """The jax.checkpoint policy of the choice (None, "full" or a policy), as jaxdist.remat.named gives it."""
        return remat_policy(Remat.parse(self.value), own_model=True)

    @property
    def chosen(self) -> Trial:
        return next(t for t in self.trials if t.value == self.value)

    def describe(self) -> str:
        c = self.chosen
        return (
            f"{self.value} (compiled peak {format_bytes(c.peak_bytes)} of a {format_bytes(self.budget)} budget, "
            f"{c.flops:.3g} FLOPs per device; {len(self.trials)} candidates compiled)"
        )

    def table(self) -> str:
        """Every candidate: peak, FLOPs, whether it fits, the choice marked."""
        rows = [f"{'train.remat':<40} {'peak':>10} {'FLOPs':>10}  fits"]
        for t in sorted(self.trials, key=lambda t: (t.flops, t.peak_bytes)):
            mark = "  <- chosen" if t.value == self.value else ""
            fits = "yes" if t.peak_bytes <= self.budget else "no"
            rows.append(f"{t.value:<40} {format_bytes(t.peak_bytes):>10} {t.flops:>10.3g}  {fits}{mark}")
        return "\n".join(rows)


def candidate_values(names: tuple[str, ...]) -> list[str]:
    """The ``train.remat`` values compiled for a model tagging ``names`` (see the module docstring)."""
    if len(names) <= ALL_SUBSETS:
        subsets = [c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]
    else:
        subsets = [(n,) for n in names] + [names] + [tuple(m for m in names if m != n) for n in names]
    return list(NAMED) + ["save:" + ",".join(s) for s in subsets]


def choose_user_remat(resolved: Resolved, compile_peak: Callable[[Resolved], CompiledPeak] | None = None) -> Resolved:
    """``resolved`` (a user's model with ``train.remat=auto``) with the remat chosen by compiling every candidate
    (``compile_peak(resolved) -> CompiledPeak``; default :func:`jaxdist.train.aot.compiled_peak` without keeping
    the programs)."""
    compile_peak = compile_peak or (lambda r: compiled_peak(r, keep=False))
    config, devices, user = resolved.config, resolved.devices, resolved.user
    traced = Program(Resolved(config, devices, Remat("none"), user=user)).traced
    names = traced.names
    budget = memory_budget(config.train.memory_budget_bytes, load_cluster(config.mesh.cluster).memory_bytes)
    trials = []
    values = candidate_values(names) if traced.blocks else ["none"]  # no block marked: nothing to recompute
    for value in values:
        peak = compile_peak(Resolved(config, devices, Remat.parse(value), user=user))
        trials.append(Trial(value, peak.peak_bytes, float(peak.flops or 0.0), peak.seconds))
    fits = [t for t in trials if t.peak_bytes <= budget]
    if not fits:
        least = min(trials, key=lambda t: t.peak_bytes)
        raise ConfigError(
            f"no remat fits your model's train step in train.memory_budget_bytes={int(budget)}: the least peak is "
            f"{format_bytes(least.peak_bytes)} per device ({least.value}); raise the budget, split the model over "
            "more devices (mesh.fsdp, mesh.tensor) or lower train.batch_size."
        )
    best = min(fits, key=lambda t: (t.flops, t.peak_bytes))
    choice = UserRematChoice(best.value, budget, tuple(trials))
    return Resolved(config, devices, Remat("selected", plan=choice), None, user)


def settle_user_remat(resolved: Resolved) -> Resolved:
    """``resolved`` as it is, unless it trains a user's model with ``train.remat=auto``: then chosen here (logged)."""
    if resolved.user is None or resolved.remat.kind != "auto":
        return resolved
    chosen = choose_user_remat(resolved)
    log.info("remat plan: %s", chosen.remat.plan.describe())
    return chosen

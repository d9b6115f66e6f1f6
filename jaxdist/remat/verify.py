"""``train.remat=auto`` against the compiler: predict the peak, compile the few best candidates, repair.

The question a user asks is "what is the fastest remat that fits in this memory?", where memory is the
per-device peak of the compiled train step (arguments + outputs + temp - aliased, as
``compiled.memory_analysis()`` reports): ``train.memory_budget_bytes``.  The selector's own model
(:mod:`jaxdist.remat.plan`) predicts saved activations exactly, but XLA's working space beside them moves
with the policy, so the answer is closed by compiling:

1. **Candidates** (:func:`candidates`): the selector's plans at a spread of activation budgets, and every
   named policy (none, full, jax's built-ins, the all-names policy, each single-name ``save:``, the recipes
   ``jaxdist remat`` prints), each with its predicted saved activations and recompute FLOPs; duplicates
   (the same saved set) and points another candidate beats on both are dropped.
2. **Prediction** (:class:`PeakModel`): peak = parameters + gradients + optimizer state (exact arithmetic)
   + saved activations (the profile) + working space, the last a learned multiple (``ratio``) of a
   reference (three float32 logits of a microbatch and twice the values one block's backward pass reads).
   The ratio is what compiles teach: it is kept per device kind in the calibration cache
   (:mod:`jaxdist.planner.verify`) and reused by the next selection.
3. **The loop** (:func:`choose`): take the least-recompute candidate predicted to fit, compile it (an
   injected function, so this module stays pure), correct the prediction by what the compile showed, and
   try again: a leaner candidate when it did not fit (predicted with that compile's working space), a faster
   one once one fits (predicted with the least working space seen, never one leaner than a candidate that
   overflowed is skipped for it).  At most
   ``max_compiles`` compiles in the normal course; if none of them fit, leaner candidates are compiled
   until one does (or none is left: ConfigError with the least peak seen).  The result is a
   :class:`VerifiedChoice`: the chosen candidate, every trial (predicted vs compiled), the time spent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from jaxdist.config import ConfigError, Remat
from jaxdist.models.names import CHECKPOINT_NAMES
from jaxdist.remat.named import ALL_NAMES, BUILTINS, RECIPES, remat_policy
from jaxdist.remat.plan import RematPlan, budget_range, format_bytes, plan_remat
from jaxdist.remat.profile import BlockProfile

# Compiles the loop spends in the normal course (the target); beyond it only to reach a fit.
MAX_COMPILES = 3
# Selector plans at this many activation budgets spread over the range join the candidates.
PLAN_BUDGETS = 12


@dataclass(frozen=True)
class Candidate:
    """One remat choice: its ``train.remat`` meaning (``spec``), predicted saved activations (bytes per device,
    all blocks, inputs included) and recompute FLOPs per step per device."""

    name: str
    spec: Remat
    activation_bytes: float
    recompute_flops: float
    saved: tuple[bool, ...] = field(repr=False, default=())
    plan: RematPlan | None = field(repr=False, default=None)

    def policy(self) -> Any:
        """The jax.checkpoint policy (None: save everything; "full": save nothing)."""
        return self.plan.policy() if self.plan is not None else remat_policy(self.spec)


def named_values() -> dict[str, str]:
    """The named policies compared: none, full, jax's built-ins, all names, each single name, the recipes."""
    out = {"none": "none", "full": "full"}
    out.update({b: b for b in BUILTINS if b != "nothing_saveable"})  # nothing_saveable is full
    out["all names"] = ALL_NAMES
    out.update({f"save:{n}": f"save:{n}" for n in CHECKPOINT_NAMES})
    out.update(RECIPES)
    return out


def _named(profile: BlockProfile, name: str, value: str) -> Candidate:
    spec = Remat.parse(value)
    ev = profile.evaluate(remat_policy(spec) if spec.kind != "full" else _save_nothing)
    L = profile.n_layers
    return Candidate(
        name,
        spec,
        L * (profile.input_bytes + ev.bytes),
        L * profile.recompute_flops(ev.recomputed),
        tuple(bool(s) for s in ev.saved),
    )


def _save_nothing(*_, **__) -> bool:
    return False


def _from_plan(plan: RematPlan) -> Candidate:
    name = plan.names_equivalent or f"selected @ {format_bytes(plan.activation_bytes)}"
    return Candidate(name, Remat("selected", plan=plan), plan.activation_bytes, plan.recompute_flops, plan.saved, plan)


def candidates(
    profile: BlockProfile, budgets: Sequence[float] = (), n_budgets: int = PLAN_BUDGETS, slack_share: float = 0.0
) -> list[Candidate]:
    """Selector plans at ``budgets`` and at ``n_budgets`` activation budgets spread over the profile's range,
    and every named policy (:func:`named_values`); one per saved set (a named one kept before a plan), none
    that another beats on both bytes and FLOPs; least recompute first."""
    lo, hi = budget_range(profile)
    spread = [lo + (hi - lo) * f for f in np.linspace(0.0, 1.0, n_budgets)]
    found: dict[tuple[bool, ...], Candidate] = {}
    for name, value in named_values().items():
        c = _named(profile, name, value)
        found.setdefault(c.saved, c)
    for b in sorted({*spread, *(x for x in budgets if x >= lo)}):
        c = _from_plan(plan_remat(profile, b, slack_share=slack_share))
        found.setdefault(c.saved, c)
    pool = sorted(found.values(), key=lambda c: (c.recompute_flops, c.activation_bytes))
    kept: list[Candidate] = []
    for c in pool:  # sorted by (FLOPs, bytes): a point is beaten by an earlier one no worse in both, better in one
        if not any(
            k.activation_bytes <= c.activation_bytes
            and (k.recompute_flops < c.recompute_flops or k.activation_bytes < c.activation_bytes)
            for k in kept
        ):
            kept.append(c)
    return kept


@dataclass(frozen=True)
class PeakModel:
    """Predicted compiled peak per device: ``fixed`` (parameters, gradients, optimizer state, bytes) + saved
    activations + ``ratio`` x ``reference`` (working space, bytes)."""

    fixed: float
    reference: float
    ratio: float

    def peak(self, activation_bytes: float) -> float:
        """Predicted peak (bytes per device) of a candidate saving ``activation_bytes``."""
        return self.fixed + activation_bytes + self.ratio * self.reference

    def observed_ratio(self, activation_bytes: float, compiled_peak: float) -> float:
        """The working-space ratio a compile of peak ``compiled_peak`` shows for that candidate."""
        return (compiled_peak - self.fixed - activation_bytes) / max(self.reference, 1.0)


@dataclass(frozen=True)
class Trial:
    """One compiled candidate: predicted and compiled peak (bytes per device), compiled FLOPs, compile seconds."""

    candidate: Candidate
    predicted: float
    compiled: float
    flops: float | None
    seconds: float
    fits: bool


@dataclass(frozen=True)
class VerifiedChoice:
    """The candidate chosen against the compiler, with every trial and the model it was predicted with."""

    chosen: Candidate
    trial: Trial
    trials: tuple[Trial, ...]
    budget_bytes: float
    model: PeakModel
    learned_ratio: float  # the working-space ratio these compiles show (mean of the trials)

    @property
    def plan(self) -> RematPlan | None:
        """The selector's plan when the chosen candidate is one, else None (a named policy)."""
        return self.chosen.plan

    @property
    def activation_bytes(self) -> float:
        """Predicted saved activations of the chosen candidate (bytes per device, all blocks)."""
        return self.chosen.activation_bytes

    @property
    def compile_seconds(self) -> float:
        """Seconds the loop spent compiling."""
        return sum(t.seconds for t in self.trials)

    def policy(self) -> Any:
        """The chosen candidate's jax.checkpoint policy (what the Trainer applies)."""
        return self.chosen.policy()

    def describe(self) -> str:
        """One line: what was chosen, predicted vs compiled peak against the budget, the compiles it took."""
        t = self.trial
        err = t.predicted / t.compiled - 1 if t.compiled else 0.0
        value = self.chosen.name if self.plan is None or self.plan.names_equivalent else "the selector's plan"
        return (
            f"remat {value}: saves {format_bytes(self.activation_bytes)}, recomputes "
            f"{self.chosen.recompute_flops / 1e9:.3g} GFLOP per step; peak per device predicted "
            f"{format_bytes(t.predicted)}, compiled {format_bytes(t.compiled)} ({err:+.1%}) of a "
            f"{format_bytes(self.budget_bytes)} budget; {len(self.trials)} compile(s) in {self.compile_seconds:.1f} s"
        )

    def table(self) -> str:
        """Every compiled trial: candidate, predicted and compiled peak, FLOPs, whether it fits."""
        rows = [f"{'compiled candidate':<36} {'predicted':>11} {'compiled':>11} {'error':>7} {'GFLOP':>8}  fits"]
        for t in self.trials:
            flops = f"{t.flops / 1e9:8.3f}" if t.flops is not None else f"{'n/a':>8}"
            rows.append(
                f"{t.candidate.name[:36]:<36} {format_bytes(t.predicted):>11} {format_bytes(t.compiled):>11} "
                f"{t.predicted / t.compiled - 1:>+7.1%} {flops}  {'yes' if t.fits else 'no'}"
            )
        return "\n".join(rows)


def choose(
    pool: Sequence[Candidate],
    budget_bytes: float,
    model: PeakModel,
    compile_peak: Callable[[Candidate], tuple[float, float | None, float]],
    max_compiles: int = MAX_COMPILES,
    activation_cap: float | None = None,
) -> VerifiedChoice:
    """The least-recompute candidate of ``pool`` whose compiled peak is at most ``budget_bytes``.

    ``compile_peak(candidate) -> (peak bytes, FLOPs or None, seconds)``.  After each compile the working
    space is corrected by what it showed (the latest compile's ratio).  ``activation_cap``
    (``train.remat_budget_bytes``) also bounds the predicted saved activations.  Raises ConfigError when
    no candidate compiles within the budget.
    """
    pool = [c for c in pool if activation_cap is None or c.activation_bytes <= activation_cap]
    if not pool:
        raise ConfigError(
            f"no remat choice saves at most train.remat_budget_bytes={int(activation_cap or 0)} bytes of activations "
            "(even saving nothing keeps the block inputs): raise it, or set it to 0 and let "
            "train.memory_budget_bytes decide."
        )
    pool = sorted(pool, key=lambda c: (c.recompute_flops, c.activation_bytes))
    trials: list[Trial] = []
    ratio = model.ratio
    best: Trial | None = None

    def rank(t: Trial) -> tuple[float, float]:
        return (t.flops if t.flops is not None else t.candidate.recompute_flops, t.compiled)

    while True:
        m = PeakModel(model.fixed, model.reference, ratio)
        tried = {id(t.candidate) for t in trials}
        leanest = min((t.candidate.activation_bytes for t in trials if not t.fits), default=math.inf)
        todo = [c for c in pool if id(c) not in tried and c.activation_bytes < leanest]
        if best is not None:  # only what could beat the fitting one
            todo = [c for c in todo if c.recompute_flops < best.candidate.recompute_flops]
        if len(trials) >= max_compiles and best is not None:
            break  # beyond the target, compile only to repair a loop that has no fit yet
        fitting = [c for c in todo if m.peak(c.activation_bytes) <= budget_bytes]
        nxt = fitting[0] if fitting else None
        if nxt is None and todo:  # none predicted to fit: the leanest left is the best hope (or, with a fit,
            nxt = min(todo, key=lambda c: c.activation_bytes)  # the nearest faster one: working space varies)
        if nxt is None:
            break
        peak, flops, secs = compile_peak(nxt)
        t = Trial(nxt, m.peak(nxt.activation_bytes), float(peak), flops, secs, peak <= budget_bytes)
        trials.append(t)
        if t.fits and (best is None or rank(t) < rank(best)):
            best = t
        # Without a fit yet, the latest compile's working space; with one, the least seen: what lies between
        # the fitting candidate and the leanest that overflowed is worth a compile while compiles are left.
        seen = [model.observed_ratio(x.candidate.activation_bytes, x.compiled) for x in trials]
        ratio = min(seen) if best is not None else seen[-1]
    learned = float(np.mean([model.observed_ratio(t.candidate.activation_bytes, t.compiled) for t in trials]))
    if best is None:
        least = min(trials, key=lambda t: t.compiled) if trials else None
        seen = f"; the least compiled peak was {format_bytes(least.compiled)} ({least.candidate.name})" if least else ""
        raise ConfigError(
            f"no remat choice compiles within train.memory_budget_bytes={int(budget_bytes)} "
            f"({format_bytes(budget_bytes)} per device){seen}: raise the budget, shard more (mesh.fsdp, "
            "mesh.tensor), or lower train.batch_size or raise train.microbatches."
        )
    return VerifiedChoice(best.candidate, best, tuple(trials), float(budget_bytes), model, learned)

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
   + saved activations (the profile) + working space.  XLA's working space moves between the policies of
   one setting by as much as the saved bytes of neighbouring candidates differ (benchmarks/README.md), and
   nothing in the profile predicts it; a **probe** does: the temp of a compiled
   forward and backward of a two-step scan of the block under the candidate's policy, less its residuals
   (:func:`jaxdist.train.aot.block_working`), follows the whole step's working space to a few per cent.
   Probed, the ratio is what the step adds beyond the probe
   (about 0); unprobed (``probe=None``), a learned multiple (``ratio``, within a learned range
   ``low``..``high``) of a reference (three float32 logits of a microbatch and twice the values one block's
   backward pass reads) stands for every candidate.  The ratios are what compiles teach: they are kept per
   device kind in the calibration cache (:mod:`jaxdist.remat.working`) and reused by the next selection.
3. **The loop** (:func:`choose`): compile (an injected function, so this module stays pure) the
   least-recompute candidate predicted to fit, then, once one fits, the candidate with the largest expected
   gain: FLOPs below the best fit (predicted: the compiles' base plus predicted recompute) times the share
   of the working-space range at which it would fit (probed: the compiles' own ratios widened by
   :data:`PROBED_MARGIN`; unprobed: the learned range, which is wide, so the fastest fit is often one
   predicted over budget at the middle ratio).  A candidate is probed only when the loop weighs it and it
   could fit at all.  At most ``max_compiles`` compiles in the normal course; if none of
   them fit, leaner candidates are compiled until one does (or none is left: ConfigError with the least
   peak seen).  The result is a :class:`VerifiedChoice`: the chosen candidate, every trial (predicted vs
   compiled), the probes and the time spent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxdist.compile_check import Trial, Verified, least_peak
from jaxdist.config import ConfigError, Remat
from jaxdist.models.names import CHECKPOINT_NAMES
from jaxdist.remat.named import ALL_NAMES, BUILTINS, RECIPES, remat_policy
from jaxdist.remat.plan import RematPlan, budget_range, format_bytes, plan_remat
from jaxdist.remat.profile import BlockProfile
from jaxdist.remat.working import DEFAULT_SHARES  # the range, as shares of the ratio, when none is given

# Compiles the loop spends in the normal course (the target); beyond it only to reach a fit.
MAX_COMPILES = 3
# Selector plans at this many activation budgets spread over the range join the candidates.
PLAN_BUDGETS = 12
# A compile is not spent to gain less than this share of the step FLOPs (XLA's count of programs saving
# nearly the same values moves by about this much).
FLOP_TOLERANCE = 0.005
# The working-space range the compiles showed is widened by this share at each end for the candidates not
# compiled: one setting's policies spread further than the few compiled ones show.
RANGE_MARGIN = 0.1
# With the candidates' working space probed (Candidate.working, jaxdist.train.aot.block_working), the step's
# working space follows the probe to a few per cent: the uncompiled candidates' range is the compiles' ratios
# widened by this share
# of the compiled candidates' probed working space.
PROBED_MARGIN = 0.05


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
    # XLA's working space of one scan step's backward under this candidate (jaxdist.train.aot.block_working),
    # bytes per device, when probed: how the step's working space moves between candidates.
    working: float | None = field(repr=False, default=None, compare=False)

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
    profile: BlockProfile,
    budgets: Sequence[float] = (),
    n_budgets: int = PLAN_BUDGETS,
    slack_share: float = 0.0,
    prune_beaten: bool = True,
) -> list[Candidate]:
    """Selector plans at ``budgets`` and at ``n_budgets`` activation budgets spread over the profile's range,
    and every named policy (:func:`named_values`); one per saved set (a named one kept before a plan); with
    ``prune_beaten``, none that another beats on both bytes and FLOPs; least recompute first (a probed loop
    keeps them all: a candidate saving more may have the smaller working space)."""
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
    if not prune_beaten:
        return pool
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
    activations + ``ratio`` x ``reference`` (working space, bytes); ``low`` and ``high``: the range of ratios
    the candidates of this setting may show (XLA's working space moves with the policy), default ``DEFAULT_SHARES`` times ``ratio``."""

    fixed: float
    reference: float
    ratio: float
    low: float | None = None
    high: float | None = None

    @property
    def ratio_range(self) -> tuple[float, float]:
        """(least, largest) working-space ratio a candidate not compiled yet may show."""
        lo = self.low if self.low is not None else DEFAULT_SHARES[0] * self.ratio
        hi = self.high if self.high is not None else DEFAULT_SHARES[1] * self.ratio
        return min(lo, hi), max(lo, hi)

    def peak(self, activation_bytes: float, ratio: float | None = None) -> float:
        """Predicted peak (bytes per device) of a candidate saving ``activation_bytes`` (at ``ratio``, default
        the model's)."""
        return self.fixed + activation_bytes + (self.ratio if ratio is None else ratio) * self.reference

    def room(self, activation_bytes: float, budget_bytes: float) -> float:
        """The largest working-space ratio at which that candidate's peak is within ``budget_bytes``."""
        return (budget_bytes - self.fixed - activation_bytes) / max(self.reference, 1.0)

    def observed_ratio(self, activation_bytes: float, compiled_peak: float) -> float:
        """The working-space ratio a compile of peak ``compiled_peak`` shows for that candidate."""
        return (compiled_peak - self.fixed - activation_bytes) / max(self.reference, 1.0)


@dataclass(frozen=True)
class VerifiedChoice(Verified[Candidate]):
    """The candidate chosen against the compiler, with every trial (:class:`Trial` of :class:`Candidate`)
    and the model it was predicted with."""

    model: PeakModel
    seen_ratios: tuple[float, ...]  # the working-space ratio each compile showed (what the store learns)
    # The chosen candidate's train step compiled as the run will run it (jaxdist.train.aot.RunnableStep: off
    # CPU), which the Trainer then runs instead of compiling again; None on CPU (compiled at LLVM level 0).
    runnable: Any = field(default=None, repr=False, compare=False)
    # One-block probes of the candidates' working space (jaxdist.train.aot.block_working) the loop asked for
    # and their seconds (0: not probed; a probe made before in this process is not counted again).
    probes: int = 0
    probe_seconds: float = 0.0

    @property
    def learned_ratio(self) -> float:
        """The working-space ratio these compiles show (their median)."""
        return float(np.median(self.seen_ratios))

    @property
    def plan(self) -> RematPlan | None:
        """The selector's plan when the chosen candidate is one, else None (a named policy)."""
        return self.chosen.plan

    @property
    def activation_bytes(self) -> float:
        """Predicted saved activations of the chosen candidate (bytes per device, all blocks)."""
        return self.chosen.activation_bytes

    def policy(self) -> Any:
        """The chosen candidate's jax.checkpoint policy (what the Trainer applies)."""
        return self.chosen.policy()

    def describe(self) -> str:
        """One line: what was chosen, predicted vs compiled peak against the budget, the compiles it took."""
        t = self.trial
        value = self.chosen.name if self.plan is None or self.plan.names_equivalent else "the selector's plan"
        return (
            f"remat {value}: saves {format_bytes(self.activation_bytes)}, recomputes "
            f"{self.chosen.recompute_flops / 1e9:.3g} GFLOP per step; peak per device predicted "
            f"{format_bytes(t.predicted)}, compiled {format_bytes(t.compiled)} ({t.error:+.1%}) of a "
            f"{format_bytes(self.budget_bytes)} budget; {len(self.trials)} compile(s) in {self.compile_seconds:.1f} s"
            + (f", {self.probes} one-block probe(s) in {self.probe_seconds:.1f} s" if self.probes else "")
        )

    def applied(self) -> str:
        """One line: what ``train.remat=auto`` applies (the chosen candidate, as a ``train.remat`` value when
        one says it)."""
        plan = self.plan
        if plan is None:
            return f"train.remat=auto applies {self.chosen.name}, the same as train.remat={self.chosen.spec}"
        same = plan.names_equivalent
        return f"train.remat=auto applies the selector's plan saving {format_bytes(plan.activation_bytes)}" + (
            f", the same as train.remat={same}" if same else " (no list of checkpoint names saves the same values)"
        )

    def table(self) -> str:
        """Every compiled trial: candidate, predicted and compiled peak, FLOPs, whether it fits."""
        rows = [f"{'compiled candidate':<36} {'predicted':>11} {'compiled':>11} {'error':>7} {'GFLOP':>8}  fits"]
        for t in self.trials:
            flops = f"{t.flops / 1e9:8.3f}" if t.flops is not None else f"{'n/a':>8}"
            rows.append(
                f"{t.candidate.name[:36]:<36} {format_bytes(t.predicted):>11} {format_bytes(t.compiled):>11} "
                f"{t.error:>+7.1%} {flops}  {'yes' if t.fits else 'no'}"
            )
        return "\n".join(rows)


class _Held:
    """What the peak model adds for a candidate beside the fixed part and the working-space ratio x reference.

    Unprobed: its saved activations.  Probed (``probe`` given, or every candidate's ``working`` set): saved
    activations plus its probed working space, probed when first asked for (at most once per candidate), so
    the ratio is what the whole step adds beyond the probe (about 0: logits and optimizer temps are not live
    at the peak of the block backward).  :meth:`may_fit` says, without probing, whether a candidate could fit
    at all: at half the least working space probed so far."""

    def __init__(self, pool: Sequence[Candidate], probe: Callable[[Candidate], float] | None):
        self.probe = probe
        self.probed = probe is not None or (bool(pool) and all(c.working is not None for c in pool))
        self.workings: dict[int, float] = {id(c): c.working for c in pool if c.working is not None}

    def working(self, c: Candidate) -> float:
        """``c``'s probed working space (bytes; 0 when nothing probes it), probed on the first call."""
        if id(c) not in self.workings:
            self.workings[id(c)] = float(self.probe(c)) if self.probe is not None else 0.0
        return self.workings[id(c)]

    def __call__(self, c: Candidate) -> float:
        return c.activation_bytes + (self.working(c) if self.probed else 0.0)

    def may_fit(self, c: Candidate, model: PeakModel, budget_bytes: float, seen: Sequence[float]) -> bool:
        if not self.probed:
            return True
        floor = 0.5 * min(self.workings.values(), default=0.0)
        offset = min(0.0, model.ratio, *seen) * model.reference
        return model.fixed + c.activation_bytes + floor + offset <= budget_bytes


def choose(
    pool: Sequence[Candidate],
    budget_bytes: float,
    model: PeakModel,
    compile_peak: Callable[[Candidate], tuple[float, float | None, float]],
    max_compiles: int = MAX_COMPILES,
    activation_cap: float | None = None,
    probe: Callable[[Candidate], float] | None = None,
) -> VerifiedChoice:
    """The fewest-FLOPs candidate of ``pool`` found whose compiled peak is at most ``budget_bytes``.

    ``compile_peak(candidate) -> (peak bytes, FLOPs or None, seconds)``.  Step FLOPs of a candidate not
    compiled are predicted as a base (compiled FLOPs less predicted recompute, from the compiles so far)
    plus its predicted recompute; its peak as ``model`` says, the working-space ratio unknown within a range
    (:meth:`PeakModel.ratio_range` and every ratio compiled, widened by :data:`RANGE_MARGIN`).

    * No fit yet: compile the least-recompute candidate predicted to fit at the model's ratio (after a
      compile that overflowed, at the largest ratio seen); none predicted to fit: the leanest not compiled.
    * A fit: compile the candidate with the largest expected gain, (FLOPs below the best fit's) x (the share
      of the ratio range at which it fits), counting only gains above :data:`FLOP_TOLERANCE`; stop when none
      is left or ``max_compiles`` are spent.

    ``probe(candidate) -> bytes`` (or every candidate's ``working``): its working space, as
    :func:`jaxdist.train.aot.block_working` measures it, is added to its saved activations, ``model.ratio``
    is then what the step adds beyond it, and the range of the uncompiled candidates is the compiles' own
    widened by :data:`PROBED_MARGIN` of the working space; a candidate is probed only when the loop weighs it
    and it could fit at all (:class:`_Held`).

    ``activation_cap`` (``train.remat_budget_bytes``) also bounds the predicted saved activations.  Raises
    ConfigError when no candidate compiles within the budget.
    """
    pool = [c for c in pool if activation_cap is None or c.activation_bytes <= activation_cap]
    if not pool:
        raise ConfigError(
            f"no remat choice saves at most train.remat_budget_bytes={int(activation_cap or 0)} bytes of activations "
            "(even saving nothing keeps the block inputs): raise it, or set it to 0 and let "
            "train.memory_budget_bytes decide."
        )
    pool = sorted(pool, key=lambda c: (c.recompute_flops, c.activation_bytes))
    held = _Held(pool, probe)
    trials: list[Trial[Candidate]] = []
    while True:
        seen = [model.observed_ratio(held(t.candidate), t.compiled) for t in trials]
        counted = [t.flops - t.candidate.recompute_flops for t in trials if t.flops is not None]
        base = float(np.mean(counted)) if counted else 0.0

        def step(c: Candidate, base: float = base) -> float:
            return base + c.recompute_flops

        def rank(t: Trial[Candidate], base: float = base) -> float:
            return t.flops if t.flops is not None else step(t.candidate, base)

        fitting = [t for t in trials if t.fits]
        best = min(fitting, key=rank, default=None)
        if best is not None and len(trials) >= max_compiles:
            break  # beyond the target, compile only to repair a loop that has no fit yet
        tried = {id(t.candidate) for t in trials}
        todo = [c for c in pool if id(c) not in tried]
        if best is None:
            nxt = _first_fit(todo, budget_bytes, model, max(seen) if seen else model.ratio, held, seen)
        else:
            nxt = _probe(
                todo, budget_bytes, model, seen, rank(best), step, held, [held.working(t.candidate) for t in trials]
            )
        if nxt is None:
            break
        peak, flops, secs = compile_peak(nxt)
        predicted = model.peak(held(nxt), float(np.median(seen)) if seen else None)
        trials.append(Trial(nxt, predicted, float(peak), secs, peak <= budget_bytes, flops))
    seen = tuple(model.observed_ratio(held(t.candidate), t.compiled) for t in trials)
    if best is None:
        least = least_peak(trials)
        where = (
            f"; the least compiled peak was {format_bytes(least.compiled)} ({least.candidate.name})" if least else ""
        )
        raise ConfigError(
            f"no remat choice compiles within train.memory_budget_bytes={int(budget_bytes)} "
            f"({format_bytes(budget_bytes)} per device){where}: raise the budget, shard more (mesh.fsdp, "
            "mesh.tensor), or lower train.batch_size or raise train.microbatches."
        )
    probes = len(held.workings) - sum(c.working is not None for c in pool) if held.probe is not None else 0
    return VerifiedChoice(best.candidate, best, tuple(trials), float(budget_bytes), model, seen, probes=probes)


def _first_fit(
    todo: Sequence[Candidate],
    budget_bytes: float,
    model: PeakModel,
    ratio: float,
    held: _Held,
    seen: Sequence[float],
) -> Candidate | None:
    """No fit yet: the least-recompute candidate predicted to fit at ``ratio``, else the leanest of ``todo``."""
    for c in todo:  # by recompute
        if held.may_fit(c, model, budget_bytes, seen) and model.room(held(c), budget_bytes) >= ratio:
            return c
    return min(todo, key=lambda c: c.activation_bytes, default=None)


def _probe(
    todo: Sequence[Candidate],
    budget_bytes: float,
    model: PeakModel,
    seen: Sequence[float],
    best_flops: float,
    step: Callable[[Candidate], float],
    held: _Held,
    compiled_working: Sequence[float],
) -> Candidate | None:
    """With a fit of ``best_flops``: the candidate of largest expected gain (FLOPs saved x the share of the
    working-space range at which it fits), or None when no candidate could gain more than the tolerance.

    Probed (``held.probed``): the range is the compiles' own ratios widened by :data:`PROBED_MARGIN` of the
    compiled candidates' probed working space (``compiled_working``), not the learned range of unprobed ones."""
    if held.probed:
        pad = PROBED_MARGIN * float(np.median(compiled_working)) / max(model.reference, 1.0)
        lo, hi = min(seen) - pad, max(seen) + pad
    else:
        lo, hi = model.ratio_range
        lo, hi = min(lo, *seen), max(hi, *seen)
        lo, hi = lo - RANGE_MARGIN * abs(lo), hi + RANGE_MARGIN * abs(hi)
    width = max(hi - lo, 1e-9)
    best, value = None, 0.0
    for c in todo:
        gain = best_flops - step(c)
        if gain <= FLOP_TOLERANCE * abs(best_flops) or not held.may_fit(c, model, budget_bytes, seen):
            continue
        share = min(1.0, max(0.0, (model.room(held(c), budget_bytes) - lo) / width))
        if share * gain > value:
            best, value = c, share * gain
    return best

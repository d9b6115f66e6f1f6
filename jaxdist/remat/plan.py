"""A remat plan: which operators of a block to save under a memory budget, and why.

    plan = plan_remat(profile, budget_bytes=20 * 2**30)
    print(plan)                                  # the table behind the choice
    policy = plan.policy()                       # a jax.checkpoint policy for the block
    print(format_comparison(compare_policies(profile, plan)))

Budgets here are what a user thinks about: bytes per device for the saved
activations of the whole stack of ``n_layers`` blocks, including each
block's input (which the layer scan keeps whatever the policy).  The
selector works per block: ``budget / n_layers - input_bytes``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxdist.remat.graph import InfeasibleBudget, Selection, evaluate
from jaxdist.remat.named import BASELINES, RECIPES, named_policies, remat_policy
from jaxdist.remat.profile import BlockProfile
from jaxdist.remat.select import EXACT_MAX_UNITS, select
from jaxdist.remat.trace import signature


def format_bytes(n: float) -> str:
    """``format_bytes(3 * 2**30) == "3.00 GiB"``."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """``format_seconds(0.0123) == "12.30 ms"``."""
    for unit, size in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= size:
            return f"{s / size:.2f} {unit}"
    return f"{s * 1e9:.1f} ns" if s > 0 else "0"


def group_contents(operators, kinds: int = 5) -> dict[str, str]:
    """Per group, what it holds: its operator count and most frequent primitives, e.g.
    ``"7 operators: 3 mul, 2 add, rsqrt, ..."`` (the ``name`` equation that is the tag itself left out)."""
    out: dict[str, Counter] = {}
    for op in operators:
        out.setdefault(op.group, Counter())
        if op.primitive != "name":
            out[op.group][op.primitive] += 1
    text = {}
    for group, counts in out.items():
        common = [f"{n} {p}" if n > 1 else p for p, n in counts.most_common(kinds)]
        more = ", ..." if len(counts) > kinds else ""
        total = sum(counts.values())
        text[group] = f"{total} operator{'s' if total != 1 else ''}" + (
            ": " + ", ".join(common) + more if common else ""
        )
    return text


def signature_policy(signatures: frozenset[str]) -> Callable:
    """A jax.checkpoint policy saving exactly the equations whose signature is in ``signatures``."""

    def policy(prim, *avals, **params):
        return signature(prim, avals, params) in signatures

    policy.signatures = signatures
    return policy


@dataclass(frozen=True)
class RematPlan:
    """The selector's decision for one block profile and budget (bytes per device, seconds per step)."""

    profile: BlockProfile
    budget_bytes: float
    selection: Selection
    saved_signatures: frozenset[str]
    saved: tuple[bool, ...]  # per operator: saved for the backward pass
    recomputed: tuple[bool, ...]  # per operator: recomputed in the backward pass
    slack_share: float = 0.0  # train.remat_slack the plan was chosen with
    optimum: Selection | None = None  # the least-recompute selection at this budget (the plan's own when slack 0)

    @property
    def block_bytes(self) -> float:
        """Saved bytes per block beyond its input (per device)."""
        return self.selection.bytes

    @property
    def activation_bytes(self) -> float:
        """Saved activations of all blocks, inputs included (bytes per device)."""
        p = self.profile
        return p.n_layers * (p.input_bytes + self.block_bytes)

    @property
    def recompute_time(self) -> float:
        """Recompute time per step for all blocks (seconds per device)."""
        return self.profile.n_layers * self.selection.time

    @property
    def recompute_flops(self) -> float:
        """Recomputed FLOPs per step for all blocks (per device)."""
        return self.profile.n_layers * self.profile.recompute_flops(np.array(self.recomputed))

    @property
    def optimum_recompute_time(self) -> float:
        """Recompute time per step of the least-recompute plan at this budget, all blocks (seconds per device)."""
        return self.profile.n_layers * (self.optimum or self.selection).time

    @property
    def optimum_activation_bytes(self) -> float:
        """Saved activations of the least-recompute plan at this budget, inputs included (bytes per device)."""
        p = self.profile
        return p.n_layers * (p.input_bytes + (self.optimum or self.selection).bytes)

    def gap_to_optimum(self) -> str:
        """One phrase: how this plan's recompute compares with the least-recompute plan at the same budget."""
        sel = self.selection
        proven = "" if sel.method.startswith("exact") or sel.gap <= 0 else f" (proven within {sel.gap:.2%})"
        extra = self.recompute_time - self.optimum_recompute_time
        if self.optimum is None or extra <= 1e-12 * max(self.recompute_time, 1e-300):
            return f"the least recompute at this budget{proven}"
        share = extra / max(self.optimum_recompute_time, 1e-300)
        return (
            f"{format_seconds(extra)} ({share:.1%}) more recompute than the optimum at this budget{proven}, "
            f"for {format_bytes(self.optimum_activation_bytes - self.activation_bytes)} less saved "
            f"(train.remat_slack={self.slack_share:g}; 0 takes the optimum)"
        )

    @property
    def names_equivalent(self) -> str | None:
        """The ``train.remat`` value naming the same saved set (``save:...`` or ``full``), when tags alone say it."""
        if any(s and not op.tag for op, s in zip(self.profile.operators, self.saved)):
            return None
        tags = self.saved_tags
        return "save:" + ",".join(dict.fromkeys(tags)) if tags else "full"

    @property
    def saved_tags(self) -> tuple[str, ...]:
        """checkpoint_name tags of the saved operators."""
        return tuple(op.tag for op, s in zip(self.profile.operators, self.saved) if s and op.tag)

    def policy(self) -> Callable:
        """The jax.checkpoint policy: ``save_only_these_names`` when only tags are saved, else by signature."""
        ops = self.profile.operators
        if all(op.tag for op, s in zip(ops, self.saved) if s):
            return jax.checkpoint_policies.save_only_these_names(*self.saved_tags)
        return signature_policy(self.saved_signatures)

    def describe(self) -> str:
        """One line: budget, saved bytes, recompute time, solver."""
        sel = self.selection
        return (
            f"budget {format_bytes(self.budget_bytes)} per device for {self.profile.n_layers} blocks; "
            f"saves {format_bytes(self.activation_bytes)} (inputs {format_bytes(self.profile.n_layers * self.profile.input_bytes)}"
            f" + {format_bytes(self.profile.n_layers * self.block_bytes)} intermediates), recomputes "
            f"{format_seconds(self.recompute_time)} / {self.recompute_flops / 1e9:.3g} GFLOP per step; "
            f"{sel.method} in {sel.solve_seconds * 1e3:.0f} ms; {self.gap_to_optimum()}"
        )

    def table(self, by_group: bool = False) -> str:
        """Operators the backward pass touches: bytes, time, saved or recomputed, and totals per block."""
        ops = self.profile.operators
        if by_group:
            groups: dict[str, list[float]] = {}
            for op, s, r in zip(ops, self.saved, self.recomputed):
                g = groups.setdefault(op.group, [0.0, 0.0, 0, 0])
                g[0] += s * (op.bytes / self.profile.n_layers if op.invariant else op.bytes)
                g[1] += op.time * r
                g[2] += s
                g[3] += r
            rows = [f"{'group':<16} {'saved':>12} {'recompute':>12} {'#saved':>7} {'#recomp':>7}"]
            rows += [
                f"{name:<16} {format_bytes(b):>12} {format_seconds(t):>12} {ns:>7} {nr:>7}"
                for name, (b, t, ns, nr) in groups.items()
            ]
            rows.append(
                "a group is named by the checkpoint_name tag that ends it and holds the operators computed since "
                "the tag before (--ops lists them one by one):"
            )
            rows += [f"  {name}: {held}" for name, held in group_contents(ops).items()]
        else:
            rows = [f"{'#':>4} {'group':<14} {'operator':<36} {'bytes':>11} {'time':>10}  decision"]
            for op, s, r in zip(ops, self.saved, self.recomputed):
                if not (s or r):
                    continue
                what = "saved" + (" (tag)" if op.tag else "") if s else "recomputed"
                if s and op.invariant:
                    what += ", layer-invariant: stored once"
                rows.append(
                    f"{op.index:>4} {op.group:<14} {op.label[:36]:<36} "
                    f"{format_bytes(op.bytes):>11} {format_seconds(op.time):>10}  {what}"
                )
        rows.append(
            f"per block: saved {format_bytes(self.block_bytes)} + input {format_bytes(self.profile.input_bytes)}, "
            f"recompute {format_seconds(self.selection.time)}"
        )
        rows.append(self.describe())
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _block_budget(profile: BlockProfile, budget_bytes: float) -> float:
    block = budget_bytes / profile.n_layers - profile.input_bytes
    if block < 0:
        floor = profile.n_layers * profile.input_bytes
        raise InfeasibleBudget(
            f"a remat budget of {format_bytes(budget_bytes)} per device cannot be met: even saving nothing keeps "
            f"the {profile.n_layers} block inputs, {format_bytes(floor)}; raise the budget to at least "
            f"{format_bytes(floor)} ({int(floor)} bytes), or shard the activations more (mesh.data, mesh.fsdp).",
            floor,
        )
    return block


def _prefer_tags(profile: BlockProfile, graph, units: set[int]) -> set[int]:
    """Swap a saved value for the checkpoint_name tag that wraps it when that costs nothing (readable policies)."""
    ops = profile.operators
    consumers = graph.consumers
    tag_unit = {op.index: graph.unit[op.index] for op in ops if op.tag}
    base = evaluate(graph, units)
    for u in sorted(units):
        members = graph.members(u)
        if all(ops[m].tag for m in members):
            continue
        swap = set()
        for m in members:
            users = consumers[m]
            if ops[m].needed or not users or not all(c in tag_unit for c in users):
                swap = None
                break
            swap.update(tag_unit[c] for c in users)
        if not swap:
            continue
        trial = (units - {u}) | swap
        ev = evaluate(graph, trial)
        if ev.time <= base.time * (1 + 1e-12) and ev.bytes <= base.bytes * (1 + 1e-12):
            units, base = trial, ev
    return units


def recompute_slack(profile: BlockProfile, share: float) -> float:
    """Seconds per block a plan may recompute beyond the least possible: ``share`` of the save-nothing recompute."""
    graph, _ = profile.graph()
    return share * evaluate(graph, ()).time


def plan_remat(
    profile: BlockProfile, budget_bytes: float, exact_max_units: int = EXACT_MAX_UNITS, slack_share: float = 0.0
) -> RematPlan:
    """The plan with the least recompute whose saved activations fit ``budget_bytes`` per device (all blocks).

    ``slack_share`` (``train.remat_slack``, default 0: the optimum) lets the
    plan recompute up to that share of the save-nothing recompute time more
    than the least, and then takes the one that saves the fewest bytes: a
    large budget is not spent on values whose recompute is negligible, which
    leaves that memory to XLA's working space (gains that small are below
    what the cost model can tell apart: XLA fuses cheap elementwise
    operations into their users, and its FLOP count of a whole program moves
    by a few percent of the forward pass with what is saved;
    benchmarks/remat.py).  Before it was a knob it was fixed at 0.03.  The
    plan keeps the optimum (``RematPlan.optimum``) to report the gap.

    Raises :class:`~jaxdist.remat.select.InfeasibleBudget` (a ConfigError)
    with the smallest feasible budget when even saving nothing does not fit.
    """
    block_budget = _block_budget(profile, budget_bytes)
    graph, unit_sigs = profile.graph()
    best = select(graph, block_budget, exact_max_units)
    optimum = sel = _with_tags(profile, graph, best)
    if slack_share > 0:
        slack = recompute_slack(profile, slack_share)
        sel = _with_tags(profile, graph, select(graph, block_budget, exact_max_units, slack=slack, best=best))
    ev = evaluate(graph, sel.saved_units)
    return RematPlan(
        profile,
        float(budget_bytes),
        sel,
        frozenset(unit_sigs[u] for u in sel.saved_units),
        tuple(bool(s) for s in ev.saved),
        tuple(bool(r) for r in ev.recomputed),
        float(slack_share),
        optimum,
    )


def _with_tags(profile: BlockProfile, graph, sel: Selection) -> Selection:
    units = _prefer_tags(profile, graph, set(sel.saved_units))
    ev = evaluate(graph, units)
    return dataclasses.replace(sel, saved_units=frozenset(units), bytes=ev.bytes, time=ev.time)


def budget_range(profile: BlockProfile) -> tuple[float, float]:
    """(save nothing, save everything useful): saved activation bytes per device for all blocks."""
    graph, _ = profile.graph()
    most = evaluate(graph, range(graph.n_units)).bytes
    return (profile.n_layers * profile.input_bytes, profile.n_layers * (profile.input_bytes + most))


# --------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class PolicyPoint:
    """Predicted cost of one policy: saved activations (bytes per device, all blocks), recompute per step."""

    name: str
    activation_bytes: float
    recompute_time: float
    recompute_flops: float
    fits: bool | None


def policy_point(profile: BlockProfile, name: str, policy: Any, budget_bytes: float | None = None) -> PolicyPoint:
    """Predict a jax.checkpoint policy's saved bytes and recompute cost from the profile."""
    ev = profile.evaluate(policy)
    L = profile.n_layers
    act = L * (profile.input_bytes + ev.bytes)
    return PolicyPoint(
        name,
        act,
        L * ev.time,
        L * profile.recompute_flops(ev.recomputed),
        None if budget_bytes is None else act <= budget_bytes,
    )


def compare_policies(
    profile: BlockProfile, plan: RematPlan | None = None, budget_bytes: float | None = None
) -> list[PolicyPoint]:
    """The plan (if given) beside no remat, the policy saving every checkpoint name (``BASELINES``), jax's
    built-in policies and the named recipes, all predicted."""
    budget = plan.budget_bytes if plan is not None and budget_bytes is None else budget_bytes
    rows = []
    if plan is not None:
        rows.append(
            PolicyPoint(
                "selected (auto)",
                plan.activation_bytes,
                plan.recompute_time,
                plan.recompute_flops,
                plan.activation_bytes <= plan.budget_bytes,
            )
        )
    for name, value in BASELINES.items():
        rows.append(policy_point(profile, name, remat_policy(value), budget))
    for name, policy in named_policies().items():
        rows.append(policy_point(profile, name, policy, budget))
    return rows


def format_comparison(rows: list[PolicyPoint]) -> str:
    """The comparison as a table: policy, saved activations, recompute time and FLOPs, fits the budget."""
    out = [f"{'policy':<34} {'saved activations':>18} {'recompute/step':>15} {'GFLOP/step':>11}  fits"]
    for r in rows:
        fits = "" if r.fits is None else "yes" if r.fits else "no"
        out.append(
            f"{r.name[:34]:<34} {format_bytes(r.activation_bytes):>18} {format_seconds(r.recompute_time):>15} "
            f"{r.recompute_flops / 1e9:>11.3f}  {fits}"
        )
    named = {**BASELINES, **RECIPES}
    recipes = [f"  {name}: train.remat={value}" for name, value in named.items() if any(r.name == name for r in rows)]
    return "\n".join(out + (["as train.remat values:"] + recipes if recipes else []))

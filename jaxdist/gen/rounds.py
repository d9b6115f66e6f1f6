"""Each round of a chain's generation job: which idle nodes process next, within the compute budget.

A job chains stages (a generator, a scorer, ...); each worker (node) serves
one stage. Every ``gen.round_s`` the dispatcher calls :func:`decide_round`
with what the nodes reported (their stage, whether they are idle) and the
pending tasks of each stage. The decision is pure and printable:

* **pending work of a node**: the next task of its stage, if it is idle and
  the stage has a pending task not already claimed by another idle node of
  the stage (tasks go to a stage's idle nodes in name order);
* **compute of a task** (budget units): its streams times the stage's
  compute per stream (``gen.stage_compute``, default 1); the tasks already
  running keep theirs, so the round's budget is ``gen.compute_budget`` less
  the running tasks' compute (no limit when the budget is 0);
* **importance of a node** = 1 + the downstream nodes that wait on its
  stage: the idle nodes of later stages whose own stage has nothing pending
  (they can only work once this stage's outputs arrive). A starved chain
  therefore feeds its bottleneck first;
* **work** of a task: its samples (streams).

The selection is :func:`jaxdist.gen.selection.select_nodes`' knapsack
(maximise importance x work within the budget), exact at these sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from jaxdist.gen.selection import NodeWork, Selection, select_nodes


@dataclass(frozen=True)
class NodeReport:
    """What a node reported: its stage (index) and whether it is idle (asked for work, holds none)."""

    node: str
    stage: int
    idle: bool


@dataclass(frozen=True)
class RoundDecision:
    """The nodes told to process this round, the compute they and the running tasks use, and why."""

    selected: tuple[str, ...]
    importance: tuple[float, ...]  # per stage
    running_compute: float
    compute: float  # of the selected tasks
    budget: float  # 0: no limit
    selection: Selection | None  # None when nothing was pending for an idle node

    @property
    def used(self) -> float:
        """Compute in use once the selected tasks run (budget units)."""
        return self.running_compute + self.compute


def decide_round(
    reports: Sequence[NodeReport],
    pending: Sequence[int],
    streams: Sequence[int],
    compute_per_stream: Sequence[float],
    running_compute: float,
    budget: float,
) -> RoundDecision:
    """The idle nodes that take a task of their stage this round (see the module docstring)."""
    n_stages = len(pending)
    waiting = [0] * n_stages  # idle nodes per stage whose stage has nothing pending
    for r in reports:
        if r.idle and pending[r.stage] == 0:
            waiting[r.stage] += 1
    importance = tuple(1.0 + sum(waiting[k + 1 :]) for k in range(n_stages))
    left = list(pending)
    work = []
    for r in sorted(reports, key=lambda r: r.node):
        if r.idle and left[r.stage] > 0:
            left[r.stage] -= 1
            work.append(NodeWork(r.node, {str(r.stage): 1}, importance[r.stage]))
    if not work:
        return RoundDecision((), importance, running_compute, 0.0, budget, None)
    cost = {str(k): streams[k] * compute_per_stream[k] for k in range(n_stages)}
    value = {str(k): float(streams[k]) for k in range(n_stages)}
    if budget > 0:
        room = max(0.0, budget - running_compute)
    else:  # no limit: room for every node's task
        room = math.fsum(cost[next(iter(w.pending))] for w in work)
    sel = select_nodes(work, cost, room, value)
    return RoundDecision(sel.nodes, importance, running_compute, sel.compute, budget, sel)


def format_round(d: RoundDecision, stage_names: Sequence[str]) -> str:
    """One line: the selected nodes, the importance per stage, the budget used."""
    imp = ", ".join(f"{n} {i:g}" for n, i in zip(stage_names, d.importance))
    limit = f"{d.budget:g}" if d.budget > 0 else "no limit"
    return (
        f"{len(d.selected)} node(s) told to process ({', '.join(d.selected) or 'none'}); importance {imp}; "
        f"compute {d.used:g} of {limit} ({d.running_compute:g} running + {d.compute:g} new)"
    )

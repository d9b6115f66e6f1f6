"""Remat (activation recomputation) chosen from measured operator costs.

* :mod:`~jaxdist.remat.trace`: the forward operators ``jax.checkpoint`` decides about, from the jaxpr.
* :mod:`~jaxdist.remat.profile`: their bytes per device, FLOPs and time (:func:`profile_block`).
* :mod:`~jaxdist.remat.graph`: the operator graph, the cost of one choice (:func:`evaluate`), a solver's answer.
* :mod:`~jaxdist.remat.select`: the optimisation (exact MILP, brute force, approximation);
  :mod:`~jaxdist.remat.lagrangian`: its minimum-cut relaxation (fallback and lower bounds).
* :mod:`~jaxdist.remat.plan`: a plan for a budget, its table, its policy, the comparison with named policies.
* :mod:`~jaxdist.remat.named`: the ``train.remat`` values that name a policy, and the named recipes.
* :mod:`~jaxdist.remat.policy`: ``train.remat`` -> policy, including ``auto``.
* :mod:`jaxdist.measure.remat` (a layer above): what XLA reports for a policy (checks and benchmarks).
"""

from jaxdist.remat.graph import InfeasibleBudget, OperatorGraph, Selection, evaluate
from jaxdist.remat.lagrangian import select_lagrangian
from jaxdist.remat.named import named_policies, remat_policy
from jaxdist.remat.plan import (
    PolicyPoint,
    RematPlan,
    budget_range,
    compare_policies,
    format_bytes,
    format_comparison,
    plan_remat,
    policy_point,
)
from jaxdist.remat.policy import auto_budget, memory_breakdown, profile_for_config, resolve_remat_policy
from jaxdist.remat.profile import BlockProfile, Operator, profile_block, profile_function

# The function select() stays in its module: importing it here would hide the module jaxdist.remat.select.
from jaxdist.remat.select import random_graph, select_approximate, select_brute_force, select_exact

__all__ = [
    "BlockProfile",
    "InfeasibleBudget",
    "Operator",
    "OperatorGraph",
    "PolicyPoint",
    "RematPlan",
    "Selection",
    "auto_budget",
    "budget_range",
    "compare_policies",
    "evaluate",
    "format_bytes",
    "format_comparison",
    "memory_breakdown",
    "named_policies",
    "plan_remat",
    "policy_point",
    "profile_block",
    "profile_for_config",
    "profile_function",
    "random_graph",
    "remat_policy",
    "resolve_remat_policy",
    "select_approximate",
    "select_brute_force",
    "select_exact",
    "select_lagrangian",
]

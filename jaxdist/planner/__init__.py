"""Planner: computation view + cluster view -> cost model -> search -> Plan -> config.

``plan(model_cfg, cluster) -> Plan`` picks mesh sizes, microbatches and remat;
``jaxdist plan`` prints its table and writes the config, ``jaxdist calibrate``
measures the present devices, and ``mesh.auto = true`` plans at train start-up.
"""

from jaxdist.planner.candidates import REMAT_CHOICES, RematChoice, Strategy, candidates
from jaxdist.planner.cluster import Calibration, ClusterView, cluster_view, load_allocation
from jaxdist.planner.computation import ComputationView, computation_view
from jaxdist.planner.cost import Estimate, Memory, collectives, estimate, memory
from jaxdist.planner.plan import Plan, PlanError, plan, resolve_auto

__all__ = [
    "REMAT_CHOICES",
    "Calibration",
    "ClusterView",
    "ComputationView",
    "Estimate",
    "Memory",
    "Plan",
    "PlanError",
    "RematChoice",
    "Strategy",
    "candidates",
    "cluster_view",
    "collectives",
    "computation_view",
    "estimate",
    "load_allocation",
    "memory",
    "plan",
    "resolve_auto",
]

"""Keeping a training job alive: controller, node and worker agents, standbys, health, setup cache, launchers.

Processes: ``jaxdist controller`` (:mod:`~jaxdist.controller.controller`, the
generation lifecycle in :mod:`~jaxdist.controller.generations`), one node agent
per host (:mod:`~jaxdist.controller.node`) and a worker agent inside every
training process (:mod:`~jaxdist.controller.agent`), talking over
:mod:`~jaxdist.controller.protocol`.  Decisions are pure functions in
:mod:`~jaxdist.controller.policy`; the cached cluster setup is in
:mod:`~jaxdist.controller.setup_cache`; launchers in :mod:`~jaxdist.controller.launch`;
:class:`~jaxdist.controller.local.LocalJob` runs a whole job on one machine and
:mod:`~jaxdist.controller.timeline` reads back what happened.
Nothing here imports JAX or model code (the worker agent runs inside the
training process, which does).
"""

from jaxdist.controller.policy import (
    choose_group_size,
    find_failures,
    lineage,
    plan_replacement,
    slow_nodes,
    valid_group_sizes,
)
from jaxdist.controller.setup_cache import SetupCache, SetupKey

__all__ = [
    "SetupCache",
    "SetupKey",
    "choose_group_size",
    "find_failures",
    "lineage",
    "plan_replacement",
    "slow_nodes",
    "valid_group_sizes",
]

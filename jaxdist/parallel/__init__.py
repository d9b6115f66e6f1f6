"""Parallelism (cluster files live in jaxdist/cluster.py): device meshes (mesh.py), logical-axis sharding rules (rules.py), expert parallelism (moe.py),
pipeline stages (pipeline.py), and the one value that holds them for a job (layout.py: ``Parallelism``)."""

from jaxdist.parallel.layout import Parallelism, sharded_tracing
from jaxdist.parallel.mesh import build_mesh, cluster_from_devices, describe_mesh, hybrid_shapes
from jaxdist.parallel.rules import (
    DEFAULT_RULES,
    activation_sharding,
    constrain,
    logical_to_spec,
    state_shardings,
)

__all__ = [
    "build_mesh",
    "cluster_from_devices",
    "describe_mesh",
    "hybrid_shapes",
    "DEFAULT_RULES",
    "activation_sharding",
    "constrain",
    "logical_to_spec",
    "state_shardings",
    "Parallelism",
    "sharded_tracing",
]

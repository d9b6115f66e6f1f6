"""Parallelism: device meshes (mesh.py) and logical-axis sharding rules (rules.py)."""

from jaxdist.parallel.mesh import (
    ClusterSpec,
    build_mesh,
    cluster_from_devices,
    describe_mesh,
    hybrid_shapes,
    list_clusters,
    load_cluster,
)
from jaxdist.parallel.rules import (
    DEFAULT_RULES,
    activation_sharding,
    constrain,
    logical_to_spec,
    state_shardings,
)

__all__ = [
    "ClusterSpec", "build_mesh", "cluster_from_devices", "describe_mesh", "hybrid_shapes",
    "list_clusters", "load_cluster",
    "DEFAULT_RULES", "activation_sharding", "constrain", "logical_to_spec", "state_shardings",
]

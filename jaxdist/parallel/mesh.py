"""Device meshes: the live devices as a cluster description, and the mesh builder.

A cluster is described once, in ``meshes/<name>.toml``, and read (without JAX)
by :func:`jaxdist.cluster.load_cluster`; :func:`cluster_from_devices` describes
the devices JAX sees the same way.  The mesh always has the six axes of
``MESH_AXES`` in that order, of the Auto type (the compiler propagates
shardings; Explicit axes reject our differently sharded matmul operands).

On several hosts the layout is hybrid: ``context``, ``tensor``, ``expert`` and ``pipeline``
stay inside one node (fast links), and the node count is absorbed by ``data``
first, then ``fsdp`` (their collectives tolerate the slower network).  The
choice of that split is the pure function :func:`hybrid_shapes`.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxdist.cluster import NODE_LOCAL_AXES, ClusterSpec, preset_for_kind
from jaxdist.config import MESH_AXES, ConfigError, MeshConfig

# Memory of a device whose runtime reports none and that no preset describes
# (bytes); CPU devices instead get an equal share of the host's RAM.
DEFAULT_MEMORY_BYTES = 2 * 2**30

# Figures for a device kind that no meshes/*.toml describes: nominal CPU-like
# numbers, so a plan can still be computed (and will look slow, not wrong-fast).
_FALLBACK = dict(
    peak_flops_bf16=5.0e10,
    peak_flops_fp32=5.0e10,
    intra_node_bandwidth=1.0e10,
    inter_node_bandwidth=1.0e9,
    intra_node_latency=1.0e-5,
    inter_node_latency=1.0e-4,
)


# --------------------------------------------------------------------------- live devices


def _by_process(devices: Sequence[Any]) -> dict[int, list[Any]]:
    groups: dict[int, list[Any]] = {}
    for d in devices:
        groups.setdefault(d.process_index, []).append(d)
    return dict(sorted(groups.items()))


def _nodes_and_per_node(devices: Sequence[Any]) -> tuple[int, int]:
    counts = Counter(d.process_index for d in devices)
    if len(set(counts.values())) != 1:
        raise ConfigError(
            f"the devices are spread unevenly over processes ({dict(sorted(counts.items()))} "
            "devices per process): give every process the same number of devices."
        )
    return len(counts), next(iter(counts.values()))


def _device_memory(device: Any, local_count: int, preset: ClusterSpec | None) -> int:
    try:
        stats = device.memory_stats()
    except Exception:  # CPU and some plugins raise instead of returning None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if preset is not None:
        return preset.memory_bytes
    if device.platform == "cpu":
        try:  # simulated CPU devices share the host's RAM
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_count
        except (ValueError, OSError, AttributeError):
            pass
    return DEFAULT_MEMORY_BYTES


def cluster_from_devices(devices: Sequence[Any] | None = None) -> ClusterSpec:
    """Describe the live devices (default ``jax.devices()``) as a ClusterSpec named ``live``.

    ``nodes`` is the number of processes, ``devices_per_node`` the devices of
    each.  Memory comes from ``device.memory_stats()["bytes_limit"]`` (what JAX
    may allocate, after its preallocation fraction) when the runtime reports it, else from the preset in ``meshes/`` with the same
    ``device_kind``, else (CPU) the host RAM divided among its devices, else
    ``DEFAULT_MEMORY_BYTES``.  FLOP/s, bandwidths and latencies come from that
    preset, or from nominal CPU-like figures for a kind no preset describes.
    """
    devices = list(jax.devices() if devices is None else devices)
    assert devices, "cluster_from_devices needs at least one device"
    nodes, per_node = _nodes_and_per_node(devices)
    kind = devices[0].device_kind
    preset = preset_for_kind(kind)
    figures = {k: getattr(preset, k) for k in _FALLBACK} if preset is not None else dict(_FALLBACK)
    return ClusterSpec(
        name="live",
        device_kind=kind,
        nodes=nodes,
        devices_per_node=per_node,
        memory_bytes=_device_memory(devices[0], per_node, preset),
        **figures,
    )


# --------------------------------------------------------------------------- mesh


def hybrid_shapes(sizes: dict[str, int], n_nodes: int, per_node: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split resolved axis sizes into (inside-node shape, across-node shape), both in MESH_AXES order.

    The node-local axes (context, tensor, expert, pipeline) live entirely inside a node;
    the ``n_nodes`` factor goes to ``data`` as far as it divides it, the rest to
    ``fsdp``.  The element-wise product of the two shapes is the mesh shape.
    Raises ConfigError when the node-local axes do not fit in ``per_node``
    devices or data*fsdp cannot take the node count.
    """
    assert set(sizes) == set(MESH_AXES), f"sizes must name exactly {MESH_AXES}, got {sorted(sizes)}"
    local = math.prod(sizes[a] for a in NODE_LOCAL_AXES)
    if per_node % local:
        raise ConfigError(
            f"mesh {'context*' if sizes['context'] > 1 else ''}tensor*expert*pipeline = {local} does not fit inside "
            f"one node of {per_node} devices: "
            f"choose sizes whose product divides {per_node} and move the rest to data or fsdp."
        )
    data, fsdp = sizes["data"], sizes["fsdp"]
    if (data * fsdp) % n_nodes or data * fsdp * local != n_nodes * per_node:
        raise ConfigError(
            f"mesh data*fsdp = {data * fsdp} cannot span the {n_nodes} nodes of {per_node} devices "
            f"with {'context*' if sizes['context'] > 1 else ''}tensor*expert*pipeline = {local}: "
            f"make data*fsdp = {n_nodes * per_node // local}."
        )
    dcn_data = math.gcd(data, n_nodes)
    # n_nodes divides data*fsdp, so what data cannot take divides fsdp.
    dcn_fsdp = n_nodes // dcn_data
    assert fsdp % dcn_fsdp == 0
    dcn = {a: 1 for a in MESH_AXES}
    dcn["data"], dcn["fsdp"] = dcn_data, dcn_fsdp
    ici = {a: sizes[a] // dcn[a] for a in MESH_AXES}
    assert math.prod(ici.values()) == per_node
    return tuple(ici[a] for a in MESH_AXES), tuple(dcn[a] for a in MESH_AXES)


def device_grid(sizes: dict[str, int], devices: Sequence[Any]) -> np.ndarray:
    """The devices arranged in an array of shape ``sizes`` (MESH_AXES order), hybrid on several processes."""
    shape = tuple(sizes[a] for a in MESH_AXES)
    n_nodes, per_node = _nodes_and_per_node(devices)
    if n_nodes > 1:
        ici, dcn = hybrid_shapes(sizes, n_nodes, per_node)
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    try:
        return mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        # e.g. a TPU subset whose topology create_device_mesh cannot fold: keep the given order.
        return np.asarray(devices, dtype=object).reshape(shape)


def mesh_devices(mesh_cfg: MeshConfig, devices: Sequence[Any]) -> list[Any]:
    """The devices a mesh runs on: the first ``mesh_cfg.devices_used(len(devices))`` of ``devices`` (all of them
    unless the axis sizes, all given, multiply to fewer; jaxdist.config.unused_devices_note says so).

    ConfigError when such a smaller mesh would leave a process of a multi-process job without a device.
    """
    devices = list(devices)
    if not devices:
        raise ConfigError(
            "the device list is empty: pass JAX devices (jax.devices() or some of them), or None for all."
        )
    used = devices[: mesh_cfg.devices_used(len(devices))]
    processes = {d.process_index for d in devices}
    if len({d.process_index for d in used}) < len(processes):
        raise ConfigError(
            f"the mesh asks for {len(used)} of the {len(devices)} devices, which leaves some of the job's "
            f"{len(processes)} processes without a device: make the axis sizes multiply to {len(devices)} "
            "(or set mesh.data=-1), or start fewer processes."
        )
    return used


def build_mesh(mesh_cfg: MeshConfig, devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh over ``devices`` (default ``jax.devices()``) with axes MESH_AXES of type Auto.

    Axis sizes are ``mesh_cfg.resolved(len(devices))`` (ConfigError if they do
    not multiply to the device count).  Devices of several processes get the
    hybrid layout of :func:`hybrid_shapes`.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_cfg.resolved(len(devices))
    grid = device_grid(sizes, devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def describe_mesh(mesh: Mesh) -> str:
    """One line, e.g. ``data=2 fsdp=2 tensor=2 (8 devices, 1 process)``; size-1 axes are left out."""
    axes = " ".join(f"{a}={s}" for a, s in mesh.shape.items() if s != 1) or "single device"
    n = mesh.devices.size
    procs = len({d.process_index for d in mesh.devices.flat})
    return f"{axes} ({n} device{'s' if n != 1 else ''}, {procs} process{'es' if procs != 1 else ''})"

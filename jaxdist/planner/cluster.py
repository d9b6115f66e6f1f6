"""Cluster view: the devices a plan may use and how fast they compute and talk.

It starts from a :class:`~jaxdist.cluster.ClusterSpec` (``meshes/*.toml``
via ``load_cluster``, or the live devices via ``cluster_from_devices``), takes
away the devices other jobs hold (a list, or an allocation file), and keeps the
largest block of free devices that has the same number on every node it uses
(a mesh needs that).  Two models can thus share one cluster: plan the second
with the first one's devices marked busy.

An allocation file is TOML; a device is its global index (``node *
devices_per_node + local``), ``"NODE:LOCAL"``, ``"NODE:A-B"`` or ``"NODE:*"``::

    [jobs.llama-8b]
    devices = ["0:*", "1:*"]        # nodes 0 and 1, every device
    [jobs.eval]
    devices = [16, 17, "3:4-7"]
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxdist.cluster import ClusterSpec
from jaxdist.config import ConfigError

# Share of the dense peak that training kernels reach when nothing is calibrated
# (large transformer steps on H100-class GPUs reach about 40-55 %).
DEFAULT_EFFICIENCY = 0.45
# Share of the compute time behind which FSDP gathers and gradient reductions can
# hide (XLA's asynchronous collectives on GPUs); XLA:CPU runs collectives in line.
DEFAULT_OVERLAP = {"cpu": 0.0}
GPU_OVERLAP = 0.5


@dataclass(frozen=True)
class Calibration:
    """Measured figures of the present devices (``jaxdist calibrate``), overriding the cluster file.

    ``efficiency``: achieved share of the peak FLOP/s in a training step (0-1].
    ``intra_node_bandwidth`` (bytes/s) and ``intra_node_latency`` (s): one
    ring step of a collective between devices of one node.
    ``collective_overhead``: fixed seconds per collective on top of the ring
    model (launch, or the rendezvous of XLA:CPU's in-process collectives).
    ``pass_overhead``: fixed seconds per forward or backward pass of one block
    on one microbatch (kernel dispatch).  None keeps the cluster view's figure.
    ``device_kind`` names the devices it was measured on.
    """

    device_kind: str
    efficiency: float
    intra_node_bandwidth: float | None = None
    intra_node_latency: float | None = None
    collective_overhead: float | None = None
    pass_overhead: float | None = None

    def to_json(self) -> str:
        """The calibration as a JSON object (what ``jaxdist calibrate`` writes)."""
        return json.dumps(dataclasses.asdict(self), indent=2)


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration JSON file; ConfigError if it is missing or malformed."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"calibration file '{p}' does not exist: run `jaxdist calibrate --out {p}` first.")
    try:
        data = json.loads(p.read_text())
        return Calibration(**data)
    except (json.JSONDecodeError, TypeError) as e:
        raise ConfigError(f"calibration file '{p}' is malformed ({e}): run `jaxdist calibrate` again.") from None


@dataclass(frozen=True)
class ClusterView:
    """The free part of a cluster that a plan uses: ``nodes`` x ``devices_per_node`` identical devices.

    ``devices`` lists the global indices used (node-major).  Figures are per
    device: ``memory_bytes`` (bytes), ``peak_flops`` (FLOP/s, for the model's
    compute dtype), bandwidths (bytes/s, one direction) and latencies (s) of a
    link inside a node and between nodes, ``efficiency`` (share of peak a
    training step reaches) and ``overlap`` (share of the compute time that can
    hide FSDP gathers and gradient reductions), ``collective_overhead`` (s per
    collective) and ``pass_overhead`` (s per block pass, see Calibration);
    ``calibration`` is what replaced the cluster file's figures, if anything.
    """

    spec: ClusterSpec
    nodes: int
    devices_per_node: int
    devices: tuple[int, ...]
    busy: tuple[int, ...]
    efficiency: float = DEFAULT_EFFICIENCY
    intra_node_bandwidth: float = 0.0
    intra_node_latency: float = 0.0
    inter_node_bandwidth: float = 0.0
    inter_node_latency: float = 0.0
    overlap: float = 0.0
    collective_overhead: float = 0.0
    pass_overhead: float = 0.0
    calibration: Calibration | None = None

    @property
    def n_devices(self) -> int:
        """Devices the plan uses."""
        return self.nodes * self.devices_per_node

    @property
    def memory_bytes(self) -> int:
        """Memory of one device (bytes)."""
        return self.spec.memory_bytes

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s of one device for ``dtype`` (float32 or bfloat16)."""
        return self.spec.peak_flops(dtype)

    def describe(self) -> str:
        """One line, e.g. ``h100x64: 8 nodes x 8 NVIDIA H100 80GB HBM3 (64 devices; 0 busy)``."""
        return (
            f"{self.spec.name}: {self.nodes} node{'s' if self.nodes != 1 else ''} x {self.devices_per_node} "
            f"{self.spec.device_kind} ({self.n_devices} devices; {len(self.busy)} busy)"
        )


def _parse_device(item: Any, spec: ClusterSpec) -> list[int]:
    per, n = spec.devices_per_node, spec.n_devices
    if isinstance(item, bool):
        raise ConfigError(f"busy device {item!r} is not a device: use an index or 'NODE:LOCAL'.")
    if isinstance(item, int):
        if not 0 <= item < n:
            raise ConfigError(f"busy device {item} is outside the cluster's {n} devices (0..{n - 1}): fix the index.")
        return [item]
    s = str(item).strip()
    if ":" not in s:
        try:
            return _parse_device(int(s), spec)
        except ValueError:
            raise ConfigError(f"busy device '{s}' is not an index or 'NODE:LOCAL': write it like 3 or '0:2'.") from None
    node_s, local_s = s.split(":", 1)
    try:
        node = int(node_s)
        if local_s == "*":
            locals_ = list(range(per))
        elif "-" in local_s:
            a, b = (int(x) for x in local_s.split("-", 1))
            locals_ = list(range(a, b + 1))
        else:
            locals_ = [int(local_s)]
    except ValueError:
        raise ConfigError(f"busy device '{s}' is not 'NODE:LOCAL', 'NODE:A-B' or 'NODE:*': fix it.") from None
    if not 0 <= node < spec.nodes or any(not 0 <= x < per for x in locals_):
        raise ConfigError(f"busy device '{s}' is outside the cluster ({spec.nodes} nodes x {per} devices): fix it.")
    return [node * per + x for x in locals_]


def load_allocation(path: str | Path, spec: ClusterSpec) -> list[int]:
    """Global indices of the devices that an allocation file gives to other jobs."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"allocation file '{p}' does not exist: check the path given to --busy.")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"allocation file '{p}' is not valid TOML ({e}): fix the syntax.") from None
    jobs = data.get("jobs")
    if not isinstance(jobs, dict):
        raise ConfigError(f"allocation file '{p}' has no [jobs.NAME] tables: add one per job with a devices list.")
    out: list[int] = []
    for name, job in jobs.items():
        if not isinstance(job, dict) or not isinstance(job.get("devices"), list):
            raise ConfigError(f"allocation file '{p}': job '{name}' needs a list 'devices = [...]'.")
        for item in job["devices"]:
            out.extend(_parse_device(item, spec))
    return out


def cluster_view(
    spec: ClusterSpec, busy: Iterable[Any] | str | Path | None = None, calibration: Calibration | None = None
) -> ClusterView:
    """The free devices of ``spec`` as a ClusterView (``busy``: device list or allocation file path).

    Keeps the block ``nodes x k`` of free devices with the most devices (ties:
    the larger ``k``, so more axes stay inside a node).  Raises ConfigError when
    no device is free.
    """
    if isinstance(busy, (str, Path)):
        taken = load_allocation(busy, spec)
    else:
        taken = [x for item in (busy or []) for x in _parse_device(item, spec)]
    taken_set = set(taken)
    per = spec.devices_per_node
    free_by_node = [[x for x in range(per) if node * per + x not in taken_set] for node in range(spec.nodes)]
    best: tuple[int, int] | None = None
    for k in sorted({len(f) for f in free_by_node if f}, reverse=True):
        n = sum(1 for f in free_by_node if len(f) >= k)
        if best is None or n * k > best[0] * best[1]:
            best = (n, k)
    if best is None:
        raise ConfigError(f"every device of cluster '{spec.name}' is busy: free some devices or use another cluster.")
    n, k = best
    # Node-local axes need a divisor of k; keep k a power-of-two-friendly count by using what is free.
    used = tuple(node * per + x for node, f in enumerate(free_by_node) if len(f) >= k for x in f[:k])
    figures = dict(
        efficiency=DEFAULT_EFFICIENCY,
        intra_node_bandwidth=spec.intra_node_bandwidth,
        intra_node_latency=spec.intra_node_latency,
        collective_overhead=0.0,
        pass_overhead=0.0,
    )
    if calibration is not None:
        for key in figures:
            value = getattr(calibration, key)
            if value is not None:
                figures[key] = value
    return ClusterView(
        spec=spec,
        nodes=n,
        devices_per_node=k,
        devices=used,
        busy=tuple(sorted(taken_set)),
        inter_node_bandwidth=spec.inter_node_bandwidth,
        inter_node_latency=spec.inter_node_latency,
        overlap=DEFAULT_OVERLAP.get(spec.device_kind.lower(), GPU_OVERLAP),
        calibration=calibration,
        **figures,
    )


def smaller_views(view: ClusterView) -> Iterator[ClusterView]:
    """Sub-blocks of ``view`` with fewer nodes or fewer devices per node, most devices first.

    The planner falls back to them when no mesh of all free devices suits
    the model and batch (e.g. 24 free devices and a batch of 32).  Made one at
    a time, as the planner asks: building every one first cost nodes^2 x
    devices per node (11 s of a 16 s plan on 2,048 nodes, benchmarks/scale.py).
    """
    per = view.devices_per_node
    shapes = [
        (n, k)
        for n in range(view.nodes, 0, -1)
        for k in range(per, 0, -1)
        if per % k == 0 and (n, k) != (view.nodes, per)
    ]
    for n, k in sorted(shapes, key=lambda nk: (-nk[0] * nk[1], -nk[1])):
        used = tuple(view.devices[node * per + i] for node in range(n) for i in range(k))
        yield dataclasses.replace(view, nodes=n, devices_per_node=k, devices=used)

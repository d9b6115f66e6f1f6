"""Cluster descriptions (``meshes/*.toml``), read without JAX.

A cluster is described once, in ``meshes/<name>.toml``: devices per node,
nodes, memory, peak FLOP/s, bandwidths and latencies.  The command line, the
controller, the planner and the mesh builder all read it through
:func:`load_cluster`, and every one of them turns a ``mesh.cluster`` value into
a file with the one rule of :func:`cluster_path`.  Nothing here imports JAX, so
the controller and ``jaxdist --help`` stay fast; describing the *live* devices
(``cluster_from_devices``) needs JAX and lives in :mod:`jaxdist.parallel.mesh`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxdist.config import Config, ConfigError

MESHES_DIR = Path(__file__).resolve().parents[1] / "meshes"

# Axes that must stay inside one node; the others (data, fsdp) may cross nodes.  context's ring passes a
# key/value block every attention step, so it stays on the fast links too.
NODE_LOCAL_AXES = ("context", "tensor", "expert", "pipeline")


# Share of a device's memory train.memory_budget_bytes=0 keeps free: the runtime, fragmentation and what
# XLA's memory_analysis() does not count (the planner's memory_fraction leaves the same).
MEMORY_RESERVE = 0.10


def memory_budget(configured: int, memory_bytes: int) -> float:
    """Bytes per device the compiled train step may hold: ``configured`` (train.memory_budget_bytes) when set,
    else ``memory_bytes`` (the cluster file's) less :data:`MEMORY_RESERVE`."""
    return float(configured) if configured else (1.0 - MEMORY_RESERVE) * memory_bytes


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster: identical devices, ``devices_per_node`` on each of ``nodes`` hosts.

    Per-device figures: ``memory_bytes`` (bytes), ``peak_flops_bf16`` and
    ``peak_flops_fp32`` (dense FLOP/s), ``intra_node_bandwidth`` and
    ``inter_node_bandwidth`` (bytes/s, one direction), ``intra_node_latency``
    and ``inter_node_latency`` (seconds).
    """

    name: str
    device_kind: str
    nodes: int
    devices_per_node: int
    memory_bytes: int
    peak_flops_bf16: float
    peak_flops_fp32: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float

    @property
    def n_devices(self) -> int:
        """Devices in the whole cluster."""
        return self.nodes * self.devices_per_node

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s of one device computing in ``dtype``: bfloat16's figure, else float32's."""
        return self.peak_flops_bf16 if dtype == "bfloat16" else self.peak_flops_fp32


_FIELDS = {f.name: f.type for f in dataclasses.fields(ClusterSpec)}
_INT_FIELDS = ("nodes", "devices_per_node", "memory_bytes")
_STR_FIELDS = ("name", "device_kind")


def list_clusters() -> list[str]:
    """Names of the cluster presets in ``meshes/`` (file names without ``.toml``), sorted."""
    return sorted(p.stem for p in MESHES_DIR.glob("*.toml"))


def cluster_path(name_or_path: str | Path) -> Path:
    """The file a ``mesh.cluster`` value names (it may not exist; :func:`load_cluster` says so).

    A bare name (no ``.toml`` ending, no directory) is the preset
    ``meshes/<name>.toml``; anything else is a path.  A path
    ``.../meshes/NAME.toml`` that does not exist but names a preset (a config
    written inside the repository, used from elsewhere) is that preset.
    """
    s = str(name_or_path)
    if not (s.endswith(".toml") or os.sep in s or "/" in s):
        return MESHES_DIR / f"{s}.toml"
    p = Path(s)
    if not p.is_file() and p.parent.name == "meshes" and (MESHES_DIR / p.name).is_file():
        return MESHES_DIR / p.name
    return p


def cluster_from_dict(data: dict[str, Any], source: str = "cluster description") -> ClusterSpec:
    """Validate a dict of cluster fields (as read from TOML) into a ClusterSpec, or raise ConfigError."""
    for key in data:
        if key not in _FIELDS:
            close = difflib.get_close_matches(key, list(_FIELDS), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"the fields are {', '.join(_FIELDS)}."
            raise ConfigError(f"{source} has an unknown field '{key}': {hint}")
    missing = [k for k in _FIELDS if k not in data]
    if missing:
        raise ConfigError(
            f"{source} is missing the field{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}: add {'them' if len(missing) > 1 else 'it'} "
            "(see meshes/cpu-8.toml for the units)."
        )
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key in _STR_FIELDS:
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{source}: field '{key}' must be a non-empty string, got {value!r}.")
        elif key in _INT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
                raise ConfigError(f"{source}: field '{key}' must be a whole number, got {value!r}.")
            value = int(value)
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{source}: field '{key}' must be a number, got {value!r}.")
            value = float(value)
        if key not in _STR_FIELDS and not value > 0:
            raise ConfigError(f"{source}: field '{key}' = {value!r} must be positive.")
        values[key] = value
    return ClusterSpec(**values)


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """Read a cluster description: a preset name in ``meshes/`` or a path (see :func:`cluster_path`).

    Raises ConfigError for a missing file, invalid TOML, a missing or unknown
    field, a value of the wrong type or a non-positive number.
    """
    if str(name_or_path).startswith("slurm:"):
        raise ConfigError(
            f"mesh.cluster={name_or_path} names a Slurm partition, which only `jaxdist plan` and `jaxdist launch` "
            "read (launch turns it into the cluster file of the job's allocation): use a cluster file here."
        )
    p = cluster_path(name_or_path)
    if not p.is_file():
        raise ConfigError(
            f"cluster description '{name_or_path}' not found ({p}): use one of "
            f"{', '.join(list_clusters())} or a path to a TOML file."
        )
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"cluster description '{p}' is not valid TOML ({e}): fix the syntax.") from None
    return cluster_from_dict(data, source=f"cluster description '{p}'")


def write_cluster(path: str | Path, spec: ClusterSpec) -> Path:
    """Write ``spec`` as a cluster description that :func:`load_cluster` reads back equal."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"{f} = {json.dumps(getattr(spec, f)) if f in _STR_FIELDS else getattr(spec, f)}" for f in _FIELDS]
    path.write_text("\n".join(lines) + "\n")
    return path


def preset_for_kind(device_kind: str) -> ClusterSpec | None:
    """The first preset in ``meshes/`` (by name) whose ``device_kind`` is ``device_kind`` (any case), or None."""
    for name in list_clusters():
        spec = load_cluster(name)
        if spec.device_kind.lower() == device_kind.lower():
            return spec
    return None


# --------------------------------------------------------------------------- simulated host devices


def simulated_devices(cfg: Config) -> int | None:
    """Host devices to simulate per process for a CPU cluster description, else None."""
    try:
        spec = load_cluster(cfg.mesh.cluster)
    except ConfigError:
        return None  # load_cluster reports the problem again, where the cluster is used
    return spec.devices_per_node if spec.device_kind.lower() == "cpu" else None


def prepare_host_devices(cfg: Config) -> None:
    """Before JAX is imported: make XLA simulate the CPU devices the cluster file describes.

    Sets ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` unless the
    flag is already there (a test or the user chose the count).
    """
    n = simulated_devices(cfg)
    flags = os.environ.get("XLA_FLAGS", "")
    if n and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def without_device_count(flags: str) -> str:
    """``XLA_FLAGS`` as a process started for a job gets them: the user's flags without the simulated device
    count, which the job's cluster file sets again in that process (:func:`prepare_host_devices`)."""
    return " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))


def calibration_dir() -> Path:
    """Where what is measured of a device kind lives (its calibration, the remat loop's working-space ratios):
    ``$JAXDIST_CALIBRATION_DIR`` or ``~/.cache/jaxdist/calibration``."""
    return Path(os.environ.get("JAXDIST_CALIBRATION_DIR") or Path.home() / ".cache" / "jaxdist" / "calibration")


def calibration_path(device_kind: str) -> Path:
    """The default calibration file for a device kind (e.g. ``.../nvidia-h100-80gb-hbm3.json``)."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_kind.lower()).strip("-") or "device"
    return calibration_dir() / f"{slug}.json"

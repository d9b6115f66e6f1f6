"""A Slurm partition's GPUs as the planner sees them: per node, how many there are and which other jobs hold.

    view = read_partition("gpu")                # sinfo + scontrol show job -d on the live cluster
    print(view.table())                         # node, state, GPUs, busy, free, holders
    spec = cluster_spec(view, figures("slurm:gpu@h100x8", view))   # the planner's ClusterSpec of it

The node and GPU counts, the states and the busy GPUs come from Slurm; the
device kind, memory, FLOP/s and links from a cluster file (``meshes/``): a
``mesh.cluster`` value ``slurm:PARTITION@CLUSTER`` names both, and
``slurm:PARTITION`` alone takes the preset whose device kind names the
partition's GPU type (``Gres=gpu:h100:8`` -> ``h100x8``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from dataclasses import dataclass

from jaxdist.cluster import ClusterSpec, list_clusters, load_cluster
from jaxdist.config import ConfigError
from jaxdist.slurm.parse import SINFO_FORMAT, parse_jobs, parse_sinfo, state_usable

PREFIX = "slurm:"


def is_slurm_source(cluster: str) -> bool:
    """True for a ``mesh.cluster`` value that names a Slurm partition (``slurm:PARTITION[@CLUSTER]``)."""
    return str(cluster).startswith(PREFIX)


def parse_source(cluster: str) -> tuple[str, str]:
    """``slurm:PARTITION@CLUSTER`` -> (PARTITION, CLUSTER); CLUSTER '' when not given."""
    assert is_slurm_source(cluster), cluster
    rest = cluster[len(PREFIX) :]
    partition, _, figures = rest.partition("@")
    if not partition:
        raise ConfigError(
            f"mesh.cluster={cluster!r} names no partition: write slurm:PARTITION or slurm:PARTITION@CLUSTER."
        )
    return partition, figures


@dataclass(frozen=True)
class NodeGPUs:
    """One node of the partition: ``gpus`` in total, ``busy`` the indices other jobs hold, ``usable`` False
    when no new job can start there (down, drained, not responding, all CPUs allocated)."""

    name: str
    state: str
    gpus: int
    busy: frozenset[int]
    holders: tuple[str, ...] = ()
    usable: bool = True

    @property
    def free(self) -> int:
        """GPUs a new job can get on this node."""
        return self.gpus - len(self.busy) if self.usable else 0


@dataclass(frozen=True)
class PartitionView:
    """The GPUs of one partition (nodes in Slurm's order) and who holds them."""

    partition: str
    gpu_type: str
    nodes: tuple[NodeGPUs, ...]

    def free(self) -> dict[str, int]:
        """Node -> GPUs free for a new job."""
        return {n.name: n.free for n in self.nodes}

    @property
    def gpus_per_node(self) -> int:
        """The most GPUs a node of the partition has."""
        return max((n.gpus for n in self.nodes), default=0)

    def busy_devices(self) -> list[int]:
        """Global device indices (``node * gpus_per_node + local``) not free: held by other jobs, on unusable
        nodes, or missing on a node with fewer GPUs than the others (the planner's ``busy`` list)."""
        per = self.gpus_per_node
        out = []
        for i, n in enumerate(self.nodes):
            taken = set(range(per)) if not n.usable else set(n.busy) | set(range(n.gpus, per))
            out.extend(i * per + x for x in sorted(taken))
        return out

    def table(self) -> str:
        """One line per node: state, GPUs, busy, free and the jobs that hold them."""
        head = f"{'node':<12} {'state':<22} {'gpus':>4} {'busy':>4} {'free':>4}  held by"
        lines = [
            f"partition {self.partition}: {sum(self.free().values())} of {sum(n.gpus for n in self.nodes)} GPUs free",
            head,
            "-" * len(head),
        ]
        for n in self.nodes:
            lines.append(
                f"{n.name:<12} {n.state:<22} {n.gpus:>4} {len(n.busy):>4} {n.free:>4}  {', '.join(n.holders) or '-'}"
            )
        return "\n".join(lines)


def partition_view(partition: str, sinfo_text: str, jobs_text: str) -> PartitionView:
    """The view of ``partition`` from ``sinfo -h -N -p PARTITION -O`` :data:`SINFO_FORMAT` and
    ``scontrol show job -d`` text (pure).

    A node's busy GPUs are the indices sinfo reports in use (typed GRES) or, when it gives only a
    count, the union of the running jobs' indices there, padded with the lowest free indices up to
    sinfo's count (a job whose detail lines were missed still counts)."""
    rows = parse_sinfo(sinfo_text)
    jobs = [j for j in parse_jobs(jobs_text) if j.state in ("RUNNING", "SUSPENDED", "COMPLETING")]
    nodes = []
    for r in rows:
        held = {j.job_id: j.gpus.get(r.node, frozenset()) for j in jobs if r.node in j.nodes}
        busy = set(r.used_indices) if r.used_indices is not None else set().union(*held.values())
        spare = [i for i in range(r.gpus) if i not in busy]
        busy.update(spare[: max(0, r.gpus_used - len(busy))])
        holders = tuple(f"job {j} ({len(idx)})" for j, idx in held.items() if idx)
        nodes.append(NodeGPUs(r.node, r.state, r.gpus, frozenset(busy), holders, state_usable(r.state)))
    types = {r.gpu_type for r in rows if r.gpu_type}
    return PartitionView(partition, types.pop() if len(types) == 1 else "", tuple(nodes))


def _slurm(argv: list[str]) -> str:
    if shutil.which(argv[0]) is None:
        raise ConfigError(f"`{argv[0]}` is not on PATH: run where the Slurm commands are, or use a cluster file.")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=os.environ)
    if out.returncode:
        raise ConfigError(f"`{' '.join(argv)}` failed: {out.stderr.strip() or out.returncode}")
    return out.stdout


def read_partition(partition: str) -> PartitionView:
    """The live view of ``partition`` (``sinfo`` and ``scontrol show job -d``); ConfigError when Slurm does not
    answer, the partition is unknown or has no GPU."""
    sinfo = _slurm(["sinfo", "-h", "-N", "-p", partition, "-O", SINFO_FORMAT])
    view = partition_view(partition, sinfo, _slurm(["scontrol", "show", "job", "-d"]))
    if not view.nodes:
        raise ConfigError(f"Slurm partition '{partition}' has no node (see `sinfo -s`): name another partition.")
    if not view.gpus_per_node:
        raise ConfigError(f"Slurm partition '{partition}' has no GPU (no gres/gpu): name a GPU partition.")
    return view


def figures(cluster: str, view: PartitionView) -> ClusterSpec:
    """The cluster file whose per-device figures apply to ``view``'s GPUs: the ``@CLUSTER`` of ``cluster``, else
    the preset whose device kind names the partition's GPU type; ConfigError when neither says."""
    _, name = parse_source(cluster)
    if name:
        return load_cluster(name)
    if view.gpu_type:
        kind = view.gpu_type.lower()
        named = [load_cluster(p) for p in list_clusters()]
        named = [c for c in named if kind in c.device_kind.lower().split() or c.name.startswith(kind)]
        if named:  # a node like the partition's first (the figures per device are the same)
            return min(named, key=lambda c: (c.devices_per_node != view.gpus_per_node, c.nodes, c.name))
    raise ConfigError(
        f"no cluster file describes the GPUs of Slurm partition '{view.partition}' "
        f"(GPU type '{view.gpu_type or 'untyped'}'): write mesh.cluster={cluster}@CLUSTER with a file of "
        f"meshes/ ({', '.join(list_clusters())}) or a path."
    )


def cluster_spec(view: PartitionView, figures: ClusterSpec, nodes: int = 0, per_node: int = 0) -> ClusterSpec:
    """``figures`` on ``nodes`` x ``per_node`` of the partition's GPUs (0: all its nodes, its GPUs per node)."""
    return dataclasses.replace(
        figures,
        name=f"slurm:{view.partition}",
        nodes=nodes or len(view.nodes),
        devices_per_node=per_node or view.gpus_per_node,
    )

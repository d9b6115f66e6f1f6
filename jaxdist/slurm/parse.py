"""Pure parsers of Slurm's text: host lists, GRES strings, ``sinfo``, ``scontrol show node -d`` and
``scontrol show job -d`` (Slurm 22.05's formats; the tests hold captured output).

GPUs are GRES (``Gres=gpu:8``, typed ``gpu:h100:8``); Slurm reports which ones are in use as
``GresUsed=gpu:h100:4(IDX:0-3)`` for typed GPUs and, untyped, only as a count (``gpu:4``) on the node:
the indices are then in each job's ``Nodes=n1 ... GRES=gpu:4(IDX:0-3)`` lines.  Without slurmdbd, GPUs
are not in the TRES fields, so nothing here reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Node state flags (scontrol's ``State=`` joins them with '+'; sinfo's long names, '*': not responding)
# under which no new job starts on the node.
UNUSABLE_FLAGS = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "MAINT", "POWER", "REBOOT", "FUTURE", "UNKNOWN")


def expand_hostlist(s: str) -> list[str]:
    """Slurm's host list syntax to names: ``n[1-3,7],gpu-a`` -> ``[n1, n2, n3, n7, gpu-a]`` (zero padding kept)."""
    out: list[str] = []
    for part in re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", s.strip()):
        if not part:
            continue
        names = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            names = [n + text for n in names]
            if ranges:
                names = [n + x for n in names for x in _range_items(ranges)]
        out.extend(names)
    return out


def _range_items(ranges: str) -> list[str]:
    items = []
    for r in ranges.split(","):
        if "-" in r:
            a, b = r.split("-", 1)
            items.extend(str(i).zfill(len(a)) for i in range(int(a), int(b) + 1))
        else:
            items.append(r)
    return items


def parse_indices(s: str) -> frozenset[int]:
    """A GRES index list ``0-3,5`` -> {0, 1, 2, 3, 5}; ``N/A`` or empty -> {}."""
    if not s or s == "N/A":
        return frozenset()
    out: set[int] = set()
    for r in s.split(","):
        a, _, b = r.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return frozenset(out)


@dataclass(frozen=True)
class Gres:
    """One GRES entry: ``name`` (gpu), ``type`` ('' untyped), ``count``, ``indices`` (None when not given)."""

    name: str
    type: str
    count: int
    indices: frozenset[int] | None = None


def parse_gres(s: str) -> list[Gres]:
    """``gpu:h100:4(IDX:0-3),gpu:a100:0(IDX:N/A)``, ``gpu:4(S:0-1)`` or ``gpu:8`` -> Gres entries;
    ``(null)``/``N/A``/'' -> []."""
    out = []
    if (s or "").strip() in ("", "(null)", "N/A"):
        return out
    for item in re.findall(r"[^,(]+(?:\([^)]*\))?", s):
        item = item.strip().strip(",")
        if not item:
            continue
        idx = None
        m = re.match(r"^(.*?)\(([^)]*)\)$", item)
        if m:
            # (IDX:0-3) in GresUsed names the devices in use; (S:0-1) in Gres is the sockets they are bound to
            # (what Slurm writes where gres.conf gives Cores or AutoDetect=nvml finds them), not device indices.
            item, inner = m.group(1), m.group(2)
            idx = None if inner.startswith("S:") else parse_indices(inner.removeprefix("IDX:"))
        fields = item.split(":")
        name = fields[0]
        count = 1
        if len(fields) > 1 and fields[-1].isdigit():
            count, fields = int(fields[-1]), fields[:-1]
        gtype = fields[1] if len(fields) > 1 else ""
        out.append(Gres(name, gtype, count, idx))
    return out


def gpus(entries: list[Gres]) -> tuple[int, frozenset[int] | None]:
    """(count of GPUs, their indices or None if any entry gave none) over the ``gpu`` entries."""
    g = [e for e in entries if e.name == "gpu"]
    count = sum(e.count for e in g)
    if any(e.indices is None for e in g if e.count):
        return count, None
    return count, frozenset().union(*(e.indices or frozenset() for e in g))


def _records(text: str, first_key: str) -> list[str]:
    """The records of scontrol's multi-line output: each starts with ``first_key=`` at a line start."""
    parts = re.split(rf"(?m)^(?={first_key}=)", text)
    return [p for p in parts if p.startswith(f"{first_key}=")]


def _field(record: str, key: str) -> str:
    m = re.search(rf"(?:^|\s){re.escape(key)}=(\S*)", record)
    return m.group(1) if m else ""


@dataclass(frozen=True)
class NodeRecord:
    """One node of ``scontrol show node -d``: ``state`` as scontrol writes it (``MIXED+DRAIN``), ``addr`` the
    address others reach it at, ``gpus`` in total and ``gpus_used`` (``used_indices`` None: not given)."""

    name: str
    state: str
    partitions: tuple[str, ...]
    addr: str
    hostname: str
    cpus: int
    cpus_alloc: int
    gpu_type: str
    gpus: int
    gpus_used: int
    used_indices: frozenset[int] | None

    @property
    def usable(self) -> bool:
        """No new job starts on a node that is down, drained, failing, not responding, ... (UNUSABLE_FLAGS)."""
        return state_usable(self.state)


def state_usable(state: str) -> bool:
    """True unless ``state`` (scontrol's ``MIXED+DRAIN`` or sinfo's ``draining``, ``down*``) has a flag of
    :data:`UNUSABLE_FLAGS`, or is fully allocated."""
    s = state.upper()
    if s.endswith("*"):  # sinfo: not responding
        return False
    flags = s.replace("+", " ").split()
    return bool(flags) and not any(f.startswith(u) for f in flags for u in UNUSABLE_FLAGS) and flags[0] != "ALLOCATED"


def parse_nodes(text: str) -> list[NodeRecord]:
    """The nodes of ``scontrol show node -d`` (multi-line or ``-o`` one-line records)."""
    out = []
    for rec in _records(text, "NodeName"):
        total = parse_gres(_field(rec, "Gres"))
        n_gpus, _ = gpus(total)
        n_used, used_idx = gpus(parse_gres(_field(rec, "GresUsed")))
        types = {e.type for e in total if e.name == "gpu"}
        out.append(
            NodeRecord(
                name=_field(rec, "NodeName"),
                state=_field(rec, "State"),
                partitions=tuple(p for p in _field(rec, "Partitions").split(",") if p),
                addr=_field(rec, "NodeAddr"),
                hostname=_field(rec, "NodeHostName"),
                cpus=int(_field(rec, "CPUTot") or 0),
                cpus_alloc=int(_field(rec, "CPUAlloc") or 0),
                gpu_type=types.pop() if len(types) == 1 else "",
                gpus=n_gpus,
                gpus_used=n_used,
                used_indices=used_idx,
            )
        )
    return out


@dataclass(frozen=True)
class JobRecord:
    """One job of ``scontrol show job -d``: its ``nodes`` and, per node, the GPU indices it holds."""

    job_id: str
    name: str
    state: str
    partition: str
    user: str
    nodes: tuple[str, ...]
    gpus: dict[str, frozenset[int]]
    batch_host: str = ""


def parse_jobs(text: str) -> list[JobRecord]:
    """The jobs of ``scontrol show job -d`` (pending ones have no nodes)."""
    out = []
    for rec in _records(text, "JobId"):
        held: dict[str, frozenset[int]] = {}
        for nodes, gres in re.findall(r"(?m)^\s+Nodes=(\S+) .*?GRES=(\S*)", rec):
            count, idx = gpus(parse_gres(gres))
            for node in expand_hostlist(nodes):
                held[node] = idx if idx is not None else frozenset(range(count))
        node_list = _field(rec, "NodeList")
        out.append(
            JobRecord(
                job_id=_field(rec, "JobId"),
                name=_field(rec, "JobName"),
                state=_field(rec, "JobState"),
                partition=_field(rec, "Partition"),
                user=_field(rec, "UserId").split("(", 1)[0],
                nodes=tuple(expand_hostlist(node_list)) if node_list and node_list != "(null)" else (),
                gpus=held,
                batch_host=_field(rec, "BatchHost"),
            )
        )
    return out


SINFO_FORMAT = "NodeList:60,StateLong:40,Gres:100,GresUsed:100"  # what parse_sinfo reads (``sinfo -N -O ...``)


@dataclass(frozen=True)
class SinfoRow:
    """One node line of ``sinfo -N -O NodeList,StateLong,Gres,GresUsed``."""

    node: str
    state: str
    gpu_type: str
    gpus: int
    gpus_used: int
    used_indices: frozenset[int] | None


def parse_sinfo(text: str) -> list[SinfoRow]:
    """The rows of ``sinfo -N -O`` :data:`SINFO_FORMAT` (with or without its header); one per node."""
    out, seen = [], set()
    for line in text.splitlines():
        f = line.split()
        if len(f) < 4 or f[0] == "NODELIST":
            continue
        for node in expand_hostlist(f[0]):
            if node in seen:  # a node in several partitions is listed once per partition
                continue
            seen.add(node)
            total = parse_gres(f[2])
            types = {e.type for e in total if e.name == "gpu"}
            n_used, idx = gpus(parse_gres(f[3]))
            out.append(SinfoRow(node, f[1], types.pop() if len(types) == 1 else "", gpus(total)[0], n_used, idx))
    return out

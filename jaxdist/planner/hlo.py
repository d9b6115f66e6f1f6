"""Collectives of a compiled XLA program, read from its HLO text (``compiled.as_text()``).

The planner predicts how many bytes each collective moves per step; this module
measures the same quantity in what XLA actually compiled, so the two can be
compared.  Collectives inside ``while`` loops (the layer scan, the microbatch
scan) are counted once per iteration, using the loop's ``known_trip_count``.

Bytes follow one convention for every kind: the size of the *whole* buffer the
collective works on, per participating device (all-reduce: its operand;
all-gather: its gathered result; reduce-scatter: its un-scattered operand;
all-to-all and collective-permute: the operand).  The time on the wire is a
separate matter (``cost.collective_time``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclass(frozen=True)
class Collective:
    """One collective instruction as executed: ``count`` times per step (loop trips multiplied in).

    ``bytes`` is the whole-buffer size per device for one execution (see the
    module docstring); ``group`` the number of devices taking part.
    """

    kind: str
    bytes: int
    group: int
    count: int
    computation: str
    op_name: str

    @property
    def total_bytes(self) -> int:
        """Bytes over the whole step: ``bytes * count``."""
        return self.bytes * self.count


def _array_bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
    return total


def _group_size(attrs: str, n_devices: int | None) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'(\w+)'", m.group(2))
        return math.prod(int(sizes[a]) for a in axes)
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"source_target_pairs=\{(.*?)\}\s*[,}]", attrs)
    if m:
        return 2
    return n_devices or 1


def _split_computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _COMP_HEAD.match(line)
            if m:
                current = m.group(2)
                comps[current] = []
                if m.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        comps[current].append(line)
    return comps, entry


def _callees(attrs: str) -> list[tuple[str, int]]:
    """(computation, times per execution) that an instruction runs; loop bodies get their trip count."""
    out = []
    body = re.search(r"\bbody=%?([\w.\-]+)", attrs)
    if body:
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', attrs)
        n = int(trips.group(1)) if trips else 1
        out.append((body.group(1), n))
        cond = re.search(r"\bcondition=%?([\w.\-]+)", attrs)
        if cond:
            out.append((cond.group(1), n + 1))
        return out
    for key in ("to_apply", "calls", "true_computation", "false_computation"):
        for name in re.findall(rf"\b{key}=%?([\w.\-]+)", attrs):
            out.append((name, 1))
    m = re.search(r"branch_computations=\{([^}]*)\}", attrs)
    if m:  # a conditional runs one branch; count each (an upper bound)
        out.extend((n.strip().lstrip("%"), 1) for n in m.group(1).split(",") if n.strip())
    return out


def parse_collectives(hlo_text: str, n_devices: int | None = None) -> list[Collective]:
    """Every collective of the program in ``hlo_text`` with its executions per step.

    ``n_devices`` is the group size assumed when an instruction names no
    replica groups (all devices).  Async pairs count once (at ``-start``).
    """
    comps, entry = _split_computations(hlo_text)
    assert entry is not None, "no ENTRY computation in the HLO text"
    found: list[Collective] = []

    def visit(name: str, times: int, stack: tuple[str, ...]) -> None:
        if name not in comps or name in stack:
            return
        for line in comps[name]:
            m = _INSTR.match(line)
            if not m:
                continue
            _, type_text, op, rest = m.groups()
            kind = op[:-6] if op.endswith("-start") else op
            if kind in KINDS:
                op_name = _OP_NAME.search(rest)
                group = _group_size(rest, n_devices)
                nbytes = _array_bytes(type_text)
                if op.endswith("-start"):
                    # The start's result is (operands, results[, scratch]); keep the results half.
                    nbytes = _array_bytes(type_text) // 2 if kind != "collective-permute" else nbytes // 2
                if kind == "reduce-scatter":
                    nbytes *= group
                found.append(Collective(kind, nbytes, group, times, name, op_name.group(1) if op_name else ""))
            if op.endswith("-done") or op == "fusion":
                continue
            for callee, n in _callees(rest):
                visit(callee, times * n, stack + (name,))

    visit(entry, 1, ())
    return found


def collective_bytes(hlo_text: str, n_devices: int | None = None) -> dict[str, int]:
    """Bytes per step by collective kind (only kinds present), plus ``"total"``."""
    out: dict[str, int] = {}
    for c in parse_collectives(hlo_text, n_devices):
        out[c.kind] = out.get(c.kind, 0) + c.total_bytes
    out["total"] = sum(out.values())
    return out

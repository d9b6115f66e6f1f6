"""Collectives of a compiled XLA program, read from its HLO text (``compiled.as_text()``).

The planner predicts how many bytes each collective moves per step, and the
expert-parallel dispatch how many its all-to-alls move; this module (the one
HLO parser, with the one table of dtype sizes) measures the same quantities in
what XLA actually compiled, so the two can be compared.

* :func:`parse_collectives` / :func:`collective_bytes`: per step.  Collectives
  inside ``while`` loops (the layer scan, the microbatch scan) are counted once
  per iteration, using the loop's ``known_trip_count``.
* :func:`instruction_bytes`: per instruction as written, each counted once
  (e.g. one layer's dispatch inside the layer scan's body).

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

# Bytes per element of each HLO element type (pred is stored as one byte).
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMP_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_GROUPS = re.compile(
    r"(replica_groups|source_target_pairs)=(\[[0-9,]*\]<=\[[0-9,]*\](T\([0-9,]*\))?|mesh\[[^\]]*\][^{]*\{[^}]*\}|\{(\{[0-9,]*\},?)*\})"
)


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
    groups: str = ""  # the replica groups (or source-target pairs) as written in the HLO

    @property
    def total_bytes(self) -> int:
        """Bytes over the whole step: ``bytes * count``."""
        return self.bytes * self.count


def array_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO type, e.g. ``f32[8,16]{1,0}`` -> 512, ``(bf16[4], s32[5])`` -> 28."""
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in DTYPE_BYTES:
            continue  # token[], opaque types: no data
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * DTYPE_BYTES[dtype]
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
                nbytes = array_bytes(type_text)
                if op.endswith("-start"):
                    # The start's result is (operands, results[, scratch]); keep the results half.
                    nbytes = array_bytes(type_text) // 2 if kind != "collective-permute" else nbytes // 2
                if kind == "reduce-scatter":
                    nbytes *= group
                groups = _GROUPS.search(rest)
                found.append(
                    Collective(
                        kind,
                        nbytes,
                        group,
                        times,
                        name,
                        op_name.group(1) if op_name else "",
                        groups.group(0) if groups else "",
                    )
                )
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


def instruction_bytes(hlo_text: str, op: str = "all-to-all") -> int:
    """Bytes of the results of every ``op`` instruction in ``hlo_text``, each counted once as written.

    Loop trips are not multiplied in and no ENTRY computation is needed (a few
    instruction lines will do); async ``-start``/``-done`` pairs are other ops.
    For all-to-all and all-reduce the result has the operand's size.
    """
    total = 0
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m and m.group(3) == op:
            total += array_bytes(m.group(2))
    return total


# --------------------------------------------------------------------------- FLOPs

# Element-wise ops XLA's cost analysis counts as one FLOP per output element (transcendentals apart).
_ELEMENTWISE = frozenset(
    (
        "add",
        "subtract",
        "multiply",
        "divide",
        "maximum",
        "minimum",
        "negate",
        "abs",
        "compare",
        "select",
        "clamp",
        "power",
        "remainder",
        "and",
        "or",
        "xor",
        "not",
        "sign",
        "floor",
        "ceil",
        "round-nearest-afz",
        "round-nearest-even",
        "atan2",
    )
)


def _elements(type_text: str) -> int:
    m = _ARRAY.search(type_text)
    if not m:
        return 0
    dims = m.group(2)
    return math.prod(int(d) for d in dims.split(",") if d) if dims else 1


def _dims(type_text: str) -> list[int]:
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m and m.group(2) else []


def _instruction_flops(op: str, type_text: str, rest: str, types: dict[str, str]) -> float:
    if op == "dot":
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
        lhs = _dims(types.get(operands[0], "")) if operands else []
        k = math.prod(lhs[int(i)] for i in contracting.group(1).split(",") if i) if contracting and lhs else 1
        return 2.0 * _elements(type_text) * k
    if op in _ELEMENTWISE:
        return float(_elements(type_text))
    if op in ("reduce", "reduce-window"):
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        return float(_elements(types.get(operands[0], ""))) if operands else 0.0
    return 0.0


def _computation_flops(comps: dict[str, list[str]], name: str, loops: bool, stack: tuple[str, ...] = ()) -> float:
    """FLOPs of one execution of computation ``name``, descending into fusions and calls; loop bodies
    ``loops=True``: times their trip count, ``loops=False``: once (as XLA's cost analysis counts them)."""
    if name not in comps or name in stack:
        return 0.0
    types: dict[str, str] = {}
    total = 0.0
    for line in comps[name]:
        m = _INSTR.match(line)
        if not m:
            continue
        var, type_text, op, rest = m.groups()
        types[var] = type_text
        total += _instruction_flops(op, type_text, rest, types)
        for callee, n in _callees(rest):
            if op == "while" and not loops:
                n = 1 if callee in re.findall(r"\bbody=%?([\w.\-]+)", rest) else 0  # count the body once
            total += n * _computation_flops(comps, callee, loops, stack + (name,))
    return total


def loop_flops_correction(hlo_text: str) -> float:
    """FLOPs XLA's ``cost_analysis()`` misses in ``hlo_text``: it counts a ``while`` body once, whatever its trip
    count (the layer scan, the microbatch scan).  Add this to its ``"flops"`` for the program's real count.

    The loop bodies are counted here with XLA's own rules (a dot: 2 x output elements x contracted size; an
    element-wise op: one per output element; a reduce: one per input element).
    """
    comps, entry = _split_computations(hlo_text)
    if entry is None:
        return 0.0
    return _computation_flops(comps, entry, loops=True) - _computation_flops(comps, entry, loops=False)


def dot_operand_types(hlo_text: str) -> dict[str, int]:
    """How many ``dot`` instructions of ``hlo_text`` multiply each element type (their first operand's), as
    written (loop bodies once), e.g. ``{"bf16": 27, "f32": 11}``: a backend that upcasts bf16 matmuls
    shows ``f32`` dots where the model asked for bf16."""
    comps, _ = _split_computations(hlo_text)
    out: dict[str, int] = {}
    for lines in comps.values():
        types: dict[str, str] = {}
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            var, type_text, op, rest = m.groups()
            types[var] = type_text
            if op == "dot":
                operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
                t = _ARRAY.search(types.get(operands[0], "")) if operands else None
                if t:
                    out[t.group(1)] = out.get(t.group(1), 0) + 1
    return out

"""Pipeline schedules as data: who runs what, tick by tick.

A pipeline splits the blocks into ``p`` stages; the batch is split into ``m``
microbatches and, for the sequence-chunked schedule, every sequence into ``s``
chunks along the sequence axis.  A *unit* is what flows through the stages:
one microbatch (gpipe, 1f1b) or one chunk of one microbatch (seq1f1b).  A
forward (F) or backward (B) of one unit on one stage takes one *tick*; the
timing model gives F and B the same length, so a chunk tick is 1/s of a
microbatch tick.

Kinds:

* ``gpipe``: every stage runs all forwards, then all backwards.
* ``1f1b``: stage k runs ``p - k - 1`` warm-up forwards, then alternates one
  forward and one backward; at most p microbatches are in flight on stage 0.
* ``seq1f1b``: 1F1B over chunks.  Chunk j of a sequence attends to the cached
  keys/values of chunks 0..j-1 on the same stage, so forwards go in chunk
  order and backwards in reverse chunk order (key/value gradients flow from
  later chunks to earlier ones).  Stage k warms up with ``s + p - k - 2``
  forwards, so stage 0 holds at most ``s + p - 1`` chunks.

Everything here is pure Python (no JAX): :func:`build_schedule` places the
per-stage op orders on ticks by simulating their dependencies, and
:func:`executor_tables` turns a schedule into the integer tables the executor
(:mod:`jaxdist.parallel.pipeline`) runs: stash slots, receive buffers, branch
per tick.  The chunk boundaries are chosen by :mod:`jaxdist.parallel.chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("gpipe", "1f1b", "seq1f1b")


@dataclass(frozen=True)
class Action:
    """One tick of one stage: ``op`` "F" (forward) or "B" (backward) of a unit."""

    op: str
    microbatch: int
    chunk: int = 0

    def label(self, chunks: int) -> str:
        """``F3`` (microbatch 3) or ``F3b`` (its chunk 1) for timelines."""
        mb = np.base_repr(self.microbatch, 36)
        return f"{self.op}{mb}{chr(ord('a') + self.chunk)}" if chunks > 1 else f"{self.op}{mb}"


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``grid[t][k]`` is stage k's action at tick t (None: idle)."""

    kind: str
    stages: int
    microbatches: int
    chunks: int
    grid: tuple[tuple[Action | None, ...], ...]

    @property
    def n_ticks(self) -> int:
        """Length of the schedule in ticks (one F or B of one unit per tick)."""
        return len(self.grid)

    @property
    def units(self) -> int:
        """Units that flow through the pipeline: microbatches x chunks."""
        return self.microbatches * self.chunks

    def bubble_fraction(self) -> float:
        """Share of stage-ticks spent idle (0..1)."""
        idle = sum(a is None for row in self.grid for a in row)
        return idle / (self.n_ticks * self.stages)

    def in_flight(self, stage: int = 0) -> list[int]:
        """Units whose forward has run on ``stage`` and whose backward has not, after each tick."""
        out, n = [], 0
        for row in self.grid:
            a = row[stage]
            n += 0 if a is None else (1 if a.op == "F" else -1)
            out.append(n)
        return out

    def peak_in_flight(self, stage: int = 0) -> int:
        """Most units whose activations ``stage`` holds at once (units: chunks for seq1f1b)."""
        return max(self.in_flight(stage))

    def activation_microbatches(self, stage: int = 0) -> float:
        """Peak activations held by ``stage``, in microbatches (peak units / chunks)."""
        return self.peak_in_flight(stage) / self.chunks

    def timeline(self, width: int | None = None) -> str:
        """The schedule as text: one row per stage, one column per tick (``.`` = idle)."""
        cells = [[a.label(self.chunks) if a else "." for a in row] for row in self.grid]
        w = width or max(len(c) for row in cells for c in row)
        ruler = "".join(f"{t:<{w + 1}}" if t % 5 == 0 else " " * (w + 1) for t in range(self.n_ticks))
        lines = ["tick    " + ruler.rstrip()]
        for k in range(self.stages):
            lines.append(f"stage {k} " + " ".join(f"{row[k]:<{w}}" for row in cells).rstrip())
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: kind, shape, ticks, bubble (measured and closed form), peak in flight."""
        p, m, s = self.stages, self.microbatches, self.chunks
        unit = "chunks" if s > 1 else "microbatches"
        return (
            f"{self.kind}: p={p} m={m} s={s}, {self.n_ticks} ticks; bubble {self.bubble_fraction():.3f} "
            f"(formula {bubble_formula(self.kind, p, m, s):.3f}); peak in flight on stage 0: "
            f"{self.peak_in_flight(0)} {unit} = {self.activation_microbatches(0):.2f} microbatches"
        )


# --------------------------------------------------------------------------- closed forms


def bubble_formula(kind: str, stages: int, microbatches: int, chunks: int = 1) -> float:
    """Idle share of a schedule in the equal-tick model: (p-1)/(s*m+p-1) (s=1 for gpipe, 1f1b)."""
    s = chunks if kind == "seq1f1b" else 1
    return (stages - 1) / (s * microbatches + stages - 1)


def peak_in_flight_formula(kind: str, stages: int, microbatches: int, chunks: int = 1) -> int:
    """Peak units in flight on stage 0: m (gpipe), min(p, m) (1f1b), min(s+p-1, s*m) (seq1f1b)."""
    if kind == "gpipe":
        return microbatches
    if kind == "1f1b":
        return min(stages, microbatches)
    return min(chunks + stages - 1, chunks * microbatches)


def activation_memory_ratio(stages: int, chunks: int) -> float:
    """Activation memory of seq1f1b relative to 1f1b on stage 0: (s+p-1)/(s*p)."""
    return (chunks + stages - 1) / (chunks * stages)


# --------------------------------------------------------------------------- building


def check_shape(kind: str, stages: int, microbatches: int, chunks: int) -> None:
    """Raise ValueError (one sentence) for a schedule that cannot be built."""
    if kind not in KINDS:
        raise ValueError(f"pipeline schedule '{kind}' is unknown: use one of {', '.join(KINDS)}.")
    for name, v in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"pipeline {name}={v} must be a positive integer.")
    if chunks > 1 and kind != "seq1f1b":
        raise ValueError(
            f"{chunks} sequence chunks need the seq1f1b schedule, not {kind}: set chunks=1 or the schedule to seq1f1b."
        )
    if kind == "1f1b" and microbatches < stages:
        raise ValueError(
            f"1f1b needs at least as many microbatches as stages ({microbatches} < {stages}): "
            f"use {stages} or more microbatches, or the gpipe schedule."
        )


def stage_orders(kind: str, stages: int, microbatches: int, chunks: int = 1) -> list[list[Action]]:
    """The order in which each stage runs its forwards and backwards (no timing yet)."""
    check_shape(kind, stages, microbatches, chunks)
    p, m, s = stages, microbatches, chunks
    fwd = [Action("F", i, c) for i in range(m) for c in range(s)]
    bwd = [Action("B", i, c) for i in range(m) for c in reversed(range(s))]
    orders = []
    for k in range(p):
        if kind == "gpipe":
            orders.append(fwd + bwd)
            continue
        warm = min(len(fwd), (s - 1) + (p - k - 1))
        order = fwd[:warm]
        for j in range(len(fwd) - warm):
            order += [fwd[warm + j], bwd[j]]
        order += bwd[len(fwd) - warm :]
        orders.append(order)
    return orders


def build_schedule(stages: int, microbatches: int, chunks: int = 1, kind: str = "seq1f1b") -> Schedule:
    """Place each stage's op order on ticks: every op runs at the first tick its inputs are ready.

    F of a unit on stage k needs its F on stage k-1 one tick earlier; B on stage
    k needs the F on k and the B on stage k+1 (the last stage: its own F).
    Chunk order within a stage comes from the op order itself.
    """
    orders = stage_orders(kind, stages, microbatches, chunks)
    p = stages
    done: dict[tuple[str, int, int, int], int] = {}  # (op, mb, chunk, stage) -> tick
    pos = [0] * p
    grid: list[tuple[Action | None, ...]] = []
    t = 0
    while any(pos[k] < len(orders[k]) for k in range(p)):
        row: list[Action | None] = []
        for k in range(p):
            a = orders[k][pos[k]] if pos[k] < len(orders[k]) else None
            if a is not None:
                if a.op == "F":
                    deps = [("F", a.microbatch, a.chunk, k - 1)] if k > 0 else []
                else:
                    deps = [("F", a.microbatch, a.chunk, k)]
                    if k < p - 1:
                        deps.append(("B", a.microbatch, a.chunk, k + 1))
                if not all(done.get(d, t) < t for d in deps):
                    a = None
            row.append(a)
        for k, a in enumerate(row):
            if a is not None:
                done[(a.op, a.microbatch, a.chunk, k)] = t
                pos[k] += 1
        grid.append(tuple(row))
        t += 1
        assert t < 10 * (len(orders[0]) + 2 * p), "schedule did not finish: inconsistent op orders"
    return Schedule(kind, stages, microbatches, chunks, tuple(grid))


# --------------------------------------------------------------------------- executor tables

IDLE = 0


@dataclass(frozen=True)
class ExecutorTables:
    """Integer tables, indexed [tick, stage], that drive the executor.

    ``branch``: 0 idle, 1+c forward of chunk c, 1+s+c backward of chunk c;
    ``microbatch``; ``chunk``; ``slot``: the stash slot holding the unit's saved activations
    (from its F to its B); ``in_slot``: the receive buffer slot holding the F's
    input activation (stages > 0) or the B's incoming gradient (stages < p-1);
    ``recv_act`` / ``recv_grad``: where to put the activation / gradient that
    arrives at this tick (the capacity index, a scratch slot, when none does).
    ``unit_slot[stage, microbatch, chunk]``: the stash slot of each unit.
    """

    branch: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    slot: np.ndarray
    in_slot: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    unit_slot: np.ndarray
    slots: int
    act_buffers: int
    grad_buffers: int

    @property
    def n_ticks(self) -> int:
        """Rows of the tables (ticks, idle padding included)."""
        return self.branch.shape[0]

    def padded(self, slots: int, act_buffers: int, grad_buffers: int, ticks: int) -> ExecutorTables:
        """The same schedule with more buffer slots and idle ticks at the end, so that several
        schedules can share one compiled executor (which takes the tables as arguments)."""
        assert slots >= self.slots and act_buffers >= self.act_buffers and grad_buffers >= self.grad_buffers
        extra = ticks - self.n_ticks
        assert extra >= 0

        def grow(a, fill):
            return np.concatenate([a, np.full((extra, a.shape[1]), fill, a.dtype)])

        recv_act = np.where(self.recv_act == self.act_buffers, act_buffers, self.recv_act)
        recv_grad = np.where(self.recv_grad == self.grad_buffers, grad_buffers, self.recv_grad)
        return ExecutorTables(
            grow(self.branch, IDLE),
            grow(self.microbatch, 0),
            grow(self.chunk, 0),
            grow(self.slot, 0),
            grow(self.in_slot, 0),
            grow(recv_act, act_buffers),
            grow(recv_grad, grad_buffers),
            self.unit_slot,
            slots,
            act_buffers,
            grad_buffers,
        )

    def stacked(self) -> np.ndarray:
        """[ticks, stages, 7] int32: branch, microbatch, chunk, slot, in_slot, recv_act, recv_grad."""
        return np.stack(
            [self.branch, self.microbatch, self.chunk, self.slot, self.in_slot, self.recv_act, self.recv_grad], axis=-1
        ).astype(np.int32)


class _Slots:
    def __init__(self):
        self.busy: set[int] = set()
        self.size = 0

    def take(self) -> int:
        i = next(j for j in range(len(self.busy) + 1) if j not in self.busy)
        self.busy.add(i)
        self.size = max(self.size, i + 1)
        return i


def executor_tables(schedule: Schedule) -> ExecutorTables:
    """Stash and receive-buffer slots for every action (lowest free slot first)."""
    sch, p, s = schedule, schedule.stages, schedule.chunks
    T = sch.n_ticks
    z = lambda: np.zeros((T, p), np.int64)  # noqa: E731
    branch, mb, chunk, slot, in_slot, recv_act, recv_grad = z(), z(), z(), z(), z(), z() - 1, z() - 1
    unit_slot = np.full((p, sch.microbatches, s), -1, np.int64)
    for k in range(p):
        stash, acts, grads = _Slots(), _Slots(), _Slots()
        waiting_act: dict[tuple[int, int], int] = {}
        waiting_grad: dict[tuple[int, int], int] = {}
        for t in range(T):
            release: list[tuple[_Slots, int]] = []
            if t > 0 and k > 0 and (a := sch.grid[t - 1][k - 1]) is not None and a.op == "F":
                recv_act[t, k] = waiting_act[(a.microbatch, a.chunk)] = acts.take()
            if t > 0 and k < p - 1 and (a := sch.grid[t - 1][k + 1]) is not None and a.op == "B":
                recv_grad[t, k] = waiting_grad[(a.microbatch, a.chunk)] = grads.take()
            a = sch.grid[t][k]
            if a is not None:
                key = (a.microbatch, a.chunk)
                mb[t, k], chunk[t, k] = a.microbatch, a.chunk
                if a.op == "F":
                    branch[t, k] = 1 + a.chunk
                    slot[t, k] = unit_slot[k, a.microbatch, a.chunk] = stash.take()
                    if k > 0:
                        in_slot[t, k] = waiting_act.pop(key)
                        release.append((acts, in_slot[t, k]))
                else:
                    branch[t, k] = 1 + s + a.chunk
                    slot[t, k] = unit_slot[k, a.microbatch, a.chunk]
                    release.append((stash, slot[t, k]))
                    if k < p - 1:
                        in_slot[t, k] = waiting_grad.pop(key)
                        release.append((grads, in_slot[t, k]))
            for pool, i in release:  # freed at the end of the tick
                pool.busy.discard(int(i))
        assert not waiting_act and not waiting_grad
        stash_size, act_size, grad_size = stash.size, max(acts.size, 1), max(grads.size, 1)
        if k == 0:
            sizes = [stash_size, act_size, grad_size]
        else:
            sizes = [max(a, b) for a, b in zip(sizes, (stash_size, act_size, grad_size))]
    slots, act_buffers, grad_buffers = sizes
    recv_act[recv_act < 0] = act_buffers  # scratch slot: a message nobody waits for
    recv_grad[recv_grad < 0] = grad_buffers
    return ExecutorTables(
        branch, mb, chunk, slot, in_slot, recv_act, recv_grad, unit_slot, slots, act_buffers, grad_buffers
    )

"""Where the training loop's host spends its time: the per-period efficiency record of one process.

The loop marks each part it enters (:meth:`LoopClock.enter`); the clock adds the seconds spent in the part
it leaves.  A part is one of ``data`` (waiting for the next batch), ``dispatch`` (batch ready to step
dispatched: the host's own part of the step; dispatch is asynchronous), ``blocked`` (waiting for the
device's results at a metrics flush: the device's compute and collectives; ``agree``, the processes agreeing
on the batch list before a step, is booked there too: it waits for the slowest peer), ``checkpoint``,
``eval``, ``callbacks`` and ``probe`` (the device probe).  The metrics window adds its honest training time at each flush (:meth:`add_window`).

:meth:`take_period` returns the record since the last one (the controller's ``health.Period`` fields) and
starts the next.  The current part, the step dispatched and since when are readable from another thread
(the controller agent's heartbeat thread) without locks: plain attribute reads of immutable values.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PART_FIELDS = {
    "data": "data_wait_s",
    "dispatch": "dispatch_s",
    "blocked": "blocked_s",
    "agree": "blocked_s",  # the processes agreeing on the batch list: waiting for peers, like a collective
    "checkpoint": "checkpoint_s",
    "eval": "eval_s",
    "callbacks": "callbacks_s",
    "probe": "probe_s",
}


class LoopClock:
    """The seconds the loop spent per part since the last period, and where it is now."""

    def __init__(self, samples_per_step: int = 0, first_step: int = 1):
        self.samples_per_step = samples_per_step  # this process's share of the global batch (sequences)
        self.phase = "idle"
        self.since = time.time()  # when the current part began (seconds since the epoch)
        self.dispatched = first_step - 1  # the newest step dispatched (1-based count of steps)
        self._t = time.perf_counter()
        self.hook: Callable[[str], None] | None = None  # test-only fault hooks (jaxdist.train.faults): sleep there
        self._reset(first_step)

    def _reset(self, first_step: int) -> None:
        self.first_step = first_step
        self.parts = dict.fromkeys(PART_FIELDS.values(), 0.0)
        self.train_s = 0.0
        self.window_steps = 0

    def enter(self, phase: str, step: int | None = None) -> None:
        """The loop enters ``phase``; the seconds since the last call go to the part it leaves."""
        now = time.perf_counter()
        if self.phase in PART_FIELDS:
            self.parts[PART_FIELDS[self.phase]] += now - self._t
        self._t = now
        if step is not None:
            self.dispatched = step
        self.phase, self.since = phase, time.time()
        if self.hook is not None:
            self.hook(phase)  # after the switch: an injected delay is booked to the part entered

    def add_window(self, steps: int, seconds: float) -> None:
        """A metrics window of ``steps`` steps finished, ``seconds`` from its start to its last step done."""
        self.window_steps += steps
        self.train_s += seconds

    def take_period(self, last_step: int) -> dict[str, float | int]:
        """The record of steps ``first_step``..``last_step`` (the part in progress is counted up to now), and
        start the next period after ``last_step``."""
        self.enter(self.phase)  # book the running part's time so far
        out: dict[str, float | int] = {
            "first_step": self.first_step,
            "last_step": last_step,
            "t_end": time.time(),
            "samples": self.samples_per_step * (last_step - self.first_step + 1),
            "train_s": self.train_s,
            **self.parts,
        }
        self._reset(last_step + 1)
        return out

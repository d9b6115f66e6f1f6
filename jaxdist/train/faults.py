"""Test-only fault hooks: injected delays and hangs for the health benchmark (benchmarks/health.py).

Off unless ``JAXDIST_FAULT_HOOKS=1`` is in the environment: never set it in a real job.  When on, each training
process reads ``<run>/faults.json`` (re-read when it changes, so one job can take many injections; a missing
file is no fault), a list of injections, each ``{"kind": ..., ...}``:

* ``{"kind": "compute", "node": N, "delay_s": s}``: node N's host sleeps ``s`` seconds when it dispatches each
  step, and in the device probe's compute test;
* ``{"kind": "data", "node": N, "delay_s": s}``: node N waits ``s`` seconds more for each batch;
* ``{"kind": "link", "nodes": [A, B], "delay_s": s}``: nodes A and B sleep ``s`` seconds where the processes
  wait for each other before each step (the batch-list agreement, a collective; every ``train.log_every``
  steps) and in the probe's transfer between A and B;
* ``{"kind": "stuck", "node": N}``: node N stops in its data wait (its heartbeats go on) while the injection
  stays in the file.

The node is ``$JAXDIST_NODE`` (set by the node agent).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

ENV = "JAXDIST_FAULT_HOOKS"
FIRED = "faults.fired.jsonl"  # when an injection took effect (a stuck rank stopped)
FILE = "faults.json"


class FaultHooks:
    """The injections of ``<run_dir>/faults.json`` as seen by ``node`` (see the module docstring)."""

    def __init__(self, run_dir: str | Path, node: str):
        self.path, self.node = Path(run_dir) / FILE, node
        self._stamp: tuple[float, int] | None = None
        self._checked = 0.0
        self.faults: list[dict[str, Any]] = []

    def current(self) -> list[dict[str, Any]]:
        """The injections now in the file (re-read at most every 0.1 s, and only when it changed)."""
        now = time.monotonic()
        if now - self._checked > 0.1:
            self._checked = now
            try:
                st = self.path.stat()
                stamp = (st.st_mtime, st.st_size)
                if stamp != self._stamp:
                    self.faults, self._stamp = list(json.loads(self.path.read_text() or "[]")), stamp
            except (OSError, ValueError):  # absent, or being rewritten: no fault until it reads whole
                self.faults, self._stamp = [], None
        return self.faults

    def _delay(self, kind: str, node: str | None = None, pair: set[str] | None = None) -> float:
        total = 0.0
        for f in self.current():
            if f.get("kind") != kind:
                continue
            if (pair is not None and set(f.get("nodes", ())) == pair) or (
                pair is None and (f.get("node") == (node or self.node) or (node or self.node) in f.get("nodes", ()))
            ):
                total += float(f.get("delay_s", 0.0))
        return total

    def on_phase(self, phase: str) -> None:
        """The loop enters ``phase`` (a LoopClock hook): sleep what the injections ask for there."""
        # A link's delay where the processes wait for each other before a step (the batch-list agreement):
        # in the flush's "blocked" a host sleep would hide behind the device's own work.
        delay = {"data": "data", "dispatch": "compute", "agree": "link"}.get(phase)
        if delay is None:
            return
        if phase == "data":
            stuck = lambda: any(f.get("kind") == "stuck" and f.get("node") == self.node for f in self.current())  # noqa: E731
            if stuck():  # the moment the rank stops, for the benchmark's injection-to-detection time
                with open(self.path.with_name(FIRED), "a") as f:
                    f.write(json.dumps({"kind": "stuck", "node": self.node, "time": time.time()}) + "\n")
            while stuck():
                time.sleep(0.2)
        s = self._delay(delay)
        if s > 0:
            time.sleep(s)

    def probe_delay(self, what: str, node: str) -> float:
        """Seconds the device probe adds to ``what`` (``"compute"`` of ``node``, or ``"pair:A:B"``)."""
        if what == "compute":
            return self._delay("compute", node)
        if what.startswith("pair:"):
            return self._delay("link", pair=set(what.split(":")[1:]))
        return 0.0


def fault_hooks(run_dir: str | Path) -> FaultHooks | None:
    """The hooks when ``$JAXDIST_FAULT_HOOKS`` is ``1`` (test-only), else None."""
    if os.environ.get(ENV) != "1":
        return None
    return FaultHooks(run_dir, os.environ.get("JAXDIST_NODE", "local"))

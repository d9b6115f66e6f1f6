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
  stays in the file;
* ``{"kind": "hang", "step": S}``: the device program of step S never finishes: a host callback inside the
  jitted step (:func:`with_device_hang`, run on the process holding the first device, rank 0) blocks for
  ever, and the other ranks wait for it in the step's collectives.  Every host has dispatched the step and
  waits for its device, as in a real hang inside a collective.  Once per run (``faults.fired.jsonl``).

The node is ``$JAXDIST_NODE`` (set by the node agent).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

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


def hang_now(run_dir: str | Path, step: int) -> bool:
    """True once per run when ``<run_dir>/faults.json`` asks the device program of ``step`` to hang (then
    recorded in ``faults.fired.jsonl``, so that the recovered group trains on)."""
    run_dir = Path(run_dir)
    try:
        faults = json.loads((run_dir / FILE).read_text() or "[]")
    except (OSError, ValueError):
        return False
    if not any(f.get("kind") == "hang" and int(f.get("step", -1)) == step for f in faults):
        return False
    fired = run_dir / FIRED
    if fired.exists() and any(json.loads(x).get("kind") == "hang" for x in fired.read_text().splitlines() if x):
        return False
    with open(fired, "a") as f:
        f.write(
            json.dumps(
                {"kind": "hang", "step": step, "node": os.environ.get("JAXDIST_NODE", "local"), "time": time.time()}
            )
            + "\n"
        )
    return True


def with_device_hang(train_step: Any, run_dir: str | Path) -> Any:
    """``train_step`` with a host callback inside the jitted program that blocks for ever when
    :func:`hang_now` says so (test-only: the trainer wraps its step only under ``$JAXDIST_FAULT_HOOKS=1``).

    The callback runs on the first device's process; its result (0) is added to the new step count, so the
    step's outputs depend on it and every rank's device waits for it through the collectives."""

    def hook(step: Any) -> Any:
        if hang_now(run_dir, int(step) + 1):
            while True:
                time.sleep(1.0)
        return np.int32(0)

    def wrapped(state: Any, tokens: Any) -> Any:
        zero = io_callback(hook, jax.ShapeDtypeStruct((), jnp.int32), state["step"], ordered=False)
        new_state, metrics = train_step(state, tokens)
        return {**new_state, "step": new_state["step"] + zero}, metrics

    return wrapped


def hooks_on() -> bool:
    """Whether ``$JAXDIST_FAULT_HOOKS`` is ``1`` (test-only)."""
    return os.environ.get(ENV) == "1"


def fault_hooks(run_dir: str | Path) -> FaultHooks | None:
    """The hooks when ``$JAXDIST_FAULT_HOOKS`` is ``1`` (test-only), else None."""
    if not hooks_on():
        return None
    return FaultHooks(run_dir, os.environ.get("JAXDIST_NODE", "local"))

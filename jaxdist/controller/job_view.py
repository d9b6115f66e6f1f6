"""Watching a controlled job from outside, whatever launched it: its state, events, and injected faults.

:class:`JobView` reads ``<run>/controller/`` (``state.json``, ``events.jsonl``)
and injects faults into its workers (a signal to a rank's process, logged with
its time in ``injections.jsonl``).  :class:`~jaxdist.controller.local.LocalJob`
(processes on this machine) and :class:`~jaxdist.controller.slurm_job.SlurmJob`
(a Slurm job) add how the job is started and stopped, and say whether its
controller has exited (:meth:`JobView.exit_code`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxdist.config import load_config
from jaxdist.controller.controller import controller_dir
from jaxdist.controller.state import read_events


def split_config_args(config_args: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config`` path or None, the overrides) of a job's config arguments."""
    args, path, i = [], None, 0
    while i < len(config_args):
        if config_args[i] == "--config":
            path, i = config_args[i + 1], i + 2
        else:
            args.append(config_args[i])
            i += 1
    return path, args


class JobView:
    """The job of ``config_args`` (relative run paths under ``cwd``), observed through its controller's files."""

    def __init__(self, config_args: list[str], cwd: str | Path = "."):
        self.config_args, self.cwd = list(config_args), Path(cwd).absolute()
        path, overrides = split_config_args(self.config_args)
        here = os.getcwd()
        try:
            os.chdir(self.cwd)
            self.cfg = load_config(path, overrides)
            self.dir = controller_dir(self.cfg)
        finally:
            os.chdir(here)
        self.run_dir = self.dir.parent

    def exit_code(self) -> int | None:
        """The controller's exit code once it has exited (0: job done), else None."""
        return None

    def state(self) -> dict[str, Any]:
        """The controller's persisted state (``{}`` before the first save)."""
        try:
            return json.loads((self.dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.dir / "events.jsonl")

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        """The events of one kind (``start``, ``failure``, ``first_step``...), in order."""
        return [e for e in self.events() if e["event"] == kind]

    def injections(self) -> list[dict[str, Any]]:
        return read_events(self.dir / "injections.jsonl")

    def summary(self) -> str:
        s = self.state()
        tail = [e["event"] for e in self.events()[-8:]]
        return (
            f"phase {s.get('phase')}, generation {s.get('generation')}, step {s.get('last_step')}, last events {tail}"
        )

    def wait_until(
        self,
        pred: Callable[[dict[str, Any]], bool],
        timeout: float,
        what: str,
        need_state: bool = True,
        poll: float = 0.05,
    ) -> dict[str, Any]:
        """Poll the state until ``pred(state)``; raises TimeoutError naming ``what`` (RuntimeError if the
        controller exits first)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.state()
            if (s or not need_state) and pred(s):
                return s
            rc = self.exit_code() if need_state else None
            if rc is not None:
                s = self.state()
                if pred(s):
                    return s
                raise RuntimeError(f"the controller exited ({rc}) before {what}: {self.summary()}")
            time.sleep(poll)
        raise TimeoutError(f"waited {timeout} s for {what}: {self.summary()}")

    def record_injection(self, **fields: Any) -> dict[str, Any]:
        """Append a fault to ``injections.jsonl`` (its wall-clock ``time``, the generation and step now)."""
        s = self.state()
        rec = {"time": time.time(), "event": "injection", "gen": s.get("generation"), "step": s.get("last_step")}
        rec.update(fields)
        with open(self.dir / "injections.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

    def member_pid(self, rank: int) -> int:
        return int(self.state()["pids"][str(rank)])

    def inject(self, rank: int, sig: int = signal.SIGKILL) -> dict[str, Any]:
        """Send ``sig`` to the process of ``rank`` in the running generation; the injection is logged."""
        s = self.state()
        pid = int(s["pids"][str(rank)])
        rec = {
            "time": time.time(),
            "event": "injection",
            "gen": s["generation"],
            "rank": rank,
            "pid": pid,
            "node": s["members"][str(rank)],
            "signal": signal.Signals(sig).name,
            "step": s.get("last_step"),
        }
        os.kill(pid, sig)
        with open(self.dir / "injections.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return rec

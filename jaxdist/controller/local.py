"""A whole controlled job on this machine, for notebooks, tests and benchmarks.

    job = LocalJob(["model=tiny", "mesh.cluster=cpu-4x2", ...], nodes=5, cwd=tmp)
    job.start()                              # controller process + 5 node agents
    job.wait_until(lambda s: s["last_step"] >= 3, 120, "step 3")
    job.inject(rank=0)                       # SIGKILL rank 0's process (recorded with its time)
    job.wait(300)                            # the controller's exit code (0: the job completed)
    job.close()

The controller runs as its own process so it can be killed and restarted
(:meth:`kill_controller`, :meth:`start_controller`): the job keeps training
meanwhile.  Injections are appended to ``<run>/controller/injections.jsonl``
(wall-clock ``time``, generation, rank, pid, signal) for timelines and benchmarks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from jaxdist.config import load_config
from jaxdist.controller.controller import controller_dir
from jaxdist.controller.launch import LocalLauncher
from jaxdist.controller.protocol import TOKEN_ENV, new_token
from jaxdist.controller.state import read_events


def write_cpu_cluster(path: str | Path, nodes: int, devices_per_node: int) -> Path:
    """A cluster description of ``nodes`` hosts with ``devices_per_node`` simulated CPU devices (nominal figures)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'name = "{path.stem}"\ndevice_kind = "cpu"\nnodes = {nodes}\n'
        f"devices_per_node = {devices_per_node}\n"
        "memory_bytes = 2147483648\npeak_flops_bf16 = 5.0e10\npeak_flops_fp32 = 5.0e10\n"
        "intra_node_bandwidth = 1.0e10\ninter_node_bandwidth = 1.0e9\n"
        "intra_node_latency = 1.0e-5\ninter_node_latency = 1.0e-4\n"
    )
    return path


def _split(config_args: list[str]) -> tuple[str | None, list[str]]:
    args, path, i = [], None, 0
    while i < len(config_args):
        if config_args[i] == "--config":
            path, i = config_args[i + 1], i + 2
        else:
            args.append(config_args[i])
            i += 1
    return path, args


class LocalJob:
    """See the module docstring.  ``cwd``: where relative run paths live; ``env``: extra variables for every process."""

    def __init__(self, config_args: list[str], nodes: int, cwd: str | Path = ".", env: dict[str, str] | None = None):
        self.config_args, self.nodes, self.cwd = list(config_args), nodes, Path(cwd).absolute()
        path, overrides = _split(self.config_args)
        here = os.getcwd()
        try:
            os.chdir(self.cwd)
            self.cfg = load_config(path, overrides)
            self.dir = controller_dir(self.cfg)
        finally:
            os.chdir(here)
        self.run_dir = self.dir.parent
        self.token = new_token()
        self.env = {**(env or {}), TOKEN_ENV: self.token}
        self.controller: subprocess.Popen | None = None
        self.launcher: LocalLauncher | None = None
        self.starts = 0

    # ------------------------------------------------------------------ processes

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_")}
        env.update(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start_controller(self, timeout: float = 60.0) -> None:
        """Start (or restart) the controller process; returns once it listens."""
        before = len([e for e in self.events() if e["event"] == "controller_start"])
        self.dir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with open(self.dir / f"controller.{self.starts}.log", "w") as out:
            self.controller = subprocess.Popen(
                [sys.executable, "-m", "jaxdist.cli", "controller", *self.config_args],
                cwd=self.cwd,
                env=self._env(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.wait_until(
            lambda s: len([e for e in self.events() if e["event"] == "controller_start"]) > before,
            timeout,
            "the controller to listen",
            need_state=False,
        )

    def endpoint(self) -> str:
        return (self.dir / "endpoint").read_text().strip()

    def start_node(self, name: str, env: dict[str, str] | None = None) -> None:
        """Start one more node agent named ``name`` (``env``: extra variables for it and its workers)."""
        if self.launcher is None:
            self.launcher = LocalLauncher(
                self.endpoint(),
                self.token,
                self.run_dir,
                self.dir / "logs",
                self.cfg.controller.heartbeat_interval,
                self._env(),
            )
        self.launcher.start(name, env)

    def start(self, stagger_s: float = 0.0, late: int = 0, timeout: float = 600.0) -> None:
        """The controller, then ``nodes`` node agents ``local-0``..., ``stagger_s`` seconds apart.

        The last ``late`` nodes start only once generation 0 is assigned: they become standbys, and
        the first ones get the rank layout a setup cache entry may hold for them.
        """
        self.start_controller()
        for i in range(self.nodes):
            if i == self.nodes - late:
                self.wait_until(lambda s: s.get("generation", -1) >= 0, timeout, "generation 0")
            elif i and stagger_s:
                time.sleep(stagger_s)
            self.start_node(f"local-{i}")

    def kill_controller(self) -> None:
        """SIGKILL the controller process (the job must go on without it)."""
        if self.controller is not None and self.controller.poll() is None:
            self.controller.kill()
            self.controller.wait()

    def wait(self, timeout: float) -> int:
        """The controller's exit code once it exits (0: job done); raises TimeoutError."""
        assert self.controller is not None
        try:
            return self.controller.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the job did not finish within {timeout} s: {self.summary()}") from None

    def close(self) -> None:
        """Kill the controller and every node agent (their workers die with them)."""
        self.kill_controller()
        if self.launcher is not None:
            self.launcher.stop()

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ observing

    def state(self) -> dict[str, Any]:
        """The controller's persisted state (``{}`` before the first save)."""
        try:
            return json.loads((self.dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.dir / "events.jsonl")

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
        """Poll the state until ``pred(state)``; raises TimeoutError naming ``what``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.state()
            if (s or not need_state) and pred(s):
                return s
            if self.controller is not None and self.controller.poll() is not None and need_state:
                s = self.state()
                if pred(s):
                    return s
                raise RuntimeError(
                    f"the controller exited ({self.controller.returncode}) before {what}: {self.summary()}"
                )
            time.sleep(poll)
        raise TimeoutError(f"waited {timeout} s for {what}: {self.summary()}")

    def lose_node(self, name: str) -> list[int]:
        """SIGKILL node agent ``name`` and every process under it, as if the machine died; the pids killed."""
        agent = self.launcher.procs[name].pid
        pids = [agent, *_descendants(agent)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        s = self.state()
        rec = {"time": time.time(), "event": "injection", "gen": s.get("generation"), "node": name}
        rec.update(signal="node_lost", pids=pids, step=s.get("last_step"))
        with open(self.dir / "injections.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return pids

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


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out

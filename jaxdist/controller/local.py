"""A whole controlled job on this machine, for notebooks, tests and benchmarks.

    job = LocalJob(["model=tiny", "mesh.cluster=cpu-4x2", ...], nodes=5, cwd=tmp)
    job.start()                              # controller process + 5 node agents
    job.wait_until(lambda s: s["last_step"] >= 3, 120, "step 3")
    job.inject(rank=0)                       # SIGKILL rank 0's process (recorded with its time)
    job.wait(300)                            # the controller's exit code (0: the job completed)
    job.close()

The controller runs as its own process so it can be killed and restarted
(:meth:`kill_controller`, :meth:`start_controller`): the job keeps training
meanwhile.  Its state, events and injections are read as any job's
(:class:`~jaxdist.controller.job_view.JobView`); injections are appended to ``<run>/controller/injections.jsonl``
(wall-clock ``time``, generation, rank, pid, signal) for timelines and benchmarks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jaxdist.cluster import without_device_count
from jaxdist.controller.job_view import JobView
from jaxdist.controller.launch import LocalLauncher
from jaxdist.controller.protocol import TOKEN_ENV, new_token


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


class LocalJob(JobView):
    """See the module docstring.  ``cwd``: where relative run paths live; ``env``: extra variables for every process.

    Its state, events and injections: :class:`~jaxdist.controller.job_view.JobView`."""

    def __init__(self, config_args: list[str], nodes: int, cwd: str | Path = ".", env: dict[str, str] | None = None):
        super().__init__(config_args, cwd)
        self.nodes = nodes
        self.token = new_token()
        self.env = {**(env or {}), TOKEN_ENV: self.token}
        self.controller: subprocess.Popen | None = None
        self.launcher: LocalLauncher | None = None
        self.starts = 0

    # ------------------------------------------------------------------ processes

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JAX_")}
        if flags := without_device_count(os.environ.get("XLA_FLAGS", "")):
            env["XLA_FLAGS"] = flags  # the user's XLA flags reach the workers; the device count is the cluster's
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

    def exit_code(self) -> int | None:
        """The controller process's exit code once it exited, else None."""
        return None if self.controller is None else self.controller.poll()

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

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def lose_node(self, name: str) -> list[int]:
        """SIGKILL node agent ``name`` and every process under it, as if the machine died; the pids killed."""
        agent = self.launcher.procs[name].pid
        pids = [agent, *_descendants(agent)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.record_injection(node=name, signal="node_lost", pids=pids)
        return pids


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

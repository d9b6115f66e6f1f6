"""Start a group of local JAX processes (jax.distributed on 127.0.0.1, gloo) running worker.py.

Used by the multi-process checkpoint tests and by benchmarks/checkpoint.py.
Children are always killed (SIGKILL: JAX's preemption handler catches
SIGTERM) and reaped with bounded waits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from jaxdist.cluster import without_device_count
from jaxdist.controller.ports import free_port

WORKER = Path(__file__).with_name("worker.py")
REPO = Path(__file__).resolve().parents[2]
PORT_TAKEN = "Failed to add port to server"  # gRPC, when the coordinator cannot bind
_DROP = ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAXDIST_HEARTBEAT_TIMEOUT")


def cluster_file(directory: Path, nodes: int, per_node: int) -> Path:
    """A CPU cluster description of ``nodes`` processes x ``per_node`` simulated devices."""
    path = Path(directory) / f"cpu-{nodes}x{per_node}.toml"
    text = (REPO / "meshes" / "cpu-2x4.toml").read_text()
    text = text.replace('name = "cpu-2x4"', f'name = "cpu-{nodes}x{per_node}"')
    text = text.replace("nodes = 2 ", f"nodes = {nodes} ").replace(
        "devices_per_node = 4 ", f"devices_per_node = {per_node} "
    )
    path.write_text(text)
    return path


def env_for(process: int, num: int, devices: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP and not k.startswith("SLURM_")}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        XLA_FLAGS=f"{without_device_count(os.environ.get('XLA_FLAGS', ''))} --xla_force_host_platform_device_count={devices}",
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(num),
        JAX_PROCESS_ID=str(process),
        JAXDIST_HEARTBEAT_TIMEOUT="10",
        PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    return env


class Group:
    """``num`` worker processes with ``devices`` CPU devices each; use as a context manager."""

    def __init__(
        self, workdir: Path, num: int, devices: int, args: list[str], tag: str = "w", nodes: list[str] | None = None
    ):
        self.workdir, self.num, self.devices, self.args, self.tag = Path(workdir), num, devices, args, tag
        self.nodes = nodes  # $JAXDIST_NODE of each process (the node it pretends to run on)
        self.procs: list[subprocess.Popen] = []
        self.logs = [self.workdir / f"{tag}.{i}.log" for i in range(num)]

    def __enter__(self) -> Group:
        for attempt in (1, 2):
            self._start(free_port())
            if not self._port_taken(timeout=300) or attempt == 2:
                return self
            for i in range(self.num):  # the coordinator's port was taken between its choice and its use: once more
                self.kill(i)
                self.logs[i].rename(self.logs[i].with_suffix(".port-taken.log"))
            self.procs = []
        return self

    def _start(self, port: int) -> None:
        for i in range(self.num):
            env = env_for(i, self.num, self.devices, port)
            if self.nodes is not None:
                env["JAXDIST_NODE"] = self.nodes[i]
            with open(self.logs[i], "w") as f:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), *self.args],
                        cwd=self.workdir,
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                    )
                )

    def _port_taken(self, timeout: float) -> bool:
        """Wait (bounded) until every process is past ``jax.distributed.initialize`` or one has exited; True if
        process 0's coordination service could not bind its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all("INITIALIZED" in self.log(i) for i in range(self.num)):
                return False
            if any(p.poll() is not None for p in self.procs):
                return PORT_TAKEN in self.log(0)
            time.sleep(0.05)
        return False

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def tail(self, i: int, n: int = 30) -> str:
        lines = [l for l in self.log(i).splitlines() if "Involuntary full rematerialization" not in l]
        return f"--- {self.tag}.{i} ---\n" + "\n".join(lines[-n:])

    def wait(self, timeout: float, code: int = 0) -> None:
        """Wait for every process to exit with ``code`` (AssertionError with the logs otherwise)."""
        deadline = time.monotonic() + timeout
        for i, p in enumerate(self.procs):
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{self.tag}.{i} still running after {timeout} s\n" + self.tail(i)) from None
            assert rc == code, f"{self.tag}.{i} exited with {rc}\n" + "\n".join(self.tail(j) for j in range(self.num))

    def wait_for_line(self, i: int, text: str, timeout: float) -> None:
        """Poll process ``i``'s log until a line contains ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log(i):
                return
            if self.procs[i].poll() is not None:
                raise AssertionError(
                    f"{self.tag}.{i} exited ({self.procs[i].returncode}) before '{text}'\n" + self.tail(i)
                )
            time.sleep(0.05)
        raise AssertionError(f"{self.tag}.{i} did not print '{text}' within {timeout} s\n" + self.tail(i))

    def kill(self, i: int) -> None:
        if self.procs[i].poll() is None:
            os.kill(self.procs[i].pid, signal.SIGKILL)
        try:
            self.procs[i].wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def results(self, i: int) -> list[dict]:
        """The ``RESULT {json}`` lines process ``i`` printed."""
        return [json.loads(l[len("RESULT ") :]) for l in self.log(i).splitlines() if l.startswith("RESULT ")]

    def __exit__(self, *exc) -> None:
        for i in range(len(self.procs)):
            self.kill(i)

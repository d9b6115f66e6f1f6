"""Launchers: where node agents run.  The controller itself runs where ``jaxdist launch`` runs.

* :class:`LocalLauncher`: node agents as processes on this machine, each one a
  simulated host whose workers get their own simulated CPU devices (the tests).
* :class:`SSHLauncher`: one ``ssh HOST`` per line of a hosts file.  The
  controller stays on loopback: each session forwards the remote host's
  loopback port to it (``ssh -R``), and the job token travels on the
  session's stdin, never on a command line.
* Slurm (:mod:`jaxdist.controller.slurm`): a batch script that runs ``jaxdist
  launch`` in its allocation, which starts one ``srun`` step per node.
* Kubernetes: :func:`kubernetes_manifest` generates a Service and Pod for the
  controller and an indexed Job of node agents (the token is a Secret).

:class:`LocalLauncher`, :class:`SSHLauncher` and
:class:`jaxdist.controller.slurm.SlurmLauncher` are each a :class:`Launcher`: built with everything they need,
``start_all()`` starts the node agents and names them, ``procs`` holds the local process standing for each
(the agent itself, its ``ssh`` session, its ``srun`` step), ``stop()`` ends them; ``jaxdist launch`` serves the
controller with whichever the config names.  Kubernetes starts its agents itself from the manifest, which
``jaxdist launch --print`` writes.

Node agents then start the workers themselves (``python -m jaxdist.cli train``
plus the job's config arguments), so a restart never waits for SSH, Slurm or
the Kubernetes scheduler.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from jaxdist.config import ConfigError
from jaxdist.controller.protocol import TOKEN_ENV

NODE_MODULE = "jaxdist.controller.node"


def read_hosts(path: str | Path) -> list[str]:
    """Hosts of a hosts file: one per line, ``#`` comments and blank lines ignored."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            f"hosts file '{p}' does not exist: set controller.hosts_file to a file with one host per line."
        )
    hosts = [l.split("#", 1)[0].strip() for l in p.read_text().splitlines()]
    hosts = [h for h in hosts if h]
    if not hosts:
        raise ConfigError(f"hosts file '{p}' lists no host: write one host name per line.")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"hosts file '{p}' lists a host twice: each host runs one node agent.")
    return hosts


def node_command(
    controller: str, node: str, host: str, work_dir: str | Path, python: str = "python3", interval: float = 0.25
) -> list[str]:
    """The argv of one node agent."""
    return [
        python,
        "-m",
        NODE_MODULE,
        "--controller",
        controller,
        "--node",
        node,
        "--host",
        host,
        "--work-dir",
        str(work_dir),
        "--interval",
        str(interval),
    ]


def kill_and_reap(procs: Iterable[subprocess.Popen], timeout: float) -> None:
    """SIGKILL each of ``procs`` still running, then wait for them all, at most ``timeout`` seconds in total."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.kill()
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


class Launcher(Protocol):
    """Where a job's node agents run: built with everything it needs, it starts them and stops them."""

    procs: dict[str, subprocess.Popen]  # node name -> the local process standing for its agent

    def start_all(self) -> list[str]:
        """Start every node agent; their node names."""
        ...

    def stop(self) -> None:
        """End every node agent still running (their workers end with them)."""
        ...


class LocalLauncher:
    """Node agents ``local-0`` ... ``local-{count-1}`` on this machine (loopback only); :meth:`start` adds one."""

    def __init__(
        self,
        controller: str,
        token: str,
        run_dir: Path,
        log_dir: Path,
        interval: float = 0.25,
        env: dict[str, str] | None = None,
        count: int = 0,
    ):
        self.controller, self.token, self.run_dir, self.log_dir = controller, token, run_dir, log_dir
        self.interval, self.env, self.count = interval, env or {}, count
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, node: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start node agent ``node`` (a name; its host is 127.0.0.1); ``env``: extra variables."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, **(env or {}), TOKEN_ENV: self.token, "PYTHONUNBUFFERED": "1"}
        env.pop("XLA_FLAGS", None)  # each worker sets its own simulated device count
        for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
            env.pop(k, None)
        with open(self.log_dir / f"node.{node}.log", "a") as out:
            p = subprocess.Popen(
                node_command(self.controller, node, "127.0.0.1", self.run_dir, sys.executable, self.interval),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs[node] = p
        return p

    def start_all(self) -> list[str]:
        names = [f"local-{i}" for i in range(self.count)]
        for name in names:
            self.start(name)
        return names

    def stop(self, timeout: float = 5.0) -> None:
        """SIGKILL every node agent still running (their workers die with them)."""
        kill_and_reap(self.procs.values(), timeout)


class SSHLauncher:
    """One node agent per host over SSH, tunnelled back to the controller's loopback port."""

    def __init__(
        self,
        hosts: list[str],
        port: int,
        token: str,
        cwd: str | Path,
        run_dir: str | Path,
        python: str = "python3",
        ssh: str = "ssh",
        interval: float = 0.25,
        log_dir: Path | None = None,
    ):
        self.hosts, self.port, self.token, self.cwd, self.run_dir = hosts, port, token, cwd, run_dir
        self.python, self.ssh, self.interval, self.log_dir = python, ssh, interval, log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def command(self, host: str) -> list[str]:
        """The ssh argv for ``host``: reverse tunnel to the controller, token read from stdin, exec the agent."""
        agent = shlex.join(node_command(f"127.0.0.1:{self.port}", host, host, self.run_dir, self.python, self.interval))
        remote = f"cd {shlex.quote(str(self.cwd))} && IFS= read -r {TOKEN_ENV} && export {TOKEN_ENV} && exec {agent}"
        return [
            self.ssh,
            "-o",
            "BatchMode=yes",
            "-o",
            "ExitOnForwardFailure=yes",
            "-R",
            f"{self.port}:127.0.0.1:{self.port}",
            host,
            remote,
        ]

    def start_all(self) -> list[str]:
        log_dir = self.log_dir or Path.cwd()
        log_dir.mkdir(parents=True, exist_ok=True)
        for host in self.hosts:
            with open(log_dir / f"ssh.{host}.log", "a") as out:
                p = subprocess.Popen(self.command(host), stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT)
            p.stdin.write((self.token + "\n").encode())
            p.stdin.flush()
            self.procs[host] = p
        return list(self.hosts)

    def stop(self, timeout: float = 5.0) -> None:
        """End every ssh session still running (SIGKILL; the remote agent loses its tunnel) and reap them."""
        kill_and_reap(self.procs.values(), timeout)


def kubernetes_manifest(
    config_args: list[str],
    nodes: int,
    image: str,
    name: str = "jaxdist",
    port: int = 7470,
    gpus_per_node: int = 0,
    run_volume: str = "jaxdist-runs",
) -> str:
    """Kubernetes objects as a YAML stream (JSON documents are valid YAML): the controller's Service and Pod
    and an indexed Job of ``nodes`` node-agent pods (one per host; ``gpus_per_node`` GPUs each).

    ``run_volume`` is a PersistentVolumeClaim mounted at /runs in every pod (checkpoints and the setup
    cache must be shared).  The job token is a Secret created beforehand, so it never sits in a file:
    ``kubectl create secret generic NAME-token --from-literal=token=$(openssl rand -hex 32)``.
    """
    env_token = {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": f"{name}-token", "key": "token"}}}
    volumes = [{"name": "runs", "persistentVolumeClaim": {"claimName": run_volume}}]
    mounts = [{"name": "runs", "mountPath": "/runs"}]
    ctl_args = [
        "python",
        "-m",
        "jaxdist.cli",
        "controller",
        *config_args,
        "train.runs_dir=/runs",
        "controller.bind=0.0.0.0",
        "controller.allow_remote=true",
        f"controller.port={port}",
    ]
    agent = (
        "exec python -m jaxdist.controller.node --controller "
        + f"{name}-controller:{port}"
        + ' --node "${HOSTNAME}" --host "${POD_IP}" --work-dir /runs'
    )
    resources = {"limits": {"nvidia.com/gpu": gpus_per_node}} if gpus_per_node else {}
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    docs = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": f"{name}-controller"},
            "spec": {"selector": {"app": f"{name}-controller"}, "ports": [{"port": port, "targetPort": port}]},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-controller", "labels": {"app": f"{name}-controller"}},
            "spec": {
                "restartPolicy": "OnFailure",
                "volumes": volumes,
                "containers": [
                    {
                        "name": "controller",
                        "image": image,
                        "args": ctl_args,
                        "env": [env_token],
                        "ports": [{"containerPort": port}],
                        "volumeMounts": mounts,
                    }
                ],
            },
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{name}-nodes"},
            "spec": {
                "completionMode": "Indexed",
                "completions": nodes,
                "parallelism": nodes,
                "backoffLimit": nodes,
                "template": {
                    "metadata": {"labels": {"app": f"{name}-node"}},
                    "spec": {
                        "restartPolicy": "Never",
                        "subdomain": f"{name}-nodes",
                        "volumes": volumes,
                        "containers": [
                            {
                                "name": "node",
                                "image": image,
                                "command": ["sh", "-c", agent],
                                "env": [env_token, pod_ip],
                                "resources": resources,
                                "volumeMounts": mounts,
                            }
                        ],
                    },
                },
            },
        },
    ]
    return "\n---\n".join(json.dumps(d, indent=2) for d in docs) + "\n"

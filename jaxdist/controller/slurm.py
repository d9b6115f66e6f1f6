"""The Slurm launcher: a batch script that runs ``jaxdist launch`` inside its allocation, and, inside an
allocation, one node agent per node as its own job step.

    jaxdist launch --print ... controller.launcher=slurm | sbatch   # the script of sbatch_script()
    salloc -N 5 jaxdist launch ... controller.launcher=slurm \\
        controller.bind=0.0.0.0 controller.allow_remote=true        # the same thing in an allocation at hand

Inside the allocation the controller runs where ``jaxdist launch`` runs (the
batch host, or salloc's shell) and :class:`SlurmLauncher` starts ``srun
--nodes=1 --nodelist=NODE --overlap`` per node of ``$SLURM_JOB_NODELIST``: one
step per node, so a node that dies ends only its own step.  The node agents
then start the workers themselves, so no restart waits for Slurm; the
standbys are the allocation's nodes beyond the training group.

What Slurm itself does to the job:

* ``--no-kill``: a failed node does not end the job (Slurm drops the node from
  the allocation); the controller has replaced it by then.
* ``scancel``: Slurm sends SIGTERM to every step (the controller saves its
  state and exits; node agents stop and take their workers along), SIGKILL
  ``KillWait`` later.  The newest committed checkpoint stays: the run resumes
  from it.
* ``--requeue`` (``scontrol requeue``): the script runs again in a new
  allocation (``$SLURM_RESTART_COUNT`` counts them); the controller sees a new
  allocation id and forms the group afresh from the nodes it now has, the
  generation count and the run's checkpoints carried on.  The script asks
  for ``--nodes=MIN-MAX``: ``controller.min_nodes`` up to ``max_nodes`` plus
  the standbys; Slurm gives as many nodes as are free at that start, the
  controller trains on up to ``max_nodes`` of them and keeps the rest as
  standbys.  So standbys never stop a job from starting, and a job started
  small grows at its next start.

The workers get no ``SLURM_*`` variables (see :mod:`jaxdist.controller.node`):
the controller gives them their rank, process count and coordinator, the
rank-0 node's ``NodeAddr`` (node names need not resolve), and JAX's own Slurm
detection would pin each process to one GPU.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from jaxdist.config import ConfigError
from jaxdist.controller.launch import node_command
from jaxdist.controller.protocol import TOKEN_ENV
from jaxdist.slurm.parse import expand_hostlist, parse_jobs, parse_nodes

SLURM_OUTPUT = "slurm-%j.out"  # under <run>/controller/, appended to on every requeue


@dataclass(frozen=True)
class SlurmRequest:
    """What the batch script asks for: ``nodes`` (a count or ``MIN-MAX``), ``gpus_per_node`` (0: none),
    ``nodelist`` (empty: Slurm chooses); ``args``: overrides the job runs with on top of its own (the
    allocation's cluster file, a plan); ``why``: the lines that explain the choice (printed by launch)."""

    nodes: str
    gpus_per_node: int = 0
    nodelist: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    why: str = ""


def node_range(min_nodes: int, max_nodes: int, standbys: int) -> str:
    """The ``--nodes`` of a job training on ``min_nodes``..``max_nodes`` nodes with up to ``standbys`` more:
    ``MIN-MAX`` (MIN: the training nodes it needs, MAX: every node it can use, standbys included) when the job
    may start on fewer than MAX, else one count.  The standbys are never part of MIN: a partition with
    exactly ``min_nodes`` nodes starts the job (Slurm gives as many nodes of the range as are free)."""
    lo, hi = min(min_nodes, max_nodes), max_nodes + standbys
    return f"{lo}-{hi}" if lo < hi else str(hi)


def partition_nodes(sinfo_text: str, partition: str = "") -> int | None:
    """Nodes of ``partition`` (''/default: the one ``sinfo`` marks with ``*``) from ``sinfo -h -N -o '%N %P'``
    text; None when that partition is not listed."""
    nodes: dict[str, set[str]] = {}
    default = ""
    for line in sinfo_text.splitlines():
        f = line.split()
        if len(f) < 2:
            continue
        name = f[1].rstrip("*")
        default = default or (name if f[1].endswith("*") else "")
        nodes.setdefault(name, set()).add(f[0])
    want = partition or default
    return len(nodes[want]) if want in nodes else None


def check_partition(nodes: str, sinfo_text: str, partition: str = "") -> None:
    """ConfigError (one sentence) when the partition has fewer nodes than the request's minimum ``nodes``."""
    need = int(nodes.split("-")[0])
    have = partition_nodes(sinfo_text, partition)
    if have is not None and have < need:
        where = f"partition '{partition}'" if partition else "the default Slurm partition"
        raise ConfigError(
            f"{where} has {have} node{'s' if have != 1 else ''}, the job needs at least {need} "
            "(controller.min_nodes, or the mesh's "
            f"nodes): lower controller.min_nodes or submit to a larger partition (SBATCH_PARTITION)."
        )


def allocation_id(env: dict[str, str] | None = None) -> str:
    """``JOBID.RESTARTS`` of the allocation this process runs in ('' outside one): a requeue changes it."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "")
    return f"{job}.{env.get('SLURM_RESTART_COUNT', '0') or '0'}" if job else ""


def sbatch_script(
    launch_args: list[str],
    request: SlurmRequest,
    run_dir: str | Path,
    cwd: str | Path,
    job_name: str = "jaxdist",
    time_limit: str = "24:00:00",
    python: str = "python3",
) -> str:
    """The batch script: ``jaxdist launch LAUNCH_ARGS controller.launcher=slurm`` in the allocation.

    The controller listens beyond loopback (``controller.bind=0.0.0.0``, ``allow_remote``), every message
    signed with the job token the script creates (mode 0600 umask, in the environment only)."""
    log = Path(run_dir) / "controller" / SLURM_OUTPUT
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={request.nodes}",  # no --ntasks-per-node: it would pin a requeued range to its last size
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={log}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={cwd}",
        "#SBATCH --no-kill",
        "#SBATCH --requeue",
    ]
    if request.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={request.gpus_per_node}")
    if request.nodelist:
        lines.append(f"#SBATCH --nodelist={','.join(request.nodelist)}")
    launch = shlex.join(
        [
            python,
            "-m",
            "jaxdist.cli",
            "launch",
            *launch_args,
            *request.args,
            "controller.launcher=slurm",
            "controller.bind=0.0.0.0",
            "controller.allow_remote=true",
        ]
    )
    why = "".join(f"# {line}\n" for line in request.why.splitlines())
    return (
        "\n".join(lines)
        + f"\n{why}set -euo pipefail\numask 077\n"
        + f"export {TOKEN_ENV}=\"$({python} -c 'import secrets; print(secrets.token_hex(32))')\"\n"
        + f"exec {launch}\n"
    )


def _scontrol(*args: str) -> str:
    out = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    if out.returncode:
        raise ConfigError(f"`scontrol {' '.join(args)}` failed: {out.stderr.strip()}")
    return out.stdout


def allocation_nodes(env: dict[str, str] | None = None) -> list[str]:
    """The nodes of the allocation this process runs in (``$SLURM_JOB_NODELIST``), in Slurm's order."""
    env = os.environ if env is None else env
    nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST", ""))
    if not nodes:
        raise ConfigError("not inside a Slurm allocation ($SLURM_JOB_NODELIST is empty): run under salloc or sbatch.")
    return nodes


def node_addresses(nodes: list[str]) -> dict[str, str]:
    """Node -> the address peers reach it at (``scontrol show node``'s NodeAddr; the name when unknown)."""
    known = {n.name: n.addr for n in parse_nodes(_scontrol("show", "node", "-d", ",".join(nodes)))}
    return {n: known.get(n) or n for n in nodes}


def allocation_gpus(job_id: str) -> dict[str, int]:
    """Node -> GPUs the allocation ``job_id`` holds there (``scontrol show job -d``)."""
    jobs = [j for j in parse_jobs(_scontrol("show", "job", "-d", job_id)) if j.job_id == job_id]
    return {n: len(g) for n, g in jobs[0].gpus.items()} if jobs else {}


class SlurmLauncher:
    """One node agent per node of the allocation, each in its own ``srun`` step (see the module docstring)."""

    def __init__(
        self,
        controller: str,
        token: str,
        run_dir: Path,
        log_dir: Path,
        python: str,
        interval: float = 0.25,
        nodes: list[str] | None = None,
        addresses: dict[str, str] | None = None,
    ):
        self.controller, self.token, self.run_dir, self.log_dir = controller, token, run_dir, log_dir
        self.python, self.interval = python, interval
        self.nodes, self.addresses = list(nodes or []), dict(addresses or {})  # Slurm's node names, their addresses
        self.procs: dict[str, subprocess.Popen] = {}

    def command(self, node: str, host: str) -> list[str]:
        """The srun argv that runs node ``node``'s agent (``host``: its address)."""
        agent = node_command(self.controller, node, host, self.run_dir, self.python, self.interval)
        return [
            "srun",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node}",
            "--overlap",  # beside the batch step, with the job's GPUs of that node
            "--kill-on-bad-exit=0",
            "--cpu-bind=none",
            f"--job-name=jaxdist-node-{node}",
            f"--output={self.log_dir / f'srun.{node}.log'}",
            *agent,
        ]

    def start_all(self) -> list[str]:
        """Start every node's agent; the names (Slurm's node names)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, TOKEN_ENV: self.token}
        for node in self.nodes:
            self.procs[node] = subprocess.Popen(
                self.command(node, self.addresses.get(node, node)), env=env, stdin=subprocess.DEVNULL
            )
        return list(self.nodes)

    def stop(self, grace: float = 5.0, timeout: float = 10.0) -> None:
        """End every step: ``grace`` seconds for the agents to stop by themselves (the controller told them to),
        then SIGTERM to srun (forwarded to the agent, which stops its workers), then SIGKILL."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

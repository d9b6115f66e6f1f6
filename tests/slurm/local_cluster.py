"""A real Slurm cluster on this machine: ``munged``, ``slurmctld`` and one ``slurmd`` per node, fake GPUs.

    cluster = LocalSlurmCluster(tmp_dir, nodes=4, gpus_per_node=8)
    cluster.start()                  # about 1 s to all nodes idle
    os.environ.update(cluster.env)   # SLURM_CONF: sbatch, srun, sinfo, scontrol talk to it
    ...
    cluster.kill_node("n3")          # the machine n3 dies: its slurmd and every process of its job steps
    cluster.restart_node("n3")       # its slurmd again; the node returns to service
    cluster.stop()                   # every job cancelled, every daemon and step stopped by PID

What makes it work (Debian 12's Slurm 22.05): the nodes share the host
(``NodeHostname=localhost NodeAddr=127.0.0.1``, one ``Port`` each, ``slurmd -N
NAME``); ``SlurmdParameters=config_overrides`` lets each declare more CPUs than
the host has; the GPUs are ``gres.conf`` ``File=`` entries that are symlinks to
``/dev/null`` (``AutoDetect=off``), so Slurm counts and assigns them
(``CUDA_VISIBLE_DEVICES``) without any device; ``munged -F`` runs with its key,
socket and logs in a private directory of mode 0755; the scheduler starts a
batch job at once (``batch_sched_delay=0,sched_min_interval=0``), looks at the queue every second
(``sched_interval=1,bf_interval=1``: a job whose begin time passes starts then) and a requeued
job may start again 5 s later (``cred_expire=5``; 120 s by default).  Every
state file lives in a fresh directory per cluster.  Jobs run as root.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from jaxdist.controller.ports import free_ports

BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
PACKAGES = "slurmctld slurmd slurm-client munge"  # Debian's packages of BINARIES


class SlurmUnavailable(RuntimeError):
    """This machine cannot run a local Slurm cluster (the message says why)."""


def missing_binaries() -> list[str]:
    """The binaries of :data:`BINARIES` not on PATH (nor in /usr/sbin)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command name) of every process (from /proc)."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, rest = stat.read_text().rsplit(")", 1)
        except (OSError, ValueError):
            continue
        out[int(stat.parent.name)] = (int(rest.split()[1]), head.split("(", 1)[1])
    return out


def _with_descendants(roots: set[int], procs: dict[int, tuple[int, str]]) -> set[int]:
    out, todo = set(roots), list(roots)
    while todo:
        p = todo.pop()
        for child, (parent, _) in procs.items():
            if parent == p and child not in out:
                out.add(child)
                todo.append(child)
    return out


class LocalSlurmCluster:
    """See the module docstring.  ``root``: an empty directory for its configuration, state and logs.

    ``nodes`` nodes ``n1``... of ``cpus_per_node`` CPUs and ``gpus_per_node`` fake GPUs (of type
    ``gpu_type`` when given: ``gpu:TYPE:8``), in one partition ``partition``.
    """

    def __init__(
        self,
        root: str | Path,
        nodes: int = 4,
        gpus_per_node: int = 8,
        cpus_per_node: int = 16,
        partition: str = "gpu",
        gpu_type: str = "",
        slurmd_timeout: int = 5,
    ):
        self.root = Path(root).absolute()
        self.node_names = [f"n{i + 1}" for i in range(nodes)]
        self.gpus_per_node, self.cpus_per_node = gpus_per_node, cpus_per_node
        self.partition, self.gpu_type, self.slurmd_timeout = partition, gpu_type, slurmd_timeout
        self.conf = self.root / "slurm.conf"
        self.munge_dir = self.root / "munge"
        self.procs: dict[str, subprocess.Popen] = {}  # "munged", "slurmctld", node name -> the daemon
        self.start_seconds: float | None = None

    @property
    def env(self) -> dict[str, str]:
        """The variables a client needs: ``SLURM_CONF``."""
        return {"SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ configuration

    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "gpu"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self.munge_dir.mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.munge_dir, 0o755)  # munged refuses a socket directory others may write to
        key = self.munge_dir / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(1024))
        for i in range(self.gpus_per_node):
            link = r / "gpu" / f"nvidia{i}"
            if not link.is_symlink():
                link.symlink_to("/dev/null")
        ctld_port, *node_ports = free_ports(1 + len(self.node_names))
        gres = f"gpu:{self.gpu_type + ':' if self.gpu_type else ''}{self.gpus_per_node}"
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus_per_node} "
            f"RealMemory=16000 Gres={gres} State=UNKNOWN"
            for n, p in zip(self.node_names, node_ports)
        )
        self.conf.write_text(
            f"""ClusterName=jaxdist
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_dir / "munge.socket"},cred_expire=5
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}/%n
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "spool"}/slurmd.%n.pid
SlurmctldLogFile={r / "log"}/slurmctld.log
SlurmdLogFile={r / "log"}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
InactiveLimit=0
KillWait=2
MinJobAge=600
{nodes}
PartitionName={self.partition} Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
"""
        )
        type_field = f" Type={self.gpu_type}" if self.gpu_type else ""
        files = f"nvidia[0-{self.gpus_per_node - 1}]" if self.gpus_per_node > 1 else "nvidia0"
        (r / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={','.join(self.node_names)} Name=gpu{type_field} File={r / 'gpu'}/{files}\n"
        )

    # ------------------------------------------------------------------ daemons

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, **self.env}
        with open(self.root / "log" / f"{name}.out", "a") as out:
            p = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = p
        return p

    def start(self, timeout: float = 60.0) -> float:
        """Start munged, slurmctld and every slurmd; return the seconds until every node was idle.

        Raises :class:`SlurmUnavailable` when the binaries are missing or this process is not root, and
        RuntimeError (after stopping what it started) when the nodes do not all become idle in ``timeout``.
        """
        missing = missing_binaries()
        if missing:
            raise SlurmUnavailable(
                f"{', '.join(missing)} not found: install Debian's {PACKAGES} packages (apt-get install -y {PACKAGES})"
            )
        if os.geteuid() != 0:
            raise SlurmUnavailable("a local Slurm cluster runs its daemons and jobs as root, and this is not root")
        t0 = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # munged needs every directory above its socket searchable by all
        self._write_config()
        m = self.munge_dir
        self._spawn(
            "munged",
            [
                "munged",
                "-F",
                f"--key-file={m / 'munge.key'}",
                f"--socket={m / 'munge.socket'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--log-file={m / 'munged.log'}",
                f"--seed-file={m / 'munged.seed'}",
            ],
        )
        try:
            self._wait(lambda: (m / "munge.socket").exists(), timeout, "munged's socket")
            self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for n in self.node_names:
                self.start_node(n)
            self.wait_idle(timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self.start_seconds

    def start_node(self, name: str) -> None:
        """Start the slurmd of node ``name``."""
        self._spawn(name, ["slurmd", "-D", "-N", name, "-f", str(self.conf)])

    def _wait(self, pred, timeout: float, what: str, poll: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return
            dead = [k for k, p in self.procs.items() if p.poll() is not None and k in ("munged", "slurmctld")]
            if dead:
                raise RuntimeError(f"{dead[0]} exited while waiting for {what}: see {self.root / 'log'}")
            time.sleep(poll)
        raise RuntimeError(f"waited {timeout} s for {what}: see the logs in {self.root / 'log'}")

    def node_states(self) -> dict[str, str]:
        """Node name -> Slurm state (``idle``, ``mixed``, ``down*``...) from ``sinfo``; {} if it does not answer."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until every node is idle."""
        self._wait(
            lambda: all(self.node_states().get(n) == "idle" for n in self.node_names), timeout, "every node idle"
        )

    def wait_up(self, nodes: list[str], timeout: float = 60.0) -> None:
        """Wait until ``nodes`` are in service: idle, mixed or allocated (not down, not responding or drained)."""
        up = ("idle", "mixed", "allocated")
        self._wait(lambda: all(self.node_states().get(n) in up for n in nodes), timeout, f"{', '.join(nodes)} up")

    def run(self, argv: list[str], check: bool = True, input: str | None = None, timeout: float = 30.0) -> str:
        """Run a Slurm client command against this cluster; its stdout."""
        out = subprocess.run(
            argv, env={**os.environ, **self.env}, capture_output=True, text=True, input=input, timeout=timeout
        )
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    # ------------------------------------------------------------------ failures

    def step_processes(self, node: str | None = None) -> set[int]:
        """PIDs of this cluster's job steps (``slurmstepd`` and everything under it), on ``node`` only if given."""
        procs = _processes()
        conf = str(self.conf)
        stepds = {p for p, (_, name) in procs.items() if name == "slurmstepd" and _environ(p).get("SLURM_CONF") == conf}
        if node is not None:
            mine = set()
            for p in _with_descendants(stepds, procs) - stepds:
                if _environ(p).get("SLURMD_NODENAME") == node:
                    while p in procs and p not in stepds:
                        p = procs[p][0]
                    if p in stepds:
                        mine.add(p)
            stepds = mine
        return _with_descendants(stepds, procs)

    def kill_node(self, name: str) -> list[int]:
        """The machine ``name`` dies: SIGKILL its slurmd and every process of every job step on it.

        Returns the PIDs killed.  Slurm marks the node DOWN once it misses its pings (``slurmd_timeout``).
        """
        pids = sorted(self.step_processes(name))
        d = self.procs.get(name)
        if d is not None and d.poll() is None:
            pids.insert(0, d.pid)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if d is not None:
            d.wait(timeout=10)
        return pids

    def restart_node(self, name: str, timeout: float = 60.0) -> None:
        """Start node ``name``'s slurmd again and wait until Slurm has it back in service."""
        d = self.procs.get(name)
        if d is None or d.poll() is not None:
            self.start_node(name)
        self.wait_up([name], timeout)

    # ------------------------------------------------------------------ end

    def stop(self, timeout: float = 20.0) -> None:
        """Cancel every job, then stop every job step and daemon this cluster started (by PID; SIGKILL if needed)."""
        if self.procs.get("slurmctld") is not None and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", f"--partition={self.partition}"], check=False)
            deadline = time.monotonic() + min(timeout, 10.0)
            while time.monotonic() < deadline and self.run(["squeue", "-h", "-t", "R,CG"], check=False).strip():
                time.sleep(0.1)
        for pid in self.step_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        order = [n for n in self.node_names if n in self.procs] + ["slurmctld", "munged"]
        for name in order:
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for name in order:
            p = self.procs.get(name)
            if p is None:
                continue
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)

    def __enter__(self) -> LocalSlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

"""A jaxdist job on a Slurm cluster, driven as a user would, for tests and benchmarks.

    job = SlurmJob([...config args...], cwd=tmp)
    job.submit()                        # jaxdist launch --print ... controller.launcher=slurm | sbatch
    job.wait_until(lambda s: s.get("last_step", 0) >= 5, 120, "step 5")
    job.inject(rank=1)                  # SIGKILL a worker (JobView)
    job.cancel(); job.requeue()         # scancel; scontrol requeue
    job.wait(300)                       # 0 once Slurm says COMPLETED

or, the in-allocation form: ``job.run_in_allocation(nodes=4)`` runs ``salloc -N 4 jaxdist launch ...
controller.launcher=slurm ...`` (the controller on this host, the node agents in the allocation).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from jaxdist.cluster import without_device_count
from jaxdist.controller.job_view import JobView
from jaxdist.slurm.parse import JobRecord, parse_jobs

DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


class SlurmJob(JobView):
    """The job of ``config_args`` (relative run paths under ``cwd``); ``env``: extra variables for the commands
    (and, through Slurm's environment propagation, for the job)."""

    def __init__(self, config_args: list[str], cwd: str | Path = ".", env: dict[str, str] | None = None):
        super().__init__(config_args, cwd)
        self.env = dict(env or {})
        self.job_id: str | None = None
        self.salloc: subprocess.Popen | None = None
        self.submitted_at: float | None = None

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith(("JAX_", "SLURM_JOB"))}
        if flags := without_device_count(os.environ.get("XLA_FLAGS", "")):
            env["XLA_FLAGS"] = flags  # the user's XLA flags reach the workers; the device count is the cluster's
        env.update(self.env)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _run(self, argv: list[str], input: str | None = None, timeout: float = 120.0) -> str:
        out = subprocess.run(
            argv, cwd=self.cwd, env=self._env(), input=input, capture_output=True, text=True, timeout=timeout
        )
        if out.returncode:
            raise RuntimeError(f"`{' '.join(argv[:4])} ...` failed ({out.returncode}): {out.stderr.strip()[-2000:]}")
        return out.stdout

    def launch_command(self, *extra: str) -> list[str]:
        """``python -m jaxdist.cli launch`` with the job's arguments, ``controller.launcher=slurm`` and ``extra``."""
        return [sys.executable, "-m", "jaxdist.cli", "launch", *self.config_args, "controller.launcher=slurm", *extra]

    def script(self) -> str:
        """The batch script ``jaxdist launch --print`` writes for this job."""
        return self._run([*self.launch_command()[:4], "--print", *self.launch_command()[4:]])

    def submit(self, script: str | None = None) -> str:
        """``jaxdist launch --print ... | sbatch``; the job id."""
        script = self.script() if script is None else script
        self.submitted_at = time.time()
        self.job_id = self._run(["sbatch", "--parsable"], input=script).strip().split(";")[0]
        return self.job_id

    def run_in_allocation(self, nodes: int, *salloc_args: str) -> None:
        """``salloc -N NODES ... jaxdist launch ...`` in the background: the in-allocation form."""
        name = f"{self.cfg.train.name}-alloc"
        argv = ["salloc", f"--nodes={nodes}", "--ntasks-per-node=1", "--no-kill", f"--job-name={name}", *salloc_args]
        argv += self.launch_command("controller.bind=0.0.0.0", "controller.allow_remote=true")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.submitted_at = time.time()
        with open(self.dir / "salloc.log", "a") as log:
            self.salloc = subprocess.Popen(argv, cwd=self.cwd, env=self._env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while self.job_id is None and time.monotonic() < deadline and self.salloc.poll() is None:
            ids = self._run(["squeue", "-h", "-n", name, "-o", "%i"]).split()
            self.job_id = ids[0] if ids else None
            time.sleep(0.1)

    def record(self) -> JobRecord | None:
        """The job as ``scontrol show job -d`` describes it (None before submission or once Slurm forgot it)."""
        if self.job_id is None:
            return None
        out = subprocess.run(
            ["scontrol", "show", "job", "-d", self.job_id], env=self._env(), capture_output=True, text=True
        )
        jobs = parse_jobs(out.stdout)
        return jobs[0] if jobs else None

    def exit_code(self) -> int | None:
        """The controller's exit code once the job ended: 0 when Slurm says COMPLETED, 1 otherwise."""
        if self.salloc is not None:
            return self.salloc.poll()
        r = self.record()
        if r is None or r.state not in DONE_STATES:
            return None
        return 0 if r.state == "COMPLETED" else 1

    def wait(self, timeout: float) -> int:
        """The exit code once the job ended; raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.exit_code()
            if rc is not None:
                return rc
            time.sleep(0.1)
        raise TimeoutError(f"the job did not finish within {timeout} s: {self.summary()}")

    def wait_state(self, states: tuple[str, ...], timeout: float) -> str:
        """Wait until Slurm reports one of ``states`` for the job; that state."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.record()
            if r is not None and r.state in states:
                return r.state
            time.sleep(0.1)
        raise TimeoutError(f"job {self.job_id} not {'/'.join(states)} within {timeout} s: {self.summary()}")

    def cancel(self) -> None:
        """``scancel`` the job (every step gets SIGTERM, SIGKILL KillWait later)."""
        self._run(["scancel", self.job_id])

    def requeue(self) -> None:
        """``scontrol requeue`` the job: its script runs again in a new allocation."""
        self._run(["scontrol", "requeue", self.job_id])

    def close(self) -> None:
        """Cancel the job if it still runs (and stop salloc)."""
        if self.job_id is not None and self.exit_code() is None:
            subprocess.run(["scancel", self.job_id], env=self._env(), capture_output=True)
        if self.salloc is not None and self.salloc.poll() is None:
            self.salloc.terminate()
            try:
                self.salloc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.salloc.kill()

    def __enter__(self) -> SlurmJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

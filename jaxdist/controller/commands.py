"""``jaxdist launch`` and ``jaxdist controller``: the command-line side of the controller."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from jaxdist.config import Config, ConfigError, load_config
from jaxdist.controller.controller import Controller, cluster_shape
from jaxdist.controller.launch import (
    LocalLauncher,
    SSHLauncher,
    kubernetes_manifest,
    read_hosts,
    sbatch_script,
    srun_command,
)


def config_args(path: str | None, overrides: list[str]) -> list[str]:
    """The arguments every worker gets: the config file (absolute) and the overrides."""
    return (["--config", str(Path(path).absolute())] if path else []) + list(overrides)


def controller(path: str | None, overrides: list[str]) -> int:
    """Run the controller of the job until it is done (0) or given up (1)."""
    cfg = load_config(path, overrides)
    ctl = Controller(cfg, config_args(path, overrides), echo=True)
    print(
        f"controller of {cfg.run_dir} listening on {ctl.endpoint.address} "
        f"(token in {ctl.dir / 'token'} unless $JAXDIST_JOB_TOKEN is set)",
        file=sys.stderr,
    )
    return ctl.run()


def _node_count(cfg: Config) -> int:
    nodes, _, _ = cluster_shape(cfg)
    return (cfg.controller.max_nodes or nodes) + cfg.controller.standbys


def launch(path: str | None, overrides: list[str], print_only: bool = False, image: str = "jaxdist:latest") -> int:
    """Start a job with the configured launcher (see :mod:`jaxdist.controller.launch`)."""
    cfg = load_config(path, overrides)
    cc = cfg.controller
    args = config_args(path, overrides)
    _, per_node, kind = cluster_shape(cfg)
    gpus = 0 if kind.lower().startswith("cpu") else per_node
    run_dir = cfg.run_dir.absolute()
    if cc.launcher == "kubernetes":
        print(kubernetes_manifest(args, _node_count(cfg), image, port=cc.port or 7470, gpus_per_node=gpus), end="")
        return 0
    if cc.launcher == "slurm" and (print_only or "SLURM_JOB_ID" not in os.environ):
        script = sbatch_script(
            args, _node_count(cfg), cc.port or 7470, run_dir, gpus_per_node=gpus, python=sys.executable
        )
        if print_only:
            print(script, end="")
            return 0
        if shutil.which("sbatch") is None:
            raise ConfigError(
                "not inside a Slurm allocation and `sbatch` is not on PATH: run `jaxdist launch "
                "--print ...` and submit the script on the cluster, or run inside salloc."
            )
        return subprocess.run(["sbatch"], input=script, text=True).returncode
    if print_only:
        raise ConfigError(f"--print is for the slurm and kubernetes launchers, not '{cc.launcher}'.")
    if cc.launcher == "slurm" and not cc.allow_remote:
        raise ConfigError(
            "inside a Slurm allocation the nodes must reach the controller over the network: "
            "set controller.bind=0.0.0.0 controller.allow_remote=true."
        )
    hosts = read_hosts(cc.hosts_file) if cc.launcher == "ssh" else []
    ctl = Controller(cfg, args, echo=True)
    log_dir = ctl.dir / "logs"
    if cc.launcher == "local":
        launcher = LocalLauncher(ctl.endpoint.address, ctl.token, run_dir, log_dir, cc.heartbeat_interval)
        launcher.start_all(_node_count(cfg))
        procs, stop = list(launcher.procs.values()), launcher.stop
    elif cc.launcher == "ssh":
        ssh = SSHLauncher(
            hosts,
            ctl.endpoint.port,
            ctl.token,
            os.getcwd(),
            run_dir,
            python=sys.executable,
            interval=cc.heartbeat_interval,
        )
        ssh.start_all(log_dir)
        procs, stop = list(ssh.procs.values()), ssh.stop
    else:  # slurm, inside an allocation
        env = {
            **os.environ,
            "CONTROLLER_HOST": os.environ.get("SLURMD_NODENAME", ctl.endpoint.host),
            "JAXDIST_JOB_TOKEN": ctl.token,
        }
        srun = subprocess.Popen(
            ["bash", "-c", srun_command(ctl.endpoint.port, run_dir, sys.executable, cc.heartbeat_interval)], env=env
        )
        procs, stop = [srun], srun.kill

    def watch() -> str | None:
        if all(p.poll() is not None for p in procs):
            return f"every node agent exited: see their logs in {log_dir}"
        return None

    try:
        return ctl.run(watch)
    finally:
        stop()

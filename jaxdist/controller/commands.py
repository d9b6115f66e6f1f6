"""``jaxdist launch`` and ``jaxdist controller``: the command-line side of the controller."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from jaxdist.cluster import ClusterSpec, write_cluster
from jaxdist.config import Config, ConfigError, load_config
from jaxdist.controller import policy
from jaxdist.controller.controller import Controller, cluster_shape, controller_dir
from jaxdist.controller.launch import Launcher, LocalLauncher, SSHLauncher, kubernetes_manifest, read_hosts
from jaxdist.controller.slurm import (
    SlurmLauncher,
    SlurmRequest,
    allocation_gpus,
    allocation_id,
    allocation_nodes,
    check_partition,
    node_addresses,
    node_range,
    sbatch_script,
)
from jaxdist.slurm.shape import ShapeChoice, choose_shape
from jaxdist.slurm.view import PartitionView, cluster_spec, figures, is_slurm_source, parse_source, read_partition

# For mesh=auto on a slurm: cluster, the CLI hands launch the planner (which imports JAX, so the controller
# does not): (config, partition, per-device figures) -> the shapes tried and the chosen plan's overrides.
ShapePlanner = Callable[[Config, PartitionView, ClusterSpec], tuple[ShapeChoice, list[str]]]


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


def launch(
    path: str | None,
    overrides: list[str],
    print_only: bool = False,
    image: str = "jaxdist:latest",
    shape_planner: ShapePlanner | None = None,
) -> int:
    """Start a job with the configured launcher (see :mod:`jaxdist.controller.launch` and ``.slurm``)."""
    cfg = load_config(path, overrides)
    cc = cfg.controller
    args = config_args(path, overrides)
    if cc.launcher == "slurm":
        if print_only or "SLURM_JOB_ID" not in os.environ:
            return _submit(cfg, args, print_only, shape_planner)
        return _run_in_allocation(cfg, args)
    _, per_node, kind = cluster_shape(cfg)
    gpus = 0 if kind.lower().startswith("cpu") else per_node
    run_dir = cfg.run_dir.absolute()
    if cc.launcher == "kubernetes":
        print(kubernetes_manifest(args, _node_count(cfg), image, port=cc.port or 7470, gpus_per_node=gpus), end="")
        return 0
    if print_only:
        raise ConfigError(f"--print is for the slurm and kubernetes launchers, not '{cc.launcher}'.")
    hosts = read_hosts(cc.hosts_file) if cc.launcher == "ssh" else []
    ctl = Controller(cfg, args, echo=True)
    log_dir = ctl.dir / "logs"
    launcher: Launcher
    if cc.launcher == "local":
        launcher = LocalLauncher(
            ctl.endpoint.address, ctl.token, run_dir, log_dir, cc.heartbeat_interval, count=_node_count(cfg)
        )
    else:
        launcher = SSHLauncher(
            hosts,
            ctl.endpoint.port,
            ctl.token,
            os.getcwd(),
            run_dir,
            python=sys.executable,
            interval=cc.heartbeat_interval,
            log_dir=log_dir,
        )
    return _serve(ctl, launcher, log_dir)


def _serve(ctl: Controller, launcher: Launcher, log_dir: Path) -> int:
    """Start the node agents and run the controller until the job ends (or every agent exited); stop them."""
    launcher.start_all()
    procs = list(launcher.procs.values())

    def watch() -> str | None:
        if all(p.poll() is not None for p in procs):
            return f"every node agent exited: see their logs in {log_dir}"
        return None

    try:
        return ctl.run(watch)
    finally:
        launcher.stop()


# --------------------------------------------------------------------------- Slurm


def slurm_request(cfg: Config, shape_planner: ShapePlanner | None = None) -> SlurmRequest:
    """What the batch script of ``cfg`` asks Slurm for.

    A cluster file: ``controller.min_nodes``..``max_nodes`` nodes plus the standbys, with the file's GPUs
    per node (none for CPU devices).  ``mesh.cluster=slurm:PARTITION[@CLUSTER]``: the shape of the
    partition's free GPUs that :func:`jaxdist.slurm.shape.choose_shape` prefers -- by the planner's predicted
    step time with ``mesh=auto`` (``shape_planner``), else by the most GPUs the mesh and batch allow -- on the
    nodes it chose; the job then runs with the cluster file of that shape (``<run>/controller/cluster.toml``)
    and, with mesh=auto, the plan.
    """
    cc = cfg.controller
    if not is_slurm_source(cfg.mesh.cluster):
        nodes, per_node, kind = cluster_shape(cfg)
        return SlurmRequest(
            node_range(cc.min_nodes, cc.max_nodes or nodes, cc.standbys),
            0 if kind.lower().startswith("cpu") else per_node,
        )
    view = read_partition(parse_source(cfg.mesh.cluster)[0])
    spec = figures(cfg.mesh.cluster, view)
    if cfg.mesh.auto:
        if shape_planner is None:
            raise ConfigError("mesh=auto on a slurm: cluster needs the planner: run it through `jaxdist launch`.")
        choice, plan_args = shape_planner(cfg, view, spec)
    else:

        def cost(n: int, k: int) -> float | None:  # the most devices the mesh and batch allow
            return None if policy.group_size_error(cfg, n, k) else 1.0 / (n * k)

        choice = choose_shape(
            view.free(), {n.name: n.gpus for n in view.nodes}, cost, cc.standbys, cc.max_nodes, cc.min_nodes
        )
        plan_args = []
    best = choice.best
    path = write_cluster(
        controller_dir(cfg) / "cluster.toml", cluster_spec(view, spec, best.training, best.gpus_per_node)
    )
    why = f"{view.table()}\nshapes tried (cost: {'predicted s/step' if cfg.mesh.auto else '1/GPUs'}):\n"
    return SlurmRequest(
        str(len(best.nodes)),
        best.gpus_per_node,
        best.nodes,
        (f"mesh.cluster={path}", *plan_args),
        why + choice.table() + f"\nasked for: {best.describe()}",
    )


def _submit(cfg: Config, args: list[str], print_only: bool, shape_planner: ShapePlanner | None) -> int:
    request = slurm_request(cfg, shape_planner)
    controller_dir(cfg).mkdir(parents=True, exist_ok=True)  # Slurm opens the job's output file there first
    script = sbatch_script(
        args, request, cfg.run_dir.absolute(), os.getcwd(), job_name=cfg.train.name, python=sys.executable
    )
    if print_only:
        print(script, end="")
        return 0
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "not inside a Slurm allocation and `sbatch` is not on PATH: run `jaxdist launch "
            "--print ...` and submit the script on the cluster, or run inside salloc."
        )
    if shutil.which("sinfo") is not None:  # a request the partition can never meet would pend for ever
        partition = os.environ.get("SBATCH_PARTITION", "")
        sinfo = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P"], capture_output=True, text=True, timeout=60)
        if sinfo.returncode == 0:
            check_partition(request.nodes, sinfo.stdout, partition)
    print(request.why, file=sys.stderr)
    return subprocess.run(["sbatch"], input=script, text=True).returncode


def _allocation_cluster(cfg: Config, nodes: list[str]) -> list[str]:
    """For a slurm: cluster inside an allocation: the cluster file of the allocation's GPUs (overrides)."""
    if not is_slurm_source(cfg.mesh.cluster):
        return []
    view_name = parse_source(cfg.mesh.cluster)[0]
    held = allocation_gpus(os.environ["SLURM_JOB_ID"])
    per_node = min((held.get(n, 0) for n in nodes), default=0)
    if not per_node:
        raise ConfigError("this allocation holds no GPU on some of its nodes: ask for --gpus-per-node.")
    view = read_partition(view_name)
    cc = cfg.controller  # the nodes Slurm gave: up to max_nodes train, at least min_nodes, the rest are standbys
    training = min(len(nodes), max(cc.min_nodes, len(nodes) - cc.standbys, 1), cc.max_nodes or len(nodes))
    spec = cluster_spec(view, figures(cfg.mesh.cluster, view), training, per_node)
    return [f"mesh.cluster={write_cluster(controller_dir(cfg) / 'cluster.toml', spec)}"]


def _run_in_allocation(cfg: Config, args: list[str]) -> int:
    cc = cfg.controller
    if not cc.allow_remote:
        raise ConfigError(
            "inside a Slurm allocation the nodes must reach the controller over the network: "
            "set controller.bind=0.0.0.0 controller.allow_remote=true."
        )
    nodes = allocation_nodes()
    extra = _allocation_cluster(cfg, nodes)
    if extra:
        args = [*args, *extra]
        cfg = cfg.replace(**{"mesh.cluster": extra[0].split("=", 1)[1]})
    ctl = Controller(cfg, args, echo=True, allocation=allocation_id())
    here = os.environ.get("SLURMD_NODENAME")  # the batch step's node; salloc's shell runs off the allocation
    if cc.bind not in ("0.0.0.0", "::", ""):
        host = cc.bind
    elif here:
        host = node_addresses([here])[here]
    else:
        host = socket.getfqdn()
    addresses = node_addresses(nodes)
    launcher = SlurmLauncher(
        f"{host}:{ctl.endpoint.port}",
        ctl.token,
        cfg.run_dir.absolute(),
        ctl.dir / "logs",
        sys.executable,
        cc.heartbeat_interval,
        nodes=nodes,
        addresses=addresses,
    )
    return _serve(ctl, launcher, ctl.dir / "logs")

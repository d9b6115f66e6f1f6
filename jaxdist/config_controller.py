"""The controller's section of a config (``[controller]``): membership, health checks and recovery.

Kept apart from :mod:`jaxdist.config_sections` (the other sections) for size; ``jaxdist.config``
re-exports it. No JAX.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from jaxdist.config_checks import check_controller
from jaxdist.config_sections import CrashedRank, Launcher, Recovery, _f

# --------------------------------------------------------------------------- controller

CONTROLLER_LAUNCHERS: tuple[str, ...] = typing.get_args(Launcher)
CONTROLLER_RECOVERY: tuple[str, ...] = typing.get_args(Recovery)


@dataclass(frozen=True)
class ControllerConfig:
    """`jaxdist launch` / `jaxdist controller`: membership, health checks and recovery (jaxdist/controller/)."""

    bind: str = _f(
        "127.0.0.1", "Address the controller listens on; anything but loopback needs controller.allow_remote=true."
    )
    port: int = _f(0, "TCP port of the controller (0: a free one, written to <run>/controller/endpoint).")
    allow_remote: bool = _f(
        False,
        "Allow listening beyond loopback (multi-host without SSH tunnels); every message stays HMAC-authenticated with the job token.",
    )
    launcher: Launcher = _f(
        "local",
        "Where `jaxdist launch` starts node agents: local, ssh, slurm or kubernetes. slurm: outside an allocation it submits (or with --print writes) a batch script that runs `jaxdist launch` in its allocation; inside one (sbatch, salloc) one srun step per node runs a node agent, the allocation's extra nodes are the standbys; a requeued job resumes from its checkpoint.",
    )
    hosts_file: str = _f("", "SSH launcher: a file with one host per line.")
    min_nodes: int = _f(
        1,
        "The fewest nodes training may start and go on with: the start waits start_grace for every node of the group (max_nodes) and then starts on the ready ones if at least this many; a recovery keeps the size the job started with while the nodes for it exist (standbys included), and only when they do not continues on a smaller group the mesh and batch allow, down to this (the batches per step stay, the per-node split changes). On Slurm the batch script asks for --nodes=min_nodes-(max_nodes + standbys): the standbys never keep a job from starting, and a job started small takes the nodes free at its next start.",
    )
    start_grace: float = _f(
        60.0,
        "Seconds the start waits, counted from when min_nodes are ready (at the default min_nodes=1: the first ready node), for the rest of the group (max_nodes) before it starts on what it has; it starts the moment all max_nodes are ready. 60 s covers a node agent's start, its import of JAX and its device check on a loaded host, and is short next to a training run; 0: start on the first min_nodes ready.",
    )
    max_nodes: int = _f(
        0,
        "Train on at most this many nodes (0: the cluster description's node count); the others wait as standbys. A restart never grows the group past the size the job started with; a group that had to shrink takes ready standbys back up to that size.",
    )
    standbys: int = _f(
        1,
        "Nodes `jaxdist launch` starts beyond max_nodes, as warm standbys (on Slurm: the most the allocation may hold beyond max_nodes; Slurm may give fewer, never keeping the job from starting).",
    )
    heartbeat_interval: float = _f(0.25, "Seconds between two heartbeats of a worker or node agent.")
    heartbeat_timeout: float = _f(
        1.5, "A training worker or a node agent silent this long (seconds) is declared failed."
    )
    heartbeat_grace: float = _f(
        15.0,
        "How long (seconds) a worker's heartbeats may pause while it is starting, or while its connection still answers ZeroMQ's own heartbeats (sent outside the Python GIL): compiling can hold the GIL for seconds on a busy host. A stopped or hung process is caught by heartbeat_timeout all the same.",
    )
    health_every: int = _f(
        10,
        "Steps per efficiency record each worker sends (closed at the metric flushes of train.log_every; 0: none): steps, samples, and the seconds its loop spent waiting for data, dispatching, blocked on the device, saving, evaluating. The controller writes them to <run>/controller/health.jsonl.",
    )
    health_z: float = _f(
        5.0,
        "A rank's part of the loop (or the job's step time) is abnormal beyond this many scaled median absolute deviations above the others' (or its recent) median -- and beyond health_min_share / health_min_change; two abnormal periods in a row raise an alarm (an event, a link probe).",
    )
    health_min_share: float = _f(
        0.08, "A rank stands out only by more than this fraction of the job's step time per step (seconds/seconds)."
    )
    health_min_change: float = _f(
        0.25,
        "The job is slower than its recent history only by more than this fraction of its recent median step time.",
    )
    evict_slow: bool = _f(
        False,
        "Evict the node a health alarm names (a rank's compute or data, persisting health_persist rounds) or a device probe names (a slow node, or the node whose network is slow) and restart the group with a standby in its place (the node is not used again); false: only report.",
    )
    progress_timeout: float = _f(
        120.0, "A training group whose step does not advance for this long (seconds) is declared failed."
    )
    start_timeout: float = _f(
        900.0, "Seconds a group may take from its assignment to its first step (join, restore, compile)."
    )
    max_failures: int = _f(
        2,
        "A node that was lost (its agent silent) or whose process failed while it was, this many times, is not used again.",
    )
    max_process_failures: int = _f(
        4,
        "Process crashes or hangs on a healthy node (its agent alive) before a verdict (counted apart from max_failures): a node that reaches it with failures of one rank keeps its place and the rank moves once to another node; a node that reaches it with failures of two or more ranks is not used again; a rank that fails this many times in all, on two or more nodes, stops the job with one sentence (it fails wherever it runs: the program, not a node).",
    )
    ban_cooldown: float = _f(
        1800.0,
        "Seconds a banned or evicted node stays out; then it may join again as a standby, its failure counts cleared (a group keeps its size, so it takes a rank at the next recovery that needs one). Each later ban of the same node doubles it; 0: a ban is for good.",
    )
    crashed_rank: CrashedRank = _f(
        "same_node",
        "Where a rank restarts after its process crashed or hung on a healthy node: same_node (a warm process of that node, which holds the rank's local-tier files; moved once after max_process_failures there) or standby (like a lost node).",
    )
    recovery: Recovery = _f(
        "standby",
        "After a failure: standby (restart the group from warm processes, a standby in the failed rank) or requeue (every process restarted cold, like a requeued job).",
    )
    warm_spares: int = _f(
        1,
        "Warm worker processes (JAX imported, data loaded, waiting for a rank) each node agent keeps ready; 0: one for the start only, none kept warm while training (less CPU and memory on the hosts; a restart starts its processes cold, as after a Slurm requeue).",
    )
    setup_cache: str = _f(
        "",
        "Directory of the cluster setup cache (rank layout, coordinator, compilation cache, NCCL files); empty: <runs_dir>/.setup_cache.",
    )
    worker_command: str = _f(
        "",
        "Command a node agent runs for one worker, the job's config arguments appended; empty: python -m jaxdist.cli train.",
    )

    def check(self) -> None:
        """ConfigError (one sentence) for controller settings that cannot work by themselves."""
        check_controller(self)

"""The controller's section of a config (``[controller]``): membership, health checks and recovery.

Checks itself (:func:`check_controller`); ``jaxdist.config`` re-exports it.  No JAX.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from jaxdist.config.fields import CrashedRank, Launcher, Recovery, choices, is_loopback, one_of, option
from jaxdist.errors import ConfigError

# --------------------------------------------------------------------------- controller

CONTROLLER_LAUNCHERS: tuple[str, ...] = typing.get_args(Launcher)
CONTROLLER_RECOVERY: tuple[str, ...] = typing.get_args(Recovery)


@dataclass(frozen=True)
class ControllerConfig:
    """`jaxdist launch` / `jaxdist controller`: membership, health checks and recovery (jaxdist/controller/)."""

    bind: str = option(
        "127.0.0.1", "Address the controller listens on; anything but loopback needs controller.allow_remote=true."
    )
    port: int = option(0, "TCP port of the controller (0: a free one, written to <run>/controller/endpoint).")
    allow_remote: bool = option(
        False,
        "Allow listening beyond loopback (multi-host without SSH tunnels); every message stays HMAC-authenticated with the job token.",
    )
    launcher: Launcher = option(
        "local",
        "Where `jaxdist launch` starts node agents: local, ssh, slurm or kubernetes. slurm: outside an allocation it submits (or with --print writes) a batch script that runs `jaxdist launch` in its allocation; inside one (sbatch, salloc) one srun step per node runs a node agent, the allocation's extra nodes are the standbys; a requeued job resumes from its checkpoint.",
    )
    hosts_file: str = option("", "SSH launcher: a file with one host per line.")
    min_nodes: int = option(
        1,
        "The fewest nodes training may start and go on with: the start waits start_grace for every node of the group (max_nodes) and then starts on the ready ones if at least this many; a recovery keeps the size the job started with while the nodes for it exist (standbys included), and only when they do not continues on a smaller group the mesh and batch allow, down to this (the batches per step stay, the per-node split changes). On Slurm the batch script asks for --nodes=min_nodes-(max_nodes + standbys): the standbys never keep a job from starting, and a job started small takes the nodes free at its next start.",
    )
    start_grace: float = option(
        60.0,
        "Seconds the start waits, counted from when min_nodes are ready (at the default min_nodes=1: the first ready node), for the rest of the group (max_nodes) before it starts on what it has; it starts the moment all max_nodes are ready. 60 s covers a node agent's start, its import of JAX and its device check on a loaded host, and is short next to a training run; 0: start on the first min_nodes ready.",
    )
    max_nodes: int = option(
        0,
        "Train on at most this many nodes (0: the cluster description's node count); the others wait as standbys. A restart never grows the group past the size the job started with; a group that had to shrink takes ready standbys back up to that size.",
    )
    standbys: int = option(
        1,
        "Nodes `jaxdist launch` starts beyond max_nodes, as warm standbys (on Slurm: the most the allocation may hold beyond max_nodes; Slurm may give fewer, never keeping the job from starting).",
    )
    heartbeat_interval: float = option(0.25, "Seconds between two heartbeats of a worker or node agent.")
    heartbeat_timeout: float = option(
        1.5, "A training worker or a node agent silent this long (seconds) is declared failed."
    )
    heartbeat_grace: float = option(
        15.0,
        "How long (seconds) a worker's heartbeats may pause while it is starting, or while its connection still answers ZeroMQ's own heartbeats (sent outside the Python GIL): compiling can hold the GIL for seconds on a busy host. A stopped or hung process is caught by heartbeat_timeout all the same.",
    )
    health_every: int = option(
        10,
        "Steps per efficiency record each worker sends (closed at the metric flushes of train.log_every; 0: none): steps, samples, and the seconds its loop spent waiting for data, dispatching, blocked on the device, saving, evaluating. The controller writes them to <run>/controller/health.jsonl.",
    )
    health_z: float = option(
        5.0,
        "A rank's part of the loop (or the job's step time) is abnormal beyond this many scaled median absolute deviations above the others' (or its recent) median -- and beyond health_min_share / health_min_change; two abnormal periods in a row raise an alarm (an event, a link probe).",
    )
    health_min_share: float = option(
        0.08, "A rank stands out only by more than this fraction of the job's step time per step (seconds/seconds)."
    )
    health_min_ratio: float = option(
        1.5,
        "A rank stands out only when its part of the loop takes more than this many times the other ranks' median (a busy host's scheduling moves one rank's share by tens of percent).",
    )
    health_min_change: float = option(
        0.25,
        "The job is slower than its recent history only by more than this fraction of its recent median step time.",
    )
    evict_slow: bool = option(
        False,
        "Evict the node a health alarm names (a rank's compute or data, persisting health_persist rounds) or a device probe names (a slow node, or the node whose network is slow) and restart the group with a standby in its place (the node is not used again); false: only report.",
    )
    progress_timeout: float = option(
        120.0, "A training group whose step does not advance for this long (seconds) is declared failed."
    )
    start_timeout: float = option(
        900.0, "Seconds a group may take from its assignment to its first step (join, restore, compile)."
    )
    max_failures: int = option(
        2,
        "A node that was lost (its agent silent) or whose process failed while it was, this many times, is not used again.",
    )
    max_process_failures: int = option(
        4,
        "Process crashes or hangs on a healthy node (its agent alive) before a verdict (counted apart from max_failures): a node that reaches it with failures of one rank keeps its place and the rank moves once to another node; a node that reaches it with failures of two or more ranks is not used again; a rank that fails this many times in all, on two or more nodes, stops the job with one sentence (it fails wherever it runs: the program, not a node).",
    )
    ban_cooldown: float = option(
        1800.0,
        "Seconds a banned or evicted node stays out; then it may join again as a standby, its failure counts cleared (a group keeps its size, so it takes a rank at the next recovery that needs one). Each later ban of the same node doubles it; 0: a ban is for good.",
    )
    crashed_rank: CrashedRank = option(
        "same_node",
        "Where a rank restarts after its process crashed or hung on a healthy node: same_node (a warm process of that node, which holds the rank's local-tier files; moved once after max_process_failures there) or standby (like a lost node).",
    )
    recovery: Recovery = option(
        "standby",
        "After a failure: standby (restart the group from warm processes, a standby in the failed rank) or requeue (every process restarted cold, like a requeued job).",
    )
    warm_spares: int = option(
        1,
        "Warm worker processes (JAX imported, data loaded, waiting for a rank) each node agent keeps ready; 0: one for the start only, none kept warm while training (less CPU and memory on the hosts; a restart starts its processes cold, as after a Slurm requeue).",
    )
    setup_cache: str = option(
        "",
        "Directory of the cluster setup cache (rank layout, coordinator, compilation cache, NCCL files); empty: <runs_dir>/.setup_cache.",
    )
    worker_command: str = option(
        "",
        "Command a node agent runs for one worker, the job's config arguments appended; empty: python -m jaxdist.cli train.",
    )

    def check(self) -> None:
        """ConfigError (one sentence) for controller settings that cannot work by themselves."""
        check_controller(self)


def check_controller(c: ControllerConfig) -> None:
    """Controller settings that cannot work (ConfigError, one sentence)."""
    if not is_loopback(c.bind) and not c.allow_remote:
        raise ConfigError(
            f"controller.bind='{c.bind}' is not a loopback address: set controller.allow_remote=true "
            "to listen beyond this machine, or keep 127.0.0.1 (SSH jobs tunnel to it)."
        )
    if not 0 <= c.port <= 65535:
        raise ConfigError(f"controller.port={c.port} is not a TCP port: use 1..65535, or 0 for a free one.")
    if c.launcher not in choices(c, "launcher"):
        raise ConfigError(f"controller.launcher='{c.launcher}' is unknown: use {', '.join(choices(c, 'launcher'))}.")
    if c.recovery not in choices(c, "recovery"):
        raise ConfigError(f"controller.recovery='{c.recovery}' is unknown: use {one_of(choices(c, 'recovery'))}.")
    if c.min_nodes < 1 or c.max_nodes < 0 or (c.max_nodes and c.max_nodes < c.min_nodes):
        raise ConfigError(
            f"controller.min_nodes={c.min_nodes} and max_nodes={c.max_nodes} are inconsistent: "
            "use min_nodes >= 1 and max_nodes >= min_nodes (or 0)."
        )
    if c.crashed_rank not in choices(c, "crashed_rank"):
        raise ConfigError(
            f"controller.crashed_rank='{c.crashed_rank}' is unknown: use {one_of(choices(c, 'crashed_rank'))}."
        )
    if not c.ban_cooldown >= 0:
        raise ConfigError(
            f"controller.ban_cooldown={c.ban_cooldown} must be >= 0 (seconds a banned node stays out; 0: for good)."
        )
    if c.standbys < 0 or c.warm_spares < 0 or c.max_failures < 1 or c.max_process_failures < 1:
        raise ConfigError(
            "controller.standbys and controller.warm_spares must be >= 0, controller.max_failures and "
            "controller.max_process_failures >= 1."
        )
    if (
        c.health_every < 0
        or not c.health_z > 0
        or not c.health_min_share >= 0
        or not c.health_min_change >= 0
        or not c.health_min_ratio >= 1
    ):
        raise ConfigError(
            f"controller.health_every={c.health_every}, health_z={c.health_z}, health_min_share="
            f"{c.health_min_share}, health_min_change={c.health_min_change} and health_min_ratio="
            f"{c.health_min_ratio} are out of range: use health_every >= 0 steps (0: no efficiency records), "
            "health_z > 0, the fractions >= 0 and health_min_ratio >= 1."
        )
    if not c.heartbeat_interval > 0 or not c.heartbeat_timeout >= 2 * c.heartbeat_interval:
        raise ConfigError(
            f"controller.heartbeat_timeout={c.heartbeat_timeout} must be at least twice "
            f"controller.heartbeat_interval={c.heartbeat_interval} (and the interval positive), "
            "or one late heartbeat fails a healthy worker."
        )
    if not c.start_grace >= 0:
        raise ConfigError(f"controller.start_grace={c.start_grace} must be >= 0 seconds.")
    if not (c.progress_timeout > 0 and c.start_timeout > 0 and c.heartbeat_grace >= c.heartbeat_timeout):
        raise ConfigError(
            "controller.progress_timeout and controller.start_timeout must be positive and "
            "controller.heartbeat_grace at least controller.heartbeat_timeout (seconds)."
        )

"""The ``[mesh]`` section and ``train.remat``'s parsed form (:class:`Remat`); each checks itself.  No JAX."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxdist.config.fields import option
from jaxdist.errors import ConfigError

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert", "pipeline")


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape and the cluster it runs on."""

    cluster: str = option(
        "cpu-8",
        "Cluster description: a name in meshes/ (cpu-8, h100x8, ...) or a path to a TOML file; for `jaxdist plan` and `jaxdist launch` (controller.launcher=slurm) also slurm:PARTITION[@CLUSTER]: the partition's free GPUs (nodes, GPUs per node, what other jobs hold: sinfo, scontrol) with the per-device figures of the cluster file CLUSTER (default: the preset named by the GPUs' GRES type); launch asks Slurm for the best shape of them and runs the job on its cluster file (<run>/controller/cluster.toml).",
    )
    data: int = option(-1, "Data-parallel replicas; -1 takes every device the other axes leave.")
    fsdp: int = option(1, "Fully sharded data parallel: parameters and optimizer state sharded, gathered per layer.")
    context: int = option(
        1,
        "Context-parallel size: each sequence is split over this many devices (kept inside a node), attention passes keys/values around them in a ring; train.seq_len must divide into 2*context chunks.",
    )
    tensor: int = option(1, "Tensor (Megatron) parallel size; kept inside a node.")
    expert: int = option(1, "Expert-parallel size (MoE models).")
    pipeline: int = option(1, "Pipeline stages.")
    expert_tensor: int = option(
        0,
        "Tensor-parallel size inside one expert (MoE); 0 uses mesh.tensor. A smaller divisor of mesh.tensor keeps attention at mesh.tensor and gives the rest of the tensor axis to the experts: they are then split expert*tensor/expert_tensor ways.",
    )
    auto: bool = option(
        False,
        'Let jaxdist.planner choose the axis sizes, train.microbatches and train.remat at start-up for the devices present (the axis sizes above are then ignored); `mesh=auto` on the CLI or `mesh = "auto"` in TOML sets it.',
    )

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    def checked_sizes(self) -> dict[str, int]:
        """Axis sizes, each a positive integer (or -1 for data); raises ConfigError otherwise."""
        sizes = self.sizes()
        for a, s in sizes.items():
            if s == 0 or s < -1 or (s == -1 and a != "data"):
                raise ConfigError(
                    f"mesh.{a}={s} is not a valid axis size: use a positive integer"
                    + (" (or -1 to fill the remaining devices)" if a == "data" else "")
                    + "."
                )
        return sizes

    def resolved(self, n_devices: int) -> dict[str, int]:
        """Axis sizes with ``data=-1`` filled in; raises ConfigError if they do not multiply to n_devices."""
        sizes = self.checked_sizes()
        others = math.prod(s for a, s in sizes.items() if a != "data")
        if sizes["data"] == -1:
            if n_devices % others:
                raise ConfigError(
                    f"mesh fsdp*tensor*expert*pipeline = {others} does not divide the {n_devices} devices: "
                    f"choose axis sizes whose product divides {n_devices}."
                )
            sizes["data"] = n_devices // others
        total = math.prod(sizes.values())
        if total != n_devices:
            shape = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "1"
            raise ConfigError(
                f"mesh {shape} has {total} devices but {n_devices} are available: "
                f"make the axis sizes multiply to {n_devices} (or set mesh.data=-1)."
            )
        return sizes

    def devices_used(self, n_devices: int) -> int:
        """How many of ``n_devices`` the mesh runs on: all of them, unless every axis size is given (no ``data=-1``,
        not ``auto``) and they multiply to fewer (the first ones are then used; :meth:`resolved` of the result
        gives the sizes).  A product above ``n_devices`` is left to :meth:`resolved` to refuse."""
        sizes = self.checked_sizes()
        if self.auto or sizes["data"] == -1:
            return n_devices
        return min(math.prod(sizes.values()), n_devices)

    def check(self) -> None:
        """ConfigError (one sentence) for mesh settings that cannot work by themselves."""
        check_mesh(self)


# --------------------------------------------------------------------------- remat


# jax.checkpoint_policies that take no arguments (train.remat=NAME); listed here to keep the config free of JAX.
JAX_POLICIES = (
    "nothing_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "checkpoint_dots",
    "checkpoint_dots_with_no_batch_dims",
)


@dataclass(frozen=True)
class Remat:
    """``train.remat`` parsed once: what each scanned block saves for its backward pass.

    ``kind``: ``none`` (no recomputation), ``full`` (save nothing but the block
    input), ``auto`` (the remat selector is to choose), ``selected`` (what it
    chose: ``plan``, a jaxdist.remat.plan.RematPlan, set by
    jaxdist.resolve.resolve), ``names`` (save the checkpoint_name tags in
    ``names``) or ``policy`` (the ``jax.checkpoint_policies`` function called
    ``policy``).  The model's scanned blocks (jaxdist.remat.named.remat_policy)
    and the pipeline stage (jaxdist.parallel.pipeline_stage.stage_remat_policy)
    both take this value.
    """

    kind: Literal["none", "full", "auto", "selected", "names", "policy"]
    names: tuple[str, ...] = ()
    policy: str = ""
    plan: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def parse(cls, value: str) -> Remat:
        """The value of a ``train.remat`` string; ConfigError (one sentence) for one that cannot be one."""
        if value in ("none", ""):
            return cls("none")
        if value in ("full", "auto"):
            return cls(value)
        if value.startswith("save:"):
            names = tuple(n for n in value[5:].split(",") if n)
            if not names:
                raise ConfigError(
                    f"train.remat='{value}' names no checkpoint tags: write save:NAME[,NAME], e.g. save:attn_out."
                )
            return cls("names", names=names)  # the model's tags are checked with the model (config.schema.validate)
        if value not in JAX_POLICIES:
            raise ConfigError(
                f"train.remat='{value}' is unknown: use none, full, auto, save:NAME[,NAME] or one of "
                "nothing_saveable, dots_saveable, dots_with_no_batch_dims_saveable, everything_saveable."
            )
        return cls("policy", policy=value)

    def __str__(self) -> str:
        """The ``train.remat`` spelling (a selection is spelled ``auto``: a resumed run selects again, alike)."""
        spelled = {"names": "save:" + ",".join(self.names), "policy": self.policy, "selected": "auto"}
        return spelled.get(self.kind, self.kind)


def check_mesh(mesh: MeshConfig) -> None:
    """Axis sizes by themselves (ConfigError, one sentence): positive, or -1 for data."""
    mesh.checked_sizes()
    if mesh.expert_tensor < 0:
        raise ConfigError(f"mesh.expert_tensor={mesh.expert_tensor} must be positive (or 0 to use all of mesh.tensor).")

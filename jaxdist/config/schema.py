"""The whole job's config (:class:`Config`, one field per section) and the rules that join sections.

Each section checks itself (its ``check()``); :func:`validate` runs them all and then the rules between
sections, without devices, whenever a config is loaded or replaced.  :func:`validate_devices` adds the
checks that need the device count (mesh product, batch divisibility), once, in
:func:`jaxdist.resolve.resolve`.  No JAX.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxdist.config.controller import ControllerConfig
from jaxdist.config.fields import check_checkpoint_names
from jaxdist.config.mesh import MeshConfig
from jaxdist.config.model import ModelConfig
from jaxdist.config.ranges import check_ranges
from jaxdist.config.run import CheckpointConfig, DataConfig, PipelineConfig, TrainConfig
from jaxdist.config.values import set_key
from jaxdist.errors import ConfigError


@dataclass(frozen=True)
class Config:
    """A whole training job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (a tuple field as a list), as ``config.json`` holds them."""
        return dataclasses.asdict(
            self, dict_factory=lambda kv: {k: list(v) if isinstance(v, tuple) else v for k, v in kv}
        )

    def to_toml(self) -> str:
        """The whole config as TOML that :func:`load_config` reads back to an equal Config."""
        out: list[str] = []

        def table(name: str, values: dict[str, Any]) -> None:
            out.append(f"[{name}]")
            out.extend(f"{k} = {json.dumps(v)}" for k, v in values.items() if not isinstance(v, dict))
            out.append("")
            for k, v in values.items():
                if isinstance(v, dict):
                    table(f"{name}.{k}", v)

        for section, values in self.to_dict().items():
            table(section, values)
        return "\n".join(out)

    def replace(self, **changes: Any) -> Config:
        """A copy with dotted keys changed, e.g. ``cfg.replace(**{"train.seq_len": 64})``, checked like overrides:
        each value for its type, then the whole config (ConfigError, one sentence).  The one way to derive a
        config in code; a section's key takes a whole section too (``cfg.replace(model=model_config)``)."""
        cfg = self.set(**changes)
        validate(cfg)
        return cfg

    def set(self, **changes: Any) -> Config:
        """Like :meth:`replace`, but only each value is checked, not the whole: for a stored run's config read
        by a command that uses a part of it (sampling reads the model, mesh and tokenizer, not the data)."""
        cfg = self
        for k, v in changes.items():
            cfg = set_key(cfg, k, v)
        return cfg

    @property
    def run_dir(self) -> Path:
        return Path(self.train.runs_dir) / self.train.name


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def validate(cfg: Config, n_devices: int | None = None, *, own_model: bool = False) -> None:
    """Raise ConfigError, one sentence saying what to change, for settings that cannot work.

    Every section checks itself, then the rules that join sections run here.
    Checks that need the device count run only when ``n_devices`` is given.  ``own_model``: the config trains a
    user's model (jaxdist.train.custom), so the rules of jaxdist's transformer (its sizes on the mesh, its remat
    tags) are not checked here: the Trainer checks the user's model itself.
    """
    for section in (cfg.model, cfg.train, cfg.data, cfg.checkpoint, cfg.mesh, cfg.controller, cfg.pipeline):
        section.check()
    check_ranges(cfg)
    if own_model:
        if n_devices is not None:
            validate_devices(cfg, n_devices)
        return
    m, t = cfg.model, cfg.train
    if t.remat_spec.kind == "names":  # a tag no block has would save nothing, silently
        check_checkpoint_names(t.remat, t.remat_spec.names)
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is longer than model.max_seq_len={m.max_seq_len}: "
            "lower train.seq_len or raise model.max_seq_len."
        )
    sizes = validate_model_on_mesh(cfg)
    _pipeline_on_model(cfg, sizes)
    _context_on_model(cfg, sizes)
    _grad_sync_on_model(cfg, sizes)
    _documents_on_model(cfg, sizes)
    if n_devices is not None:
        validate_devices(cfg, n_devices)


def _documents_on_model(cfg: Config, sizes: dict[str, int]) -> None:
    """data.packing=documents's reach so far (ConfigError, one sentence): the xla, blockwise and ring attention's
    document masks, on every mesh axis (pipeline stages too), with train.grad_sync=end."""
    if cfg.data.packing != "documents":
        return
    if cfg.model.vocab_size > 1 << 29:  # a packed row's flags sit above the ids (jaxdist.data.documents.ID_MASK)
        raise ConfigError(
            f"data.packing=documents keeps token ids below 2**29, but model.vocab_size={cfg.model.vocab_size}: use "
            "data.packing=stream."
        )
    if cfg.model.attention == "cudnn":
        raise ConfigError(
            "data.packing=documents masks documents in the xla and blockwise attention, not cudnn: set "
            "model.attention=auto (it runs blockwise with documents where it would pick cudnn), xla or blockwise."
        )
    if cfg.train.grad_sync != "end":
        raise ConfigError(
            f"data.packing=documents runs with train.grad_sync=end only so far, not {cfg.train.grad_sync}: set "
            "train.grad_sync=end, or data.packing=stream."
        )


def validate_model_on_mesh(cfg: Config) -> dict[str, int]:
    """The model and mesh sections and the model's fit to the mesh (heads, key/value heads, d_ff, experts over
    tensor and expert), all that sampling needs; ConfigError (one sentence).  Returns the mesh's axis sizes."""
    cfg.model.check()
    cfg.mesh.check()
    m = cfg.model
    sizes = cfg.mesh.checked_sizes()
    if m.n_heads % sizes["tensor"]:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by mesh.tensor={sizes['tensor']}: "
            "choose a tensor size that divides the number of heads."
        )
    if m.n_kv_heads % sizes["tensor"] and sizes["tensor"] % m.n_kv_heads:
        raise ConfigError(
            f"model.n_kv_heads={m.n_kv_heads} and mesh.tensor={sizes['tensor']} do not divide "
            "one another: choose a tensor size that divides n_kv_heads or is a multiple of it."
        )
    if (not m.moe.experts or m.moe.every > 1) and m.d_ff % sizes["tensor"]:
        raise ConfigError(
            f"model.d_ff={m.d_ff} is not divisible by mesh.tensor={sizes['tensor']}: "
            "choose a tensor size that divides d_ff."
        )
    _moe_on_mesh(m, cfg.mesh, sizes)
    return sizes


def unused_devices_note(mesh: MeshConfig, n_devices: int) -> str | None:
    """One line when the mesh asks for fewer than ``n_devices`` devices (it runs on the first ones), else None."""
    used = mesh.devices_used(n_devices)
    if used == n_devices:
        return None
    shape = " x ".join(f"{a}={s}" for a, s in mesh.resolved(used).items() if s != 1) or "data=1"
    return (
        f"mesh {shape} runs on the first {used} of the {n_devices} devices; {n_devices - used} left unused "
        "(mesh.data=-1 uses them all)"
    )


def validate_devices(cfg: Config, n_devices: int) -> None:
    """The checks that need the device count: the mesh product and the batch's divisibility by the data axes.

    A mesh whose axis sizes are all given and multiply to fewer than ``n_devices`` runs on the first ones
    (:meth:`~jaxdist.config.MeshConfig.devices_used`); one that needs more is an error.
    """
    t = cfg.train
    resolved = cfg.mesh.resolved(cfg.mesh.devices_used(n_devices))
    batch_ways = resolved["data"] * resolved["fsdp"] * resolved["expert"]  # attention splits tokens over expert too
    micro = t.batch_size // t.microbatches
    if micro % batch_ways:
        raise ConfigError(
            f"the microbatch of {micro} sequences (train.batch_size={t.batch_size} / "
            f"train.microbatches={t.microbatches}) is not divisible by the data axes "
            f"data*fsdp{'*expert' if resolved['expert'] > 1 else ''}={batch_ways}: "
            f"make the batch a multiple of {batch_ways * t.microbatches}."
        )


# Why capacity dispatch does not run on sequence chunks (jaxdist.parallel.pipeline raises the same).
MOE_CAPACITY_CHUNKS = (
    "capacity dispatch gives each expert slots for the tokens of one layer call, so a sequence chunk would drop "
    "other tokens than its whole microbatch does: set model.moe.dispatch=dropless, pipeline.chunks=1 or "
    "pipeline.schedule=1f1b."
)


def _pipeline_on_model(cfg: Config, sizes: dict[str, int]) -> None:
    """The pipeline's fit to the model and the batch (ConfigError, one sentence)."""
    m, t, p = cfg.model, cfg.train, cfg.pipeline
    stages = sizes["pipeline"]
    if stages == 1:
        return
    if m.moe.experts:  # whole groups of moe.every blocks per stage
        _moe_pipeline_on_model(cfg, stages)
        if p.schedule == "gpipe":  # its blocks run as gpipe stages by autodiff (jaxdist.parallel.pipeline_blocks)
            return
    if m.n_layers % stages:
        raise ConfigError(
            f"model.n_layers={m.n_layers} is not divisible by mesh.pipeline={stages}: "
            "choose a number of stages that divides the number of layers."
        )
    chunks = p.chunks if p.schedule == "seq1f1b" else 1  # the other schedules ignore chunks
    if t.seq_len % chunks:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is not divisible into pipeline.chunks={chunks} chunks: "
            f"choose a sequence length that is a multiple of {chunks}, or fewer chunks."
        )
    if p.schedule == "1f1b" and t.microbatches < stages:
        raise ConfigError(
            f"the 1f1b schedule needs train.microbatches >= mesh.pipeline, got {t.microbatches} < "
            f"{stages}: set train.microbatches={stages} or more, or use gpipe or seq1f1b."
        )
    if m.moe.experts and chunks > 1 and m.moe.dispatch == "capacity":
        raise ConfigError(MOE_CAPACITY_CHUNKS)
    expert_view = (cfg.mesh.expert_tensor or sizes["tensor"]) < sizes["tensor"]
    by_xla = m.moe.dispatch == "capacity" or expert_view  # the planned dispatch does not run inside the stages
    if m.moe.experts and by_xla and sizes["fsdp"] > 1 and sizes["expert"] > 1:
        # XLA 0.10's SPMD partitioner aborts the process (a failed CHECK in spmd_partitioner_util) on it.
        raise ConfigError(
            f"an MoE model's {p.schedule} stages leave {'capacity dispatch' if not expert_view else 'the expert view'}"
            f" to XLA, whose partitioner fails on mesh.fsdp={sizes['fsdp']} with mesh.expert={sizes['expert']} "
            "there: set mesh.fsdp=1, model.moe.dispatch=dropless with mesh.expert_tensor=0, or "
            "pipeline.schedule=gpipe."
        )


def _moe_pipeline_on_model(cfg: Config, stages: int) -> None:
    """An MoE model's stages: their share of the blocks; gpipe's unpacked rows (ConfigError)."""
    m = cfg.model
    groups = m.n_layers // max(m.moe.every, 1)
    if groups % stages:
        raise ConfigError(
            f"model.n_layers={m.n_layers} / model.moe.every={m.moe.every} = {groups} groups of blocks, which "
            f"mesh.pipeline={stages} stages do not divide: choose a number of stages that divides {groups}."
        )
    if cfg.data.packing == "documents" and cfg.pipeline.schedule == "gpipe":
        raise ConfigError(
            "data.packing=documents does not run on an MoE model's gpipe stages yet (a stage's microbatch would "
            "need its rows' segments): set data.packing=stream, pipeline.schedule=1f1b or mesh.pipeline=1."
        )


def _context_on_model(cfg: Config, sizes: dict[str, int]) -> None:
    """Context parallelism's fit to the model, the pipeline and the sequence (ConfigError, one sentence)."""
    c = sizes["context"]
    if c == 1:
        return
    if sizes["pipeline"] > 1:
        raise ConfigError(
            f"mesh.context={c} does not run with pipeline stages yet (mesh.pipeline={sizes['pipeline']}): "
            "set mesh.pipeline=1 or mesh.context=1."
        )
    if cfg.train.seq_len % (2 * c):
        raise ConfigError(
            f"train.seq_len={cfg.train.seq_len} does not split into 2*mesh.context={2 * c} equal chunks: "
            f"make train.seq_len a multiple of {2 * c}."
        )


def _moe_on_mesh(m: ModelConfig, mesh: MeshConfig, sizes: dict[str, int]) -> None:
    """The MoE layers' fit to the mesh (ConfigError, one sentence)."""
    e = m.moe
    if not e.experts:
        if sizes["expert"] > 1:
            raise ConfigError(
                f"mesh.expert={sizes['expert']} needs an MoE model: set model.moe.experts "
                "(or model=moe-tiny), or set mesh.expert=1."
            )
        return
    tensor = sizes["tensor"]
    etp = mesh.expert_tensor or tensor
    if tensor % etp:
        raise ConfigError(
            f"mesh.expert_tensor={mesh.expert_tensor} does not divide mesh.tensor={tensor}: "
            "choose a divisor of the tensor size (or 0 to use all of it)."
        )
    ep = sizes["expert"] * (tensor // etp)
    if e.experts % ep:
        how = f"mesh.expert={sizes['expert']}" + (
            f" x mesh.tensor/mesh.expert_tensor={tensor // etp}" if ep != sizes["expert"] else ""
        )
        raise ConfigError(
            f"model.moe.experts={e.experts} is not divisible by the expert-parallel size {ep} "
            f"({how}): choose a number of experts that is a multiple of {ep}, or a smaller mesh.expert."
        )
    if (e.d_ff or m.d_ff) % etp:
        raise ConfigError(
            f"the expert width {e.d_ff or m.d_ff} (model.moe.d_ff, or d_ff) is not divisible by "
            f"the expert tensor size {etp}: choose a width or mesh.expert_tensor that divides it."
        )
    if e.shared_d_ff % tensor:
        raise ConfigError(
            f"model.moe.shared_d_ff={e.shared_d_ff} is not divisible by mesh.tensor={tensor}: "
            "choose a shared-expert width that the tensor size divides."
        )


def check_ordered(batch_size: int, unit_rows: int, devices: int) -> str | None:
    """Why ``train.grad_sync=ordered`` cannot split this batch (one sentence), or None."""
    if batch_size % unit_rows:
        return (
            f"train.grad_unit_rows={unit_rows} does not divide train.batch_size={batch_size}: choose a unit that "
            "divides the batch."
        )
    units = batch_size // unit_rows
    if units & (units - 1):
        return (
            f"train.grad_sync=ordered sums a power-of-two number of units, but train.batch_size={batch_size} / "
            f"train.grad_unit_rows={unit_rows} = {units}: make the batch a power of two times the unit."
        )
    if units % devices:
        return (
            f"train.grad_sync=ordered gives each of the {devices} devices on the data axes whole units, but there "
            f"are {units} units of {unit_rows} rows: lower train.grad_unit_rows or use fewer devices."
        )
    return None


def _ordered_on_model(cfg: Config, sizes: dict[str, int]) -> None:
    """train.grad_sync=ordered's reach (ConfigError, one sentence): dense models on the data and fsdp axes, no
    microbatches, the batch a power of two of units that the data axes divide."""
    for axis in ("tensor", "context", "expert", "pipeline"):
        if sizes[axis] > 1:
            raise ConfigError(
                f"train.grad_sync=ordered runs on the data and fsdp axes only, not with mesh.{axis}={sizes[axis]}: "
                f"set mesh.{axis}=1 or train.grad_sync=end."
            )
    if cfg.model.moe.experts:
        raise ConfigError("train.grad_sync=ordered covers dense models only: set train.grad_sync=end for an MoE model.")
    if cfg.train.microbatches > 1:
        raise ConfigError(
            f"train.grad_sync=ordered already goes through the batch in units of train.grad_unit_rows rows: set "
            f"train.microbatches=1 (not {cfg.train.microbatches})."
        )
    problem = check_ordered(cfg.train.batch_size, cfg.train.grad_unit_rows, sizes["data"] * sizes["fsdp"])
    if problem:
        raise ConfigError(problem)


def _grad_sync_on_model(cfg: Config, sizes: dict[str, int]) -> None:
    """train.grad_sync=per_block's reach (ConfigError, one sentence): the shard_map form covers dense models
    on data, fsdp, tensor and pipeline axes, MoE models on data, fsdp, tensor and expert axes (each expert on
    all of tensor) and on 1f1b or seq1f1b stages with dropless dispatch, with microbatches only as pipeline
    microbatches."""
    if cfg.train.grad_sync == "ordered":
        _ordered_on_model(cfg, sizes)
    if cfg.train.grad_sync != "per_block":
        return
    moe = cfg.model.moe
    if moe.experts and sizes["pipeline"] > 1 and cfg.pipeline.schedule == "gpipe":
        raise ConfigError(
            "train.grad_sync=per_block does not run an MoE model's gpipe stages: set pipeline.schedule=1f1b, "
            "pipeline.schedule=seq1f1b or train.grad_sync=end."
        )
    if moe.experts and sizes["pipeline"] > 1 and moe.dispatch != "dropless":
        raise ConfigError(
            "train.grad_sync=per_block runs an MoE model's pipeline stages with dropless dispatch only: set "
            "model.moe.dispatch=dropless or train.grad_sync=end."
        )
    if moe.experts and sizes["expert"] > 1 and cfg.mesh.expert_tensor not in (0, sizes["tensor"]):
        raise ConfigError(
            f"train.grad_sync=per_block runs each expert on all of mesh.tensor={sizes['tensor']}: set "
            f"mesh.expert_tensor=0 or train.grad_sync=end."
        )
    if cfg.train.microbatches > 1 and sizes["pipeline"] == 1:
        raise ConfigError(
            f"train.grad_sync=per_block reduces each block once per step, which train.microbatches="
            f"{cfg.train.microbatches} without pipeline stages would repeat per microbatch: set "
            "train.microbatches=1, mesh.pipeline > 1 or train.grad_sync=end."
        )
    for axis in ("context",) if moe.experts else ("context", "expert"):
        if sizes[axis] > 1:
            raise ConfigError(
                f"train.grad_sync=per_block does not run with mesh.{axis}={sizes[axis]} yet: set mesh.{axis}=1 "
                "or train.grad_sync=end."
            )

"""What cannot work: one sentence per problem, saying what to change.

Each section checks itself (``check_model``, ``check_moe``, ``check_mesh``,
``check_train``, ``check_pipeline``, ``check_data``, ``check_checkpoint``,
``check_controller``; the sections' ``check()`` methods call them), and the
rules that join sections stay in one place, :func:`validate`.  It runs
without devices when a config is loaded (:func:`jaxdist.config.load_config`);
:func:`validate_devices` adds the checks that need the device count (mesh
product, batch divisibility), once, in :func:`jaxdist.resolve.resolve`.

This module imports nothing from config.py (which imports it): a choice's
values are read from its field's ``Literal`` type with :func:`choices`.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import math
import socket
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from jaxdist.errors import ConfigError
from jaxdist.config_ranges import check_ranges

# The checkpoint_name tags of a model block, in the order a block computes them (a remat policy saves a subset:
# ``train.remat=save:NAME[,NAME]``).  Defined here, below the config, so that train.remat is checked when a config
# is loaded; jaxdist.models.names re-exports it and the model's blocks use exactly these names.
CHECKPOINT_NAMES: tuple[str, ...] = (
    "attn_norm",
    "query_proj",
    "key_proj",
    "value_proj",
    "attn_context",
    "attn_out",
    "mlp_norm",
    "mlp_gate",
    "mlp_up",
    "mlp_out",
)

if TYPE_CHECKING:  # config.py imports this module to validate what it loads
    from jaxdist.config import (
        CheckpointConfig,
        Config,
        ControllerConfig,
        DataConfig,
        MeshConfig,
        ModelConfig,
        MoEConfig,
        PipelineConfig,
        TrainConfig,
    )


def choices(section: object, name: str) -> tuple[str, ...]:
    """The values a Literal-typed config field allows, read from its dataclass (defined once, in config.py)."""
    return typing.get_args(typing.get_type_hints(type(section))[name])


def _one_of(values: tuple[str, ...]) -> str:
    return ", ".join(values[:-1]) + f" or {values[-1]}" if len(values) > 1 else values[0]


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1) or a name that resolves only to loopback addresses.

    ``127.0.0.1.example.com`` is a name, not an address: it counts as loopback only if DNS says so.
    """
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False  # a name that does not resolve: not known to be loopback
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_model(m: ModelConfig) -> None:
    """Model shape and numerics, the MoE table included (ConfigError, one sentence)."""
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "max_seq_len"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}: "
            "choose n_kv_heads that divides n_heads."
        )
    for name in ("dtype", "param_dtype", "attention"):
        if getattr(m, name) not in choices(m, name):
            raise ConfigError(f"model.{name}='{getattr(m, name)}' is not supported: use {_one_of(choices(m, name))}.")
    if m.attention_block <= 0:
        raise ConfigError(f"model.attention_block={m.attention_block} must be positive (tokens per block).")
    if m.attention == "cudnn" and m.dtype != "bfloat16":
        raise ConfigError(
            f"model.attention=cudnn runs in bfloat16 only but model.dtype={m.dtype}: "
            "set model.dtype=bfloat16 or use model.attention=auto, xla or blockwise."
        )
    _check_rope(m)
    m.moe.check()
    if m.moe.experts and (m.moe.every <= 0 or m.n_layers % m.moe.every):
        raise ConfigError(
            f"model.moe.every={m.moe.every} does not divide model.n_layers={m.n_layers}: "
            "choose an MoE interval that divides the number of blocks."
        )


def _check_rope(m: ModelConfig) -> None:
    """The rotary scaling fields (ConfigError, one sentence)."""
    if m.rope_scaling not in choices(m, "rope_scaling"):
        raise ConfigError(
            f"model.rope_scaling='{m.rope_scaling}' is not supported: use {_one_of(choices(m, 'rope_scaling'))}."
        )
    if m.rope_scaling != "none" and not m.rope_factor > 0:
        raise ConfigError(
            f"model.rope_factor={m.rope_factor} must be positive with model.rope_scaling={m.rope_scaling}."
        )
    if m.rope_scaling == "llama3" and not (
        0 < m.rope_low_freq_factor < m.rope_high_freq_factor and m.rope_original_max_len > 0
    ):
        raise ConfigError(
            f"model.rope_scaling=llama3 needs 0 < rope_low_freq_factor ({m.rope_low_freq_factor}) < "
            f"rope_high_freq_factor ({m.rope_high_freq_factor}) and a positive rope_original_max_len "
            f"({m.rope_original_max_len}): fix those fields."
        )


def check_moe(e: MoEConfig) -> None:
    """The ``[model.moe]`` table by itself (ConfigError, one sentence); a dense model (experts = 0) passes."""
    if e.experts < 0:
        raise ConfigError(f"model.moe.experts={e.experts} must be positive (or 0 for a dense model).")
    if not e.experts:
        return
    if not 1 <= e.top_k <= e.experts:
        raise ConfigError(
            f"model.moe.top_k={e.top_k} must lie between 1 and model.moe.experts={e.experts}: "
            "route each token to at most as many experts as there are."
        )
    for name in ("d_ff", "shared_d_ff"):
        if getattr(e, name) < 0:
            raise ConfigError(f"model.moe.{name}={getattr(e, name)} must be positive (or 0).")
    if e.every <= 0:
        raise ConfigError(f"model.moe.every={e.every} must be positive: every k-th block is an MoE block.")
    if e.router not in choices(e, "router"):
        raise ConfigError(f"model.moe.router='{e.router}' is unknown: use {_one_of(choices(e, 'router'))}.")
    if e.dispatch not in choices(e, "dispatch"):
        raise ConfigError(f"model.moe.dispatch='{e.dispatch}' is unknown: use {_one_of(choices(e, 'dispatch'))}.")
    if e.dispatch == "capacity" and not e.capacity_factor > 0:
        raise ConfigError(
            f"model.moe.capacity_factor={e.capacity_factor} must be positive in capacity mode: "
            "use e.g. 1.25, or set model.moe.dispatch=dropless."
        )


def check_mesh(mesh: MeshConfig) -> None:
    """Axis sizes by themselves (ConfigError, one sentence): positive, or -1 for data."""
    mesh.checked_sizes()
    if mesh.expert_tensor < 0:
        raise ConfigError(f"mesh.expert_tensor={mesh.expert_tensor} must be positive (or 0 to use all of mesh.tensor).")


def check_train(t: TrainConfig) -> None:
    """Optimisation and logging settings by themselves (ConfigError, one sentence)."""
    for name in ("steps", "batch_size", "seq_len", "microbatches", "log_every", "grad_unit_rows"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be positive.")
    for name in ("learning_rate", "min_lr_ratio", "weight_decay", "b1", "b2", "grad_clip"):
        if not math.isfinite(getattr(t, name)) or getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be a finite number >= 0.")
    if not (math.isfinite(t.remat_slack) and 0 <= t.remat_slack <= 1):
        raise ConfigError(
            f"train.remat_slack={t.remat_slack} is not a share between 0 and 1: it is the extra recompute the remat "
            "selector may accept (a share of the save-nothing recompute), 0 for the optimum, e.g. 0.03."
        )
    for name in (
        "warmup_steps",
        "schedule_steps",
        "skip_nonfinite",
        "memory_budget_bytes",
        "remat_budget_bytes",
        "grad_bucket_bytes",
    ):
        if getattr(t, name) < 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be 0 or positive.")
    if not t.name or "/" in t.name or "\\" in t.name or t.name in (".", ".."):
        raise ConfigError(
            f"train.name='{t.name}' is not a plain folder name (no '/', '\\' or '..'): the run lives in "
            "<train.runs_dir>/<train.name>, so choose a name such as my-run (train.runs_dir says where runs go)."
        )
    if t.batch_size % t.microbatches:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.microbatches={t.microbatches}: "
            "choose a microbatch count that divides the batch."
        )
    if t.profile_steps and (len(t.profile_steps) != 2 or not 1 <= t.profile_steps[0] <= t.profile_steps[1]):
        raise ConfigError(
            f"train.profile_steps={list(t.profile_steps)} is not [first, last] with 1 <= first <= last: "
            "write it like train.profile_steps=[5,8] (steps 5 to 8), or [] for no trace."
        )
    if t.tracker not in choices(t, "tracker"):
        raise ConfigError(f"train.tracker='{t.tracker}' is unknown: use {_one_of(choices(t, 'tracker'))}.")
    if t.tracker != "none" and importlib.util.find_spec(t.tracker) is None:
        raise ConfigError(
            f"train.tracker='{t.tracker}' needs the {t.tracker} package, which is not installed: "
            f"pip install {t.tracker}, or set train.tracker=none (metrics still go to metrics.jsonl and TensorBoard)."
        )


def check_checkpoint_names(value: str, names: tuple[str, ...]) -> None:
    """ConfigError (one sentence) when ``train.remat=save:...`` (``value``) names a tag no block has: jax would
    save nothing for it, silently, which is full recomputation under another name."""
    unknown = [n for n in names if n not in CHECKPOINT_NAMES]
    if unknown:
        raise ConfigError(
            f"train.remat='{value}' names {', '.join(repr(n) for n in unknown)}, which the model does not tag: "
            f"use save: with some of {', '.join(CHECKPOINT_NAMES)}."
        )


def check_pipeline(p: PipelineConfig) -> None:
    """The ``[pipeline]`` table by itself (ConfigError, one sentence)."""
    if p.schedule not in choices(p, "schedule"):
        raise ConfigError(f"pipeline.schedule='{p.schedule}' is unknown: use {_one_of(choices(p, 'schedule'))}.")
    if p.chunk_split not in choices(p, "chunk_split"):
        raise ConfigError(
            f"pipeline.chunk_split='{p.chunk_split}' is unknown: use {_one_of(choices(p, 'chunk_split'))}."
        )
    if p.chunks <= 0:
        raise ConfigError(f"pipeline.chunks={p.chunks} must be positive.")


def check_data(d: DataConfig) -> None:
    """Where tokens come from (ConfigError, one sentence): the source, its path, its element type."""
    if d.source not in choices(d, "source"):
        raise ConfigError(f"data.source='{d.source}' is unknown: use {_one_of(choices(d, 'source'))}.")
    if d.source in ("text_dir", "tokens"):
        if not d.path:
            raise ConfigError(
                f"data.source='{d.source}' needs data.path: set it to the "
                + ("directory of text files." if d.source == "text_dir" else "token file.")
            )
        p = Path(d.path)
        if d.source == "text_dir" and not p.is_dir():
            raise ConfigError(f"data.path '{p}' is not a directory: point it at a directory of text files.")
        if d.source == "tokens" and not p.is_file():
            raise ConfigError(f"data.path '{p}' does not exist: point it at a flat token file.")
    if d.token_dtype not in choices(d, "token_dtype"):
        raise ConfigError(
            f"data.token_dtype='{d.token_dtype}' is not supported: use {_one_of(choices(d, 'token_dtype'))}."
        )
    if not 0 < d.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must lie strictly between 0 and 1.")
    if d.tokenizer != "bytes":
        t = Path(d.tokenizer)
        if not t.is_file():
            raise ConfigError(
                f"data.tokenizer '{t}' does not exist: point it at a tokenizer.json or a SentencePiece .model, "
                "or set data.tokenizer=bytes."
            )
        if t.suffix not in (".json", ".model"):
            raise ConfigError(
                f"data.tokenizer '{t}' is neither a Hugging Face tokenizer.json nor a SentencePiece .model: "
                "point it at one of those, or set data.tokenizer=bytes."
            )
        if d.source != "tokens":
            raise ConfigError(
                f"data.source='{d.source}' is read byte by byte, which data.tokenizer '{t}' cannot tokenize: "
                f"run `jaxdist data prepare SRC OUT --tokenizer {t}` and train with data.source=tokens "
                "data.path=OUT/tokens.bin."
            )


def check_checkpoint(c: CheckpointConfig) -> None:
    """Checkpoint intervals and the local tier (ConfigError, one sentence)."""
    if c.every <= 0 or c.keep <= 0:
        raise ConfigError("checkpoint.every and checkpoint.keep must be positive.")
    if c.local_dir and (c.local_every <= 0 or c.local_keep <= 0):
        raise ConfigError(
            f"checkpoint.local_every={c.local_every} and checkpoint.local_keep={c.local_keep} must be positive."
        )
    if c.local_dir not in ("", "auto") and not c.enabled:
        raise ConfigError(
            "checkpoint.local_dir needs checkpoint.enabled=true (the local tier sits beside the "
            "persistent checkpoints, not instead of them)."
        )


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
        raise ConfigError(f"controller.recovery='{c.recovery}' is unknown: use {_one_of(choices(c, 'recovery'))}.")
    if c.min_nodes < 1 or c.max_nodes < 0 or (c.max_nodes and c.max_nodes < c.min_nodes):
        raise ConfigError(
            f"controller.min_nodes={c.min_nodes} and max_nodes={c.max_nodes} are inconsistent: "
            "use min_nodes >= 1 and max_nodes >= min_nodes (or 0)."
        )
    if c.crashed_rank not in choices(c, "crashed_rank"):
        raise ConfigError(
            f"controller.crashed_rank='{c.crashed_rank}' is unknown: use {_one_of(choices(c, 'crashed_rank'))}."
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
    if c.health_every < 0 or not c.health_z > 0 or not c.health_min_share >= 0 or not c.health_min_change >= 0:
        raise ConfigError(
            f"controller.health_every={c.health_every}, health_z={c.health_z}, health_min_share="
            f"{c.health_min_share} and health_min_change={c.health_min_change} are out of range: use "
            "health_every >= 0 steps (0: no efficiency records), health_z > 0 and the fractions >= 0."
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


def validate(cfg: Config, n_devices: int | None = None) -> None:
    """Raise ConfigError, one sentence saying what to change, for settings that cannot work.

    Every section checks itself, then the rules that join sections run here.
    Checks that need the device count run only when ``n_devices`` is given.
    """
    for section in (cfg.model, cfg.train, cfg.data, cfg.checkpoint, cfg.mesh, cfg.controller, cfg.pipeline):
        section.check()
    check_ranges(cfg)
    m, t = cfg.model, cfg.train
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is longer than model.max_seq_len={m.max_seq_len}: "
            "lower train.seq_len or raise model.max_seq_len."
        )
    sizes = validate_model_on_mesh(cfg)
    _pipeline_on_model(cfg, sizes["pipeline"])
    _context_on_model(cfg, sizes)
    _grad_sync_on_model(cfg, sizes)
    if n_devices is not None:
        validate_devices(cfg, n_devices)


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


def mark_resolved(cfg: Config, n_devices: int) -> None:
    """Note on ``cfg`` (an attribute, not a field: never saved or compared) that it was resolved and validated
    for ``n_devices`` devices (jaxdist.resolve.resolve)."""
    object.__setattr__(cfg, "_resolved_for", n_devices)


def is_resolved(cfg: Config, n_devices: int) -> bool:
    """Whether ``cfg`` was resolved and validated for ``n_devices`` devices."""
    return getattr(cfg, "_resolved_for", None) == n_devices


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


# Why an MoE model has no pipeline stages yet (jaxdist.parallel.pipeline raises the same).
MOE_NOT_PIPELINED = (
    "pipeline stages do not support MoE models yet: a stage runs the dense sequence-chunked block "
    "only, and the router losses of every stage's MoE layers would have to join the last stage's "
    "loss: set mesh.pipeline=1 or model.moe.experts=0."
)


def _pipeline_on_model(cfg: Config, stages: int) -> None:
    """The pipeline's fit to the model and the batch (ConfigError, one sentence)."""
    m, t, p = cfg.model, cfg.train, cfg.pipeline
    if stages == 1:
        return
    if m.moe.experts:
        raise ConfigError(MOE_NOT_PIPELINED)
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
    if cfg.model.moe.experts:
        raise ConfigError(
            f"mesh.context={c} does not run MoE models yet (model.moe.experts={cfg.model.moe.experts}): "
            "set mesh.context=1 or use a dense model."
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
    on data, fsdp, tensor and pipeline axes, with microbatches only as pipeline microbatches."""
    if cfg.train.grad_sync == "ordered":
        _ordered_on_model(cfg, sizes)
    if cfg.train.grad_sync != "per_block":
        return
    if cfg.model.moe.experts:
        raise ConfigError(
            "train.grad_sync=per_block covers dense models only: set train.grad_sync=end for an MoE model."
        )
    if cfg.train.microbatches > 1 and sizes["pipeline"] == 1:
        raise ConfigError(
            f"train.grad_sync=per_block reduces each block once per step, which train.microbatches="
            f"{cfg.train.microbatches} without pipeline stages would repeat per microbatch: set "
            "train.microbatches=1, mesh.pipeline > 1 or train.grad_sync=end."
        )
    for axis in ("context", "expert"):
        if sizes[axis] > 1:
            raise ConfigError(
                f"train.grad_sync=per_block does not run with mesh.{axis}={sizes[axis]} yet: set mesh.{axis}=1 "
                "or train.grad_sync=end."
            )

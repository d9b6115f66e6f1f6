"""What cannot work: validation of a whole Config, one sentence per problem saying what to change.

``validate(cfg)`` runs without devices when a config is loaded
(:func:`jaxdist.config.load_config`); ``validate(cfg, n_devices)`` adds the
checks that need the device count (mesh product, batch divisibility).
"""

from __future__ import annotations

from pathlib import Path

from jaxdist.config import (CONTROLLER_LAUNCHERS, CONTROLLER_RECOVERY, Config, ConfigError, ControllerConfig,
                            MeshConfig, ModelConfig)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost (no DNS lookup)."""
    return host in ("localhost", "::1") or host.startswith("127.")


def _validate_controller(c: ControllerConfig) -> None:
    """Controller settings that cannot work (ConfigError, one sentence)."""
    if not is_loopback(c.bind) and not c.allow_remote:
        raise ConfigError(f"controller.bind='{c.bind}' is not a loopback address: set controller.allow_remote=true "
                          "to listen beyond this machine, or keep 127.0.0.1 (SSH jobs tunnel to it).")
    if not 0 <= c.port <= 65535:
        raise ConfigError(f"controller.port={c.port} is not a TCP port: use 1..65535, or 0 for a free one.")
    if c.launcher not in CONTROLLER_LAUNCHERS:
        raise ConfigError(f"controller.launcher='{c.launcher}' is unknown: use {', '.join(CONTROLLER_LAUNCHERS)}.")
    if c.recovery not in CONTROLLER_RECOVERY:
        raise ConfigError(f"controller.recovery='{c.recovery}' is unknown: use standby or requeue.")
    if c.min_nodes < 1 or c.max_nodes < 0 or (c.max_nodes and c.max_nodes < c.min_nodes):
        raise ConfigError(f"controller.min_nodes={c.min_nodes} and max_nodes={c.max_nodes} are inconsistent: "
                          "use min_nodes >= 1 and max_nodes >= min_nodes (or 0).")
    if c.standbys < 0 or c.warm_spares < 0 or c.max_failures < 1:
        raise ConfigError("controller.standbys and controller.warm_spares must be >= 0 and controller.max_failures >= 1.")
    if not c.heartbeat_interval > 0 or not c.heartbeat_timeout >= 2 * c.heartbeat_interval:
        raise ConfigError(f"controller.heartbeat_timeout={c.heartbeat_timeout} must be at least twice "
                          f"controller.heartbeat_interval={c.heartbeat_interval} (and the interval positive), "
                          "or one late heartbeat fails a healthy worker.")
    if not (c.progress_timeout > 0 and c.start_timeout > 0 and c.heartbeat_grace >= c.heartbeat_timeout):
        raise ConfigError("controller.progress_timeout and controller.start_timeout must be positive and "
                          "controller.heartbeat_grace at least controller.heartbeat_timeout (seconds).")




def validate(cfg: Config, n_devices: int | None = None) -> None:
    """Raise ConfigError, one sentence saying what to change, for settings that cannot work.

    Checks that need the device count (mesh product, batch divisibility by the
    data axes) run only when ``n_devices`` is given.
    """
    m, t, d = cfg.model, cfg.train, cfg.data
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "max_seq_len"):
        if getattr(m, name) <= 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive.")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}: "
                          "choose n_kv_heads that divides n_heads.")
    for name in ("dtype", "param_dtype"):
        if getattr(m, name) not in ("float32", "bfloat16"):
            raise ConfigError(f"model.{name}='{getattr(m, name)}' is not supported: use float32 or bfloat16.")
    for name in ("steps", "batch_size", "seq_len", "microbatches", "log_every"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be positive.")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} is longer than model.max_seq_len={m.max_seq_len}: "
                          "lower train.seq_len or raise model.max_seq_len.")
    if t.batch_size % t.microbatches:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.microbatches={t.microbatches}: "
                          "choose a microbatch count that divides the batch.")
    if d.source not in ("stdlib", "text_dir", "tokens"):
        raise ConfigError(f"data.source='{d.source}' is unknown: use stdlib, text_dir or tokens.")
    if d.source in ("text_dir", "tokens"):
        if not d.path:
            raise ConfigError(f"data.source='{d.source}' needs data.path: set it to the "
                              + ("directory of text files." if d.source == "text_dir" else "token file."))
        p = Path(d.path)
        if d.source == "text_dir" and not p.is_dir():
            raise ConfigError(f"data.path '{p}' is not a directory: point it at a directory of text files.")
        if d.source == "tokens" and not p.is_file():
            raise ConfigError(f"data.path '{p}' does not exist: point it at a flat token file.")
    if d.token_dtype not in ("uint16", "uint32"):
        raise ConfigError(f"data.token_dtype='{d.token_dtype}' is not supported: use uint16 or uint32.")
    if not 0 < d.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must lie strictly between 0 and 1.")
    if cfg.checkpoint.every <= 0 or cfg.checkpoint.keep <= 0:
        raise ConfigError("checkpoint.every and checkpoint.keep must be positive.")
    if cfg.checkpoint.local_dir and (cfg.checkpoint.local_every <= 0 or cfg.checkpoint.local_keep <= 0):
        raise ConfigError("checkpoint.local_every and checkpoint.local_keep must be positive.")
    if cfg.checkpoint.local_dir and not cfg.checkpoint.enabled:
        raise ConfigError("checkpoint.local_dir needs checkpoint.enabled=true (the local tier sits beside the "
                          "persistent checkpoints, not instead of them).")
    # Mesh checks that need no device count.
    sizes = cfg.mesh.checked_sizes()
    if m.n_heads % sizes["tensor"]:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by mesh.tensor={sizes['tensor']}: "
                          "choose a tensor size that divides the number of heads.")
    if m.n_kv_heads % sizes["tensor"] and sizes["tensor"] % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={m.n_kv_heads} and mesh.tensor={sizes['tensor']} do not divide "
                          "one another: choose a tensor size that divides n_kv_heads or is a multiple of it.")
    if (not m.moe_experts or m.moe_every > 1) and m.d_ff % sizes["tensor"]:
        raise ConfigError(f"model.d_ff={m.d_ff} is not divisible by mesh.tensor={sizes['tensor']}: "
                          "choose a tensor size that divides d_ff.")
    _validate_moe(m, cfg.mesh, sizes)
    _validate_controller(cfg.controller)
    _validate_pipeline(cfg, sizes["pipeline"])
    if n_devices is not None:
        resolved = cfg.mesh.resolved(n_devices)
        batch_ways = resolved["data"] * resolved["fsdp"] * resolved["expert"]  # attention splits tokens over expert too
        micro = t.batch_size // t.microbatches
        if micro % batch_ways:
            raise ConfigError(
                f"the microbatch of {micro} sequences (train.batch_size={t.batch_size} / "
                f"train.microbatches={t.microbatches}) is not divisible by the data axes "
                f"data*fsdp{'*expert' if resolved['expert'] > 1 else ''}={batch_ways}: "
                f"make the batch a multiple of {batch_ways * t.microbatches}.")


def _validate_pipeline(cfg: Config, stages: int) -> None:
    """Pipeline settings and their fit to the model (ConfigError, one sentence)."""
    m, t = cfg.model, cfg.train
    if t.pipeline_schedule not in ("gpipe", "1f1b", "seq1f1b"):
        raise ConfigError(f"train.pipeline_schedule='{t.pipeline_schedule}' is unknown: use gpipe, 1f1b or seq1f1b.")
    if t.pipeline_chunk_split not in ("cost", "equal"):
        raise ConfigError(f"train.pipeline_chunk_split='{t.pipeline_chunk_split}' is unknown: use cost or equal.")
    if t.pipeline_chunks <= 0:
        raise ConfigError(f"train.pipeline_chunks={t.pipeline_chunks} must be positive.")
    if stages == 1:
        return
    if m.moe_experts:
        raise ConfigError("pipeline stages do not support MoE models yet: set mesh.pipeline=1 or model.moe_experts=0.")
    if m.n_layers % stages:
        raise ConfigError(f"model.n_layers={m.n_layers} is not divisible by mesh.pipeline={stages}: "
                          "choose a number of stages that divides the number of layers.")
    chunks = t.pipeline_chunks if t.pipeline_schedule == "seq1f1b" else 1  # the other schedules ignore chunks
    if t.seq_len % chunks:
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible into train.pipeline_chunks={chunks} chunks: "
                          f"choose a sequence length that is a multiple of {chunks}, or fewer chunks.")
    if t.pipeline_schedule == "1f1b" and t.microbatches < stages:
        raise ConfigError(f"the 1f1b schedule needs train.microbatches >= mesh.pipeline, got {t.microbatches} < "
                          f"{stages}: set train.microbatches={stages} or more, or use gpipe or seq1f1b.")


def _validate_moe(m: ModelConfig, mesh: MeshConfig, sizes: dict[str, int]) -> None:
    """MoE settings and their fit to the mesh (ConfigError, one sentence)."""
    if not m.moe_experts:
        if sizes["expert"] > 1:
            raise ConfigError(f"mesh.expert={sizes['expert']} needs an MoE model: set model.moe_experts "
                              "(or model=moe-tiny), or set mesh.expert=1.")
        return
    if m.moe_experts < 0:
        raise ConfigError(f"model.moe_experts={m.moe_experts} must be positive (or 0 for a dense model).")
    if not 1 <= m.moe_top_k <= m.moe_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must lie between 1 and model.moe_experts={m.moe_experts}: "
                          "route each token to at most as many experts as there are.")
    for name in ("moe_d_ff", "moe_shared_d_ff"):
        if getattr(m, name) < 0:
            raise ConfigError(f"model.{name}={getattr(m, name)} must be positive (or 0).")
    if m.moe_every <= 0 or m.n_layers % m.moe_every:
        raise ConfigError(f"model.moe_every={m.moe_every} does not divide model.n_layers={m.n_layers}: "
                          "choose an MoE interval that divides the number of blocks.")
    if m.moe_router not in ("softmax", "sigmoid"):
        raise ConfigError(f"model.moe_router='{m.moe_router}' is unknown: use softmax or sigmoid.")
    if m.moe_dispatch not in ("dropless", "capacity"):
        raise ConfigError(f"model.moe_dispatch='{m.moe_dispatch}' is unknown: use dropless or capacity.")
    if m.moe_dispatch == "capacity" and not m.moe_capacity_factor > 0:
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor} must be positive in capacity mode: "
                          "use e.g. 1.25, or set model.moe_dispatch=dropless.")
    tensor = sizes["tensor"]
    etp = mesh.expert_tensor or tensor
    if mesh.expert_tensor < 0 or tensor % etp:
        raise ConfigError(f"mesh.expert_tensor={mesh.expert_tensor} does not divide mesh.tensor={tensor}: "
                          "choose a divisor of the tensor size (or 0 to use all of it).")
    ep = sizes["expert"] * (tensor // etp)
    if m.moe_experts % ep:
        how = f"mesh.expert={sizes['expert']}" + (f" x mesh.tensor/mesh.expert_tensor={tensor // etp}" if ep != sizes["expert"] else "")
        raise ConfigError(f"model.moe_experts={m.moe_experts} is not divisible by the expert-parallel size {ep} "
                          f"({how}): choose a number of experts that is a multiple of {ep}, or a smaller mesh.expert.")
    if (m.moe_d_ff or m.d_ff) % etp:
        raise ConfigError(f"the expert width {m.moe_d_ff or m.d_ff} (model.moe_d_ff, or d_ff) is not divisible by "
                          f"the expert tensor size {etp}: choose a width or mesh.expert_tensor that divides it.")
    if m.moe_shared_d_ff % tensor:
        raise ConfigError(f"model.moe_shared_d_ff={m.moe_shared_d_ff} is not divisible by mesh.tensor={tensor}: "
                          "choose a shared-expert width that the tensor size divides.")

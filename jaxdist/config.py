"""Configuration: dataclasses for model, mesh, train, data and checkpoint.

A config is built from defaults, then a TOML file, then dotted command-line
overrides (``train.steps=200 mesh.tensor=2``).  ``model=NAME`` selects a model
preset before any ``model.*`` override applies.  Every field carries its help
text in ``metadata["help"]``; the README's configuration reference is generated
from it (``python -m jaxdist.config``) and a test keeps the two in step.

This module imports no JAX, so the CLI can read a config (and the number of
simulated CPU devices it wants) before JAX starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user-caused configuration mistake, reported as one sentence."""


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


# --------------------------------------------------------------------------- model

@dataclass
class ModelConfig:
    """Decoder-only transformer shape and numerics."""

    preset: str = _f("small", "Preset the other model fields start from (see MODEL_PRESETS); `model=NAME` on the CLI sets it.")
    vocab_size: int = _f(260, "Vocabulary size (tokens). The byte tokenizer uses 256 bytes + 4 specials = 260.")
    d_model: int = _f(128, "Residual stream width (features).")
    n_layers: int = _f(4, "Number of transformer blocks (stacked and scanned).")
    n_heads: int = _f(4, "Query heads per block.")
    n_kv_heads: int = _f(2, "Key/value heads (grouped-query attention); must divide n_heads.")
    head_dim: int = _f(32, "Features per attention head.")
    d_ff: int = _f(384, "Hidden width of the SwiGLU MLP.")
    max_seq_len: int = _f(128, "Longest sequence the rotary tables cover (tokens).")
    rope_theta: float = _f(10000.0, "Rotary embedding base.")
    norm_eps: float = _f(1e-5, "RMSNorm epsilon.")
    tie_embeddings: bool = _f(True, "Share the input embedding with the output projection.")
    dtype: str = _f("float32", "Compute dtype of activations and matmuls: float32 or bfloat16.")
    param_dtype: str = _f("float32", "Storage dtype of the master weights: float32 (recommended with bf16 compute) or bfloat16.")
    init_std: float = _f(0.02, "Standard deviation of the normal weight initialiser.")
    moe_experts: int = _f(0, "Routed experts per MoE block; 0 makes a dense model.")
    moe_top_k: int = _f(2, "Experts each token is routed to (the k of top-k), 1..moe_experts.")
    moe_d_ff: int = _f(0, "Hidden width of one expert's SwiGLU FFN; 0 uses d_ff.")
    moe_every: int = _f(1, "Every k-th block is an MoE block (blocks k-1, 2k-1, ...), the others keep the dense MLP; must divide n_layers.")
    moe_shared_d_ff: int = _f(0, "Hidden width of a shared expert every token also goes through (0: none).")
    moe_router: str = _f("softmax", "Router scores: softmax (Mixtral) or sigmoid (DeepSeek-V3).")
    moe_renormalize: bool = _f(True, "Rescale each token's k expert weights to sum to 1.")
    moe_dispatch: str = _f("dropless", "dropless (tokens sorted by expert, grouped matmul, none dropped) or capacity (fixed slots per expert, overflow dropped).")
    moe_capacity_factor: float = _f(1.25, "Capacity mode: slots per expert = ceil(factor x tokens x k / experts), counted over each device's tokens.")
    moe_aux_loss_coef: float = _f(0.01, "Weight of the load-balancing loss (mean over MoE blocks) in the training objective.")
    moe_z_loss_coef: float = _f(0.001, "Weight of the router z-loss (mean squared log-sum-exp of the router logits) in the training objective.")

    def ffn_params(self, active: bool = False) -> int:
        """Matmul parameters of all feed-forward blocks (dense MLPs, routers, experts, shared experts).

        ``active=True`` counts only the moe_top_k experts one token runs through.
        """
        d, L = self.d_model, self.n_layers
        if not self.moe_experts:
            return L * 3 * d * self.d_ff
        n_moe = L // self.moe_every
        experts = self.moe_top_k if active else self.moe_experts
        moe = d * self.moe_experts + experts * 3 * d * (self.moe_d_ff or self.d_ff) + 3 * d * self.moe_shared_d_ff
        return (L - n_moe) * 3 * d * self.d_ff + n_moe * moe

    def num_params(self, active: bool = False) -> int:
        """Parameter count (embedding included, tied output counted once); ``active``: per token (MoE)."""
        d, v, L = self.d_model, self.vocab_size, self.n_layers
        attn = d * self.n_heads * self.head_dim * 2 + d * self.n_kv_heads * self.head_dim * 2
        block = attn + 2 * d
        out = 0 if self.tie_embeddings else d * v
        return v * d + L * block + self.ffn_params(active) + d + out


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: compiles in a second, still has every feature (GQA, scan over 2 layers).
    "tiny": dict(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                 d_ff=128, max_seq_len=128),
    # The embedded default: trains in a few minutes on 2 CPU cores.
    "small": dict(vocab_size=260, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32,
                  d_ff=384, max_seq_len=128),
    # Real shapes, for planning and for GPUs.
    "llama-1b": dict(vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                     head_dim=64, d_ff=8192, max_seq_len=4096, rope_theta=500000.0,
                     tie_embeddings=True, dtype="bfloat16"),
    "llama-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                     head_dim=128, d_ff=14336, max_seq_len=8192, rope_theta=500000.0,
                     tie_embeddings=False, dtype="bfloat16"),
    "llama-70b": dict(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                      head_dim=128, d_ff=28672, max_seq_len=8192, rope_theta=500000.0,
                      tie_embeddings=False, dtype="bfloat16"),
    # Mixture of experts.  Tests and `jaxdist train model=moe-tiny`: 8 experts, top-2.
    "moe-tiny": dict(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                     d_ff=128, max_seq_len=128, moe_experts=8, moe_top_k=2, moe_d_ff=64),
    # Real shapes, for planning: Mixtral-8x7B (8 experts, top-2, 46.7B params, 12.9B active).
    "mixtral-8x7b": dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         head_dim=128, d_ff=14336, max_seq_len=32768, rope_theta=1e6,
                         tie_embeddings=False, dtype="bfloat16", moe_experts=8, moe_top_k=2),
    # Fine-grained experts shaped like DeepSeekMoE-16B: 64 small experts, top-6, 2 shared (as one of width 2x1408).
    "deepseek-moe-16b": dict(vocab_size=102400, d_model=2048, n_layers=28, n_heads=16, n_kv_heads=16,
                             head_dim=128, d_ff=10944, max_seq_len=4096, tie_embeddings=False,
                             dtype="bfloat16", moe_experts=64, moe_top_k=6, moe_d_ff=1408,
                             moe_shared_d_ff=2816),
}


# --------------------------------------------------------------------------- mesh

MESH_AXES = ("data", "fsdp", "tensor", "expert", "pipeline")


@dataclass
class MeshConfig:
    """Device mesh shape and the cluster it runs on."""

    cluster: str = _f("cpu-8", "Cluster description: a name in meshes/ (cpu-8, h100x8, ...) or a path to a TOML file.")
    data: int = _f(-1, "Data-parallel replicas; -1 takes every device the other axes leave.")
    fsdp: int = _f(1, "Fully sharded data parallel: parameters and optimizer state sharded, gathered per layer.")
    tensor: int = _f(1, "Tensor (Megatron) parallel size; kept inside a node.")
    expert: int = _f(1, "Expert-parallel size (MoE models).")
    pipeline: int = _f(1, "Pipeline stages.")
    expert_tensor: int = _f(0, "Tensor-parallel size inside one expert (MoE); 0 uses mesh.tensor. A smaller divisor of mesh.tensor keeps attention at mesh.tensor and gives the rest of the tensor axis to the experts: they are then split expert*tensor/expert_tensor ways.")
    auto: bool = _f(False, "Let jaxdist.planner choose the axis sizes, train.microbatches and train.remat at start-up for the devices present (the axis sizes above are then ignored); `mesh=auto` on the CLI or `mesh = \"auto\"` in TOML sets it.")

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    def checked_sizes(self) -> dict[str, int]:
        """Axis sizes, each a positive integer (or -1 for data); raises ConfigError otherwise."""
        sizes = self.sizes()
        for a, s in sizes.items():
            if s == 0 or s < -1 or (s == -1 and a != "data"):
                raise ConfigError(f"mesh.{a}={s} is not a valid axis size: use a positive integer"
                                  + (" (or -1 to fill the remaining devices)" if a == "data" else "") + ".")
        return sizes

    def resolved(self, n_devices: int) -> dict[str, int]:
        """Axis sizes with ``data=-1`` filled in; raises ConfigError if they do not multiply to n_devices."""
        sizes = self.checked_sizes()
        others = math.prod(s for a, s in sizes.items() if a != "data")
        if sizes["data"] == -1:
            if n_devices % others:
                raise ConfigError(
                    f"mesh fsdp*tensor*expert*pipeline = {others} does not divide the {n_devices} devices: "
                    f"choose axis sizes whose product divides {n_devices}.")
            sizes["data"] = n_devices // others
        total = math.prod(sizes.values())
        if total != n_devices:
            shape = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "1"
            raise ConfigError(
                f"mesh {shape} has {total} devices but {n_devices} are available: "
                f"make the axis sizes multiply to {n_devices} (or set mesh.data=-1).")
        return sizes


# --------------------------------------------------------------------------- train

@dataclass
class TrainConfig:
    """Optimisation, schedule, logging and where the run lives."""

    name: str = _f("default", "Run name; outputs go to <runs_dir>/<name>/.")
    runs_dir: str = _f("runs", "Directory holding one folder per run.")
    steps: int = _f(300, "Optimizer steps to train.")
    batch_size: int = _f(32, "Global batch size in sequences per optimizer step.")
    seq_len: int = _f(128, "Tokens per training sequence.")
    microbatches: int = _f(1, "Gradient accumulation: the global batch is split into this many microbatches.")
    learning_rate: float = _f(3e-3, "Peak learning rate of AdamW.")
    warmup_steps: int = _f(30, "Linear warmup steps from 0 to the peak learning rate.")
    min_lr_ratio: float = _f(0.1, "Cosine decay ends at learning_rate * min_lr_ratio.")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (not applied to norms).")
    b1: float = _f(0.9, "AdamW beta1.")
    b2: float = _f(0.95, "AdamW beta2.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value (0 disables).")
    seed: int = _f(0, "Seed for parameter initialisation and the training RNG.")
    remat: str = _f("none", "Activation recomputation policy for each block: none (save everything), full (save nothing), auto (chosen from operator costs within the memory budget; see `jaxdist remat`), save:NAME[,NAME] (save these checkpoint names), or a jax.checkpoint_policies name such as dots_saveable.")
    remat_budget_bytes: int = _f(0, "With train.remat=auto: bytes per device for the saved activations of all blocks (block inputs included); 0 derives it from the device memory in meshes/ minus parameters, gradients, optimizer state and working space.")
    log_every: int = _f(10, "Write metrics every N steps (console, JSONL, TensorBoard).")
    eval_every: int = _f(100, "Evaluate on the held-out split every N steps (0: only at the end).")
    eval_batches: int = _f(4, "Held-out batches per evaluation.")
    progress: bool = _f(True, "Show a progress bar on the console (process 0 only).")
    tensorboard: bool = _f(True, "Write TensorBoard event files under <run>/tb/.")
    pipeline_schedule: str = _f("seq1f1b", "Pipeline schedule when mesh.pipeline > 1: gpipe, 1f1b, or seq1f1b (1F1B over sequence chunks); train.microbatches is the number of pipeline microbatches.")
    pipeline_chunks: int = _f(2, "seq1f1b: chunks each sequence is split into along the sequence axis (1 makes it 1f1b); the other schedules ignore it.")
    pipeline_chunk_split: str = _f("cost", "seq1f1b chunk boundaries: cost (equal attention + MLP FLOPs per chunk, later chunks shorter) or equal (equal token counts).")


# --------------------------------------------------------------------------- data

@dataclass
class DataConfig:
    """Where tokens come from and how they are split."""

    source: str = _f("stdlib", "stdlib (the Python standard library's .py files, byte-tokenized), text_dir (a directory of text files) or tokens (a flat token file).")
    path: str = _f("", "Directory (text_dir) or file (tokens); unused for stdlib.")
    token_dtype: str = _f("uint16", "Element type of a token file: uint16 or uint32.")
    eval_fraction: float = _f(0.05, "Share of files (or of the token file's tail) held out for evaluation.")
    seed: int = _f(0, "Seed of the sample order.")
    max_bytes: int = _f(0, "Read at most this many bytes of text (0: all); keeps tests small.")


# --------------------------------------------------------------------------- checkpoint

@dataclass
class CheckpointConfig:
    """Orbax checkpointing of params, optimizer state, step, RNG and data position."""

    enabled: bool = _f(True, "Write checkpoints under <run>/checkpoints/.")
    every: int = _f(100, "Save every N steps (and always at the end).")
    keep: int = _f(3, "Keep the last K checkpoints.")
    asynchronous: bool = _f(True, "Save in the background; the step waits only for the device-to-host copy.")
    resume: bool = _f(True, "Resume from the latest checkpoint in the run directory if there is one.")
    local_dir: str = _f("", "Node-local directory of the fast tier ('' = off; {node} becomes the node's name): every local_every steps each process writes its shards there and a copy of one other node's, so at most local_every steps are lost even when a node is.")
    local_every: int = _f(1, "With local_dir: save to the fast local tier every N steps.")
    local_keep: int = _f(2, "With local_dir: newest local steps each process keeps.")


# --------------------------------------------------------------------------- controller

CONTROLLER_LAUNCHERS = ("local", "ssh", "slurm", "kubernetes")
CONTROLLER_RECOVERY = ("standby", "requeue")


@dataclass
class ControllerConfig:
    """`jaxdist launch` / `jaxdist controller`: membership, health checks and recovery (jaxdist/controller/)."""

    bind: str = _f("127.0.0.1", "Address the controller listens on; anything but loopback needs controller.allow_remote=true.")
    port: int = _f(0, "TCP port of the controller (0: a free one, written to <run>/controller/endpoint).")
    allow_remote: bool = _f(False, "Allow listening beyond loopback (multi-host without SSH tunnels); every message stays HMAC-authenticated with the job token.")
    launcher: str = _f("local", "Where `jaxdist launch` starts node agents: local, ssh, slurm or kubernetes.")
    hosts_file: str = _f("", "SSH launcher: a file with one host per line.")
    min_nodes: int = _f(1, "Training starts as soon as this many nodes are ready.")
    max_nodes: int = _f(0, "Train on at most this many nodes (0: the cluster description's node count); the others wait as standbys.")
    standbys: int = _f(1, "Nodes `jaxdist launch` starts beyond max_nodes, as warm standbys.")
    heartbeat_interval: float = _f(0.25, "Seconds between two heartbeats of a worker or node agent.")
    heartbeat_timeout: float = _f(1.5, "A training worker or a node agent silent this long (seconds) is declared failed.")
    heartbeat_grace: float = _f(15.0, "How long (seconds) a worker's heartbeats may pause while it is starting, or while its connection still answers ZeroMQ's own heartbeats (sent outside the Python GIL): compiling can hold the GIL for seconds on a busy host. A stopped or hung process is caught by heartbeat_timeout all the same.")
    progress_timeout: float = _f(120.0, "A training group whose step does not advance for this long (seconds) is declared failed.")
    start_timeout: float = _f(900.0, "Seconds a group may take from its assignment to its first step (join, restore, compile).")
    max_failures: int = _f(2, "A node that failed this many times is not used again.")
    recovery: str = _f("standby", "After a failure: standby (restart the group from warm processes, a standby in the failed rank) or requeue (every process restarted cold, like a requeued job).")
    warm_spares: int = _f(1, "Warm worker processes (JAX imported, data loaded, waiting for a rank) each node agent keeps ready.")
    setup_cache: str = _f("", "Directory of the cluster setup cache (rank layout, coordinator, compilation cache, NCCL files); empty: <runs_dir>/.setup_cache.")
    worker_command: str = _f("", "Command a node agent runs for one worker, the job's config arguments appended; empty: python -m jaxdist.cli train.")


# --------------------------------------------------------------------------- whole

@dataclass
class Config:
    """A whole training job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.train.runs_dir) / self.train.name


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}
_SECTION_CLASSES = {"model": ModelConfig, "mesh": MeshConfig, "train": TrainConfig,
                    "data": DataConfig, "checkpoint": CheckpointConfig, "controller": ControllerConfig}


def _all_keys() -> list[str]:
    return [f"{s}.{f.name}" for s, cls in _SECTION_CLASSES.items() for f in dataclasses.fields(cls)]


def _unknown(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys() + list(_SECTION_CLASSES), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else "; see the configuration reference in README.md."
    return ConfigError(f"unknown config key '{key}'{hint}")


def _field_type(cls, name: str):
    hints = typing.get_type_hints(cls)
    return hints[name]


def _coerce(key: str, value: Any, typ) -> Any:
    """Convert a TOML or CLI value to the field's type, or raise ConfigError."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        typ = args[0]
    try:
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if typ is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            return str(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    article = "an" if typ.__name__[0] in "aeiou" else "a"
    raise ConfigError(f"config key '{key}' needs {article} {typ.__name__}, got {value!r}.")


def apply_preset(model: ModelConfig, name: str) -> ModelConfig:
    """A ModelConfig with the preset's fields (others keep their values)."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset '{name}': choose one of {', '.join(MODEL_PRESETS)}.")
    return dataclasses.replace(model, preset=name, **MODEL_PRESETS[name])


def _set(cfg: Config, key: str, value: Any) -> None:
    if key == "model":
        cfg.model = apply_preset(cfg.model, str(value))
        return
    if key == "mesh" and str(value).lower() == "auto":  # mesh=auto: the planner picks the mesh
        cfg.mesh.auto = True
        return
    parts = key.split(".")
    if len(parts) != 2 or parts[0] not in _SECTION_CLASSES:
        raise _unknown(key)
    section, name = parts
    cls = _SECTION_CLASSES[section]
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise _unknown(key)
    if section == "model" and name == "preset":
        cfg.model = apply_preset(cfg.model, str(value))
        return
    setattr(getattr(cfg, section), name, _coerce(key, value, _field_type(cls, name)))


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.extend(_flatten(v, key + "."))
        else:
            out.append((key, v))
    return out


def _ordered(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    # Presets first, so that model.* keys given beside them win.
    return sorted(items, key=lambda kv: kv[0] not in ("model", "model.preset"))


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """``["train.steps=5", "--mesh.tensor", "2"]`` -> ``[("train.steps", "5"), ("mesh.tensor", "2")]``."""
    out, i = [], 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            a = a[2:]
            if "=" not in a:
                if i + 1 >= len(args):
                    raise ConfigError(f"override '--{a}' has no value: write --{a}=VALUE.")
                a = f"{a}={args[i + 1]}"
                i += 1
        if "=" not in a:
            raise ConfigError(f"override '{a}' is not KEY=VALUE: write it like train.steps=200.")
        k, v = a.split("=", 1)
        if not k.strip():
            raise ConfigError(f"override '{a}' has no key: write it like train.steps=200.")
        out.append((k.strip(), v.strip()))
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the TOML file at ``path``, then dotted overrides; validated without devices."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist: check the path given to --config.")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{p}' is not valid TOML ({e}): fix the syntax.") from None
        for k, v in _ordered(_flatten(data)):
            _set(cfg, k, v)
    for k, v in _ordered(parse_overrides(list(overrides or []))):
        _set(cfg, k, v)
    from jaxdist.config_checks import validate  # here: config_checks imports this module

    validate(cfg)
    return cfg


def from_dict(d: dict[str, Any]) -> Config:
    """Rebuild a Config from ``Config.to_dict()`` output (as stored with a run)."""
    cfg = Config()
    for k, v in _flatten(d):
        if k == "model.preset":
            cfg.model.preset = v
            continue
        _set(cfg, k, v)
    return cfg


# --------------------------------------------------------------------------- docs

def reference_markdown() -> str:
    """The configuration reference as Markdown tables (embedded in README.md)."""
    lines = []
    for section, cls in _SECTION_CLASSES.items():
        lines.append(f"### `[{section}]` — {cls.__doc__.strip()}")
        lines.append("")
        lines.append("| key | default | meaning |")
        lines.append("| --- | --- | --- |")
        default = cls()
        for f in dataclasses.fields(cls):
            v = getattr(default, f.name)
            lines.append(f"| `{section}.{f.name}` | `{v!r}` | {f.metadata['help']} |")
        lines.append("")
    lines.append("Model presets: " + ", ".join(f"`{k}`" for k in MODEL_PRESETS) + ".")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m jaxdist.config > reference
    print(reference_markdown())

"""The sections of a config: one frozen dataclass per TOML table, every field with its help text.

``jaxdist.config`` re-exports every name here and adds the whole :class:`~jaxdist.config.Config`,
reading (defaults, TOML, dotted overrides) and the reference; import from there.  Each section
checks itself (``check()``, in :mod:`jaxdist.config_checks`).  No JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxdist.config_checks import (
    check_checkpoint,
    check_checkpoint_names,
    check_data,
    check_mesh,
    check_model,
    check_moe,
    check_pipeline,
    check_train,
)
from jaxdist.errors import ConfigError

# Every choice a config field offers, defined once (the checks and the CLI read them with `choices`).
DType = Literal["float32", "bfloat16"]
Router = Literal["softmax", "sigmoid"]
RopeScaling = Literal["none", "linear", "llama3"]
Dispatch = Literal["dropless", "capacity"]
PipelineSchedule = Literal["gpipe", "1f1b", "seq1f1b"]
ChunkSplit = Literal["cost", "equal"]
GradSync = Literal["end", "per_block", "ordered"]
DataSource = Literal["stdlib", "text_dir", "tokens"]
TokenDType = Literal["uint16", "uint32"]
Launcher = Literal["local", "ssh", "slurm", "kubernetes"]
Recovery = Literal["standby", "requeue"]
CrashedRank = Literal["same_node", "standby"]
Attention = Literal["auto", "xla", "blockwise", "cudnn"]
Tracker = Literal["none", "wandb", "mlflow"]
PIPELINE_SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)


def _f(default, help: str, **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


# --------------------------------------------------------------------------- model


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts (the ``[model.moe]`` table): routed experts per MoE block; experts = 0 makes a dense model."""

    experts: int = _f(0, "Routed experts per MoE block; 0 makes a dense model.")
    top_k: int = _f(2, "Experts each token is routed to (the k of top-k), 1..experts.")
    d_ff: int = _f(0, "Hidden width of one expert's SwiGLU FFN; 0 uses d_ff.")
    every: int = _f(
        1,
        "Every k-th block is an MoE block (blocks k-1, 2k-1, ...), the others keep the dense MLP; must divide n_layers.",
    )
    shared_d_ff: int = _f(0, "Hidden width of a shared expert every token also goes through (0: none).")
    router: Router = _f("softmax", "Router scores: softmax (Mixtral) or sigmoid (DeepSeek-V3).")
    renormalize: bool = _f(True, "Rescale each token's k expert weights to sum to 1.")
    dispatch: Dispatch = _f(
        "dropless",
        "dropless (tokens sorted by expert, grouped matmul, none dropped) or capacity (fixed slots per expert, overflow dropped).",
    )
    capacity_factor: float = _f(
        1.25,
        "Capacity mode: slots per expert = ceil(factor x tokens x k / experts), counted over each device's tokens.",
    )
    aux_loss_coef: float = _f(
        0.01, "Weight of the load-balancing loss (mean over MoE blocks) in the training objective."
    )
    z_loss_coef: float = _f(
        0.001, "Weight of the router z-loss (mean squared log-sum-exp of the router logits) in the training objective."
    )

    def check(self) -> None:
        """ConfigError (one sentence) for MoE settings that cannot work by themselves."""
        check_moe(self)


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape and numerics."""

    preset: str = _f(
        "small", "Preset the other model fields start from (see MODEL_PRESETS); `model=NAME` on the CLI sets it."
    )
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
    dtype: DType = _f("float32", "Compute dtype of activations and matmuls: float32 or bfloat16.")
    param_dtype: DType = _f(
        "float32", "Storage dtype of the master weights: float32 (recommended with bf16 compute) or bfloat16."
    )
    init_std: float = _f(0.02, "Standard deviation of the normal weight initialiser.")
    attention: Attention = _f(
        "auto",
        "Attention implementation: xla (whole [T, T] scores), blockwise (online softmax over key/value blocks, "
        "memory linear in T), cudnn (fused, CUDA GPUs, bfloat16), or auto (cudnn where supported, else blockwise "
        "from 2048 tokens, else xla).",
    )
    attention_block: int = _f(512, "Tokens per query and key/value block of blockwise attention.")
    rope_scaling: RopeScaling = _f(
        "none",
        "Rotary frequency scaling: none, linear (every frequency / rope_factor) or llama3 (Llama 3.1's blend).",
    )
    rope_factor: float = _f(1.0, "Rotary scaling factor of rope_scaling=linear or llama3.")
    rope_low_freq_factor: float = _f(
        1.0, "llama3 scaling: wavelengths above rope_original_max_len / this are divided by rope_factor."
    )
    rope_high_freq_factor: float = _f(
        4.0, "llama3 scaling: wavelengths below rope_original_max_len / this are kept (blended in between)."
    )
    rope_original_max_len: int = _f(8192, "llama3 scaling: the context length the model was pretrained with (tokens).")
    qkv_bias: bool = _f(False, "Learned biases on the query, key and value projections (Qwen2).")
    qk_norm: bool = _f(False, "RMSNorm of each query and key head over head_dim, before the rotary embedding (Qwen3).")
    init_from: str = _f(
        "",
        "A Hugging Face model directory (config.json + *.safetensors): the model fields come from its config.json, "
        "a run without a checkpoint starts from its weights, and its tokenizer (tokenizer.json or tokenizer.model) "
        "is data.tokenizer for data.source=tokens unless that is set.",
    )
    moe: "MoEConfig" = field(
        default_factory=lambda: MoEConfig(), metadata={"help": "Mixture of experts: the `[model.moe]` table (below)."}
    )

    def check(self) -> None:
        """ConfigError (one sentence) for model settings that cannot work by themselves."""
        check_model(self)


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # Tests: compiles in a second, still has every feature (GQA, scan over 2 layers).
    "tiny": dict(
        vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, max_seq_len=128
    ),
    # The embedded default: trains in a few minutes on 2 CPU cores.
    "small": dict(
        vocab_size=260, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384, max_seq_len=128
    ),
    # Real shapes, for planning and for GPUs.
    "llama-1b": dict(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        d_ff=8192,
        max_seq_len=4096,
        rope_theta=500000.0,
        tie_embeddings=True,
        dtype="bfloat16",
    ),
    "llama-8b": dict(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
        dtype="bfloat16",
    ),
    "llama-70b": dict(
        vocab_size=128256,
        d_model=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        head_dim=128,
        d_ff=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
        tie_embeddings=False,
        dtype="bfloat16",
    ),
    # Mixture of experts.  Tests and `jaxdist train model=moe-tiny`: 8 experts, top-2.
    "moe-tiny": dict(
        vocab_size=260,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=128,
        max_seq_len=128,
        moe=dict(experts=8, top_k=2, d_ff=64),
    ),
    # Real shapes, for planning: Mixtral-8x7B (8 experts, top-2, 46.7B params, 12.9B active).
    "mixtral-8x7b": dict(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=14336,
        max_seq_len=32768,
        rope_theta=1e6,
        tie_embeddings=False,
        dtype="bfloat16",
        moe=dict(experts=8, top_k=2),
    ),
    # Qwen3 (per-head q/k RMSNorm, rope_theta 1e6): Qwen3-0.6B and Qwen3-8B, for planning and `model.init_from`.
    "qwen3-0.6b": dict(
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        d_ff=3072,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=True,
        qk_norm=True,
        dtype="bfloat16",
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        d_model=4096,
        n_layers=36,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        d_ff=12288,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        dtype="bfloat16",
    ),
    # Qwen3-30B-A3B: 128 experts of width 768, top-8 renormalised (norm_topk_prob), 30.5B params, 3.3B active.
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        d_model=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        head_dim=128,
        d_ff=6144,
        max_seq_len=40960,
        rope_theta=1e6,
        norm_eps=1e-6,
        tie_embeddings=False,
        qk_norm=True,
        dtype="bfloat16",
        moe=dict(experts=128, top_k=8, d_ff=768, renormalize=True),
    ),
    # Fine-grained experts shaped like DeepSeekMoE-16B: 64 small experts, top-6, 2 shared (as one of width 2x1408).
    "deepseek-moe-16b": dict(
        vocab_size=102400,
        d_model=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=16,
        head_dim=128,
        d_ff=10944,
        max_seq_len=4096,
        tie_embeddings=False,
        dtype="bfloat16",
        moe=dict(experts=64, top_k=6, d_ff=1408, shared_d_ff=2816),
    ),
}


# --------------------------------------------------------------------------- mesh

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert", "pipeline")


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh shape and the cluster it runs on."""

    cluster: str = _f(
        "cpu-8",
        "Cluster description: a name in meshes/ (cpu-8, h100x8, ...) or a path to a TOML file; for `jaxdist plan` and `jaxdist launch` (controller.launcher=slurm) also slurm:PARTITION[@CLUSTER]: the partition's free GPUs (nodes, GPUs per node, what other jobs hold: sinfo, scontrol) with the per-device figures of the cluster file CLUSTER (default: the preset named by the GPUs' GRES type); launch asks Slurm for the best shape of them and runs the job on its cluster file (<run>/controller/cluster.toml).",
    )
    data: int = _f(-1, "Data-parallel replicas; -1 takes every device the other axes leave.")
    fsdp: int = _f(1, "Fully sharded data parallel: parameters and optimizer state sharded, gathered per layer.")
    context: int = _f(
        1,
        "Context-parallel size: each sequence is split over this many devices (kept inside a node), attention passes keys/values around them in a ring; train.seq_len must divide into 2*context chunks.",
    )
    tensor: int = _f(1, "Tensor (Megatron) parallel size; kept inside a node.")
    expert: int = _f(1, "Expert-parallel size (MoE models).")
    pipeline: int = _f(1, "Pipeline stages.")
    expert_tensor: int = _f(
        0,
        "Tensor-parallel size inside one expert (MoE); 0 uses mesh.tensor. A smaller divisor of mesh.tensor keeps attention at mesh.tensor and gives the rest of the tensor axis to the experts: they are then split expert*tensor/expert_tensor ways.",
    )
    auto: bool = _f(
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
    def parse(cls, value: str) -> "Remat":
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
            check_checkpoint_names(value, names)
            return cls("names", names=names)
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


# --------------------------------------------------------------------------- train


@dataclass(frozen=True)
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
    schedule_steps: int = _f(
        0,
        "Length in steps of the learning-rate schedule (warmup, then cosine decay); 0: train.steps when the run starts. The length is recorded in the checkpoints, so a resumed run with another train.steps keeps it (past its end the rate stays at learning_rate * min_lr_ratio) unless this sets a new one.",
    )
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (not applied to norms).")
    b1: float = _f(0.9, "AdamW beta1.")
    b2: float = _f(0.95, "AdamW beta2.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value (0 disables).")
    grad_sync: GradSync = _f(
        "end",
        "When the gradients are reduced over the data axes: end (after the whole backward pass, XLA's automatic sharding) or per_block (each bucket of blocks right after its backward, in a shard_map over data and fsdp, so the reduction overlaps the rest of the backward pass; see `jaxdist comm plan`). With pipeline stages each stage reduces its blocks' gradients once per step, right after its last backward. per_block needs a dense model, no context or expert axis, and train.microbatches=1 unless mesh.pipeline > 1. ordered: the batch's units of train.grad_unit_rows rows are differentiated one by one and their gradients added in one fixed binary tree, so the step has the same bits whatever the number of devices on the data axes (a shrunk or grown group continues the uninterrupted run exactly); it costs a sequential loop over units and an all-gather of whole gradients (benchmarks/ordered_sum.py), and needs a dense model on the data and fsdp axes only with train.microbatches=1.",
    )
    grad_unit_rows: int = _f(
        1,
        "Rows per unit with train.grad_sync=ordered: train.batch_size / grad_unit_rows must be a power of two that every data-parallel group size you run divides.",
    )
    grad_bucket_bytes: int = _f(
        0,
        "Gradient bytes per device one collective may carry with train.grad_sync=per_block (consecutive layers are bucketed up to it); 0 chooses it from the cluster's link bandwidth x latency (`jaxdist comm plan` prints the rule).",
    )
    skip_nonfinite: int = _f(
        0,
        "Steps with a non-finite loss or gradient norm to skip (their update is not applied, their batch counts as trained, each is logged) before one more stops the run; a stopped run keeps only checkpoints from before that step. Counted from the process's start.",
    )
    seed: int = _f(0, "Seed for parameter initialisation and the training RNG.")
    remat: str = _f(
        "none",
        "Activation recomputation policy for each block: none (save everything), full (save nothing), auto (chosen from operator costs within the memory budget; see `jaxdist remat`), save:NAME[,NAME] (save these checkpoint names), or a jax.checkpoint_policies name such as dots_saveable.",
    )
    remat_budget_bytes: int = _f(
        0,
        "With train.remat=auto: an extra bound on the saved activations of all blocks (block inputs included, bytes per device), beside train.memory_budget_bytes which bounds the whole compiled peak; 0: no extra bound (with train.remat_verify=false: derived from the device memory minus parameters, gradients, optimizer state and working space).",
    )
    memory_budget_bytes: int = _f(
        0,
        "Bytes per device the compiled train step may hold at its peak (arguments + outputs + temp - aliased, as XLA's memory_analysis() reports); 0: the cluster file's memory_bytes less a 10% reserve for the runtime and fragmentation. train.remat=auto and `jaxdist plan --verify` choose against it by compiling their best candidates.",
    )
    remat_verify: bool = _f(
        True,
        "With train.remat=auto: compile the best candidates ahead of time (at most 3 in the normal course) and keep the fastest whose compiled peak fits train.memory_budget_bytes; false trusts the prediction (no compile; the plan then only bounds saved activations by train.remat_budget_bytes or the predicted budget).",
    )
    remat_slack: float = _f(
        0.0,
        "With train.remat=auto: recompute the selector may add beyond the least possible within the budget, as a share of the save-nothing recompute, to save fewer bytes (it then takes the fewest bytes within that slack); 0 takes the least-recompute plan (the optimum at the budget). `jaxdist remat` prints the gap to the optimum.",
    )
    log_every: int = _f(10, "Write metrics every N steps (console, JSONL, TensorBoard).")
    eval_every: int = _f(100, "Evaluate on the held-out split every N steps (0: only at the end).")
    eval_batches: int = _f(4, "Held-out batches per evaluation (0: no evaluation at all).")
    progress: bool = _f(True, "Show a progress bar on the console (process 0 only).")
    tensorboard: bool = _f(True, "Write TensorBoard event files under <run>/tb/.")
    profile_steps: tuple[int, ...] = _f(
        (),
        "[a, b]: write a JAX profiler trace of steps a..b (counted from 1, inclusive) under <run>/profile/ (TensorBoard's profile plugin or Perfetto); []: none.",
    )
    tracker: Tracker = _f(
        "none",
        "Also send metrics to an experiment tracker: none, wandb or mlflow (the package must be installed; never required).",
    )

    @functools.cached_property
    def remat_spec(self) -> Remat:
        """``remat`` parsed (once per config; ConfigError if it cannot be parsed), or, on the copy that
        :meth:`with_remat_plan` made, what the selector chose for ``auto``."""
        return Remat.parse(self.remat)

    def with_remat_plan(self, plan: Any) -> "TrainConfig":
        """A copy whose ``remat_spec`` is the remat selector's ``plan`` (``train.remat`` stays ``auto``): a
        jaxdist.remat.plan.RematPlan, or the closed loop's jaxdist.remat.verify.VerifiedChoice (both have
        ``policy()``).

        Set by jaxdist.resolve.resolve; a section replaced later parses ``auto`` again (its batch or mesh may
        differ), and a resumed run selects again, alike.
        """
        assert self.remat == "auto", "only train.remat=auto is resolved to a plan"
        out = dataclasses.replace(self)
        out.__dict__["remat_spec"] = Remat("selected", plan=plan)  # the cached parse, settled
        return out

    def check(self) -> None:
        """ConfigError (one sentence) for train settings that cannot work by themselves."""
        check_train(self)
        self.remat_spec  # noqa: B018  (parses train.remat: a bad value fails at load time)


# --------------------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline schedule when mesh.pipeline > 1 (train.microbatches is the number of pipeline microbatches)."""

    schedule: PipelineSchedule = _f(
        "seq1f1b",
        "Pipeline schedule when mesh.pipeline > 1: gpipe, 1f1b, or seq1f1b (1F1B over sequence chunks); train.microbatches is the number of pipeline microbatches.",
    )
    chunks: int = _f(
        2,
        "seq1f1b: chunks each sequence is split into along the sequence axis (1 makes it 1f1b); the other schedules ignore it.",
    )
    chunk_split: ChunkSplit = _f(
        "cost",
        "seq1f1b chunk boundaries: cost (equal attention + MLP FLOPs per chunk, later chunks shorter) or equal (equal token counts).",
    )

    def check(self) -> None:
        """ConfigError (one sentence) for pipeline settings that cannot work by themselves."""
        check_pipeline(self)


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are split."""

    source: DataSource = _f(
        "stdlib",
        "stdlib (the Python standard library's .py files, byte-tokenized), text_dir (a directory of text files) or tokens (a flat token file).",
    )
    path: str = _f("", "Directory (text_dir) or file (tokens); unused for stdlib.")
    token_dtype: TokenDType = _f("uint16", "Element type of a token file: uint16 or uint32.")
    eval_fraction: float = _f(0.05, "Share of files (or of the token file's tail) held out for evaluation.")
    seed: int = _f(0, "Seed of the sample order.")
    max_bytes: int = _f(0, "Read at most this many bytes of text (0: all); keeps tests small.")
    tokenizer: str = _f(
        "bytes",
        "bytes (one token per UTF-8 byte, 260 ids) or the path of a Hugging Face tokenizer.json or a SentencePiece .model; with a file, model.vocab_size follows its vocabulary unless set, and text is tokenized with `jaxdist data prepare` (data.source=tokens).",
    )

    def check(self) -> None:
        """ConfigError (one sentence) for data settings that cannot work by themselves."""
        check_data(self)


# --------------------------------------------------------------------------- checkpoint


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing of params, optimizer state, step, RNG and data position."""

    enabled: bool = _f(True, "Write checkpoints under <run>/checkpoints/.")
    every: int = _f(100, "Save every N steps (and always at the end).")
    keep: int = _f(3, "Keep the last K checkpoints.")
    asynchronous: bool = _f(True, "Save in the background; the step waits only for the device-to-host copy.")
    resume: bool = _f(True, "Resume from the latest checkpoint in the run directory if there is one.")
    local_dir: str = _f(
        "auto",
        "Node-local directory of the fast tier ({node} becomes the node's name; '' = off): every local_every steps each process writes its shards there and a copy of one other node's, so at most local_every steps are lost even when a node is. auto: on in a job started by jaxdist launch (under a node agent), in <system temporary directory>/jaxdist-local/{node}, when every process's disk there has room for 6 times its shards (own and replica, local_keep+1 steps); off otherwise (jaxdist train, or too little room: logged).",
    )
    local_every: int = _f(1, "With local_dir: save to the fast local tier every N steps.")
    local_keep: int = _f(2, "With local_dir: newest local steps each process keeps.")

    def check(self) -> None:
        """ConfigError (one sentence) for checkpoint settings that cannot work by themselves."""
        check_checkpoint(self)

"""The ``[train]``, ``[pipeline]``, ``[data]`` and ``[checkpoint]`` sections; each checks itself.  No JAX."""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from dataclasses import dataclass
from pathlib import Path

from jaxdist.config.fields import (
    ChunkSplit,
    DataSource,
    GradSync,
    Packing,
    PipelineSchedule,
    TokenDType,
    Tracker,
    choices,
    one_of,
    option,
)
from jaxdist.config.mesh import Remat
from jaxdist.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, schedule, logging and where the run lives."""

    name: str = option("default", "Run name; outputs go to <runs_dir>/<name>/.")
    runs_dir: str = option("runs", "Directory holding one folder per run.")
    steps: int = option(300, "Optimizer steps to train.")
    batch_size: int = option(32, "Global batch size in sequences per optimizer step.")
    seq_len: int = option(128, "Tokens per training sequence.")
    microbatches: int = option(1, "Gradient accumulation: the global batch is split into this many microbatches.")
    learning_rate: float = option(3e-3, "Peak learning rate of AdamW.")
    warmup_steps: int = option(30, "Linear warmup steps from 0 to the peak learning rate.")
    min_lr_ratio: float = option(0.1, "Cosine decay ends at learning_rate * min_lr_ratio.")
    schedule_steps: int = option(
        0,
        "Length in steps of the learning-rate schedule (warmup, then cosine decay); 0: train.steps when the run starts. The length is recorded in the checkpoints, so a resumed run with another train.steps keeps it (past its end the rate stays at learning_rate * min_lr_ratio) unless this sets a new one.",
    )
    weight_decay: float = option(0.1, "AdamW decoupled weight decay (not applied to norms).")
    b1: float = option(0.9, "AdamW beta1.")
    b2: float = option(0.95, "AdamW beta2.")
    grad_clip: float = option(1.0, "Clip the global gradient norm to this value (0 disables).")
    grad_sync: GradSync = option(
        "end",
        "When the gradients are reduced over the data axes: end (after the whole backward pass, XLA's automatic sharding) or per_block (each bucket of blocks right after its backward, in a shard_map over data and fsdp, so the reduction overlaps the rest of the backward pass; see `jaxdist comm plan`). With pipeline stages each stage reduces its blocks' gradients once per step, right after its last backward. per_block needs no context axis, train.microbatches=1 unless mesh.pipeline > 1, and for an MoE model each expert on all of mesh.tensor (its dense weights are then reduced over data x expert, its experts over data) and, with pipeline stages, the 1f1b or seq1f1b schedule and dropless dispatch (whose stages reduce this way under either setting). ordered: the batch's units of train.grad_unit_rows rows are differentiated one by one and their gradients added in one fixed binary tree, so the step has the same bits whatever the number of devices on the data axes (a shrunk or grown group continues the uninterrupted run exactly); it costs a sequential loop over units and an all-gather of whole gradients (benchmarks/ordered_sum.py), and needs a dense model on the data and fsdp axes only with train.microbatches=1.",
    )
    grad_unit_rows: int = option(
        1,
        "Rows per unit with train.grad_sync=ordered: train.batch_size / grad_unit_rows must be a power of two that every data-parallel group size you run divides.",
    )
    grad_bucket_bytes: int = option(
        0,
        "Gradient bytes per device one collective may carry with train.grad_sync=per_block (consecutive layers are bucketed up to it); 0 chooses it from the cluster's link bandwidth x latency (`jaxdist comm plan` prints the rule).",
    )
    skip_nonfinite: int = option(
        0,
        "Steps with a non-finite loss or gradient norm to skip (their update is not applied, their batch counts as trained, each is logged) before one more stops the run; a stopped run keeps only checkpoints from before that step. Counted from the process's start.",
    )
    seed: int = option(0, "Seed for parameter initialisation and the training RNG.")
    remat: str = option(
        "none",
        "Activation recomputation policy for each block: none (save everything), full (save nothing), auto (chosen from operator costs within the memory budget; see `jaxdist remat`), save:NAME[,NAME] (save these checkpoint names), or a jax.checkpoint_policies name such as dots_saveable.",
    )
    remat_budget_bytes: int = option(
        0,
        "With train.remat=auto: an extra bound on the saved activations of all blocks (block inputs included, bytes per device), beside train.memory_budget_bytes which bounds the whole compiled peak; 0: no extra bound (with train.remat_verify=false: derived from the device memory minus parameters, gradients, optimizer state and working space).",
    )
    memory_budget_bytes: int = option(
        0,
        "Bytes per device the compiled train step may hold at its peak (arguments + outputs + temp - aliased, as XLA's memory_analysis() reports); 0: the cluster file's memory_bytes less a 10% reserve for the runtime and fragmentation. train.remat=auto and `jaxdist plan --verify` choose against it by compiling their best candidates.",
    )
    remat_verify: bool = option(
        True,
        "With train.remat=auto: compile the best candidates ahead of time (at most 3 in the normal course) and keep the fastest whose compiled peak fits train.memory_budget_bytes; false trusts the prediction (no compile; the plan then only bounds saved activations by train.remat_budget_bytes or the predicted budget).",
    )
    remat_slack: float = option(
        0.0,
        "With train.remat=auto: recompute the selector may add beyond the least possible within the budget, as a share of the save-nothing recompute, to save fewer bytes (it then takes the fewest bytes within that slack); 0 takes the least-recompute plan (the optimum at the budget). `jaxdist remat` prints the gap to the optimum.",
    )
    log_every: int = option(10, "Write metrics every N steps (console, JSONL, TensorBoard).")
    eval_every: int = option(100, "Evaluate on the held-out split every N steps (0: only at the end).")
    eval_batches: int = option(4, "Held-out batches per evaluation (0: no evaluation at all).")
    progress: bool = option(True, "Show a progress bar on the console (process 0 only).")
    tensorboard: bool = option(True, "Write TensorBoard event files under <run>/tb/.")
    profile_steps: tuple[int, ...] = option(
        (),
        "[a, b]: write a JAX profiler trace of steps a..b (counted from 1, inclusive) under <run>/profile/ (TensorBoard's profile plugin or Perfetto); []: none.",
    )
    entry: str = option(
        "",
        "module:function that returns your own model and what goes with it, a dict with model and loss (and optimizer, data, eval_data, collate, added_data, flops_per_example: the Trainer's keywords, jaxdist.train.custom); called with the config in every worker; empty: jaxdist's own transformer on the [data] settings.",
    )
    tracker: Tracker = option(
        "none",
        "Also send metrics to an experiment tracker: none, wandb or mlflow (the package must be installed; never required).",
    )

    @functools.cached_property
    def remat_spec(self) -> Remat:
        """``remat`` parsed (once per config; ConfigError if it cannot be parsed).  What the selector chooses for
        ``auto`` is not here: jaxdist.resolve.resolve returns it beside the config (``Resolved.remat``)."""
        return Remat.parse(self.remat)

    def check(self) -> None:
        """ConfigError (one sentence) for train settings that cannot work by themselves."""
        check_train(self)
        self.remat_spec  # noqa: B018  (parses train.remat: a bad value fails at load time)


# --------------------------------------------------------------------------- pipeline


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline schedule when mesh.pipeline > 1 (train.microbatches is the number of pipeline microbatches)."""

    schedule: PipelineSchedule = option(
        "seq1f1b",
        "Pipeline schedule when mesh.pipeline > 1: gpipe, 1f1b, or seq1f1b (1F1B over sequence chunks); train.microbatches is the number of pipeline microbatches.",
    )
    chunks: int = option(
        2,
        "seq1f1b: chunks each sequence is split into along the sequence axis (1 makes it 1f1b); the other schedules ignore it.",
    )
    chunk_split: ChunkSplit = option(
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

    source: DataSource = option(
        "stdlib",
        "stdlib (the Python standard library's .py files, byte-tokenized), text_dir (a directory of text files) or tokens (a flat token file).",
    )
    path: str = option("", "Directory (text_dir) or file (tokens); unused for stdlib.")
    token_dtype: TokenDType = option("uint16", "Element type of a token file: uint16 or uint32.")
    eval_fraction: float = option(0.05, "Share of files (or of the token file's tail) held out for evaluation.")
    seed: int = option(0, "Seed of the sample order.")
    max_bytes: int = option(0, "Read at most this many bytes of text (0: all); keeps tests small.")
    tokenizer: str = option(
        "bytes",
        "bytes (one token per UTF-8 byte, 260 ids) or the path of a Hugging Face tokenizer.json or a SentencePiece .model; with a file, model.vocab_size follows its vocabulary unless set, and text is tokenized with `jaxdist data prepare` (data.source=tokens).",
    )

    packing: Packing = option(
        "stream",
        "How training rows are cut: stream (windows of train.seq_len+1 tokens of the concatenated documents; a token attends across document ends) or documents (rows packed from whole documents, a document longer than a row cut into overlapping pieces; a token attends only within its document, positions restart per document, no loss across a boundary or on padding; needs the document boundaries: a text source's files, or the documents.bin `jaxdist data prepare` writes; the xla, blockwise or ring attention (auto runs blockwise where it would pick cudnn), train.grad_sync=end).",
    )

    def check(self) -> None:
        """ConfigError (one sentence) for data settings that cannot work by themselves."""
        check_data(self)


# --------------------------------------------------------------------------- checkpoint


@dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing of params, optimizer state, step, RNG and data position."""

    enabled: bool = option(True, "Write checkpoints under <run>/checkpoints/.")
    every: int = option(100, "Save every N steps (and always at the end).")
    keep: int = option(3, "Keep the last K checkpoints.")
    asynchronous: bool = option(True, "Save in the background; the step waits only for the device-to-host copy.")
    resume: bool = option(True, "Resume from the latest checkpoint in the run directory if there is one.")
    local_dir: str = option(
        "auto",
        "Node-local directory of the fast tier ({node} becomes the node's name; '' = off): every local_every steps each process writes its shards there and a copy of one other node's, so at most local_every steps are lost even when a node is. auto: on in a job started by jaxdist launch (under a node agent), in <system temporary directory>/jaxdist-local/{node}, when every process's disk there has room for 6 times its shards (own and replica, local_keep+1 steps); off otherwise (jaxdist train, or too little room: logged).",
    )
    local_every: int = option(1, "With local_dir: save to the fast local tier every N steps.")
    local_keep: int = option(2, "With local_dir: newest local steps each process keeps.")

    def check(self) -> None:
        """ConfigError (one sentence) for checkpoint settings that cannot work by themselves."""
        check_checkpoint(self)


def check_train(t: TrainConfig) -> None:
    """Optimisation and logging settings by themselves (ConfigError, one sentence)."""
    if t.entry and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", t.entry):
        raise ConfigError(
            f"train.entry={t.entry!r} is not module:function: write it as mypackage.job:spec (a module Python can "
            "import, and the function in it that returns your model and loss)."
        )
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
        raise ConfigError(f"train.tracker='{t.tracker}' is unknown: use {one_of(choices(t, 'tracker'))}.")
    if t.tracker != "none" and importlib.util.find_spec(t.tracker) is None:
        raise ConfigError(
            f"train.tracker='{t.tracker}' needs the {t.tracker} package, which is not installed: "
            f"pip install {t.tracker}, or set train.tracker=none (metrics still go to metrics.jsonl and TensorBoard)."
        )


def check_pipeline(p: PipelineConfig) -> None:
    """The ``[pipeline]`` table by itself (ConfigError, one sentence)."""
    if p.schedule not in choices(p, "schedule"):
        raise ConfigError(f"pipeline.schedule='{p.schedule}' is unknown: use {one_of(choices(p, 'schedule'))}.")
    if p.chunk_split not in choices(p, "chunk_split"):
        raise ConfigError(
            f"pipeline.chunk_split='{p.chunk_split}' is unknown: use {one_of(choices(p, 'chunk_split'))}."
        )
    if p.chunks <= 0:
        raise ConfigError(f"pipeline.chunks={p.chunks} must be positive.")


def check_data(d: DataConfig) -> None:
    """Where tokens come from (ConfigError, one sentence): the source, its path, its element type."""
    if d.source not in choices(d, "source"):
        raise ConfigError(f"data.source='{d.source}' is unknown: use {one_of(choices(d, 'source'))}.")
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
            f"data.token_dtype='{d.token_dtype}' is not supported: use {one_of(choices(d, 'token_dtype'))}."
        )
    if not 0 < d.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must lie strictly between 0 and 1.")
    if d.packing not in choices(d, "packing"):
        raise ConfigError(f"data.packing='{d.packing}' is unknown: use {one_of(choices(d, 'packing'))}.")
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

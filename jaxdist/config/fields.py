"""What every config section shares: the choices a field offers, the help-text field, the checkpoint tags.

A choice's values are read from its field's ``Literal`` type (:func:`choices`), defined once here.  No JAX.
"""

from __future__ import annotations

import ipaddress
import socket
import typing
from dataclasses import field
from typing import Literal

from jaxdist.config.ranges import type_hints
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
Packing = Literal["stream", "documents"]
Launcher = Literal["local", "ssh", "slurm", "kubernetes"]
Recovery = Literal["standby", "requeue"]
CrashedRank = Literal["same_node", "standby"]
Attention = Literal["auto", "xla", "blockwise", "cudnn"]
Tracker = Literal["none", "wandb", "mlflow"]
PIPELINE_SCHEDULES: tuple[str, ...] = typing.get_args(PipelineSchedule)


def option(default, help: str, **kw):
    """A config field with its default and its help text (``metadata["help"]``, the reference's third column)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


# The checkpoint_name tags of a model block, in the order a block computes them (a remat policy saves a subset:
# ``train.remat=save:NAME[,NAME]``).  Defined with the config, so that train.remat is checked when a config
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


def choices(section: object, name: str) -> tuple[str, ...]:
    """The values a Literal-typed config field allows, read from its dataclass (defined once, in this module)."""
    return typing.get_args(type_hints(type(section))[name])


def one_of(values: tuple[str, ...]) -> str:
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


def check_checkpoint_names(value: str, names: tuple[str, ...]) -> None:
    """ConfigError (one sentence) when ``train.remat=save:...`` (``value``) names a tag no block has: jax would
    save nothing for it, silently, which is full recomputation under another name."""
    unknown = [n for n in names if n not in CHECKPOINT_NAMES]
    if unknown:
        raise ConfigError(
            f"train.remat='{value}' names {', '.join(repr(n) for n in unknown)}, which the model does not tag: "
            f"use save: with some of {', '.join(CHECKPOINT_NAMES)}."
        )

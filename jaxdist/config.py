"""Configuration: the whole job's config, read from defaults, TOML and overrides (sections: config_sections.py).

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
import json
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from jaxdist.config_checks import validate
from jaxdist.config_controller import CONTROLLER_LAUNCHERS, CONTROLLER_RECOVERY, ControllerConfig  # noqa: F401
from jaxdist.config_sections import (  # noqa: F401  (re-exported: the sections are imported from here)
    CheckpointConfig,
    ChunkSplit,
    DataConfig,
    DataSource,
    Dispatch,
    DType,
    Launcher,
    MESH_AXES,
    MeshConfig,
    MODEL_PRESETS,
    ModelConfig,
    MoEConfig,
    PIPELINE_SCHEDULES,
    PipelineConfig,
    PipelineSchedule,
    Recovery,
    Remat,
    Router,
    TokenDType,
    TrainConfig,
)
from jaxdist.errors import ConfigError, expect, expect_strings
from jaxdist.config_hf import apply_init_from
from jaxdist.config_hf_dir import model_tokenizer

# --------------------------------------------------------------------------- whole


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

    def replace(self, **changes: Any) -> "Config":
        """A copy with dotted keys changed, e.g. ``cfg.replace(**{"train.seq_len": 64})``, checked like overrides:
        each value for its type, then the whole config (ConfigError, one sentence)."""
        cfg = self.set(**changes)
        validate(cfg)
        return cfg

    def set(self, **changes: Any) -> "Config":
        """Like :meth:`replace`, but only each value is checked, not the whole: for a stored run's config read
        by a command that uses a part of it (sampling reads the model, mesh and tokenizer, not the data)."""
        cfg = self
        for k, v in changes.items():
            cfg = _set(cfg, k, v)
        return cfg

    @property
    def run_dir(self) -> Path:
        return Path(self.train.runs_dir) / self.train.name


# Every table of a config: its dotted path -> its dataclass (nested tables after their parent).
_SECTION_CLASSES = {
    "model": ModelConfig,
    "model.moe": MoEConfig,
    "mesh": MeshConfig,
    "train": TrainConfig,
    "pipeline": PipelineConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "controller": ControllerConfig,
}
SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}

# Keys that moved to a table of their own: old key -> new key.
MOVED_KEYS = {
    **{f"model.moe_{f.name}": f"model.moe.{f.name}" for f in dataclasses.fields(MoEConfig)},
    "train.pipeline_schedule": "pipeline.schedule",
    "train.pipeline_chunks": "pipeline.chunks",
    "train.pipeline_chunk_split": "pipeline.chunk_split",
}


def _all_keys() -> list[str]:
    return [
        f"{s}.{f.name}"
        for s, cls in _SECTION_CLASSES.items()
        for f in dataclasses.fields(cls)
        if f"{s}.{f.name}" not in _SECTION_CLASSES
    ]


def _unknown(key: str) -> ConfigError:
    if key in MOVED_KEYS:
        return ConfigError(f"config key '{key}' is now '{MOVED_KEYS[key]}': rename it.")
    close = difflib.get_close_matches(key, _all_keys() + list(_SECTION_CLASSES), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else "; see the configuration reference in README.md."
    return ConfigError(f"unknown config key '{key}'{hint}")


def _section(cfg: Config, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _with_section(cfg: Any, path: str, value: Any) -> Any:
    """``cfg`` with the table at dotted ``path`` replaced by ``value`` (frozen dataclasses all the way down)."""
    head, _, rest = path.partition(".")
    inner = value if not rest else _with_section(getattr(cfg, head), rest, value)
    return dataclasses.replace(cfg, **{head: inner})


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
    if typing.get_origin(typ) is Literal:  # a choice: a string here, checked against its values by validate()
        typ = str
    if typing.get_origin(typ) is tuple:  # tuple[int, ...]: a TOML list, or "[5, 8]" / "5,8" on the command line
        items = value
        if isinstance(value, str):
            text = value.strip().removeprefix("[").removesuffix("]")
            items = [v for v in (t.strip() for t in text.split(",")) if v]
        if isinstance(items, (list, tuple)):
            item_type = typing.get_args(typ)[0]
            return tuple(_coerce(key, v, item_type) for v in items)
        raise ConfigError(f"config key '{key}' needs a list, got {value!r}.")
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
            n = int(value)
            if not -(2**63) <= n < 2**63:  # no setting counts that far; a huge one would only hang or overflow later
                raise ConfigError(f"config key '{key}'={value} does not fit in 64 bits: give a realistic value.")
            return n
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError  # a TOML list or table is not a name (str() would make the run '['a']')
            text = str(value)
            if any(ord(ch) < 32 and ch != "\t" or ord(ch) == 127 for ch in text):
                raise ConfigError(
                    f"config key '{key}' holds a control character ({text!r}): names and paths take printable text."
                )
            return text
    except ConfigError:
        raise
    except (TypeError, ValueError, OverflowError):
        pass
    else:
        return value
    article = "an" if typ.__name__[0] in "aeiou" else "a"
    raise ConfigError(f"config key '{key}' needs {article} {typ.__name__}, got {value!r}.")


def apply_preset(model: ModelConfig, name: str) -> ModelConfig:
    """A ModelConfig with the preset's fields (others keep their values)."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"unknown model preset '{name}': choose one of {', '.join(MODEL_PRESETS)}.")
    fields = dict(MODEL_PRESETS[name])
    moe = dataclasses.replace(model.moe, **fields.pop("moe", {}))
    return dataclasses.replace(model, preset=name, moe=moe, **fields)


def _set(cfg: Config, key: str, value: Any) -> Config:
    """``cfg`` with dotted ``key`` set to ``value`` (coerced to the field's type); ConfigError for a bad key."""
    if key in ("model", "model.preset"):
        return dataclasses.replace(cfg, model=apply_preset(cfg.model, str(value)))
    if key == "mesh" and str(value).lower() == "auto":  # mesh=auto: the planner picks the mesh
        return _with_section(cfg, "mesh", dataclasses.replace(cfg.mesh, auto=True))
    path, _, name = key.rpartition(".")
    cls = _SECTION_CLASSES.get(path)
    if cls is None or key in _SECTION_CLASSES or name not in {f.name for f in dataclasses.fields(cls)}:
        raise _unknown(key)
    section = dataclasses.replace(_section(cfg, path), **{name: _coerce(key, value, _field_type(cls, name))})
    return _with_section(cfg, path, section)


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
    expect(path, (str, os.PathLike, type(None)), "load_config's path", "a TOML file path or None")
    expect_strings(overrides or [], "load_config's overrides", 'a list of "key=value" strings')
    cfg = Config()
    explicit: set[str] = set()  # the keys the user set (model.init_from's config.json fills in the others)
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file '{p}' is a directory: pass the TOML file inside it to --config.")
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist: check the path given to --config.")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file '{p}' is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}): "
                "save it as UTF-8, as TOML requires."
            ) from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file '{p}' is not valid TOML ({e}): fix the syntax.") from None
        except RecursionError:
            raise ConfigError(f"config file '{p}' nests arrays or tables too deeply to read: flatten it.") from None
        for k, v in _ordered(_flatten(data)):
            cfg = _set(cfg, k, v)
            explicit.add(k)
    for k, v in _ordered(parse_overrides(list(overrides or []))):
        cfg = _set(cfg, k, v)
        explicit.add(k)
    cfg = model_tokenizer(apply_init_from(cfg, explicit), explicit)
    validate(cfg)
    return cfg


def from_dict(d: dict[str, Any]) -> Config:
    """Rebuild a Config from ``Config.to_dict()`` output (as stored with a run; older runs' moved keys too)."""
    cfg = Config()
    for k, v in _flatten(d):
        k = MOVED_KEYS.get(k, k)
        if k == "model.preset":  # the stored fields follow; the preset only names where they came from
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset=v))
            continue
        cfg = _set(cfg, k, v)
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
            if f"{section}.{f.name}" in _SECTION_CLASSES:  # a nested table: its keys follow in its own section
                lines.append(f"| `{section}.{f.name}` | table | {f.metadata['help']} |")
                continue
            lines.append(f"| `{section}.{f.name}` | `{v!r}` | {f.metadata['help']} |")
        lines.append("")
    lines.append("Model presets: " + ", ".join(f"`{k}`" for k in MODEL_PRESETS) + ".")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m jaxdist.config > reference
    print(reference_markdown())

"""Dotted keys and their values: a TOML or command-line value checked and converted to its field's type,
set into a config (frozen dataclasses all the way down), the model presets applied, overrides parsed.

Works on any config shaped like :class:`jaxdist.config.Config` (its sections as attributes); imports no
``Config``, so that the Config can use it.  No JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, TypeVar

from jaxdist.config.controller import ControllerConfig
from jaxdist.config.mesh import MeshConfig
from jaxdist.config.model import MODEL_PRESETS, ModelConfig, MoEConfig
from jaxdist.config.run import CheckpointConfig, DataConfig, PipelineConfig, TrainConfig
from jaxdist.errors import ConfigError

T = TypeVar("T")


# Every table of a config: its dotted path -> its dataclass (nested tables after their parent).
SECTION_CLASSES = {
    "model": ModelConfig,
    "model.moe": MoEConfig,
    "mesh": MeshConfig,
    "train": TrainConfig,
    "pipeline": PipelineConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "controller": ControllerConfig,
}
# Keys that moved to a table of their own: old key -> new key.
MOVED_KEYS = {
    **{f"model.moe_{f.name}": f"model.moe.{f.name}" for f in dataclasses.fields(MoEConfig)},
    "train.pipeline_schedule": "pipeline.schedule",
    "train.pipeline_chunks": "pipeline.chunks",
    "train.pipeline_chunk_split": "pipeline.chunk_split",
}


def all_keys() -> list[str]:
    return [
        f"{s}.{f.name}"
        for s, cls in SECTION_CLASSES.items()
        for f in dataclasses.fields(cls)
        if f"{s}.{f.name}" not in SECTION_CLASSES
    ]


def _unknown(key: str) -> ConfigError:
    if key in MOVED_KEYS:
        return ConfigError(f"config key '{key}' is now '{MOVED_KEYS[key]}': rename it.")
    close = difflib.get_close_matches(key, all_keys() + list(SECTION_CLASSES), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else "; see the configuration reference in docs/configuration.md."
    return ConfigError(f"unknown config key '{key}'{hint}")


def _section(cfg: Any, path: str) -> Any:
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


def set_key(cfg: T, key: str, value: Any) -> T:
    """``cfg`` with dotted ``key`` set to ``value`` (coerced to the field's type); ConfigError for a bad key.

    A section's key takes a whole section (``model=`` a ModelConfig); ``model`` also takes a preset's name.
    """
    if key in SECTION_CLASSES and isinstance(value, SECTION_CLASSES[key]):
        return _with_section(cfg, key, value)
    if key in ("model", "model.preset"):
        return dataclasses.replace(cfg, model=apply_preset(cfg.model, str(value)))
    if key == "mesh" and str(value).lower() == "auto":  # mesh=auto: the planner picks the mesh
        return _with_section(cfg, "mesh", dataclasses.replace(cfg.mesh, auto=True))
    path, _, name = key.rpartition(".")
    cls = SECTION_CLASSES.get(path)
    if cls is None or key in SECTION_CLASSES or name not in {f.name for f in dataclasses.fields(cls)}:
        raise _unknown(key)
    section = dataclasses.replace(_section(cfg, path), **{name: _coerce(key, value, _field_type(cls, name))})
    return _with_section(cfg, path, section)


def flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.extend(flatten(v, key + "."))
        else:
            out.append((key, v))
    return out


def ordered(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
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

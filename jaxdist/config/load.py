"""Reading a config: defaults, then a TOML file, then dotted command-line overrides (``train.steps=200
mesh.tensor=2``); ``model=NAME`` selects a model preset before any ``model.*`` override applies; a
``model.init_from`` directory's ``config.json`` fills the model fields not given.  Also the
configuration reference (every field's help text, ``python -m jaxdist.config``), which a test keeps in
step with docs/configuration.md.

Imports no JAX, so the CLI can read a config (and the number of simulated CPU devices it wants) before
JAX starts.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from jaxdist.config.hf import apply_init_from
from jaxdist.config.hf_dir import model_tokenizer
from jaxdist.config.model import MODEL_PRESETS
from jaxdist.config.schema import Config, validate
from jaxdist.config.values import MOVED_KEYS, SECTION_CLASSES, flatten, ordered, parse_overrides, set_key
from jaxdist.errors import ConfigError, expect, expect_strings


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, own_model: bool = False
) -> Config:
    """Defaults, then the TOML file at ``path``, then dotted overrides; validated without devices.

    ``own_model``: for your own model (``Trainer(config, model=...)``): the rules of jaxdist's transformer
    (``train.remat=save:NAME`` among its tags, its sizes on the mesh) are left to the Trainer, which checks
    your model's instead."""
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
        for k, v in ordered(flatten(data)):
            cfg = set_key(cfg, k, v)
            explicit.add(k)
    for k, v in ordered(parse_overrides(list(overrides or []))):
        cfg = set_key(cfg, k, v)
        explicit.add(k)
    cfg = model_tokenizer(apply_init_from(cfg, explicit), explicit)
    validate(cfg, own_model=own_model or bool(cfg.train.entry))  # train.entry: the Trainer checks that model
    return cfg


def from_dict(d: dict[str, Any]) -> Config:
    """Rebuild a Config from ``Config.to_dict()`` output (as stored with a run; older runs' moved keys too)."""
    cfg = Config()
    for k, v in flatten(d):
        k = MOVED_KEYS.get(k, k)
        if k == "model.preset":  # the stored fields follow; the preset only names where they came from
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, preset=v))
            continue
        cfg = set_key(cfg, k, v)
    return cfg


# --------------------------------------------------------------------------- docs


def reference_markdown() -> str:
    """The configuration reference as Markdown tables (embedded in docs/configuration.md)."""
    lines = []
    for section, cls in SECTION_CLASSES.items():
        lines.append(f"### `[{section}]` — {cls.__doc__.strip()}")
        lines.append("")
        lines.append("| key | default | meaning |")
        lines.append("| --- | --- | --- |")
        default = cls()
        for f in dataclasses.fields(cls):
            v = getattr(default, f.name)
            if f"{section}.{f.name}" in SECTION_CLASSES:  # a nested table: its keys follow in its own section
                lines.append(f"| `{section}.{f.name}` | table | {f.metadata['help']} |")
                continue
            lines.append(f"| `{section}.{f.name}` | `{v!r}` | {f.metadata['help']} |")
        lines.append("")
    lines.append("Model presets: " + ", ".join(f"`{k}`" for k in MODEL_PRESETS) + ".")
    return "\n".join(lines)

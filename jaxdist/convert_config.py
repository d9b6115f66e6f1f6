"""The configs of ``jaxdist convert`` (no JAX: the CLI reads them to set up the devices before JAX starts)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxdist.config import Config, from_dict, load_config
from jaxdist.errors import ConfigError


def _at_run(run_dir: Path) -> list[str]:
    """Overrides that put a run at ``run_dir`` (train.runs_dir / train.name)."""
    run_dir = Path(run_dir).absolute()
    return [f"train.runs_dir={run_dir.parent}", f"train.name={run_dir.name}"]


def import_config(hf_dir: str | Path, run_dir: str | Path, overrides: list[str] = ()) -> Config:
    """The config of a run at ``run_dir`` fine-tuning ``hf_dir`` (model from its config.json; ``overrides``
    as for ``jaxdist train``, which win over the run directory's place)."""
    return load_config(None, [f"model.init_from={Path(hf_dir).absolute()}", *_at_run(Path(run_dir)), *overrides])


def stored_config(run_dir: str | Path, overrides: list[str] = ()) -> Config:
    """The config a run recorded in ``run_dir/config.json``, at ``run_dir`` wherever it lies now, with ``overrides``
    (e.g. another mesh for the export)."""
    path = Path(run_dir) / "config.json"
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: point to a jaxdist run directory.") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a readable run config ({e}): point to a jaxdist run directory.") from None
    cfg = from_dict(stored).replace(**dict(kv.split("=", 1) for kv in _at_run(Path(run_dir))))
    if overrides:
        cfg = cfg.replace(**dict(o.split("=", 1) for o in overrides))
    return cfg

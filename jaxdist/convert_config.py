"""The configs of ``jaxdist convert`` (no JAX: the CLI reads them to set up the devices before JAX starts)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxdist.config import Config, from_dict, load_config, parse_overrides
from jaxdist.config.hf_dir import run_tokenizer, tokenizer_in
from jaxdist.errors import ConfigError
from jaxdist.run_owner import check_not_own_model


def _at_run(run_dir: Path) -> list[str]:
    """Overrides that put a run at ``run_dir`` (train.runs_dir / train.name)."""
    run_dir = Path(run_dir).absolute()
    return [f"train.runs_dir={run_dir.parent}", f"train.name={run_dir.name}"]


def _is_run(d: Path) -> bool:
    """A jaxdist run directory: checkpoints, a batch list or a run config (a ``train`` table) in it."""
    if (d / "checkpoints").is_dir() or (d / "batchlist").is_dir() or (d / "metrics.jsonl").is_file():
        return True
    try:
        return "train" in json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def _is_hf_model(d: Path) -> bool:
    """A Hugging Face model directory: safetensors files or a config.json with a ``model_type``."""
    if any(d.glob("*.safetensors")) or (d / "model.safetensors.index.json").is_file():
        return True
    try:
        return "model_type" in json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return False


def check_destination(direction: str, src: str | Path, dst: str | Path, force: bool = False) -> None:
    """Refuse (ConfigError) a conversion that would write into its own input, into a directory of the other
    kind (a run for a Hugging Face export, a model for an import), or over files it did not make (unless
    ``force``).  Nothing has been written when it refuses."""
    s, d = Path(src).resolve(), Path(dst).resolve()
    if s == d or s in d.parents or d in s.parents:
        raise ConfigError(
            f"the output {dst} is {'the input' if s == d else 'inside or around the input'} {src}: "
            "write the conversion to a new directory."
        )
    if not d.exists():
        return
    if not d.is_dir():
        raise ConfigError(f"the output {dst} is a file, not a directory: name a new directory.")
    if direction == "jaxdist-to-hf" and _is_run(d):
        raise ConfigError(f"the output {dst} is a jaxdist run directory: export the model to a new directory.")
    if direction == "hf-to-jaxdist" and _is_hf_model(d):
        raise ConfigError(f"the output {dst} is a Hugging Face model directory: import into a new run directory.")
    if any(d.iterdir()) and not force:
        raise ConfigError(
            f"the output {dst} is not empty: name a new directory, or pass --force to write over its files."
        )


def import_config(hf_dir: str | Path, run_dir: str | Path, overrides: list[str] = ()) -> tuple[Config, Path | None]:
    """(the config that converts ``hf_dir`` into a run at ``run_dir``, the tokenizer file that goes with it).

    The model comes from config.json; ``overrides`` as for ``jaxdist train`` win over the run directory's place.
    The tokenizer is ``data.tokenizer`` when given, else the directory's own (``tokenizer.json`` or
    ``tokenizer.model``), else None (the run keeps bytes).  The conversion reads no data, so its config
    keeps ``data.tokenizer=bytes``: the tokenizer is recorded in the run once the weights are saved.
    """
    pairs = parse_overrides(list(overrides))
    given = [v for k, v in pairs if k == "data.tokenizer"]
    rest = [f"{k}={v}" for k, v in pairs if k != "data.tokenizer"]
    cfg = load_config(
        None, [f"model.init_from={Path(hf_dir).absolute()}", *_at_run(Path(run_dir)), "data.tokenizer=bytes", *rest]
    )
    if given and given[-1] != "bytes":
        if not Path(given[-1]).is_file():
            raise ConfigError(
                f"data.tokenizer '{given[-1]}' does not exist: point it at a tokenizer.json or a SentencePiece "
                "model, or leave it out to take the directory's own."
            )
        return cfg, Path(given[-1]).absolute()
    return cfg, None if given else tokenizer_in(hf_dir)


def stored_config(run_dir: str | Path, overrides: list[str] = ()) -> Config:
    """The config a run recorded in ``run_dir/config.json``, at ``run_dir`` wherever it lies now, with ``overrides``
    (e.g. another mesh for the export)."""
    path = Path(run_dir) / "config.json"
    check_not_own_model(run_dir, "jaxdist convert")
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist: point to a jaxdist run directory.") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a readable run config ({e}): point to a jaxdist run directory.") from None
    cfg = from_dict(stored).set(**dict(kv.split("=", 1) for kv in _at_run(Path(run_dir))))
    cfg = cfg.set(**{"data.tokenizer": run_tokenizer(run_dir, cfg.data.tokenizer)})
    for key, value in parse_overrides(list(overrides)):
        cfg = cfg.set(**{key: value})
    return cfg

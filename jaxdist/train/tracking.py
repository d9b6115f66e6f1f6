"""Optional experiment trackers beside metrics.jsonl and TensorBoard: ``train.tracker = "wandb" | "mlflow"``.

Neither package is a dependency: the config check refuses a tracker that is not installed, in one
sentence, before anything starts.  Only process 0 opens a tracker (as it alone writes metrics).  A
record of kind ``train`` at step 12 with ``loss`` becomes the scalar ``train/loss`` at step 12 (the
TensorBoard tags), so the three sinks show the same curves.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path
from typing import Any


class WandbTracker:
    """Weights & Biases: one wandb run per jaxdist run (its files under ``<run>/wandb/``)."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        self._wandb = importlib.import_module("wandb")
        self._run = self._wandb.init(name=name, dir=str(run_dir), config=config, resume="allow")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    """MLflow: one MLflow run per jaxdist run; ``MLFLOW_TRACKING_URI`` if set, else ``<run>/mlruns``."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        self._mlflow = importlib.import_module("mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            self._mlflow.set_tracking_uri((Path(run_dir) / "mlruns").resolve().as_uri())
        self._mlflow.start_run(run_name=name)
        self._mlflow.log_params(_flat(config))

    def log(self, scalars: dict[str, float], step: int) -> None:
        # MLflow metric names may not hold "/" on every backend store; TensorBoard's tag with "." instead.
        self._mlflow.log_metrics({k.replace("/", "."): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_tracker(kind: str, run_dir: str | Path, name: str, config: dict[str, Any]):
    """The tracker ``kind`` (``train.tracker``) for this run, or None for ``none``."""
    return None if kind == "none" else TRACKERS[kind](Path(run_dir), name, config)


def scalars(kind: str, values: dict[str, Any]) -> dict[str, float]:
    """A record's finite numbers as ``kind/name`` scalars (what TensorBoard and the trackers show)."""
    return {f"{kind}/{k}": float(v) for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out

"""Metric sinks: a JSONL file and TensorBoard event files (process 0 only)."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

from jaxdist import optional
from jaxdist.data.audit import read_records
from jaxdist.train.tracking import scalars


class MetricsWriter:
    """Appends one JSON object per record to ``<run>/metrics.jsonl`` and mirrors scalars to TensorBoard.

    Records carry a ``kind`` ("train", "eval", ...), a ``step`` and the ``writer``
    (an id of this writer, new for each Trainer: ``jaxdist data verify`` tells
    two writers' histories apart from a resumed one by it).  Writing is a no-op
    on processes other than 0 so every process can call it.
    """

    def __init__(self, run_dir: str | Path, enabled: bool = True, tensorboard: bool = True, tracker: Any = None):
        self.enabled = enabled
        self.writer = uuid.uuid4().hex[:12]
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._tracker = tracker  # jaxdist.train.tracking: W&B or MLflow (train.tracker), or None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        torn = _ends_mid_line(self.path)  # a kill mid-write: the first append starts on a fresh line
        self._file = open(self.path, "a", buffering=1)
        if torn:
            self._file.write("\n")
        tensorboardx = _load_tensorboardx() if tensorboard else None
        if tensorboardx is not None:
            self._tb = tensorboardx.SummaryWriter(str(Path(run_dir) / "tb"))

    def write(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": int(step)}
        record.update({k: _plain(v) for k, v in values.items()})
        record["writer"] = self.writer
        self._file.write(json.dumps(record) + "\n")
        tags = scalars(kind, {k: v for k, v in record.items() if k not in ("kind", "step", "writer", "batch_digest")})
        if self._tb is not None:
            for tag, v in tags.items():
                self._tb.add_scalar(tag, v, int(step))
        if self._tracker is not None and tags:
            self._tracker.log(tags, int(step))

    def flush(self) -> None:
        if self._file:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._tracker is not None:
            self._tracker.close()
            self._tracker = None


def _plain(v: Any) -> Any:
    try:
        return float(v) if not isinstance(v, (int, str, bool)) else v
    except (TypeError, ValueError):
        return str(v)


def _ends_mid_line(path: Path) -> bool:
    """True if ``path`` exists, is not empty and its last byte is not a newline."""
    try:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except OSError:  # missing, or empty (a seek before the start)
        return False


def read_metrics(run_dir: str | Path, kind: str | None = "train") -> list[dict[str, Any]]:
    """Records of ``<run>/metrics.jsonl`` (of one kind, or all with ``kind=None``); a torn line (a kill
    mid-write) is skipped with a warning naming it (see jaxdist.data.audit.read_records)."""
    rows = read_records(Path(run_dir) / "metrics.jsonl")
    return [r for r in rows if kind is None or r.get("kind") == kind]


def _load_tensorboardx():
    """tensorboardX (None, with one warning, when it is not installed), imported without importing torch.

    tensorboardX's writer imports torch at import when torch is installed, only so that its ``add_*`` calls
    accept torch tensors; this writer logs Python floats.  Importing torch costs every training process
    seconds of CPU (each process of a multi-host job, each run of a test suite that has torch for other reasons),
    so while tensorboardX is imported, ``import torch`` fails as if torch were absent (a None entry in
    ``sys.modules``), and tensorboardX falls back to NumPy.  The entry is removed again: a later ``import
    torch`` in the same process works.  When torch or tensorboardX is already imported, nothing is hidden.
    """
    hide = "torch" not in sys.modules and "tensorboardX" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        return optional.load("tensorboardX", "no TensorBoard event files", "train.tensorboard=false")
    finally:
        if hide and "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]

"""The working-space store: what compiles taught about XLA's working space, per device kind.

The remat selector's closed loop (:mod:`jaxdist.remat.verify`) learns the ratio of XLA's working space to its
reference from each compile; the ratios live per device kind beside the calibration (``<kind>.working.json``
in :func:`jaxdist.cluster.calibration_dir`), keyed by the setting (the last :data:`KEEP_SEEN` a setting's
compiles showed), and the next selection starts from them (:class:`Working`): the same setting's median, least
and largest when it was seen, else the device kind's median setting, its range scaled alike.  XLA's working
space moves between remat policies of one setting (benchmarks/remat_budget.py), so the range, not only the
middle, is what the next selection needs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxdist.cluster import calibration_path

# Settings kept per device kind (the oldest are dropped first), and ratios kept per setting (the newest).
KEEP = 64
KEEP_SEEN = 16
# The working-space ratio before anything is learned, and the range around it as shares of it: XLA:CPU's
# ratios are 0.33-0.71 over the settings of benchmarks/remat_budget.py, 0.55-0.75 of a setting's largest
# within it; a device kind's own ratios replace these after its first compiles.
DEFAULT_RATIO = 0.5
DEFAULT_SHARES = (0.5, 2.0)
# A setting's own least and largest ratio are its range once this many compiles showed them; before, its
# median times the shares of the device kind's settings that have that many (else DEFAULT_SHARES).
RANGE_SEEN = 4


@dataclass(frozen=True)
class Working:
    """What compiles taught about XLA's working space for a setting, as ratios to its reference: the
    ``ratio`` to predict with (the median seen), the ``low`` and ``high`` seen, and where it came from."""

    ratio: float
    low: float
    high: float
    source: str


def working_path(device_kind: str) -> Path:
    """Where the working-space ratios of a device kind live (beside its calibration file)."""
    p = calibration_path(device_kind)
    return p.with_name(p.stem + ".working.json")


def _read(device_kind: str) -> dict[str, list[float]]:
    p = working_path(device_kind)
    try:
        data = json.loads(p.read_text())
        out = {}
        for k, v in data.get("ratios", {}).items():  # a list of ratios seen (an older file: one number)
            out[str(k)] = [float(x) for x in v] if isinstance(v, list) else [float(v)]
        return {k: v for k, v in out.items() if v}
    except (OSError, ValueError, AttributeError, TypeError):  # none yet, or a torn file: start again
        return {}


def load_working(device_kind: str, key: str) -> Working:
    """What is known of the working space of setting ``key`` on ``device_kind`` (ratios to its reference):
    the setting's median, else the median of the device kind's settings, else :data:`DEFAULT_RATIO`; its
    range: the setting's own least and largest once :data:`RANGE_SEEN` compiles showed them, else the
    median times the widest shares of the device kind's settings that have as many (else
    :data:`DEFAULT_SHARES`)."""
    ratios = _read(device_kind)
    mids = {k: float(np.median(v)) for k, v in ratios.items()}
    spread = [(min(v) / mids[k], max(v) / mids[k]) for k, v in ratios.items() if len(v) >= RANGE_SEEN and mids[k] > 0]
    shares = (min(s[0] for s in spread), max(s[1] for s in spread)) if spread else DEFAULT_SHARES
    if key in ratios:
        seen, mid, source = ratios[key], mids[key], "learned for this setting"
        if len(seen) >= RANGE_SEEN:
            return Working(mid, min(seen), max(seen), source)
    elif ratios:
        mid, source = (
            float(np.median(list(mids.values()))),
            f"median of {len(ratios)} settings learned on {device_kind}",
        )
    else:
        mid, source = DEFAULT_RATIO, "default (nothing learned yet)"
    return Working(mid, mid * shares[0], mid * shares[1], source)


def record_working(device_kind: str, key: str, seen: Sequence[float]) -> Path:
    """Add the ratios ``seen`` (one per compile) to setting ``key`` (its newest :data:`KEEP_SEEN` kept; the
    setting moves to the newest of at most :data:`KEEP`); returns the file's path."""
    ratios = _read(device_kind)
    old = ratios.pop(key, [])
    ratios[key] = (old + [float(x) for x in seen])[-KEEP_SEEN:]
    ratios = dict(list(ratios.items())[-KEEP:])
    p = working_path(device_kind)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"device_kind": device_kind, "ratios": ratios}, indent=1) + "\n")
    tmp.replace(p)  # atomic: processes of one job write the same numbers
    return p

"""Calibrations: where they live, the reference steps, and the fit of measured times to the cost model.

``jaxdist calibrate`` (:func:`jaxdist.measure.calibrate.calibrate`) makes two
measurements, both on the devices JAX sees:

* links: an all-reduce (``psum`` in ``shard_map``) over all devices at a small
  and a large size, fitted to the ring model ``2(n-1) latency + 2(n-1)/n
  bytes / bandwidth`` (latency in s, bandwidth in bytes/s per device);
* efficiency and overheads: the Trainer's jitted step of a reference model
  in three settings (:func:`reference_overrides`: data-parallel in one and in
  many microbatches, fully sharded), timed round-robin
  (:func:`jaxdist.measure.steps.measure_strategies`), fitted (:func:`fit`) to compute / efficiency
  (against the cluster file's peak FLOP/s) + a fixed cost per block pass + a
  fixed cost per collective + the predicted communication.

The result is a :class:`~jaxdist.planner.cluster.Calibration`, written as
JSON to ``calibration_path(device_kind)`` (``$JAXDIST_CALIBRATION_DIR``, else
``~/.cache/jaxdist/calibration/``) where :func:`jaxdist.planner.plan` finds it
for clusters of the same device kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jaxdist.cluster import calibration_path
from jaxdist.planner.candidates import strategy_of
from jaxdist.planner.cluster import Calibration, cluster_view, load_calibration
from jaxdist.planner.computation import computation_view
from jaxdist.planner.cost import estimate


def default_calibration(device_kind: str) -> Calibration | None:
    """The calibration ``jaxdist calibrate`` wrote for this device kind, or None if there is none."""
    p = calibration_path(device_kind)
    return load_calibration(p) if p.is_file() else None


def reference_overrides(
    n_devices: int, model: str = "small", batch_per_device: int = 8, seq_len: int = 32
) -> list[list[str]]:
    """The three reference steps calibrate times, all on ``n_devices`` at one batch: data-parallel in one
    microbatch, data-parallel in ``batch_per_device`` microbatches (many block passes), and fully sharded
    in ``batch_per_device // 2`` microbatches (many collectives)."""
    n, b = n_devices, batch_per_device
    common = [f"model={model}", f"train.seq_len={seq_len}", f"train.batch_size={b * n}"]
    return [
        common + [f"mesh.data={n}"],
        common + [f"mesh.data={n}", f"train.microbatches={b}"],
        common + ["mesh.data=1", f"mesh.fsdp={n}", f"train.microbatches={max(1, b // 2)}"],
    ]


def fit(times: Sequence[float], estimates: Sequence, peak: float) -> tuple[float, float, float]:
    """(efficiency, pass_overhead s, collective_overhead s) that best explain measured step ``times``.

    Each estimate must come from a cluster view with efficiency 1 and no
    overheads: then time = compute / efficiency + passes * pass_overhead +
    collectives * collective_overhead + communication, solved by non-negative
    least squares (relative errors weighted alike).
    """
    rows, rhs = [], []
    for t, e in zip(times, estimates):
        rows.append([e.flops_per_device / peak / t, e.extra["passes"] / t, e.extra["collectives"] / t])
        rhs.append((t - e.comm_time) / t)
    from scipy.optimize import nnls  # scipy (~0.4 s to import) only for a calibration fit

    x, _ = nnls(np.asarray(rows), np.asarray(rhs))
    inv_eff, pass_overhead, collective_overhead = (float(v) for v in x)
    return (1.0 / inv_eff if inv_eff > 0 else 1.0), pass_overhead, collective_overhead


def calibration_from(
    cfgs: Sequence, times: Sequence[float], spec, n_devices: int, latency: float, bandwidth: float
) -> Calibration:
    """The Calibration that fits measured step ``times`` of ``cfgs`` on ``n_devices`` of cluster ``spec``."""
    linked = Calibration(
        device_kind=spec.device_kind,
        efficiency=1.0,
        intra_node_bandwidth=bandwidth,
        intra_node_latency=latency,
        collective_overhead=0.0,
        pass_overhead=0.0,
    )
    view = cluster_view(dataclasses.replace(spec, nodes=1, devices_per_node=n_devices), calibration=linked)
    estimates = [
        estimate(computation_view(c.model, c.train.seq_len), view, strategy_of(c, n_devices), c.train.batch_size)
        for c in cfgs
    ]
    efficiency, pass_overhead, collective_overhead = fit(times, estimates, view.peak_flops(cfgs[0].model.dtype))
    return dataclasses.replace(
        linked, efficiency=min(efficiency, 1.0), pass_overhead=pass_overhead, collective_overhead=collective_overhead
    )


def write_calibration(cal: Calibration, path: str | Path | None = None) -> Path:
    """Write ``cal`` as JSON (default: ``calibration_path(cal.device_kind)``); returns the path."""
    p = Path(path) if path else calibration_path(cal.device_kind)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(cal.to_json() + "\n")
    return p

"""``jaxdist calibrate``: measure the present devices so the cost model's times match them.

Links: an all-reduce over all devices at two sizes, fitted to the ring model
(:func:`measure_links`); efficiency and overheads: the reference steps of
:func:`jaxdist.planner.calibrate.reference_overrides` timed round-robin and
fitted by :func:`jaxdist.planner.calibrate.calibration_from`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdist.cluster import load_cluster
from jaxdist.measure.steps import measure_strategies, measurement_config
from jaxdist.planner.calibrate import calibration_from, reference_overrides
from jaxdist.planner.cluster import Calibration

LINK_SIZES = (2**12, 2**22)  # bytes per device of the two all-reduces


def measure_links(
    devices: Sequence | None = None, sizes: Sequence[int] = LINK_SIZES, repeats: int = 7
) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of an all-reduce over ``devices``, fitted to the ring model."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    assert n > 1, "measuring links needs at least two devices"
    mesh = Mesh(np.asarray(devices), ("x",))
    f = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    times = []
    for nbytes in sizes:
        x = jax.device_put(jnp.ones((n, nbytes // 4), jnp.float32), NamedSharding(mesh, P("x")))
        f(x).block_until_ready()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            samples.append(time.perf_counter() - t0)
        times.append(min(samples))
    (b0, b1), (t0_, t1) = sizes, times
    per_byte = max((t1 - t0_) / (b1 - b0), 1e-15)  # seconds per whole-buffer byte
    bandwidth = 2 * (n - 1) / n / per_byte
    latency = max((t0_ - 2 * (n - 1) / n * b0 / bandwidth) / (2 * (n - 1)), 1e-7)
    return latency, bandwidth


def calibrate(
    devices: Sequence | None = None,
    cluster: str = "cpu-8",
    model: str = "small",
    batch_per_device: int = 8,
    seq_len: int = 32,
    rounds: int = 4,
) -> Calibration:
    """Measure links, then fit efficiency and overheads to the reference steps on ``devices`` (default: all),
    against the peak FLOP/s of the ``cluster`` file."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    latency, bandwidth = measure_links(devices) if n > 1 else (1e-6, 1e12)
    cfgs = [
        measurement_config(o + [f"mesh.cluster={cluster}"])
        for o in reference_overrides(n, model, batch_per_device, seq_len)
    ]
    times = [m.step_time for m in measure_strategies(cfgs, devices, rounds=rounds)]
    return calibration_from(cfgs, times, load_cluster(cluster), n, latency, bandwidth)

"""What ``train.grad_sync=ordered`` costs against XLA's all-reduce (``end``, the default), on 8 CPU devices.

For three model sizes (and, at the middle one, units of 2 rows as well as 1) the gradient computation of one step (loss and
gradients of a batch of 16 x 64 tokens, mesh data=4 x fsdp=2) is compiled both ways; per way: the median step
time of ``--reps`` runs, the compiled temporary bytes per device (``memory_analysis``) and the collective bytes
per device (the compiled HLO's collectives, loop trips counted);
then ordered / end.  Also whether the ordered gradients are bit-identical on data=2 x fsdp=2 (4 devices).

    python benchmarks/ordered_sum.py            # ~5 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.models import create_abstract, init_params  # noqa: E402
from jaxdist.parallel.hlo import parse_collectives  # noqa: E402
from jaxdist.parallel.layout import Parallelism  # noqa: E402
from jaxdist.parallel.ordered_sum import ordered_grads_fn  # noqa: E402
from jaxdist.train.step import loss_metrics_and_grads  # noqa: E402

SIZES = {  # name: model overrides
    "d64 L2": ["model.d_model=64", "model.n_layers=2", "model.d_ff=256"],
    "d128 L4": ["model.d_model=128", "model.n_layers=4", "model.d_ff=512"],
    "d256 L4": ["model.d_model=256", "model.n_layers=4", "model.d_ff=1024"],
}
B, T = 16, 64


def build(model: list[str], mesh: list[str], way: str, unit_rows: int):
    cfg = load_config(None, ["model=tiny", *model, f"train.batch_size={B}", f"train.seq_len={T}", *mesh])
    par = Parallelism.build(cfg)
    graphdef, abstract, names = create_abstract(cfg.model)
    shardings = par.param_shardings(names, abstract)
    params = jax.jit(lambda: init_params(cfg.model, 0), out_shardings=shardings)()
    if way == "ordered":
        fn = ordered_grads_fn(graphdef, par.mesh, par.rules, shardings, unit_rows)
    else:
        fn = lambda p, t: loss_metrics_and_grads(graphdef, p, t)  # noqa: E731
    jitted = jax.jit(par.bind(fn), in_shardings=(shardings, par.batch_sharding))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (B, T + 1)).astype(np.int32)
    return jitted, params, tokens, len(par.mesh.devices.flat)


def measure(model, mesh, way, unit_rows, reps):
    jitted, params, tokens, n = build(model, mesh, way, unit_rows)
    compiled = jitted.lower(params, tokens).compile()
    mem = compiled.memory_analysis()
    coll = sum(c.bytes * c.count for c in parse_collectives(compiled.as_text(), n))
    out = jax.block_until_ready(compiled(params, tokens))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(compiled(params, tokens))
        times.append(time.perf_counter() - t)
    return {
        "s": statistics.median(times),
        "temp": mem.temp_size_in_bytes,
        "coll": coll,
        "out": jax.device_get(out),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    mesh8, mesh4 = ["mesh.data=4", "mesh.fsdp=2"], ["mesh.data=2", "mesh.fsdp=2"]
    rows = [(name, model, 1) for name, model in SIZES.items()]
    rows += [("d128 L4", SIZES["d128 L4"], 2)]  # 8 units of 2 rows: one unit per device
    print(f"batch {B} x {T} tokens, mesh data=4 x fsdp=2 (8 CPU devices), load {os.getloadavg()[0]:.1f}")
    print(
        "model   | unit rows | end ms | ordered ms | time x | end temp MB | ord temp MB | temp x "
        "| end coll MB | ord coll MB | coll x | same bits on 4 devices"
    )
    for name, model, unit in rows:
        end = measure(model, mesh8, "end", unit, a.reps)
        ordr = measure(model, mesh8, "ordered", unit, a.reps)
        four = measure(model, mesh4, "ordered", unit, 1)
        same = all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(ordr["out"]), jax.tree.leaves(four["out"])))
        print(
            f"{name:7} | {unit:9} | {end['s'] * 1e3:6.1f} | {ordr['s'] * 1e3:10.1f} | {ordr['s'] / end['s']:6.2f} "
            f"| {end['temp'] / 1e6:11.2f} | {ordr['temp'] / 1e6:11.2f} | {ordr['temp'] / max(end['temp'], 1):6.2f} "
            f"| {end['coll'] / 1e6:11.2f} | {ordr['coll'] / 1e6:11.2f} "
            f"| {ordr['coll'] / max(end['coll'], 1):6.2f} | {same}",
            flush=True,
        )
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

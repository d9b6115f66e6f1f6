"""Exposed gradient communication: reduce at the end vs per block vs the lower bound; and end vs per_block here.

Part 1, an event simulation of one backward pass on a cluster of ``meshes/``:

* compute: the blocks' backward passes in backward order (head, layers last to first, embedding), each taking
  ``backward FLOPs of the block on the tokens one device holds / (cluster peak FLOP/s x efficiency)``;
  ``efficiency`` is measured on this machine: the FLOP/s a real block backward reaches (jitted, a d=512 block)
  over the FLOP/s of a large matmul here (this machine's achievable peak);
* communication: the plan's buckets (jaxdist.parallel.comm.plan_comm), one at a time on the link, each a ring
  reduce-scatter over fsdp ((n-1) latency + (n-1)/n bytes / bandwidth) then a ring all-reduce over data
  (2 (n-1) latency + 2 (n-1)/n bytes / bandwidth); the embedding's lookup gradient a reduce-scatter over
  data x fsdp then an all-gather over data; bandwidth and latency of the link the plan chose;
* ``end``: every bucket starts when the backward ends; ``per_block``: a bucket starts when its last block's
  backward is done and the link is free; exposed = last collective's end - backward's end;
* lower bound: the embedding's bucket cannot start before the backward ends, and the link cannot carry the
  other buckets faster than it can: ``max(t(last bucket), total comm - (backward time after the head's
  backward))``.

Part 2: the measured step time of ``train.grad_sync=end`` (automatic sharding) and ``per_block`` (shard_map,
bucket collectives in the backward) on 8 simulated CPU devices, same process, alternating, as a ratio.

    python benchmarks/comm.py [--steps 5] [--seq 4096] [--seqs-per-device 1]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxdist.cluster import load_cluster  # noqa: E402
from jaxdist.config import Config, apply_preset, load_config  # noqa: E402
from jaxdist.models.arithmetic import dense_block_flops_fwd, head_flops_fwd  # noqa: E402
from jaxdist.models.transformer import block_forward, rotary_tables  # noqa: E402
from jaxdist.parallel.comm import CommPlan, plan_comm  # noqa: E402


def _best(fn, *args, reps: int = 3) -> float:
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return min(out)


def measured_efficiency() -> float:
    """FLOP/s of a jitted block backward (d=512, 256 tokens, fp32) over a 1024^3 matmul's, on one device here."""
    n = 1024
    a = jnp.ones((n, n), jnp.float32)
    peak = 2 * n**3 / _best(jax.jit(lambda x: x @ x), a)
    sizes = {"d_model": 512, "n_heads": 8, "n_kv_heads": 8, "head_dim": 64, "d_ff": 1536}
    m = Config().replace(**{f"model.{k}": v for k, v in sizes.items()}).model
    t = 256
    key = jax.random.key(0)
    shapes = {
        "attn_norm": (512,), "mlp_norm": (512,), "wq": (512, 8, 64), "wk": (512, 8, 64), "wv": (512, 8, 64),
        "wo": (8, 64, 512), "w_gate": (512, 1536), "w_up": (512, 1536), "w_down": (1536, 512),
    }  # fmt: skip
    p = {k: jax.random.normal(key, s, jnp.float32) * 0.02 for k, s in shapes.items()}
    x = jax.random.normal(key, (1, t, 512), jnp.float32)
    cos, sin = rotary_tables(jnp.arange(t), 64, 1e4)
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(block_forward(p, x, cos, sin, m))))
    block_bwd = 2 * dense_block_flops_fwd(m, t) * t  # backward = 2 x forward
    return min(1.0, (block_bwd / _best(grad, p, x)) / peak)


def _ring(n: int, nbytes: float, lat: float, bw: float, steps: float) -> float:
    return 0.0 if n <= 1 else steps * (n - 1) * lat + steps * (n - 1) / n * nbytes / bw


def bucket_time(plan: CommPlan, i: int) -> float:
    """Seconds on the link of bucket i (rings): reduce-scatter over fsdp then all-reduce over data; the
    embedding's lookup gradient, a reduce-scatter over data x fsdp then an all-gather over data."""
    b, sizes = plan.buckets[i], dict(plan.axis_sizes)
    data, fsdp, lat, bw = sizes.get("data", 1), sizes.get("fsdp", 1), plan.latency, plan.bandwidth
    if b.collective.endswith("reduce-scatter(data, fsdp) + all-gather(data)"):
        return _ring(data * fsdp, b.bytes, lat, bw, 1) + _ring(data, b.reduced_bytes, lat, bw, 1)
    return _ring(fsdp, b.bytes, lat, bw, 1) + _ring(data, b.reduced_bytes, lat, bw, 2)


def simulate(model, sizes: dict, cluster_name: str, seq: int, seqs: int, eff: float) -> dict:
    """Exposed communication (s) of end, per_block and the lower bound, and the backward time (s)."""
    cluster = load_cluster(cluster_name)
    plan = plan_comm(model, sizes, cluster)
    flops = cluster.peak_flops(model.dtype) * eff
    tokens = seq * seqs
    tensor = sizes.get("tensor", 1)
    layer = 2 * dense_block_flops_fwd(model, seq) * tokens / tensor / flops
    head = 2 * head_flops_fwd(model) * tokens / tensor / flops
    embed = 0.0  # a lookup: its backward is a scatter-add, no matmul FLOPs
    k = plan.layers_per_bucket
    ready = [head]  # when each bucket's last block's backward is done
    t = head
    for _ in range(model.n_layers // k):
        t += k * layer
        ready.append(t)
    t += embed
    ready.append(t)
    backward = t
    comm = [bucket_time(plan, i) for i in range(len(plan.buckets))]
    end = sum(comm)
    free = 0.0
    for r, c in zip(ready, comm):
        free = max(free, r) + c
    per_block = max(0.0, free - backward)
    lower = max(comm[-1], sum(comm) - (backward - head))
    return {"plan": plan, "backward": backward, "end": end, "per_block": per_block, "lower": lower, "comm": end}


def measured_ratio(steps: int) -> tuple[float, float]:
    """(end, per_block) fastest step times (s) of the Trainer's step on 8 CPU devices, tiny model, data=8."""
    from jaxdist.models import create_abstract, init_params
    from jaxdist.parallel.comm import plan_for_config
    from jaxdist.parallel.grad_sync import per_block_grads_fn
    from jaxdist.parallel.layout import Parallelism
    from jaxdist.train.optimizer import make_optimizer
    from jaxdist.train.step import init_state, make_train_step

    over = ["model=small", "train.batch_size=32", "train.seq_len=64", "mesh.data=8", "train.grad_bucket_bytes=1"]
    cfg = load_config(None, over)
    par = Parallelism.build(cfg)
    graphdef, abstract, names = create_abstract(cfg.model)
    shardings = par.param_shardings(names, abstract)
    opt, sched = make_optimizer(cfg.train, 10)
    state = jax.jit(lambda: init_state(init_params(cfg.model), opt, 0))()
    tokens = jax.device_put(
        jax.random.randint(jax.random.key(0), (32, 65), 0, cfg.model.vocab_size), par.batch_sharding
    )
    plan = plan_for_config(cfg, load_cluster("cpu-8"))
    fns = {
        "end": jax.jit(par.bind(make_train_step(graphdef, opt, sched))),
        "per_block": jax.jit(
            par.bind(
                make_train_step(
                    graphdef,
                    opt,
                    sched,
                    grads_fn=per_block_grads_fn(graphdef, cfg.model, par.mesh, par.rules, shardings, plan),
                )
            )
        ),
    }
    best = {k: float("inf") for k in fns}
    for _k, f in fns.items():
        jax.block_until_ready(f(state, tokens))  # compile
    for _ in range(steps):  # alternate, so load on the shared machine falls on both alike
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(state, tokens))
            best[k] = min(best[k], time.perf_counter() - t0)
    return best["end"], best["per_block"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--seqs-per-device", type=int, default=1)
    args = ap.parse_args()
    eff = measured_efficiency()
    print(f"block backward efficiency measured here (block FLOP/s / matmul FLOP/s): {eff:.2f}")
    base = Config().model
    cases = [
        ("llama-8b", "h100x8", {"data": 8}),
        ("llama-70b", "h100x64", {"data": 8, "fsdp": 8}),
    ]
    print(
        f"{'model':<10} {'cluster':<8} {'mesh':<14} {'buckets':>7} {'backward ms':>11} {'comm ms':>8} "
        f"{'exposed: end':>12} {'per_block':>9} {'lower bound':>11}"
    )
    for preset, cluster, sizes in cases:
        r = simulate(apply_preset(base, preset), sizes, cluster, args.seq, args.seqs_per_device, eff)
        mesh = " ".join(f"{a}={n}" for a, n in sizes.items())
        print(
            f"{preset:<10} {cluster:<8} {mesh:<14} {len(r['plan'].buckets):>7} {r['backward'] * 1e3:>11.1f} "
            f"{r['comm'] * 1e3:>8.1f} {r['end'] * 1e3:>12.1f} {r['per_block'] * 1e3:>9.1f} {r['lower'] * 1e3:>11.1f}"
        )
    end, per_block = measured_ratio(args.steps)
    print(
        f"measured on 8 CPU devices (model=small, batch 32x64, data=8, one bucket per layer), fastest of "
        f"{args.steps}: end {end * 1e3:.1f} ms, per_block {per_block * 1e3:.1f} ms, per_block/end {per_block / end:.3f}"
    )


if __name__ == "__main__":
    main()

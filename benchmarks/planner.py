"""The planner's predictions against the compiled Trainer step on 8 simulated CPU devices.

Four tables:

1. memory and collectives: for (model, mesh) pairs, the predicted bytes per
   device vs ``compiled.memory_analysis()`` (arguments + outputs + temp -
   aliased) and the predicted collective bytes per step vs the collectives
   parsed from ``compiled.as_text()``;
2. ranking: ``jaxdist calibrate``'s fit on three reference steps, then
   predicted vs measured step time of 8 other strategies of one model, and
   their Spearman correlation;
3. search: on random models and clusters small enough to enumerate, the
   evaluations the search needs vs the candidate count, and whether it finds
   the exhaustive optimum;
4. planning time for large models on large clusters.

    python benchmarks/planner.py                 # all four (a few minutes on 2 cores)
    python benchmarks/planner.py --only search   # one table: memory, ranking, search or scale
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from jaxdist.config import ModelConfig, load_config  # noqa: E402

SMALL = ["model=small", "train.batch_size=32", "train.seq_len=128"]
# (model settings, mesh and strategy overrides): the pairs of table 1 beyond the ranking strategies.
PAIRS = [
    (SMALL, ["mesh.data=8"]),
    (SMALL, ["mesh.data=1", "mesh.fsdp=8", "train.remat=full"]),
    (SMALL, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.microbatches=2"]),
]


def predicted(cfg, cluster_view_):
    from jaxdist.planner.candidates import strategy_of
    from jaxdist.planner.computation import computation_view
    from jaxdist.planner.cost import estimate

    return estimate(
        computation_view(cfg.model, cfg.train.seq_len), cluster_view_, strategy_of(cfg, 8), cfg.train.batch_size
    )


def measured_vs_predicted(rounds: int = 5) -> dict:
    """Compile (and time) the calibration references, the ranking strategies and the extra pairs."""
    import jax

    from jaxdist.cluster import load_cluster
    from jaxdist.measure.calibrate import measure_links
    from jaxdist.measure.steps import RANKING_MODEL, RANKING_STRATEGIES, measure_strategies, measurement_config
    from jaxdist.planner.calibrate import calibration_from, reference_overrides
    from jaxdist.planner.cluster import cluster_view

    refs = [measurement_config(o) for o in reference_overrides(8, "tiny", 8, 32)]
    ranking = [measurement_config(RANKING_MODEL + o) for o in RANKING_STRATEGIES]
    pairs = [measurement_config(m + o) for m, o in PAIRS]
    latency, bandwidth = measure_links(jax.devices())
    timed = measure_strategies(refs + ranking, rounds=rounds)
    untimed = measure_strategies(pairs, rounds=0)
    spec = load_cluster("cpu-8")
    cal = calibration_from(refs, [m.step_time for m in timed[: len(refs)]], spec, 8, latency, bandwidth)
    view = cluster_view(spec, calibration=cal)
    cfgs = refs + ranking + pairs
    return {
        "calibration": cal,
        "configs": cfgs,
        "measured": timed + untimed,
        "estimates": [predicted(c, view) for c in cfgs],
        "n_refs": len(refs),
        "n_ranking": len(ranking),
    }


def _label(cfg) -> str:
    from jaxdist.planner.candidates import strategy_of

    return f"{cfg.model.preset:5s} {strategy_of(cfg, 8).describe()}"


def table_memory(r: dict) -> None:
    print("\n1. memory per device and collective bytes per step: predicted vs compiled (8 CPU devices)")
    print(f"{'model / strategy':<58} {'mem MiB':>8} {'XLA':>8} {'err':>7}   {'comm MiB':>8} {'XLA':>8} {'err':>7}")
    worst_m = worst_c = 0.0
    for cfg, m, e in zip(r["configs"], r["measured"], r["estimates"]):
        em = e.memory.total / m.memory_bytes - 1
        ec = e.comm_bytes / m.collective_bytes["total"] - 1
        worst_m, worst_c = max(worst_m, abs(em)), max(worst_c, abs(ec))
        print(
            f"{_label(cfg):<58} {e.memory.total / 2**20:>8.2f} {m.memory_bytes / 2**20:>8.2f} {em:>+7.1%}   "
            f"{e.comm_bytes / 2**20:>8.3f} {m.collective_bytes['total'] / 2**20:>8.3f} {ec:>+7.1%}"
        )
    print(
        f"{len(r['configs'])} pairs; worst memory error {worst_m:.1%} (target 10%), "
        f"worst collective error {worst_c:.1%} (target 5%)"
    )


def table_ranking(r: dict) -> float:
    from scipy.stats import spearmanr

    cal = r["calibration"]
    print(
        f"\n2. step time after calibration: efficiency {cal.efficiency:.3f}, pass overhead "
        f"{cal.pass_overhead * 1e3:.3f} ms, collective overhead {cal.collective_overhead * 1e3:.3f} ms, "
        f"link {cal.intra_node_bandwidth / 1e9:.2f} GB/s / {cal.intra_node_latency * 1e6:.1f} us"
    )
    lo, hi = r["n_refs"], r["n_refs"] + r["n_ranking"]
    print(f"{'strategy (tiny, batch 64 x 32)':<58} {'predicted ms':>12} {'measured ms':>12}")
    for i, (cfg, m, e) in enumerate(zip(r["configs"], r["measured"], r["estimates"])):
        if i < hi:
            tag = " (calibration reference)" if i < lo else ""
            print(f"{_label(cfg):<58} {e.step_time * 1e3:>12.2f} {m.step_time * 1e3:>12.2f}{tag}")
    rho = spearmanr([e.step_time for e in r["estimates"][lo:hi]], [m.step_time for m in r["measured"][lo:hi]])[0]
    print(f"Spearman correlation over the {hi - lo} strategies: {rho:.3f} (target 0.8)")
    return float(rho)


def random_case(rng: random.Random):
    """A random dense model, cluster and batch whose candidate space is enumerable."""
    from jaxdist.cluster import ClusterSpec

    heads = rng.choice([8, 16, 32, 64])
    model = ModelConfig(
        preset="random",
        vocab_size=rng.choice([32000, 50304, 128256]),
        d_model=heads * 128,
        n_layers=rng.choice([8, 12, 16, 24, 32, 48]),
        n_heads=heads,
        n_kv_heads=rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0]),
        head_dim=128,
        d_ff=heads * 128 * rng.choice([3, 4]),
        max_seq_len=4096,
        dtype="bfloat16",
    )
    per_node = rng.choice([4, 8])
    nodes = rng.choice([1, 2, 4, 8, 16])
    spec = ClusterSpec(
        name="random",
        device_kind="gpu",
        nodes=nodes,
        devices_per_node=per_node,
        memory_bytes=rng.choice([40, 80, 141]) * 10**9,
        peak_flops_bf16=989e12,
        peak_flops_fp32=67e12,
        intra_node_bandwidth=rng.choice([150e9, 450e9]),
        inter_node_bandwidth=rng.choice([12.5e9, 25e9, 50e9]),
        intra_node_latency=3e-6,
        inter_node_latency=1e-5,
    )
    batch = nodes * per_node * rng.choice([1, 2, 4, 8])
    return model, spec, batch, rng.choice([1024, 2048, 4096])


def search_cases(n: int = 30, seed: int = 0):
    """(model, spec, batch, seq, plan by search, plan by enumeration) for ``n`` random cases."""
    from jaxdist.planner import PlanError, plan

    rng = random.Random(seed)
    out = []
    while len(out) < n:
        model, spec, batch, seq = random_case(rng)
        axes = ("data", "fsdp", "tensor", "pipeline")
        try:
            full = plan(model, spec, batch_size=batch, seq_len=seq, axes=axes, enumerate_all=True)
        except PlanError:
            continue
        if full.space < 1000:
            continue
        found = plan(model, spec, batch_size=batch, seq_len=seq, axes=axes)
        out.append((model, spec, batch, seq, found, full))
    return out


def table_search(n: int = 30) -> None:
    from jaxdist.planner.search import objective

    print(f"\n3. search vs exhaustive enumeration, {n} random models and clusters (axes data, fsdp, tensor, pipeline)")
    print(
        f"{'layers':>6} {'heads':>5} {'devices':>9} {'batch':>5} {'seq':>5} {'plans':>7} {'evaluated':>9} "
        f"{'share':>6}  optimum"
    )
    hits = 0
    worst = 0.0
    for model, spec, batch, seq, found, full in search_cases(n):
        share = found.evaluations / full.space
        same = objective(found.best) == objective(full.best)
        hits += same
        worst = max(worst, share)
        print(
            f"{model.n_layers:>6} {model.n_heads:>5} {spec.nodes:>3}x{spec.devices_per_node:<5} {batch:>5} {seq:>5} "
            f"{full.space:>7} {found.evaluations:>9} {share:>6.1%}  {'found' if same else 'MISSED'}"
        )
    print(f"optimum found in {hits}/{n}; at most {worst:.1%} of the plans evaluated (target 10%)")


def table_scale() -> None:
    from jaxdist.cluster import ClusterSpec, load_cluster
    from jaxdist.planner import plan

    print("\n4. planning time")
    gpt3 = ModelConfig(
        preset="gpt-175b",
        vocab_size=50304,
        d_model=12288,
        n_layers=96,
        n_heads=96,
        n_kv_heads=96,
        head_dim=128,
        d_ff=32768,
        max_seq_len=2048,
        tie_embeddings=False,
        dtype="bfloat16",
    )
    h100 = load_cluster("h100x64")
    big = ClusterSpec(**{**h100.__dict__, "name": "h100x1024", "nodes": 128})
    cases = [
        ("llama-70b", load_config(None, ["model=llama-70b"]).model, h100, 256, 4096),
        ("gpt-175b (96 layers)", gpt3, big, 1536, 2048),
    ]
    for name, model, spec, batch, seq in cases:
        t0 = time.perf_counter()
        p = plan(model, spec, batch_size=batch, seq_len=seq, axes=("data", "fsdp", "tensor", "pipeline"))
        dt = time.perf_counter() - t0
        e = p.best
        print(
            f"{name:<22} on {spec.n_devices:>5} GPUs: {dt:6.2f} s, {p.evaluations} plans evaluated; "
            f"{e.strategy.describe()}, {e.step_time:.3g} s/step, MFU {e.mfu:.1%}, "
            f"{e.memory.total / 2**30:.1f} GiB/device"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=("memory", "ranking", "search", "scale"))
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds per strategy (table 2)")
    ap.add_argument("--cases", type=int, default=30, help="random cases (table 3)")
    args = ap.parse_args(argv)
    if args.only in (None, "memory", "ranking"):
        r = measured_vs_predicted(args.rounds)
        if args.only in (None, "memory"):
            table_memory(r)
        if args.only in (None, "ranking"):
            table_ranking(r)
    if args.only in (None, "search"):
        table_search(args.cases)
    if args.only in (None, "scale"):
        table_scale()
    return 0


if __name__ == "__main__":
    sys.exit(main())

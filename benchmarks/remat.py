"""Remat selector: predictions against XLA, Pareto points against named policies, optimality.

Three tables:

1. **Pareto** (CPU, XLA): the block of a small model (default ``tiny`` with
   16 layers, batch 16 x seq 64, one device) is profiled (time = XLA FLOPs /
   peak), the selector plans at ``--budgets`` budgets spread between "save
   nothing" and "save everything", and every plan and every named policy
   (jax's built-ins and the common recipes) is compiled as the gradient of
   the training loss.  Columns: predicted saved activations (all layers,
   beyond the block inputs), what XLA reports (temp bytes minus those of
   ``nothing_saveable``), their relative difference, predicted recompute
   FLOPs per block, XLA's (FLOPs minus those of ``everything_saveable``; XLA
   counts a loop body once, so this is per block), and which named policy,
   if any, dominates the point (no more memory and no more recompute, one of
   them less by more than the noise: 1% of everything_saveable's saved bytes
   and of nothing_saveable's recompute FLOPs).
2. **Optimality**: on generated operator graphs (chains and branching graphs
   of 20 to 500 operators), the selector's recompute time against the exact
   optimum (brute force up to 20 operators, the MILP above) at several
   budgets, and its solve time.
3. With ``--model-table``: the plan and comparison that ``jaxdist remat``
   prints for the profiled model.

    python benchmarks/remat.py                       # all of the above on CPU, a few minutes on 2 cores
    python benchmarks/remat.py --skip-pareto         # optimality only (about a minute)
    python benchmarks/remat.py --devices 8 --mesh data=2,fsdp=2,tensor=2   # sharded Pareto table
    python benchmarks/remat.py --budget-table        # train.remat=auto against the compiler (remat_budget.py)
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,tensor=2"`` -> ``{"data": 2, "tensor": 2}``."""
    out = {}
    for part in filter(None, text.split(",")):
        k, v = part.split("=")
        out[k.strip()] = int(v)
    return out


def pareto_table(args) -> bool:
    import jax
    import numpy as np

    from jaxdist.config import load_config
    from jaxdist.measure.remat import dominated_by, measure_policies
    from jaxdist.parallel.mesh import build_mesh
    from jaxdist.remat import budget_range, named_policies, plan_remat, policy_point, profile_block

    cfg = load_config(
        None,
        [f"model={args.preset}", f"model.n_layers={args.layers}", "model.max_seq_len=4096"]
        + [f"mesh.{k}={v}" for k, v in parse_mesh(args.mesh).items()],
    )
    mesh = build_mesh(cfg.mesh, jax.devices()[: args.devices])
    t0 = time.perf_counter()
    profile = profile_block(cfg.model, args.batch, args.seq, dict(mesh.shape), peak_flops=1e12)
    L = profile.n_layers
    floor = L * profile.input_bytes
    lo, hi = budget_range(profile)
    budgets = [lo + (hi - lo) * f for f in np.linspace(0.0, 1.0, args.budgets + 2)[1:-1]]
    plans = {f"selected @ {(b - lo) / (hi - lo):.0%}": plan_remat(profile, b) for b in budgets}
    named = named_policies()
    print(
        f"profiled {len(profile.operators)} operators in {time.perf_counter() - t0:.1f} s; "
        f"budgets {lo / 2**20:.2f}..{hi / 2**20:.2f} MiB per device; compiling {len(plans) + len(named)} programs ...",
        file=sys.stderr,
    )
    policies = {**{k: p.policy() for k, p in plans.items()}, **named}
    t0 = time.perf_counter()
    xla = measure_policies(cfg.model, mesh, args.batch, args.seq, policies)
    print(f"compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    base, full = xla["nothing_saveable"], xla["everything_saveable"]

    rows = {}
    for name in policies:
        if name in plans:
            pred_b, pred_f = plans[name].activation_bytes - floor, plans[name].recompute_flops / L
        else:
            pt = policy_point(profile, name, named[name])
            pred_b, pred_f = pt.activation_bytes - floor, pt.recompute_flops / L
        rows[name] = (pred_b, xla[name].temp_bytes - base.temp_bytes, pred_f, xla[name].flops - full.flops)
    named_pts = {n: (r[1], r[3]) for n, r in rows.items() if n in named}
    # Noise: 1% of everything_saveable's saved bytes and of nothing_saveable's recompute FLOPs (as the tests).
    tol = (0.01 * rows["everything_saveable"][1], 0.01 * rows["nothing_saveable"][3])
    print(
        f"\nPareto: {args.preset} x {L} layers, batch {args.batch} x seq {args.seq}, mesh {args.mesh or 'one device'}, "
        f"{args.devices} device(s); bytes per device, recompute per block"
    )
    print(
        f"{'policy':<44} {'pred MiB':>9} {'XLA MiB':>9} {'diff':>7} {'pred MFLOP':>11} {'XLA MFLOP':>10}  dominated by"
    )
    ok = True
    for name, (pb, mb, pf, mf) in rows.items():
        diff = f"{(pb - mb) / mb:+.1%}" if abs(mb) > 1e-9 * max(1.0, abs(pb)) and mb > 0 else "n/a"
        dom = (dominated_by((mb, mf), named_pts, tol) or "-") if name in plans else ""
        ok &= dom in ("", "-")
        print(
            f"{name[:44]:<44} {pb / 2**20:>9.3f} {mb / 2**20:>9.3f} {diff:>7} {pf / 1e6:>11.3f} {mf / 1e6:>10.3f}  {dom}"
        )
    if args.model_table:
        from jaxdist.remat import compare_policies, format_comparison

        mid = list(plans.values())[len(plans) // 2]
        print("\n" + mid.table(by_group=True) + "\n\n" + format_comparison(compare_policies(profile, mid)))
    return ok


def optimality_table(args) -> bool:
    from jaxdist.remat.select import evaluate, random_graph, select, select_brute_force, select_exact

    print("\nOptimality: selector (exact MILP up to 200 units, MILP to a 0.5% proven gap above) against the optimum")
    print(f"{'graph':<16} {'budget':>7} {'optimum':>11} {'selector':>11} {'error':>8} {'method':<22} {'solve ms':>9}")
    worst, slowest = 0.0, 0.0
    cases = [(k, n, s) for n in (20, 60, 200, 500) for k in ("chain", "branching") for s in range(args.seeds)]
    for kind, n, seed in cases:
        g = random_graph(n, kind, seed)
        full = evaluate(g, range(g.n_units)).bytes
        for frac in (0.2, 0.5, 0.8):
            b = frac * full
            ref = select_brute_force(g, b) if n <= 20 else select_exact(g, b)
            got = select(g, b)
            err = (got.time - ref.time) / max(ref.time, 1e-300)
            worst, slowest = max(worst, err), max(slowest, got.solve_seconds if n == 500 else 0.0)
            print(
                f"{kind[:6]}-{n}-s{seed:<5} {frac:>7.0%} {ref.time * 1e3:>9.4f}ms {got.time * 1e3:>9.4f}ms "
                f"{err:>8.3%} {got.method[:22]:<22} {got.solve_seconds * 1e3:>9.0f}"
            )
    print(
        f"{len(cases) * 3} instances on {len(cases)} graphs: worst error {worst:.3%} (target <= 1%), "
        f"slowest 500-operator selection {slowest:.2f} s (target < 1 s)"
    )
    return worst <= 0.01 and slowest < 1.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--mesh", default="", help="axis sizes, e.g. data=2,fsdp=2,tensor=2 (default: one device)")
    p.add_argument("--devices", type=int, default=1, help="devices in the mesh (simulated CPU devices)")
    p.add_argument("--budgets", type=int, default=10)
    p.add_argument(
        "--budget-table",
        action="store_true",
        help="only the compiled-peak table of benchmarks/remat_budget.py (train.remat=auto against every named "
        "policy at --budgets budgets on the issue's settings)",
    )
    p.add_argument("--seeds", type=int, default=2, help="generated graphs per kind and size")
    p.add_argument("--skip-pareto", action="store_true")
    p.add_argument("--skip-optimality", action="store_true")
    p.add_argument("--model-table", action="store_true")
    args = p.parse_args(argv)
    if args.budget_table:  # its own device count (8 simulated): the settings' meshes use up to 4
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import remat_budget

        return remat_budget.main(["--budgets", str(args.budgets)])
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={max(args.devices, 1)}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ok = True
    if not args.skip_pareto:
        ok &= pareto_table(args)
    if not args.skip_optimality:
        ok &= optimality_table(args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

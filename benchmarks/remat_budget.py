"""train.remat=auto against the compiler: at budgets between the full-remat and the no-remat compiled peak,
the chosen plan's compiled peak fits, and its step FLOPs are at most those of every named policy that fits.

For each setting (model overrides, mesh) every named policy (none, full, jax's built-ins, the all-names
policy, every single-name save:, the recipes `jaxdist remat` prints) is compiled as the whole train step
(compile only, nothing runs); budgets are spread between the full-remat and the no-remat peak; at each,
:func:`jaxdist.resolve.verified_remat` chooses (its compiles counted and timed; a program compiled before in
this benchmark is read from a cache keyed by its saved set, so the time column is the compiles the loop
would spend, the count is its trials).  Every compile is also appended to a cache file (``--cache``, one JSON
line per program, keyed by setting, mesh and the program's remat), so a rerun resumes where the last stopped
and ``--compare-only`` compiles only the comparison set (the named policies, once per setting and mesh).  Columns: budget, chosen, predicted and compiled peak, its FLOPs,
the best named policy that fits and its FLOPs, the loop's compiles (trials) and their seconds (s), the seconds
of the one-block working-space probes it asked for (probe s; a probe is made once per process, so a setting's
first budget pays most of them), ok (fits and FLOPs <= 1.01 x the best named).

    python benchmarks/remat.py --budget-table                    # the issue's settings (long on 2 cores)
    python benchmarks/remat_budget.py --settings tiny:1 --budgets 4
    nice -n 10 python benchmarks/remat_budget.py --compare-only    # the comparison set alone, cached
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

# The setting: small widened to d_model 256, d_ff 1024, 4 layers, seq 512, batch 4, one device.
SETTINGS = {
    "issue": (["model=small", "model.d_model=256", "model.d_ff=1024", "model.n_layers=4", "model.max_seq_len=512",
               "train.seq_len=512", "train.batch_size=4"], ["1"]),
    "tiny": (["model=tiny", "train.seq_len=64", "train.batch_size=8"], ["1", "data=2,tensor=2"]),
    "small": (["model=small", "train.seq_len=64", "train.batch_size=8"], ["1", "fsdp=2,tensor=2"]),
    "moe-tiny": (["model=moe-tiny", "train.seq_len=64", "train.batch_size=8"], ["1", "data=2,expert=2"]),
}  # fmt: skip


def mesh_overrides(mesh: str) -> list[str]:
    """``"data=2,tensor=2"`` -> mesh overrides on cpu-8 (the rest of the devices unused); ``"1"``: cpu-1."""
    if mesh == "1":  # every axis given: one device, even where JAX simulates 8
        return ["mesh.cluster=cpu-1", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.expert=1"]
    sizes = dict(kv.split("=") for kv in mesh.split(","))
    return ["mesh.cluster=cpu-8"] + [f"mesh.{a}={sizes.get(a, 1)}" for a in ("data", "fsdp", "tensor", "expert")]


class CompileCache:
    """Compiled peaks by (setting, mesh, program), kept in a JSON-lines file so a rerun resumes."""

    def __init__(self, path: str):
        self.path, self.items = path, {}
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:  # a line torn by an interrupted write
                        continue
                    self.items[row["key"]] = row["peak"]

    def get(self, key: str, compile_fn):
        from jaxdist.train.aot import CompiledPeak

        if key not in self.items:
            got = compile_fn()
            self.items[key] = {f.name: getattr(got, f.name) for f in dataclasses.fields(got) if f.name != "runnable"}
            with open(self.path, "a") as f:
                f.write(json.dumps({"key": key, "peak": self.items[key]}) + "\n")
        return CompiledPeak(**self.items[key])


def program_key(cfg) -> str:
    """What the compiled program depends on beyond the setting: the remat (a selector plan by its saved set).
    ``cfg``: a Config (its train.remat) or a jaxdist.train.resolved.Resolved (its remat choice)."""
    spec = cfg.remat if hasattr(cfg, "remat") and not hasattr(cfg, "train") else cfg.train.remat_spec
    c = spec.plan
    if spec.kind == "selected" and c is not None and getattr(c, "plan", None) is not None:
        return "saved:" + "".join("1" if s else "0" for s in c.saved)
    if spec.kind == "selected":  # a named candidate of the loop: the same program as its train.remat value
        return "value:" + str(c.spec)
    return "value:" + str(spec)


def run_setting(
    name: str, overrides: list[str], mesh: str, n_budgets: int, cache: CompileCache, compare_only: bool = False
) -> list[bool]:
    import jax

    from jaxdist.config import load_config
    from jaxdist.remat.plan import format_bytes
    from jaxdist.remat.verify import named_values
    from jaxdist.resolve import verified_remat
    from jaxdist.train.aot import compiled_peak

    base = load_config(None, overrides + mesh_overrides(mesh) + ["train.remat=auto"])
    devices = jax.devices()[: base.mesh.devices_used(len(jax.devices()))]

    def compile_cached(cfg):
        return cache.get(f"{name}|{mesh}|{program_key(cfg)}", lambda: compiled_peak(cfg, devices))

    t0 = time.perf_counter()
    named = {}
    for label, value in named_values().items():
        cfg = base.replace(**{"train.remat": value})
        named[label] = compile_cached(cfg)
    full, none = named["full"].peak_bytes, named["none"].peak_bytes
    print(
        f"\n{name}, mesh {mesh}: {len(named)} named policies compiled in {time.perf_counter() - t0:.0f} s; "
        f"full remat {format_bytes(full)}, no remat {format_bytes(none)} per device",
        flush=True,
    )
    if compare_only:
        return []
    print(
        f"{'budget':>11} {'chosen':<28} {'predicted':>11} {'compiled':>11} {'GFLOP':>8} "
        f"{'best named that fits':<24} {'GFLOP':>8} {'trials':>6} {'s':>5} {'probe s':>7}  ok"
    )
    oks = []
    lo, hi = min(full, none), max(full, none)
    for i in range(n_budgets):
        budget = int(lo + (hi - lo) * (i + 0.5) / n_budgets)
        cfg = base.replace(**{"train.memory_budget_bytes": budget})
        seconds = [0.0]

        def timed(c):
            got = compile_cached(c)
            seconds[0] += got.seconds  # what the loop would spend: each trial is a compile of its own  # noqa: B023 (used in this iteration)
            return got

        ch = verified_remat(cfg, devices, compile_peak=timed)
        fits = {n: p for n, p in named.items() if p.peak_bytes <= budget}
        best = min(fits.items(), key=lambda kv: kv[1].flops) if fits else None
        flops = ch.trial.flops
        ok = ch.trial.compiled <= budget and (best is None or flops <= 1.01 * best[1].flops)
        oks.append(ok)
        print(
            f"{format_bytes(budget):>11} {ch.chosen.name[:28]:<28} {format_bytes(ch.trial.predicted):>11} "
            f"{format_bytes(ch.trial.compiled):>11} {flops / 1e9:>8.3f} "
            f"{(best[0] if best else '-')[:24]:<24} {best[1].flops / 1e9 if best else float('nan'):>8.3f} "
            f"{len(ch.trials):>6} {seconds[0]:>5.0f} {ch.probe_seconds:>7.1f}  {'yes' if ok else 'NO'}",
            flush=True,
        )
        if not ok:  # what the loop compiled, for the reader to see where it went
            print("            compiled: " + "; ".join(
                f"{t.candidate.name} {format_bytes(t.compiled)} {t.flops / 1e9:.3f} GFLOP" for t in ch.trials
            ), flush=True)  # fmt: skip
    return oks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--settings",
        default="issue:1,tiny:1,tiny:data=2|tensor=2,small:1,small:fsdp=2|tensor=2,moe-tiny:1,moe-tiny:data=2|expert=2",
        help="NAME:MESH list (mesh axes joined by |)",
    )
    p.add_argument("--budgets", type=int, default=10)
    p.add_argument(
        "--cache",
        default=os.path.join(tempfile.gettempdir(), "jaxdist-remat-budget.jsonl"),
        help="compiled peaks kept between runs (JSON lines; delete it after changing the model or the compiler)",
    )
    p.add_argument("--compare-only", action="store_true", help="compile the named policies only (into --cache)")
    args = p.parse_args(argv)
    cache = CompileCache(args.cache)
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAXDIST_CALIBRATION_DIR", tempfile.mkdtemp(prefix="jaxdist-remat-budget-"))
    oks = []
    for item in args.settings.split(","):
        name, mesh = item.split(":")
        oks += run_setting(name, SETTINGS[name][0], mesh.replace("|", ","), args.budgets, cache, args.compare_only)
    print(f"\n{sum(oks)} of {len(oks)} (setting, budget) cases: compiled peak within the budget and FLOPs <= 1.01 x "
          "the best fitting named policy")  # fmt: skip
    return 0 if all(oks) else 1


if __name__ == "__main__":
    sys.exit(main())

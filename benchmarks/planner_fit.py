"""Fit the planner's memory coefficients to XLA:CPU and check them on settings the fit never saw.

Compiles the Trainer's step for a random sample of (model, batch, sequence,
mesh, remat, microbatches) settings on 8 simulated CPU devices, reads
``compiled.memory_analysis()`` (arguments + outputs + temp - aliased), fits
:class:`jaxdist.planner.cost.MemoryCoefficients` by the minimax linear
programme of :mod:`jaxdist.planner.fit`, and prints

* k-fold cross-validation on the sample (fit on k-1 folds, error on the last);
* the relative error of the coefficients fitted on the whole sample and of the
  shipped ones on the sample (in-sample), on the 12 pairs
  tests/planner/test_measured.py checks (never in the sample), and on settings
  of models with larger vocabularies (outside the fit domain).

    python benchmarks/planner_fit.py --measurements mem.json   # 144 + 24 + 12 settings (~15 min on 2 cores)
    python benchmarks/planner_fit.py --settings 48 --other-vocab 8

Paste the printed coefficients into ``XLA_CPU_MEMORY`` (jaxdist/planner/cost.py) to ship them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import tempfile

os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    + ["--xla_force_host_platform_device_count=8"]
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MESHES = [
    ["mesh.data=8"],
    ["mesh.data=1", "mesh.fsdp=8"],
    ["mesh.data=4", "mesh.tensor=2"],
    ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"],
    ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
    ["mesh.data=2", "mesh.fsdp=4"],
    ["mesh.data=4", "mesh.fsdp=2"],
]
# The fit domain: the presets and a shallower small model, all with the byte vocabulary (260) ...
FIT_MODELS = [["model=tiny"], ["model=small"], ["model=small", "model.n_layers=2", "model.d_ff=256"]]
# ... and models with larger vocabularies, reported outside it.
OTHER_VOCAB_MODELS = [
    ["model=tiny", "model.vocab_size=4096"],
    ["model=small", "model.n_layers=2", "model.vocab_size=2048"],
]


def test_pairs() -> list[list[str]]:
    """The overrides of the 12 pairs tests/planner/test_measured.py compares with XLA."""
    from jaxdist.measure.steps import RANKING_MODEL, RANKING_STRATEGIES, SMALL_CHECK
    from jaxdist.planner.calibrate import reference_overrides

    return reference_overrides(8, "tiny", 8, 32) + [RANKING_MODEL + o for o in RANKING_STRATEGIES] + [SMALL_CHECK]


def grid(models: list[list[str]]) -> list[list[str]]:
    """Every setting of ``models`` on the sampling grid (batch divisible by the batch ways and the microbatches)."""
    from jaxdist.planner.candidates import REMAT_CHOICES

    out = []
    for model, mesh, remat, batch, seq, m in itertools.product(
        models, MESHES, REMAT_CHOICES, (32, 64), (32, 64), (1, 2, 4, 8)
    ):
        ways = 1
        for o in mesh:
            if o.startswith(("mesh.data=", "mesh.fsdp=")):
                ways *= int(o.split("=")[1])
        if (batch // m) % ways or batch % m:
            continue
        out.append(
            model
            + mesh
            + [
                f"train.batch_size={batch}",
                f"train.seq_len={seq}",
                f"train.microbatches={m}",
                f"train.remat={remat.train_remat}",
            ]
        )
    return out


def _key(overrides: list[str]):
    from jaxdist.config import load_config
    from jaxdist.planner.candidates import strategy_of

    c = load_config(None, overrides)
    return (repr(c.model), c.train.batch_size, c.train.seq_len, strategy_of(c, 8))


def measure(settings: list[list[str]], known: dict[str, int]):
    """(config, MemoryTerms, measured bytes) per setting; ``known`` (overrides joined by spaces -> bytes)
    saves compiling settings measured before and receives the new ones."""
    from jaxdist.measure.steps import measure_strategies, measurement_config
    from jaxdist.planner.candidates import strategy_of
    from jaxdist.planner.computation import computation_view
    from jaxdist.planner.cost import memory_terms

    runs = tempfile.mkdtemp(prefix="jaxdist-fit-")
    cfgs = [measurement_config(o, runs) for o in settings]
    todo = [i for i, o in enumerate(settings) if " ".join(o) not in known]
    for i, m in zip(todo, measure_strategies([cfgs[i] for i in todo], rounds=0)):
        known[" ".join(settings[i])] = m.memory_bytes
    terms = [
        memory_terms(computation_view(c.model, c.train.seq_len), strategy_of(c, 8), c.train.batch_size) for c in cfgs
    ]
    return cfgs, terms, [known[" ".join(o)] for o in settings]


def report(name: str, cfgs, terms, measured, coeffs: dict, verbose: bool = False) -> None:
    from jaxdist.planner.candidates import strategy_of
    from jaxdist.planner.fit import relative_errors

    errs = {k: relative_errors(terms, measured, c) for k, c in coeffs.items()}
    if verbose:
        print(f"{'model / strategy':<62} {'XLA MiB':>8} " + " ".join(f"{k:>9}" for k in coeffs))
        for i, c in enumerate(cfgs):
            label = (
                f"{c.model.preset} L{c.model.n_layers} b{c.train.batch_size}x{c.train.seq_len} "
                f"{strategy_of(c, 8).describe()}"
            )
            print(f"{label:<62} {measured[i] / 2**20:>8.2f} " + " ".join(f"{e[i]:>+9.1%}" for e in errs.values()))
    print(
        f"{name:<28} n={len(cfgs):<3} worst |error|: "
        + ", ".join(f"{k} {max(abs(x) for x in e):.1%}" for k, e in errs.items())
        + "; mean |error|: "
        + ", ".join(f"{k} {sum(abs(x) for x in e) / len(e):.1%}" for k, e in errs.items())
    )


def cross_validate(terms, measured, folds: int) -> tuple[float, float, float]:
    """(mean in-sample worst, worst held-out, mean held-out) |error| over ``folds`` folds."""
    from jaxdist.planner.fit import fit_memory_coefficients, relative_errors

    ins, held = [], []
    for i in range(folds):
        train = [j for j in range(len(terms)) if j % folds != i]
        test = [j for j in range(len(terms)) if j % folds == i]
        f = fit_memory_coefficients([terms[j] for j in train], [measured[j] for j in train])
        ins.append(f.max_error)
        held += [abs(e) for e in relative_errors([terms[j] for j in test], [measured[j] for j in test], f.coefficients)]
    return sum(ins) / folds, max(held), sum(held) / len(held)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", type=int, default=144, help="settings of the fit domain to measure")
    ap.add_argument("--folds", type=int, default=3, help="cross-validation folds")
    ap.add_argument("--other-vocab", type=int, default=24, help="settings with larger vocabularies (outside the fit)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--verbose", action="store_true", help="one row per setting")
    ap.add_argument(
        "--measurements",
        help="JSON file of measured bytes per setting: read if it exists, "
        "then written with the new ones (refit without compiling again)",
    )
    args = ap.parse_args(argv)

    from jaxdist.planner.cost import XLA_CPU_MEMORY
    from jaxdist.planner.fit import fit_memory_coefficients

    checked = test_pairs()
    excluded = {_key(o) for o in checked}
    pool = [o for o in grid(FIT_MODELS) if _key(o) not in excluded]
    random.Random(args.seed).shuffle(pool)
    others = grid(OTHER_VOCAB_MODELS)
    random.Random(args.seed).shuffle(others)
    print(
        f"fit domain: {len(pool)} settings of the byte-vocabulary models (the {len(checked)} test pairs left out); "
        f"measuring {args.settings}, {args.other_vocab} of larger vocabularies and the {len(checked)} test "
        "pairs; 8 CPU devices"
    )
    known = {}
    if args.measurements and os.path.exists(args.measurements):
        with open(args.measurements) as f:
            known = json.load(f)
    sets = {
        "fit (in-sample)": measure(pool[: args.settings], known),
        "test pairs": measure(checked, known),
        "larger vocabularies": measure(others[: args.other_vocab], known),
    }
    if args.measurements:
        with open(args.measurements, "w") as f:
            json.dump(known, f, indent=0)
    _, terms, measured = sets["fit (in-sample)"]
    mean_in, worst_held, mean_held = cross_validate(terms, measured, args.folds)
    print(
        f"\n{args.folds}-fold cross-validation on the fit domain: in-sample worst {mean_in:.1%} (mean over folds); "
        f"held out worst {worst_held:.1%}, mean {mean_held:.1%}"
    )
    fitted = fit_memory_coefficients(terms, measured)
    coeffs = {"fitted": fitted.coefficients, "shipped": XLA_CPU_MEMORY}
    print(f"\nfitted on all {len(terms)} (minimax LP, worst {fitted.max_error:.1%}):\n  {fitted.coefficients}")
    print(f"shipped coefficients:\n  {XLA_CPU_MEMORY}\n")
    for name, (cfgs, terms, measured) in sets.items():
        report(name, cfgs, terms, measured, coeffs, args.verbose)
    return 0


if __name__ == "__main__":
    sys.exit(main())

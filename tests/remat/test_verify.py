"""train.remat=auto closed against the compiler (jaxdist/remat/verify.py) and the working-space store.

The loop's decisions are checked with an injected compiler whose answer is known (peak = fixed + saved +
a per-candidate working space), against brute force over the candidates; one test compiles for real: an
injected optimistic working-space term makes the first candidate overflow, the loop repairs, the chosen
plan's compiled peak fits, and what the compiles taught is stored and read back.
"""

import dataclasses
import json
from pathlib import Path

import jax
import pytest

from jaxdist.config import ConfigError, Remat, load_config
from jaxdist.remat import profile_block
from jaxdist.remat.policy import profile_for_config
from jaxdist.remat.verify import Candidate, PeakModel, candidates, choose, named_values
from jaxdist.remat.working import Working, load_working, record_working, working_path
from jaxdist.resolve import setting_key, verified_remat
from jaxdist.train.aot import peak_of
from jaxdist.train.resolved import Resolved
from jaxdist.train.trainer import Trainer

B, T = 4, 32


@pytest.fixture(scope="module")
def pool():
    profile = profile_block(load_config(None, ["model=tiny"]).model, B, T, {}, peak_flops=5e10)
    return candidates(profile, n_budgets=8)


def _compiler(fixed, working):
    calls = []

    def compile_peak(c):
        calls.append(c)
        return fixed + c.activation_bytes + working(c), c.recompute_flops, 0.0

    return compile_peak, calls


def _optimum(pool, budget, fixed, working):
    fits = [c for c in pool if fixed + c.activation_bytes + working(c) <= budget]
    return min(fits, key=lambda c: (c.recompute_flops, c.activation_bytes))


def test_candidates_cover_the_named_set_and_are_pareto(pool):
    names = {c.name for c in pool}
    assert "full" in names and min(c.recompute_flops for c in pool) == 0  # both ends: save nothing, recompute nothing
    for a in pool:
        for b in pool:
            better = b.activation_bytes < a.activation_bytes or b.recompute_flops < a.recompute_flops
            assert not (b.activation_bytes <= a.activation_bytes and b.recompute_flops <= a.recompute_flops and better)
    assert len(named_values()) >= 5 + 12 and len({c.saved for c in pool}) == len(pool)


@pytest.mark.parametrize("ratio", [0.0, 1.0, 4.0])  # optimistic, right, pessimistic working-space terms
@pytest.mark.parametrize("share", [0.25, 0.6])
def test_chosen_fits_and_is_the_optimum_whatever_the_starting_term(pool, ratio, share):
    # Within 3 compiles the chosen one fits and is the fastest compiled one that does; allowed 8, the loop
    # finds the optimum over all candidates (brute force) from any starting term.
    fixed, ref = 1_000_000.0, 2_000_000.0
    # The true working space moves with the candidate (as XLA's does): 1.0-1.2 x the reference.
    working = lambda c: ref * (1.0 + 0.2 * (c.activation_bytes % 7) / 7)  # noqa: E731
    lo = min(c.activation_bytes for c in pool)
    hi = max(c.activation_bytes for c in pool)
    budget = fixed + 1.2 * ref + lo + share * (hi - lo)
    compile_peak, calls = _compiler(fixed, working)
    got = choose(pool, budget, PeakModel(fixed, ref, ratio), compile_peak)
    assert got.trial.compiled <= budget and all(t.fits == (t.compiled <= budget) for t in got.trials)
    assert got.trial.flops == min(t.flops for t in got.trials if t.fits) and len(calls) <= 3
    if ratio == 0.0:  # optimistic: the first compile overflows and the loop repairs
        assert not got.trials[0].fits
    best = _optimum(pool, budget, fixed, working)
    wide = choose(pool, budget, PeakModel(fixed, ref, ratio), _compiler(fixed, working)[0], max_compiles=8)
    assert wide.chosen.recompute_flops == best.recompute_flops and wide.trial.compiled <= budget


RECORDED = json.loads((Path(__file__).parent / "data" / "xla_cpu_peaks.json").read_text())["settings"]


def test_recorded_xla_peaks_the_fastest_fit_within_three_compiles():
    # What XLA:CPU compiled for every candidate of the 7 settings of benchmarks/remat_budget.py (its working
    # space moves by ~25 % between policies of one setting): at 10 budgets between full remat and no remat,
    # from starting ratios 0.4, 0.6 and 0.8, against brute force over the same candidates.  The loop that
    # ranked by predicted recompute and moved only leaner after an overflow matched brute force (within
    # 1 %) in 191 of these 210 cases with 560 compiles; expected gain over the working-space range: 198, 410.
    matched = compiles = cases = 0
    for setting in RECORDED.values():
        pool = [Candidate(n, Remat("none"), a, r) for n, a, r, _, _ in setting["pool"]]
        compiled = {n: (p, f) for n, _, _, p, f in setting["pool"]}
        lo, hi = compiled["full"][0], max(p for p, _ in compiled.values())
        for start in (0.4, 0.6, 0.8):
            for i in range(10):
                budget = lo + (hi - lo) * (i + 0.5) / 10
                got = choose(
                    pool,
                    budget,
                    PeakModel(setting["fixed"], setting["ref"], start),
                    lambda c, compiled=compiled: (*compiled[c.name], 0.0),
                )
                best = min(f for p, f in compiled.values() if p <= budget)
                assert got.trial.compiled <= budget and got.trial.compiled == compiled[got.chosen.name][0]
                assert len(got.trials) <= 3 or not any(t.fits for t in got.trials[:3])
                matched += got.trial.flops <= 1.01 * best
                compiles += len(got.trials)
                cases += 1
    assert cases == 210 and matched >= 198 and compiles <= 410, (matched, compiles)


def test_no_candidate_fits_is_one_sentence(pool):
    compile_peak, _ = _compiler(1e9, lambda c: 0.0)
    with pytest.raises(ConfigError, match="no remat choice compiles within train.memory_budget_bytes=1000"):
        choose(pool, 1000, PeakModel(0.0, 1.0, 0.0), compile_peak)


def test_working_ratio_store(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_CALIBRATION_DIR", str(tmp_path))
    assert load_working("cpu", "a") == Working(0.5, 0.25, 1.0, "default (nothing learned yet)")
    record_working("cpu", "a", [0.5])
    record_working("cpu", "b", [0.9, 1.0])
    record_working("cpu", "b", [0.8, 0.7])  # 4 compiles: b's own range
    record_working("cpu", "c", [0.7])
    b = load_working("cpu", "b")
    assert b.source == "learned for this setting" and (b.ratio, b.low, b.high) == pytest.approx((0.85, 0.7, 1.0))
    # a has one compile: its median, and the range as the shares of b's (the one setting with 4)
    got = load_working("cpu", "a")
    assert (got.ratio, got.low, got.high) == pytest.approx((0.5, 0.5 * 0.7 / 0.85, 0.5 * 1.0 / 0.85))
    z = load_working("cpu", "z")  # never seen: the median setting (a 0.5, b 0.85, c 0.7)
    assert z.source == "median of 3 settings learned on cpu" and (z.ratio, z.low) == pytest.approx(
        (0.7, 0.7 * 0.7 / 0.85)
    )
    assert load_working("gpu", "a").ratio == 0.5 and working_path("cpu").parent == tmp_path
    working_path("cpu").write_text(json.dumps({"ratios": {"old": 0.6}}))  # a file of the earlier format
    assert load_working("cpu", "old").ratio == 0.6


def test_real_compiles_repair_an_optimistic_term_and_store_the_learned_one(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_CALIBRATION_DIR", str(tmp_path))
    budget = 3_800_000  # between full remat (~2.6 MB) and no remat (4.06 MB) at this size
    cfg = load_config(
        None,
        [
            "model=tiny",
            "mesh.cluster=cpu-1",
            f"train.batch_size={B}",
            f"train.seq_len={T}",
            "train.remat=auto",
            f"train.memory_budget_bytes={budget}",
        ],
    )
    devices = jax.devices()[:1]
    key = setting_key(cfg, cfg.mesh.resolved(1)) + ":probed"  # the store's key of a probed loop
    record_working(devices[0].device_kind, key, [-5.0])  # a wrong, optimistic working space: no room at all
    choice = verified_remat(cfg, devices)
    assert not choice.trials[0].fits and choice.trials[0].compiled > budget  # the prediction was optimistic
    assert choice.trial.compiled <= budget and choice.trial.fits  # repaired: the chosen plan's peak fits
    fitting = [t for t in choice.trials if t.fits]
    assert choice.trial.flops == min(t.flops for t in fitting)
    stored = json.loads(working_path(devices[0].device_kind).read_text())["ratios"][key]
    assert stored == pytest.approx([-5.0, *choice.seen_ratios]) and all(r > 0 for r in choice.seen_ratios)
    assert load_working(devices[0].device_kind, key).source == "learned for this setting"
    # The step the run compiles (the resolved config's, as the Trainer compiles it; the loop compiled at LLVM
    # level 0, which leaves XLA:CPU's buffer assignment as it is) peaks where the loop measured, within the
    # budget; the probes follow XLA's working space: the repaired prediction is within 2 % of that peak.  (The
    # chosen trial is never the first here: the first overflows.)  Only the candidates the loop weighed were probed.
    run = Trainer.for_compiling(Resolved(cfg, tuple(devices), cfg.train.remat_spec).with_remat(choice))
    peak = peak_of(run.compiled_train_step())[0]
    assert peak == choice.trial.compiled and peak <= budget
    assert abs(choice.trial.predicted / peak - 1) < 0.02
    assert 0 < choice.probes < len(candidates(profile_for_config(cfg, {}, 5e10), prune_beaten=False))


def test_probed_working_space_finds_the_optimum_the_unprobed_loop_misses(pool):
    # XLA's working space moves by up to 50 % between candidates here, unrelated to what they save.  A probe
    # that follows it to within 2 % (Candidate.working, as jaxdist.train.aot.block_working measures it) lets
    # at most 3 compiles find the brute-force optimum at each of 20 budgets; one learned ratio for all does not.
    profile = profile_block(load_config(None, ["model=tiny"]).model, B, T, {}, peak_flops=5e10)
    raw = candidates(profile, n_budgets=8, prune_beaten=False)
    fixed, ref = 1_000_000.0, 2_000_000.0
    true = {c.saved: ref * (0.75 + 0.5 * ((hash(c.saved) // 7) % 11) / 10) for c in raw}
    noise = {c.saved: 1 + 0.01 * (((hash(c.saved) // 3) % 5) - 2) for c in raw}
    probed = [dataclasses.replace(c, working=true[c.saved] * noise[c.saved]) for c in raw]
    compile_peak = lambda c: (fixed + c.activation_bytes + true[c.saved], c.recompute_flops, 0.0)  # noqa: E731
    peaks = [compile_peak(c)[0] for c in raw]
    matched, probes = {"probed": 0, "unprobed": 0}, 0
    for i in range(20):
        budget = min(peaks) + (i + 0.5) / 20 * (max(peaks) - min(peaks))
        best = min(c.recompute_flops for c, p in zip(raw, peaks) if p <= budget)
        for label, cands, start in (("probed", probed, 0.0), ("unprobed", pool, 1.0)):
            got = choose(cands, budget, PeakModel(fixed, ref, start), compile_peak)
            assert got.trial.compiled <= budget
            matched[label] += got.chosen.recompute_flops <= 1.005 * best
            if label == "probed":
                assert len(got.trials) <= 3
                asked = []  # the same loop probing as it goes: the same choice, and not every candidate probed
                lazy = choose(
                    raw,
                    budget,
                    PeakModel(fixed, ref, 0.0),
                    compile_peak,
                    probe=lambda c, asked=asked: asked.append(c) or true[c.saved] * noise[c.saved],
                )
                assert lazy.chosen.saved == got.chosen.saved and lazy.probes == len(asked) <= len(raw)
                probes += lazy.probes
    assert matched["probed"] == 20 and matched["unprobed"] < 18, matched
    assert probes < 20 * len(raw) / 2, probes

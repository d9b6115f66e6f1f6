"""The sampler's profile from its own run logs against a direct measurement (issue 16): streams 1, 2, 4, 8.

The sampler (the ``tiny`` preset, random weights, one CPU device) continues
prompts of ``--prompt-len`` random bytes greedily, as a generation worker
does, and each batch of ``s`` prompts is written to a run log (JSONL) the way
a worker writes it: ``s`` records with ``streams = s``, the batch's start and
end, tokens in and out (:class:`jaxdist.gen.runlog.RunLogWriter`). Two things
make the log fit for a profile, the two the first real logs lacked:

* **each batch shape is warmed up first**: one untimed batch per stream count
  compiles its programs (the worker marks such requests ``first_use``
  instead, and fits leave them out);
* **output lengths vary**: each batch stops after one of ``--lengths``
  (all rows of a batch the same), so the per-token and per-request costs
  separate. The cache is sized for the longest, so there is one program per
  stream count whatever the length.

``jaxdist gen profile``'s fit (:func:`jaxdist.gen.profile.fit_profiles`: the
step-time model of :mod:`jaxdist.gen.perfmodel`, robust to slowed requests,
refused more than 15% from its logs) then predicts the throughput at each
stream count; the **direct measurement** is separate batches of
``--check-len`` tokens (a length not logged), ``s x tokens / median batch
seconds`` (the mean is printed beside it).

**Design against a shared machine.** On 2 cores shared with other jobs a
batch of a few milliseconds is slowed 2-3x, by an amount that drifts over
seconds. The run is therefore ``--rounds`` randomised blocks: each round runs
one batch of every logged stream count and length and one of every direct
stream count, in a new random order, so every cell sees the same load; the
fit follows the typical (median) request, as the direct measurement does.
About a minute on a quiet machine, two at load 4-9.

    python benchmarks/gen_profile.py [--rounds 200] [--log DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.gen.profile import MAX_FIT_ERROR, fit_profiles, format_table  # noqa: E402
from jaxdist.gen.runlog import RunLogWriter, read_run_logs  # noqa: E402
from jaxdist.models.transformer import init_params  # noqa: E402
from jaxdist.sample.sampler import Sampler  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--lengths", default="8,16,32,48", help="output lengths of the logged batches")
    p.add_argument("--rounds", type=int, default=200, help="rounds of one batch per stream count and length")
    p.add_argument("--check-len", type=int, default=28, help="output length of the direct measurement")
    p.add_argument("--log", help="a folder for the run log and the direct batches' seconds (default: a temporary one)")
    a = p.parse_args(argv)
    streams = [int(x) for x in a.streams.split(",")]
    lengths = [int(x) for x in a.lengths.split(",")]
    cfg = load_config(None, [f"model={a.preset}", "mesh.cluster=cpu-1"])
    sampler = Sampler(cfg, jax.jit(lambda: init_params(cfg.model, 0))())
    rng = np.random.default_rng(0)
    longest = max(max(lengths), a.check_len)
    clock = time.perf_counter

    def batch(s: int, n: int) -> float:
        """Seconds of one batch of s prompts stopped after n tokens each (the cache sized for the longest)."""
        prompts = list(rng.integers(32, 127, size=(s, a.prompt_len)))
        t0 = clock()
        d = sampler.decode(prompts, longest, stop_at_eos=False, until=lambda b, hist: len(hist) >= n)
        assert all(len(t) == n for t in d.tokens), [len(t) for t in d.tokens]
        return clock() - t0

    log_path = Path(a.log or tempfile.mkdtemp(prefix="gen-profile-")) / "runlog.bench.jsonl"
    log = RunLogWriter(log_path, a.preset, worker="bench")
    t_start = time.perf_counter()
    load0 = os.getloadavg()[0]
    for s in streams:
        batch(s, 2)  # the warm-up: compiles this stream count's programs (prefill and step)
    # rounds of every cell once (each logged stream count and length, and each direct stream count), in a new
    # random order each round: a change of load on a shared machine hits every cell alike (a randomised block)
    cells = [(s, n, True) for s in streams for n in lengths] + [(s, a.check_len, False) for s in streams]
    direct: dict[int, list[float]] = {s: [] for s in streams}
    for _ in range(a.rounds):
        for i in rng.permutation(len(cells)):
            s, n, logged = cells[i]
            start = time.time()
            seconds = batch(s, n)
            if logged:
                for _ in range(s):
                    log.log(s, start, start + seconds, a.prompt_len, n)
            else:
                direct[s].append(seconds)
    load1 = os.getloadavg()[0]
    (log_path.parent / "direct.json").write_text(json.dumps({str(s): v for s, v in direct.items()}))
    try:  # fitted without the error limit, so the table shows how far off a refused fit is
        prof = fit_profiles(read_run_logs([log_path]).records, max_error=math.inf)[a.preset]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table({a.preset: prof}))
    verdict = "accepts" if prof.fit_error <= MAX_FIT_ERROR else "refuses"
    print(
        f"\nfit error {100 * prof.fit_error:.1f}%: jaxdist gen profile {verdict} it (limit {100 * MAX_FIT_ERROR:.0f}%)"
    )
    print(
        f"\nsampler {a.preset} (random weights), 1 {jax.devices()[0].platform} device, prompt {a.prompt_len} "
        f"tokens; {a.rounds} rounds of one batch of each logged stream count and output length ({a.lengths}) "
        f"and of each direct one ({a.check_len} tokens, not logged), in random order; {time.perf_counter() - t_start:.0f} s; load average {load0:.1f} -> {load1:.1f} "
        f"({os.cpu_count()} cores); JAX {jax.__version__}\n"
    )
    print("| streams | measured tok/s (median batch) | fitted tok/s | error | measured tok/s (mean batch) |")
    print("| --- | --- | --- | --- | --- |")
    worst = 0.0
    for s in streams:
        measured = s * a.check_len / statistics.median(direct[s])
        fitted = float(prof.tokens_per_s(s, a.prompt_len, a.check_len))
        worst = max(worst, abs(fitted / measured - 1))
        mean = s * a.check_len / statistics.fmean(direct[s])
        print(f"| {s} | {measured:.0f} | {fitted:.0f} | {100 * (fitted / measured - 1):+.1f}% | {mean:.0f} |")
    print(f"\nworst error {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A model's performance parameters from its run logs: ``jaxdist gen profile LOGS... [--out FILE]``.

The model (:mod:`jaxdist.gen.perfmodel`): a request of ``n_in`` prompt and
``n_out`` generated tokens among ``s`` parallel streams takes
``L(s) = a + p n_in + b n_out + (s - 1)(a' + p' n_in + b' n_out)`` seconds:
a serial latency per request and per token, and what each extra stream adds
to each (``b + b' (s - 1)`` is a batched decoding step's time). From it: the
throughput at each stream count, where it saturates and the latency cost of
a stream.

**The fit.** All six by one non-negative linear regression of every
request's latency (:func:`scipy.optimize.lsq_linear`) on
``[1, n_in, n_out, s-1, (s-1) n_in, (s-1) n_out]``, in relative errors, each
stream count weighing the same in all. Single-stream requests fix the serial
part, the others the per-stream part; a prompt length that never varies
cannot be told from the fixed cost (its two columns are left out, folded into
``a`` and ``a'``). The loss is robust (soft L1 on the relative error, scale
5%, by iteratively reweighted least squares): a request slowed by something
else (another job on the machine, a pause) counts like a request 5% off, so a
few such requests move the fit little, and on noisy logs the fit follows the
typical (median) request rather than the mean. Requests marked ``first_use``
(their time includes compiling a batch shape) are left out.

**The check.** The fit's error is the worst typical (median) relative error
of the fitted latency over the logged stream counts, each split into its
shorter and longer half of requests (so a curve that is wrong in streams or in
length shows); a fit more than ``--max-error`` (15%) from its logs is refused
with one sentence on what to log. The table prints, per stream count, the
measured throughput (``s`` times its requests' output tokens over their
seconds, the whole time including slow requests) beside the fitted one, and
the typical error there. A record's ``streams`` must be the requests really
running together (a last, smaller batch logs its own size).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from jaxdist.errors import ConfigError
from jaxdist.gen.perfmodel import ModelProfile, StreamPoint, synthetic_records
from jaxdist.gen.runlog import RunRecord, parse_record, read_run_logs

__all__ = [
    "ModelProfile", "StreamPoint", "fit_profile", "fit_profiles", "format_table", "load_profiles", "main",
    "records_from_measurements", "save_profiles", "synthetic_records",
]  # fmt: skip

MAX_FIT_ERROR = 0.15  # a fit further than this from its own logs is refused (see the module docstring)
ROBUST_SCALE = 0.05  # relative error beyond which a request counts less than quadratically (soft L1)
MIN_SERIAL = 3  # single-stream requests a fit needs
PROFILE_VERSION = 2  # version 1: one contention factor per model (a file of it is refused: profile the logs again)


def records_from_measurements(
    model: str, measurements: Iterable[Sequence[float]], worker: str = "", node: str = ""
) -> list[RunRecord]:
    """Run-log records from ``(streams, start, end, tokens_in, tokens_out)`` tuples (seconds, tokens).

    For the sampler: one tuple per prompt of a batch, ``streams`` the batch's
    size and ``start`` / ``end`` the batch's. ConfigError for a bad tuple.
    """
    out = []
    for i, m in enumerate(measurements):
        try:
            if len(m) != 5:
                raise ValueError(f"{len(m)} values, not 5")
            keys = ("streams", "start", "end", "tokens_in", "tokens_out")
            out.append(parse_record({"model": model, **dict(zip(keys, m)), "worker": worker, "node": node}))
        except (ValueError, TypeError) as e:
            raise ConfigError(
                f"measurement {i} of '{model}' is not (streams, start, end, tokens_in, tokens_out) ({e}): fix it."
            ) from None
    return out


def _check(model: str, s: np.ndarray, tin: np.ndarray, tout: np.ndarray, y: np.ndarray) -> None:
    """One sentence for logs that cannot determine the parameters."""
    serial = s == 1
    if serial.sum() < MIN_SERIAL:
        raise ConfigError(
            f"model '{model}' has {int(serial.sum())} single-stream request(s) in the logs: log at least "
            f"{MIN_SERIAL} requests of it at 1 stream."
        )
    if len(np.unique(tout[serial])) < 2:
        raise ConfigError(
            f"model '{model}' has single-stream requests of one output length only ({int(tout[serial][0])} tokens): "
            f"log them with at least two output lengths to separate per-request from per-token latency."
        )
    if serial.all():
        raise ConfigError(
            f"model '{model}' was logged at 1 stream only: add runs of it with several parallel streams "
            f"(2, 4 and 8, say) to measure its throughput curve."
        )
    if len(np.unique(tout[~serial])) < 2:
        raise ConfigError(
            f"model '{model}' has parallel-stream requests of one output length only ({int(tout[~serial][0])} "
            f"tokens): log them with at least two output lengths to separate what a stream adds per request "
            f"from what it adds per token."
        )
    if np.any(y <= 0):
        raise ConfigError(f"model '{model}' has a request of zero duration: log real start and end times.")


def _robust_fit(X: np.ndarray, y: np.ndarray, w: np.ndarray, iterations: int = 100) -> np.ndarray:
    """Non-negative theta minimising sum_i w_i soft_l1((X_i theta - y_i) / f_i), f_i = X_i theta (the relative
    error of the fit), by iteratively reweighted least squares from the plain relative-error solution."""
    from scipy.optimize import lsq_linear  # scipy (~0.4 s to import) only when a profile is fitted

    theta = lsq_linear(X * (np.sqrt(w) / y)[:, None], np.sqrt(w), bounds=(0, np.inf), method="bvls").x
    for _ in range(iterations):
        f = np.maximum(X @ theta, 1e-12 * y)
        e = (f - y) / f
        omega = w / np.sqrt(1 + (e / ROBUST_SCALE) ** 2)  # soft L1: psi(e) / e
        new = lsq_linear(X * (np.sqrt(omega) / f)[:, None], np.sqrt(omega) * y / f, bounds=(0, np.inf), method="bvls").x
        change = np.max(np.abs(X @ new - X @ theta) / f)
        theta = new
        if change < 1e-9:
            break
    return theta


def _typical_errors(s: np.ndarray, tout: np.ndarray, rel: np.ndarray) -> tuple[dict[int, float], float]:
    """Per stream count, the median relative error; and the worst median over each stream count's shorter and
    longer half of requests (by output length)."""
    per_s, worst = {}, 0.0
    for k in np.unique(s):
        at = s == k
        per_s[int(k)] = float(np.median(rel[at]))
        cut = np.median(tout[at])
        halves = [tout[at] <= cut, tout[at] > cut] if np.any(tout[at] > cut) else [np.ones(at.sum(), bool)]
        worst = max([worst, *(abs(float(np.median(rel[at][h]))) for h in halves if h.any())])
    return per_s, worst


def fit_profile(model: str, records: list[RunRecord], max_error: float = MAX_FIT_ERROR) -> ModelProfile:
    """The performance parameters of ``model`` from its records; ConfigError if they cannot determine them or
    the fit is further than ``max_error`` (relative) from them. First-use requests (compiles) are left out."""
    records = [r for r in records if r.model == model and not r.first_use]
    s = np.array([r.streams for r in records], float)
    tin = np.array([r.tokens_in for r in records], float)
    tout = np.array([r.tokens_out for r in records], float)
    y = np.array([r.seconds for r in records])
    _check(model, s, tin, tout, y)
    serial, x = s == 1, s - 1
    cols = {"a": np.ones_like(y), "b": tout, "a'": x, "b'": x * tout}
    if len(np.unique(tin[serial])) > 1:  # a prompt length that never varies is part of the fixed cost
        cols["p"] = tin
    if len(np.unique(tin[~serial])) > 1:
        cols["p'"] = x * tin
    counts = {k: n for k, n in zip(*np.unique(s, return_counts=True))}
    w = np.array([1.0 / counts[k] for k in s])  # every stream count weighs the same
    w *= len(w) / w.sum()
    theta = dict(zip(cols, _robust_fit(np.stack(list(cols.values()), 1), y, w)))
    par = {k: float(theta.get(k, 0.0)) for k in ("a", "p", "b", "a'", "p'", "b'")}
    fitted = par["a"] + par["p"] * tin + par["b"] * tout + x * (par["a'"] + par["p'"] * tin + par["b'"] * tout)
    rel = fitted / y - 1
    per_s, worst = _typical_errors(s, tout, rel)
    points = []
    by_s: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(s):
        by_s[int(k)].append(i)
    for k in sorted(by_s):
        idx = np.array(by_s[k])
        busy = float(y[idx].sum())
        # s streams always running, each at its requests' token rate (a sampler batch: its tokens / its time)
        tokens_s = k * float(tout[idx].sum()) / busy
        points.append(
            StreamPoint(k, len(idx), tokens_s, busy / len(idx), float(tin[idx].mean()), float(tout[idx].mean()),
                        per_s[k])
        )  # fmt: skip
    prof = ModelProfile(
        model, len(records), par["a"], par["p"], par["b"], par["a'"], par["p'"], par["b'"],
        float(tin.mean()), float(tout.mean()), tuple(points), worst, float(np.median(np.abs(rel))),
    )  # fmt: skip
    if not prof.fit_error <= max_error:
        raise ConfigError(
            f"the fit of model '{model}' is {100 * prof.fit_error:.1f}% from its own logs (over the "
            f"{100 * max_error:.0f}% limit): log it after a warm-up of each batch shape (or mark first uses), with "
            f"varied output lengths at each stream count and enough requests at each."
        )
    return prof


def fit_profiles(records: list[RunRecord], max_error: float = MAX_FIT_ERROR) -> dict[str, ModelProfile]:
    """One profile per model in ``records`` (in order of first appearance); see :func:`fit_profile`."""
    models = list(dict.fromkeys(r.model for r in records))
    return {m: fit_profile(m, records, max_error) for m in models}


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g}"


def format_table(profiles: dict[str, ModelProfile], curves: bool = True) -> str:
    """The parameters and what follows from them, one row per model; with ``curves`` also measured vs fitted
    throughput per stream count. Milliseconds (ms) and output tokens/s."""
    rows = [(
        "model", "requests", "req ms", "in-tok ms", "out-tok ms", "+stream req ms", "+stream in-tok ms",
        "+stream out-tok ms", "fit err", "scatter",
    )]  # fmt: skip
    for pr in profiles.values():
        rows.append((
            pr.model, str(pr.requests), _ms(pr.request_s), _ms(pr.input_token_s), _ms(pr.output_token_s),
            _ms(pr.stream_request_s), _ms(pr.stream_input_token_s), _ms(pr.stream_output_token_s),
            f"{100 * pr.fit_error:.1f}%", f"{100 * pr.scatter:.1f}%",
        ))  # fmt: skip
    out = [_grid(rows)]
    rows = [(
        "model", "mean in/out tokens", "1-stream ms", "1-stream tok/s", "+stream ms", "contention", "limit tok/s",
        "saturates at",
    )]  # fmt: skip
    for pr in profiles.values():
        sat = "never" if math.isinf(pr.saturation_streams) else f"{pr.saturation_streams:.1f} streams"
        rows.append((
            pr.model, f"{pr.mean_tokens_in:.4g} / {pr.mean_tokens_out:.4g}", _ms(pr.serial_latency_s()),
            f"{pr.serial_tokens_s:.4g}", _ms(pr.extra_stream_s()), f"{pr.contention:.3f}", f"{pr.limit_tokens_s:.4g}",
            sat,
        ))  # fmt: skip
    out.append(_grid(rows))
    if curves:
        rows = [(
            "model", "streams", "requests", "measured tok/s", "fitted tok/s", "latency s", "fitted latency s",
            "fit vs typical",
        )]  # fmt: skip
        for pr in profiles.values():
            for pt in pr.points:
                rows.append((
                    pr.model, str(pt.streams), str(pt.requests), f"{pt.tokens_s:.4g}",
                    f"{pr.tokens_per_s(pt.streams, pt.tokens_in, pt.tokens_out):.4g}", f"{pt.latency_s:.4g}",
                    f"{pr.latency_s(pt.streams, pt.tokens_in, pt.tokens_out):.4g}", f"{100 * pt.error:+.1f}%",
                ))  # fmt: skip
        out.append(_grid(rows))
    return "\n\n".join(out)


def _grid(rows: list[Sequence[str]]) -> str:
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([fmt(rows[0]), "  ".join("-" * x for x in w), *map(fmt, rows[1:])])


def save_profiles(path: str | Path, profiles: dict[str, ModelProfile]) -> None:
    """Write the profiles as JSON (``{"version": 2, "profiles": [...]}``)."""
    doc = {"version": PROFILE_VERSION, "profiles": [asdict(p) for p in profiles.values()]}
    try:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as e:
        raise ConfigError(
            f"the profile file '{path}' cannot be written ({e.strerror}): name a writable path."
        ) from None


def load_profiles(path: str | Path) -> dict[str, ModelProfile]:
    """The profiles :func:`save_profiles` wrote; ConfigError (one sentence) for a missing or damaged file."""
    try:
        doc = json.loads(Path(path).read_text())
        if doc.get("version") != PROFILE_VERSION:
            raise ConfigError(
                f"the profile file '{path}' is of version {doc.get('version')}, not {PROFILE_VERSION} (the model of "
                f"jaxdist/gen/perfmodel.py): run jaxdist gen profile on its logs again."
            )
        out = {}
        for d in doc["profiles"]:
            d = dict(d, points=tuple(StreamPoint(**pt) for pt in d["points"]))
            out[d["model"]] = ModelProfile(**d)
    except ConfigError:
        raise
    except OSError:
        raise ConfigError(f"the profile file '{path}' cannot be read: run jaxdist gen profile LOGS --out it.") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(
            f"the profile file '{path}' is not a profile: write it again with jaxdist gen profile."
        ) from None
    return out


def main(argv: list[str] | None = None) -> int:
    """``jaxdist gen profile LOGS... [--out FILE] [--models A,B]``: print the table, write the JSON; 2 on bad input."""
    ap = argparse.ArgumentParser(prog="jaxdist gen profile", description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+", help="run logs (JSONL, one request a line)")
    ap.add_argument("--out", default="gen-profile.json", help="where to write the parameters (JSON)")
    ap.add_argument("--models", help="comma-separated model names the logs must keep to")
    ap.add_argument(
        "--max-error", type=float, default=MAX_FIT_ERROR, help="refuse a fit further than this from its logs"
    )
    a = ap.parse_args(argv)
    try:  # each skipped line is a warning of jaxdist.gen.runlog
        runlog = read_run_logs(a.logs, a.models.split(",") if a.models else None)
        profiles = fit_profiles(runlog.records, a.max_error)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(profiles))
    try:
        save_profiles(a.out, profiles)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"\nwrote {a.out}")
    return 0

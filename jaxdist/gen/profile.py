"""A model's performance parameters from its run logs: ``jaxdist gen profile LOGS... [--out FILE]``.

**The model.** A node running ``s`` requests in parallel (``s`` streams) does
each decoding step for all of them together; the step costs a fixed part (the
weights are read once) plus a part per stream (its own key/value reads and
compute). With that linear step cost every request at ``s`` streams is slowed
by the same factor, so

* serial latency of a request (1 stream): ``L1 = a + p * tokens_in + b * tokens_out`` (s);
* latency at ``s`` streams: ``L(s) = L1 * (1 + c * (s - 1))``: each extra
  stream adds ``c`` of the serial latency (``c * b`` seconds per output token);
* throughput (output tokens/s of a node): ``X(s) = s * r1 / (1 + c * (s - 1))``,
  rising from the serial ``r1`` towards the limit ``r1 / c``; it **saturates**
  (reaches 90% of the limit) at ``s_sat = 9 (1 - c) / c`` streams, beyond which
  ten more percent of throughput would cost as much latency again.

This is the contention term of Gunther's scalability law. It was chosen over a
roofline ``min(s * r1, X_max)`` because its two parameters follow from the
same linear step cost as the latency, it is smooth (a least-squares fit on 3-4
stream counts is well posed; a kink is not), and it gives the latency cost of
a stream directly. A node whose throughput falls with more streams fits
``c > 1``.

**The fit.** ``a, p, b`` by non-negative least squares of relative errors on
the single-stream requests (:func:`scipy.optimize.lsq_linear`); ``r1`` is then
the serial throughput of the logged mean request. ``c`` by least squares
(:func:`scipy.optimize.least_squares`) of the log slowdown at each logged
stream count: the requests' latency over what the serial fit predicts for the
same requests alone, ``1 + c (s - 1)`` in the model; dividing by the serial
prediction takes out the differing request sizes of the stream counts, so the
fit sees the curve and not the sample. The measured throughput at ``s``
streams (printed beside the fitted one) is ``s`` times the token rate of its
requests (output tokens / request seconds), i.e. ``s`` streams always running;
for a sampler batch of ``s`` prompts that is the batch's output tokens over
its time. A record's ``streams`` must therefore be the requests really running
together (a last, smaller batch logs its own size).

:func:`synthetic_records` writes what a node following the model would log
(with noise): the reference of the tests and ``benchmarks/scheduler.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from scipy.optimize import least_squares, lsq_linear

from jaxdist.errors import ConfigError
from jaxdist.gen.runlog import RunRecord, parse_record, read_run_logs

MAX_FIT_ERROR = 0.15  # a fit further than this from its own logs is refused (relative rms / worst stream count)
SATURATION = 0.9  # the share of the throughput limit at which a model counts as saturated
MIN_SERIAL = 3  # single-stream requests a fit needs (three unknowns: a, p, b)


@dataclass(frozen=True)
class StreamPoint:
    """What the logs measured at one stream count: requests, node throughput (output tokens/s), mean latency (s),
    mean tokens in and out per request, and the slowdown against running them alone."""

    streams: int
    requests: int
    tokens_s: float
    latency_s: float
    tokens_in: float
    tokens_out: float
    slowdown: float  # the requests' latency over what the serial fit predicts for them alone


@dataclass(frozen=True)
class ModelProfile:
    """A model's performance parameters (see the module docstring); seconds and tokens throughout."""

    model: str
    requests: int
    request_s: float  # a: fixed serial latency per request (s)
    input_token_s: float  # p: serial latency per prompt token (s)
    output_token_s: float  # b: serial latency per generated token (s)
    serial_tokens_s: float  # r1: throughput at 1 stream, output tokens/s
    contention: float  # c: share of the serial latency each extra stream adds
    mean_tokens_in: float
    mean_tokens_out: float
    points: tuple[StreamPoint, ...]
    serial_rms: float  # relative rms error of the serial latency fit
    curve_rms: float  # relative rms error of the slowdown (throughput curve) fit

    @property
    def fit_error(self) -> float:
        """How far the fit is from its logs: the worst of the serial and curve rms errors and, per stream count,
        the fitted throughput's relative error against the measured one."""
        worst = max(
            (abs(self.tokens_per_s(p.streams, p.tokens_in, p.tokens_out) / p.tokens_s - 1) for p in self.points
             if p.tokens_s > 0),
            default=0.0,
        )  # fmt: skip
        return max(self.serial_rms, self.curve_rms, worst)

    @property
    def limit_tokens_s(self) -> float:
        """The throughput the curve tends to with many streams (output tokens/s; inf when c = 0)."""
        return self.serial_tokens_s / self.contention if self.contention > 0 else math.inf

    @property
    def saturation_streams(self) -> float:
        """Streams at which throughput reaches 90% of its limit (>= 1; inf when c = 0)."""
        c = self.contention
        if c <= 0:
            return math.inf
        return max(1.0, SATURATION * (1 - c) / ((1 - SATURATION) * c))

    @property
    def extra_stream_token_s(self) -> float:
        """Latency each extra stream adds per generated token (s)."""
        return self.contention * self.output_token_s

    @property
    def extra_stream_s(self) -> float:
        """Latency each extra stream adds to a request of the logged mean size (s)."""
        return self.contention * self.serial_latency_s(self.mean_tokens_in, self.mean_tokens_out)

    def serial_latency_s(self, tokens_in: float, tokens_out: float) -> float:
        """Latency of one request run alone (s)."""
        return self.request_s + self.input_token_s * tokens_in + self.output_token_s * tokens_out

    def latency_s(self, streams: int, tokens_in: float, tokens_out: float) -> float:
        """Latency of a request among ``streams`` parallel streams (s)."""
        return self.serial_latency_s(tokens_in, tokens_out) * (1 + self.contention * (streams - 1))

    def requests_per_s(self, streams: int, tokens_in: float, tokens_out: float) -> float:
        """Requests a node finishes per second at ``streams`` streams, all requests of this size."""
        return streams / self.latency_s(streams, tokens_in, tokens_out)

    def tokens_per_s(self, streams: int, tokens_in: float | None = None, tokens_out: float | None = None) -> float:
        """The fitted throughput curve X(s) (output tokens/s of a node) for requests of the logged mean size, or
        of the size given."""
        if tokens_in is None or tokens_out is None:
            return streams * self.serial_tokens_s / (1 + self.contention * (streams - 1))
        return tokens_out * self.requests_per_s(streams, tokens_in, tokens_out)


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


def _fit_serial(model: str, serial: list[RunRecord]) -> tuple[float, float, float, float]:
    if len(serial) < MIN_SERIAL:
        raise ConfigError(
            f"model '{model}' has {len(serial)} single-stream request(s) in the logs: log at least "
            f"{MIN_SERIAL} requests of it at 1 stream."
        )
    tin = np.array([r.tokens_in for r in serial], float)
    tout = np.array([r.tokens_out for r in serial], float)
    y = np.array([r.seconds for r in serial])
    if len(np.unique(tout)) < 2:
        raise ConfigError(
            f"model '{model}' has single-stream requests of one output length only ({int(tout[0])} tokens): "
            f"log them with at least two output lengths to separate per-request from per-token latency."
        )
    if np.any(y <= 0):
        raise ConfigError(f"model '{model}' has a single-stream request of zero duration: log real start and end.")
    cols = [np.ones_like(y), tin, tout]
    use_in = len(np.unique(tin)) > 1  # a constant prompt length cannot be told from the fixed cost
    A = np.stack(cols if use_in else [cols[0], cols[2]], axis=1) / y[:, None]  # relative errors
    sol = lsq_linear(A, np.ones_like(y), bounds=(0, np.inf))
    a, p, b = (sol.x[0], sol.x[1], sol.x[2]) if use_in else (sol.x[0], 0.0, sol.x[1])
    rms = float(np.sqrt(np.mean((A @ sol.x - 1) ** 2)))
    return float(a), float(p), float(b), rms


def _fit_contention(model: str, points: list[StreamPoint]) -> tuple[float, float]:
    s = np.array([p.streams for p in points], float)
    f = np.array([p.slowdown for p in points])
    if np.all(s == 1):
        raise ConfigError(
            f"model '{model}' was logged at 1 stream only: add runs of it with several parallel streams "
            f"(2, 4 and 8, say) to measure its throughput curve."
        )
    if np.any(f <= 0):
        raise ConfigError(f"model '{model}' has requests of zero duration at some stream count: log real times.")
    multi = s > 1  # the slowdown at 1 stream does not depend on c
    c0 = max(float(np.sum((f[multi] - 1) * (s[multi] - 1)) / np.sum((s[multi] - 1) ** 2)), 1e-6)
    sol = least_squares(lambda c: np.log1p(c[0] * (s[multi] - 1)) - np.log(f[multi]), [c0], bounds=(0.0, np.inf))
    c = float(sol.x[0])
    rms = float(np.sqrt(np.mean((1 + c * (s - 1) - f) ** 2 / f**2)))
    return c, rms


def fit_profile(model: str, records: list[RunRecord], max_error: float = MAX_FIT_ERROR) -> ModelProfile:
    """The performance parameters of ``model`` from its records; ConfigError if they cannot determine them or
    the fit is further than ``max_error`` (relative) from them. First-use requests (compiles) are left out."""
    records = [r for r in records if r.model == model and not r.first_use]
    a, p, b, serial_rms = _fit_serial(model, [r for r in records if r.streams == 1])
    by_s: dict[int, list[RunRecord]] = defaultdict(list)
    for r in records:
        by_s[r.streams].append(r)
    points = []
    for s in sorted(by_s):
        rs = by_s[s]
        busy = sum(r.seconds for r in rs)
        serial = sum(a + p * r.tokens_in + b * r.tokens_out for r in rs)
        # s streams always running, each at its requests' token rate (a sampler batch: its tokens / its time)
        tokens_s = s * sum(r.tokens_out for r in rs) / busy if busy > 0 else 0.0
        mean_in, mean_out = np.mean([r.tokens_in for r in rs]), np.mean([r.tokens_out for r in rs])
        points.append(StreamPoint(s, len(rs), tokens_s, busy / len(rs), float(mean_in), float(mean_out), busy / serial))
    c, curve_rms = _fit_contention(model, points)
    mean_in = float(np.mean([r.tokens_in for r in records]))
    mean_out = float(np.mean([r.tokens_out for r in records]))
    prof = ModelProfile(
        model=model,
        requests=len(records),
        request_s=a,
        input_token_s=p,
        output_token_s=b,
        serial_tokens_s=mean_out / (a + p * mean_in + b * mean_out),
        contention=c,
        mean_tokens_in=mean_in,
        mean_tokens_out=mean_out,
        points=tuple(points),
        serial_rms=serial_rms,
        curve_rms=curve_rms,
    )
    if not prof.fit_error <= max_error:
        raise ConfigError(
            f"the fit of model '{model}' is {100 * prof.fit_error:.1f}% from its own logs (over the "
            f"{100 * max_error:.0f}% limit): log it after a warm-up of each batch shape (or mark first uses), with "
            f"varied output lengths at 1 stream and enough requests at each stream count."
        )
    return prof


def fit_profiles(records: list[RunRecord], max_error: float = MAX_FIT_ERROR) -> dict[str, ModelProfile]:
    """One profile per model in ``records`` (in order of first appearance); see :func:`fit_profile`."""
    models = list(dict.fromkeys(r.model for r in records))
    return {m: fit_profile(m, records, max_error) for m in models}


def synthetic_records(
    model: str,
    request_s: float,
    input_token_s: float,
    output_token_s: float,
    contention: float,
    streams: Sequence[int] = (1, 2, 4, 8),
    requests: int = 1000,
    noise: float = 0.02,
    tokens_in: tuple[int, int] = (1, 512),
    tokens_out: tuple[int, int] = (1, 256),
    seed: int = 0,
) -> list[RunRecord]:
    """Records of a node following the model: ``requests`` per stream count, ``s`` streams run back to back.

    Token counts are uniform in the given ranges; each latency is multiplied by
    a log-normal factor of ``noise`` standard deviation.
    """
    rng = np.random.default_rng(seed)
    out = []
    for s in streams:
        free = np.zeros(s)  # when each stream is next free (s)
        tin = rng.integers(tokens_in[0], tokens_in[1] + 1, requests)
        tout = rng.integers(tokens_out[0], tokens_out[1] + 1, requests)
        lat = (request_s + input_token_s * tin + output_token_s * tout) * (1 + contention * (s - 1))
        lat = lat * rng.lognormal(0.0, noise, requests)
        for i in range(requests):
            k = int(np.argmin(free))
            out.append(RunRecord(model, s, free[k], free[k] + lat[i], int(tin[i]), int(tout[i]), f"w{s}"))
            free[k] += lat[i]
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:.3g}"


def format_table(profiles: dict[str, ModelProfile], curves: bool = True) -> str:
    """The parameters, one row per model; with ``curves`` also measured vs fitted throughput per stream count."""
    head = (
        "model", "requests", "req ms", "in-tok ms", "out-tok ms", "1-stream tok/s", "contention",
        "limit tok/s", "saturates at", "+stream ms/tok", "+stream ms/req", "fit err",
    )  # fmt: skip
    rows = [head]
    for pr in profiles.values():
        sat = "never" if math.isinf(pr.saturation_streams) else f"{pr.saturation_streams:.1f} streams"
        rows.append(
            (
                pr.model, str(pr.requests), _ms(pr.request_s), _ms(pr.input_token_s), _ms(pr.output_token_s),
                f"{pr.serial_tokens_s:.4g}", f"{pr.contention:.3f}", f"{pr.limit_tokens_s:.4g}", sat,
                _ms(pr.extra_stream_token_s), _ms(pr.extra_stream_s),
                f"{100 * pr.fit_error:.1f}%",
            )
        )  # fmt: skip
    out = [_grid(rows)]
    if curves:
        rows = [("model", "streams", "requests", "measured tok/s", "fitted tok/s", "latency s", "fitted latency s")]
        for pr in profiles.values():
            for pt in pr.points:
                fitted_l = pr.latency_s(pt.streams, pt.tokens_in, pt.tokens_out)
                fitted_x = pr.tokens_per_s(pt.streams, pt.tokens_in, pt.tokens_out)
                rows.append(
                    (
                        pr.model, str(pt.streams), str(pt.requests), f"{pt.tokens_s:.4g}",
                        f"{fitted_x:.4g}", f"{pt.latency_s:.4g}", f"{fitted_l:.4g}",
                    )
                )  # fmt: skip
        out.append(_grid(rows))
    return "\n\n".join(out)


def _grid(rows: list[Sequence[str]]) -> str:
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([fmt(rows[0]), "  ".join("-" * x for x in w), *map(fmt, rows[1:])])


def save_profiles(path: str | Path, profiles: dict[str, ModelProfile]) -> None:
    """Write the profiles as JSON (``{"version": 1, "profiles": [...]}``)."""
    doc = {"version": 1, "profiles": [asdict(p) for p in profiles.values()]}
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
        out = {}
        for d in doc["profiles"]:
            d = dict(d, points=tuple(StreamPoint(**pt) for pt in d["points"]))
            out[d["model"]] = ModelProfile(**d)
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

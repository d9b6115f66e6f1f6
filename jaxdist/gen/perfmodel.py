"""A generation node's performance model: a request's latency and a node's throughput against its parallel streams.

**The model.** A node running ``s`` requests at once (``s`` streams: a
sampler batch of ``s`` prompts) does each step for all of them together. A
batched decoding step costs a fixed part (the weights are read once, the
host dispatches one program) plus a part per stream (its own key/value reads
and compute): the **step time** ``t(s) = b + b' (s - 1)`` seconds per output
token. The prefill is the same per prompt token (``p + p' (s - 1)``), and
each request has a fixed part (host work, a prefill's launch: ``a + a' (s - 1)``).
So a request of ``n_in`` prompt and ``n_out`` generated tokens takes

    L(s) = L1 + (s - 1) D,   L1 = a + p n_in + b n_out,   D = a' + p' n_in + b' n_out   (seconds)

``L1`` is its **serial latency** (1 stream), ``D`` the **latency cost of each
extra stream**. A node's **throughput** is ``X(s) = s n_out / L(s)`` output
tokens/s, rising from the serial ``r1 = n_out / L1`` towards the limit
``n_out / D``; it **saturates** (reaches 90% of the limit) at
``s_sat = 9 (L1 - D) / D`` streams, beyond which ten more percent of
throughput would cost as much latency again.

Why this and not one contention factor for the whole request (``L(s) = L1 (1
+ c (s - 1))``, the model of the first profiles, which is the special case
``a' = c a, p' = c p, b' = c b``): on a real sampler the parts scale
differently with streams. The sampler on one CPU device (``tiny``) has a
per-request part of a few ms that hardly grows with the batch and a step
time that does; one ``c`` for both misses the direct measurement in both
directions (benchmarks/README.md). On a GPU the step
time is the familiar weights-read floor plus per-sequence work, and the
prefill grows with the batch's prompt tokens: the same six numbers.
The contention of a request size, ``c = D / L1``, is still reported.

:func:`synthetic_records` writes what a node following a given model would
log (with noise): the reference of the tests and ``benchmarks/scheduler.py``.
The fit is :func:`jaxdist.gen.profile.fit_profile`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxdist.gen.runlog import RunRecord

SATURATION = 0.9  # the share of the throughput limit at which a model counts as saturated


@dataclass(frozen=True)
class StreamPoint:
    """What the logs measured at one stream count: requests, node throughput (output tokens/s: ``s`` times its
    requests' output tokens over their seconds), mean latency (s), mean tokens in and out per request, and the
    fit's typical relative error there (the median over its requests of fitted / measured latency - 1)."""

    streams: int
    requests: int
    tokens_s: float
    latency_s: float
    tokens_in: float
    tokens_out: float
    error: float


@dataclass(frozen=True)
class ModelProfile:
    """A model's performance parameters (see the module docstring); seconds and tokens throughout.

    ``fit_error``: the worst typical relative error of the fitted latency over
    the logged stream counts, each split into its shorter and longer requests;
    ``scatter``: the median relative distance of a request from the fit (the
    logs' noise)."""

    model: str
    requests: int
    request_s: float  # a: fixed serial latency per request (s)
    input_token_s: float  # p: serial latency per prompt token (s)
    output_token_s: float  # b: serial latency per generated token = the step time at 1 stream (s)
    stream_request_s: float  # a': latency each extra stream adds per request (s)
    stream_input_token_s: float  # p': ... per prompt token (s)
    stream_output_token_s: float  # b': ... per generated token = the step time's growth per stream (s)
    mean_tokens_in: float
    mean_tokens_out: float
    points: tuple[StreamPoint, ...] = ()
    fit_error: float = 0.0
    scatter: float = 0.0

    @classmethod
    def with_contention(
        cls,
        model: str,
        request_s: float,
        input_token_s: float,
        output_token_s: float,
        contention: float,
        mean_tokens_in: float = 100.0,
        mean_tokens_out: float = 100.0,
    ) -> ModelProfile:
        """The profile whose every extra stream adds ``contention`` of the serial latency, whatever the request
        size: ``L(s) = L1 (1 + c (s - 1))`` (the special case a' = c a, p' = c p, b' = c b)."""
        c = contention
        return cls(
            model, 0, request_s, input_token_s, output_token_s, c * request_s, c * input_token_s, c * output_token_s,
            mean_tokens_in, mean_tokens_out,
        )  # fmt: skip

    def _sizes(self, tokens_in, tokens_out):
        return (
            self.mean_tokens_in if tokens_in is None else tokens_in,
            self.mean_tokens_out if tokens_out is None else tokens_out,
        )

    def serial_latency_s(self, tokens_in: float | None = None, tokens_out: float | None = None) -> float:
        """L1: latency of one request run alone (s); default: a request of the logged mean size."""
        tin, tout = self._sizes(tokens_in, tokens_out)
        return self.request_s + self.input_token_s * tin + self.output_token_s * tout

    def extra_stream_s(self, tokens_in: float | None = None, tokens_out: float | None = None) -> float:
        """D: latency each extra stream adds to a request (s); default: a request of the logged mean size."""
        tin, tout = self._sizes(tokens_in, tokens_out)
        return self.stream_request_s + self.stream_input_token_s * tin + self.stream_output_token_s * tout

    def latency_s(self, streams, tokens_in: float | None = None, tokens_out: float | None = None):
        """L(s): latency of a request among ``streams`` parallel streams (s); works on arrays of stream counts."""
        return self.serial_latency_s(tokens_in, tokens_out) + (np.asarray(streams) - 1) * self.extra_stream_s(
            tokens_in, tokens_out
        )

    def step_s(self, streams):
        """t(s): the latency per generated token at ``streams`` streams (s): a batched decoding step's time."""
        return self.output_token_s + (np.asarray(streams) - 1) * self.stream_output_token_s

    def requests_per_s(self, streams, tokens_in: float | None = None, tokens_out: float | None = None):
        """Requests a node finishes per second at ``streams`` streams, all requests of this size."""
        return np.asarray(streams) / self.latency_s(streams, tokens_in, tokens_out)

    def tokens_per_s(self, streams, tokens_in: float | None = None, tokens_out: float | None = None):
        """X(s): output tokens/s of a node at ``streams`` streams, for requests of the logged mean size or the
        size given."""
        _, tout = self._sizes(tokens_in, tokens_out)
        return tout * self.requests_per_s(streams, tokens_in, tokens_out)

    @property
    def contention(self) -> float:
        """c = D / L1 for a request of the logged mean size: the share of its serial latency each stream adds."""
        return self.extra_stream_s() / self.serial_latency_s()

    @property
    def serial_tokens_s(self) -> float:
        """r1: throughput at 1 stream (output tokens/s), requests of the logged mean size."""
        return self.mean_tokens_out / self.serial_latency_s()

    @property
    def limit_tokens_s(self) -> float:
        """The throughput X(s) tends to with many streams (output tokens/s; inf when a stream costs nothing)."""
        d = self.extra_stream_s()
        return self.mean_tokens_out / d if d > 0 else math.inf

    @property
    def saturation_streams(self) -> float:
        """Streams at which the throughput reaches 90% of its limit (>= 1; inf when a stream costs nothing)."""
        d = self.extra_stream_s()
        if d <= 0:
            return math.inf
        return max(1.0, SATURATION * (self.serial_latency_s() - d) / ((1 - SATURATION) * d))

    @property
    def extra_stream_token_s(self) -> float:
        """Latency each extra stream adds per generated token (s): b'."""
        return self.stream_output_token_s


def synthetic_records(
    truth: ModelProfile,
    streams: Sequence[int] = (1, 2, 4, 8),
    requests: int = 1000,
    noise: float = 0.02,
    tokens_in: tuple[int, int] = (1, 512),
    tokens_out: tuple[int, int] = (1, 256),
    seed: int = 0,
) -> list[RunRecord]:
    """Records of a node following ``truth``'s latency: ``requests`` per stream count, ``s`` streams run back to
    back. Token counts are uniform in the given ranges; each latency is multiplied by a log-normal factor of
    ``noise`` standard deviation."""
    rng = np.random.default_rng(seed)
    out = []
    for s in streams:
        free = np.zeros(s)  # when each stream is next free (s)
        tin = rng.integers(tokens_in[0], tokens_in[1] + 1, requests)
        tout = rng.integers(tokens_out[0], tokens_out[1] + 1, requests)
        lat = truth.latency_s(s, tin, tout) * rng.lognormal(0.0, noise, requests)
        for i in range(requests):
            k = int(np.argmin(free))
            out.append(RunRecord(truth.model, s, free[k], free[k] + lat[i], int(tin[i]), int(tout[i]), f"w{s}"))
            free[k] += lat[i]
    return out

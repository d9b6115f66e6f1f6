"""Where to cut a sequence into chunks for the sequence-chunked pipeline (pure Python).

With causal attention a later chunk attends to more keys, so equal token
counts give unequal work.  The executor runs chunk ``[a, b)`` as ``b - a``
queries against the ``b`` keys of positions ``0..b-1`` (the cached prefix and
the chunk itself, masked inside the chunk), so one block's forward on the
chunk costs

    cost(a, b) = per_token * (b - a) + per_pair * (b - a) * b      FLOPs

with ``per_token`` the projections and MLP of one token and ``per_pair`` the
score and context products of one query-key pair (plus the softmax's
elementwise work).  :func:`chunk_boundaries` picks boundaries that make these
costs as equal as integer positions allow (``split="cost"``), or equal token
counts (``split="equal"``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

SPLITS = ("cost", "equal")

# XLA's cost analysis counts about this many elementwise FLOPs per attention
# score (scale, mask, max, subtract, exp, sum, divide) besides the two products.
SOFTMAX_FLOPS_PER_SCORE = 6


@dataclass(frozen=True)
class ChunkCost:
    """Forward FLOPs of one block on a chunk: per token, and per query-key pair."""

    per_token: float
    per_pair: float

    def __call__(self, start: int, stop: int) -> float:
        """FLOPs of chunk [start, stop): its queries against keys 0..stop-1."""
        n = stop - start
        return self.per_token * n + self.per_pair * n * stop


def chunk_cost_model(cfg) -> ChunkCost:
    """The forward cost model of one transformer block of ``cfg`` (a ModelConfig), in FLOPs."""
    d, h, kv, hd, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
    per_token = 2.0 * (d * (h + 2 * kv) * hd + h * hd * d + 3 * d * f)
    per_pair = h * (4.0 * hd + SOFTMAX_FLOPS_PER_SCORE)
    return ChunkCost(per_token, per_pair)


def _next_stop(cost: ChunkCost, start: int, target: float) -> float:
    # Solve per_pair*(b-a)*b + per_token*(b-a) = target for b >= a (continuous).
    a, alpha, beta = start, cost.per_token, cost.per_pair
    if beta == 0:
        return a + target / alpha
    qb = alpha - beta * a
    return (-qb + math.sqrt(qb * qb + 4 * beta * (alpha * a + target))) / (2 * beta)


def _continuous(seq_len: int, chunks: int, cost: ChunkCost) -> list[float]:
    lo, hi = 0.0, cost(0, seq_len)
    for _ in range(200):  # bisection on the per-chunk cost
        mid = (lo + hi) / 2
        b = 0.0
        for _ in range(chunks):
            b = _next_stop(cost, b, mid)
        lo, hi = (mid, hi) if b < seq_len else (lo, mid)
    cuts, b = [0.0], 0.0
    for _ in range(chunks - 1):
        b = _next_stop(cost, b, hi)
        cuts.append(b)
    return cuts + [float(seq_len)]


def _spread(bounds: list[int], cost: ChunkCost) -> float:
    c = [cost(a, b) for a, b in zip(bounds, bounds[1:])]
    return max(c) - min(c)


def chunk_boundaries(
    seq_len: int, chunks: int, cost: ChunkCost | None = None, split: str = "cost", multiple_of: int = 1
) -> tuple[int, ...]:
    """Chunk boundaries ``(0, b1, ..., seq_len)`` (``chunks + 1`` token positions).

    ``split="cost"`` equalises ``cost(a, b)`` (needs ``cost``); ``"equal"`` cuts
    equal token counts.  Interior boundaries are multiples of ``multiple_of``
    tokens.  Raises ValueError if ``seq_len`` cannot give ``chunks`` non-empty
    chunks on that grid.
    """
    if split not in SPLITS:
        raise ValueError(f"chunk split '{split}' is unknown: use one of {', '.join(SPLITS)}.")
    if chunks < 1 or multiple_of < 1:
        raise ValueError(f"chunks={chunks} and multiple_of={multiple_of} must be positive.")
    if seq_len % multiple_of or seq_len // multiple_of < chunks:
        raise ValueError(
            f"a sequence of {seq_len} tokens does not split into {chunks} chunks of whole "
            f"{multiple_of}-token blocks: choose a sequence length that is a multiple of "
            f"{chunks * multiple_of}."
        )
    g, n = multiple_of, seq_len // multiple_of
    if split == "equal" or chunks == 1:
        if n % chunks:
            raise ValueError(
                f"a sequence of {seq_len} tokens does not split into {chunks} equal chunks: "
                f"choose a sequence length that is a multiple of {chunks * g}."
            )
        return tuple(i * seq_len // chunks for i in range(chunks + 1))
    if cost is None:
        raise ValueError("split='cost' needs a cost model (chunk_cost_model(model_config)).")
    cont = _continuous(seq_len, chunks, cost)
    bounds = [0] + [round(b / g) for b in cont[1:-1]] + [n]
    for i in range(1, chunks):  # keep chunks non-empty after rounding
        bounds[i] = min(max(bounds[i], bounds[i - 1] + 1), n - (chunks - i))
    scaled = ChunkCost(cost.per_token * g, cost.per_pair * g * g)
    improved = True
    while improved:  # move runs of consecutive boundaries by one grid step while the spread shrinks
        improved = False
        for i, j in itertools.combinations_with_replacement(range(1, chunks), 2):
            for step in (-1, 1):
                trial = bounds[:i] + [b + step for b in bounds[i : j + 1]] + bounds[j + 1 :]
                if (
                    trial[i - 1] < trial[i]
                    and trial[j] < trial[j + 1]
                    and _spread(trial, scaled) < _spread(bounds, scaled)
                ):
                    bounds, improved = trial, True
    return tuple(b * g for b in bounds)


def chunk_costs(bounds: tuple[int, ...], cost: ChunkCost) -> list[float]:
    """Cost of each chunk [bounds[i], bounds[i+1])."""
    return [cost(a, b) for a, b in zip(bounds, bounds[1:])]

"""Packed documents (``data.packing=documents``): what skipping other documents' key/value blocks saves, and how
much of a row packing fills.

Table 1, per sequence length (default 2k, 4k, 8k tokens, one row, documents of lognormal length with mean
``--mean`` = 512): the forward and backward of the attention alone (``jax.grad`` of the sum of its output;
8 query heads, 2 key/value heads of 64, float32, one CPU device) with

* ``skip``: :func:`jaxdist.models.attention.blockwise_document_attention`, the key/value blocks holding none of a
  query block's documents skipped (what ``model.attention=blockwise`` runs with documents);
* ``mask``: the same with ``skip=False``: every causal block visited, the other documents masked;
* ``xla``: :func:`jaxdist.models.attention.causal_attention` with the segment mask on the whole score matrix.

Step time is the median of ``--steps`` timed runs after a warmup; peak is ``compiled.memory_analysis()``
(temp + arguments + outputs - aliased).  ``blocks`` counts the key/value blocks the forward visits (skip) against
every causal block (mask), from the segments alone: the operation count behind the times.

Table 2: packing efficiency (real tokens / row tokens) of ``documents`` (next fit, :func:`jaxdist.data.documents.
pack`) against padding each document (cut into rows) to a row of its own, on 20,000 documents of that lognormal
spread (sigma ``--sigma``), at each sequence length.

    python benchmarks/documents.py
    python benchmarks/documents.py --seqs 1024,2048 --steps 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

H, KV, D = 8, 2, 64


def lengths(n: int, mean: float, sigma: float, seed: int = 0) -> np.ndarray:
    """``n`` document lengths (tokens, at least 2) lognormal with this mean and sigma of the log."""
    mu = np.log(mean) - sigma**2 / 2
    return np.maximum(2, np.random.default_rng(seed).lognormal(mu, sigma, n).round()).astype(np.int64)


def segments_of(seq: int, mean: float, sigma: float, seed: int = 0) -> np.ndarray:
    """[1, seq] segment ids of one row filled with documents of that spread (the last one cut at the row's end)."""
    ls = lengths(seq, mean, sigma, seed)
    ends = np.cumsum(ls)
    n = int(np.searchsorted(ends, seq)) + 1
    return np.repeat(np.arange(1, n + 1, dtype=np.int32), np.diff(np.concatenate([[0], np.minimum(ends[:n], seq)])))[
        None, :seq
    ]


def visited_blocks(segments: np.ndarray, block: int) -> tuple[int, int]:
    """(key blocks the skipping forward visits, every causal key block) over the query blocks of one row."""
    seq = segments.shape[1]
    new = np.concatenate([[True], segments[0, 1:] != segments[0, :-1]])
    starts = np.maximum.accumulate(np.where(new, np.arange(seq), 0))
    nq = -(-seq // block)
    causal = sum(i + 1 for i in range(nq))
    skip = sum(i + 1 - starts[i * block] // block for i in range(nq))
    return skip, causal


def measure(fn, args, steps: int) -> tuple[float, float]:
    """(median seconds of ``steps`` runs after a warmup, compiled peak MiB) of ``jax.grad(sum(fn(*args)))``."""
    import jax

    grad = jax.jit(jax.grad(lambda q, k, v, seg: fn(q, k, v, seg).sum(), argnums=(0, 1, 2)))
    compiled = grad.lower(*args).compile()
    m = compiled.memory_analysis()
    peak = (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes) / 2**20
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--mean", type=float, default=512)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp

    from jaxdist.data.documents import pack
    from jaxdist.models.attention import blockwise_document_attention, causal_attention

    seqs = [int(s) for s in a.seqs.split(",") if s]
    print(
        f"attention forward+backward, 1 row, {H} heads / {KV} kv x {D}, fp32, block {a.block}, documents lognormal "
        f"mean {a.mean:.0f} sigma {a.sigma}, {jax.devices()[0].platform}"
    )
    print(
        f"{'seq':>6} {'docs':>5} {'blocks skip/mask':>17} {'skip s':>8} {'mask s':>8} {'xla s':>8} "
        f"{'mask/skip':>9} {'xla/skip':>8} {'skip MiB':>9} {'mask MiB':>9} {'xla MiB':>9}"
    )
    for seq in seqs:
        seg = segments_of(seq, a.mean, a.sigma)
        rng = np.random.default_rng(1)
        q = jnp.asarray(rng.standard_normal((1, seq, H, D), np.float32))
        k, v = (jnp.asarray(rng.standard_normal((1, seq, KV, D), np.float32)) for _ in range(2))
        args = (q, k, v, jnp.asarray(seg))
        skip_t, skip_p = measure(
            lambda q, k, v, s: blockwise_document_attention(q, k, v, s, a.block, True), args, a.steps
        )
        mask_t, mask_p = measure(
            lambda q, k, v, s: blockwise_document_attention(q, k, v, s, a.block, False), args, a.steps
        )
        xla_t, xla_p = measure(lambda q, k, v, s: causal_attention(q, k, v, 0, s), args, a.steps)
        vis, causal = visited_blocks(seg, a.block)
        print(
            f"{seq:>6} {int(seg.max()):>5} {vis:>8}/{causal:<8} {skip_t:>8.3f} {mask_t:>8.3f} {xla_t:>8.3f} "
            f"{mask_t / skip_t:>9.2f} {xla_t / skip_t:>8.2f} {skip_p:>9.1f} {mask_p:>9.1f} {xla_p:>9.1f}"
        )

    print(f"\npacking efficiency, 20,000 documents lognormal mean {a.mean:.0f} sigma {a.sigma}")
    print(f"{'seq':>6} {'rows documents':>15} {'documents':>10} {'rows padded':>12} {'padded':>8}")
    ls = lengths(20_000, a.mean, a.sigma, seed=2)
    starts = np.concatenate([[0], np.cumsum(ls)[:-1]])
    for seq in seqs:
        p = pack(starts, int(ls.sum()), seq)
        padded_rows = int(np.sum(-(-np.maximum(ls - 1, 1) // seq)))  # each document cut into rows of its own
        print(
            f"{seq:>6} {p.rows:>15,} {p.efficiency:>10.1%} {padded_rows:>12,} "
            f"{ls.sum() / (padded_rows * (seq + 1)):>8.1%}"
        )


if __name__ == "__main__":
    main()

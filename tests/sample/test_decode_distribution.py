"""The sampler's token choice against the exact distribution it must draw from (jaxdist/sample/decode.py).

``choose_tokens`` with temperature T, top-k K and top-p P must draw token i with probability
softmax(logits / T) restricted to the top-K tokens and the smallest nucleus of mass >= P, renormalised.
Here 40,000 draws per setting over a 6-token vocabulary are compared with those probabilities computed in
NumPy by a chi-square test (fixed key: the same draws on every run); a sampler that ignored the temperature
or cut the wrong tokens is off by thousands of draws, far past the 1e-4 significance used.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxdist.sample.decode import Settings, choose_tokens

pytestmark = pytest.mark.default_emitters  # a nucleus whose probabilities sum to top_p exactly (tests/conftest.py)

LOGITS = np.array([2.0, 1.2, 0.5, 0.0, -1.0, -2.5], np.float32)
DRAWS = 40_000


def exact(t: float, k: int = 0, p: float = 1.0) -> np.ndarray:
    """The probabilities the settings define, from the definition."""
    z = LOGITS.astype(np.float64) / t
    order = np.argsort(-z)
    keep = np.zeros(len(z), bool)
    keep[order[: k or len(z)]] = True
    probs = np.exp(z - z.max()) * keep
    probs /= probs.sum()
    mass = 0.0
    nucleus = np.zeros(len(z), bool)
    for i in order:  # the smallest set of the most likely tokens whose mass reaches p
        if not keep[i] or (mass >= p and p < 1):
            continue
        nucleus[i] = True
        mass += probs[i]
    out = np.where(nucleus, probs, 0.0)
    return out / out.sum()


@pytest.mark.parametrize(
    "t,k,p",
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (2.0, 0, 1.0), (0.7, 3, 1.0), (1.5, 0, 0.8), (1.0, 4, 0.6)],
)
def test_draws_follow_the_exact_distribution(t, k, p):
    settings = Settings(jnp.float32(t), jnp.int32(k), jnp.float32(p), jnp.int32(-1))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, len(LOGITS)))
    ids = jax.jit(choose_tokens, static_argnums=3)(logits, jax.random.key(7), settings, len(LOGITS))
    counts = np.bincount(np.asarray(ids), minlength=len(LOGITS))
    want = exact(t, k, p)
    assert counts[want == 0].sum() == 0, (counts, want)  # cut tokens are never drawn
    support = want > 0
    res = stats.chisquare(counts[support], DRAWS * want[support])
    assert res.pvalue > 1e-4, (counts, DRAWS * want, res)


def test_the_temperature_changes_the_distribution():
    """The test above can tell temperatures apart: the draws at T=0.5 fail the T=1 distribution."""
    settings = Settings(jnp.float32(0.5), jnp.int32(0), jnp.float32(1.0), jnp.int32(-1))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, len(LOGITS)))
    ids = jax.jit(choose_tokens, static_argnums=3)(logits, jax.random.key(7), settings, len(LOGITS))
    counts = np.bincount(np.asarray(ids), minlength=len(LOGITS))
    assert stats.chisquare(counts, DRAWS * exact(1.0)).pvalue < 1e-12


def test_greedy_top_k_1_and_undecodable_ids_on_distinct_rows():
    """Rows with different maxima (not one row repeated): temperature 0 and top-k 1 both give each row's argmax over
    the ids the tokenizer decodes (vocab 6 of 8 logits: ids 6 and 7, the largest here, are never chosen); sampling
    at temperature 1 draws decodable ids only, in the exact proportions."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 8)).astype(np.float32)
    logits[:, 6:] += 10.0  # undecodable ids that would win every row
    want = np.argmax(logits[:, :6], axis=1)
    assert len(set(want.tolist())) > 3  # the rows differ
    choose = jax.jit(choose_tokens, static_argnums=3)
    for t, k in ((0.0, 0), (1.0, 1)):
        settings = Settings(jnp.float32(t), jnp.int32(k), jnp.float32(1.0), jnp.int32(-1))
        assert np.asarray(choose(jnp.asarray(logits), jax.random.key(1), settings, 6)).tolist() == want.tolist()
    row = np.concatenate([LOGITS, [9.0, 9.0]]).astype(np.float32)
    settings = Settings(jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0), jnp.int32(-1))
    ids = choose(jnp.broadcast_to(jnp.asarray(row), (DRAWS, 8)), jax.random.key(7), settings, 6)
    counts = np.bincount(np.asarray(ids), minlength=8)
    assert counts[6:].sum() == 0
    assert stats.chisquare(counts[:6], DRAWS * exact(1.0)).pvalue > 1e-4


def test_a_nucleus_whose_mass_reaches_top_p_exactly_stops_there():
    """top_p equal to the mass of the most likely token (as float32 computes it, so the comparison is exact): that
    token alone reaches p, so the nucleus is it alone and every draw is it.  A nucleus that also took the tokens whose
    mass before them *equals* p (``<=`` for ``<``) draws the second token about a third of the time."""
    desc = jnp.asarray(np.sort(LOGITS)[::-1])
    probs = jax.nn.softmax(desc)
    top_p = float((jnp.cumsum(probs) - probs)[1])  # the mass before the second token: the first token's
    assert abs(top_p - exact(1.0)[0]) < 1e-6
    settings = Settings(jnp.float32(1.0), jnp.int32(0), jnp.float32(top_p), jnp.int32(-1))
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (2000, len(LOGITS)))
    ids = jax.jit(choose_tokens, static_argnums=3)(logits, jax.random.key(3), settings, len(LOGITS))
    assert np.bincount(np.asarray(ids), minlength=len(LOGITS)).tolist() == [2000, 0, 0, 0, 0, 0]

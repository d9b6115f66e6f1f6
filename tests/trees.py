"""Comparing two pytrees leaf by leaf, their structure first (a dropped leaf, say the optimizer state, fails)."""

from __future__ import annotations

import jax


def leaf_pairs(a, b) -> list[tuple]:
    """The (leaf of ``a``, leaf of ``b``) pairs, after asserting both trees have the same structure."""
    sa, sb = jax.tree.structure(a), jax.tree.structure(b)
    assert sa == sb, f"the trees differ in structure:\n{sa}\n{sb}"
    return list(zip(jax.tree.leaves(a), jax.tree.leaves(b)))

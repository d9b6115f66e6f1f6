"""Generation functions for the generation-cluster tests (named as ``tests.gen.genfns:expand``)."""

import os
import time

SHARD_BYTES = 600


def expand(samples: list[str]) -> str:
    """A deterministic 'teacher': the task's samples repeated to SHARD_BYTES bytes, after a pause to be killed in."""
    time.sleep(float(os.environ.get("GENFN_SLEEP", "1.0")))
    text = " | ".join(samples) + "\n"
    return (text * (SHARD_BYTES // len(text) + 1))[:SHARD_BYTES]


# A chain's cheap stages with known cost curves: a task of s samples takes a * (1 + c * (s - 1)) seconds
# (times GENFN_SCALE), the profile model of jaxdist/gen/profile.py with no per-token cost.
VARIANTS_COST = (0.05, 0.25)
SCORE_COST = (0.04, 0.5)


def _spend(samples: list[str], cost: tuple[float, float]) -> None:
    a, c = cost
    time.sleep(float(os.environ.get("GENFN_SCALE", "1.0")) * a * (1 + c * (len(samples) - 1)))


def variants(samples: list[str]) -> list[str]:
    """A generator stage: two continuations of each sample."""
    _spend(samples, VARIANTS_COST)
    return [f"{s} /{v}" for s in samples for v in ("a", "b")]


def score(samples: list[str]) -> list[str]:
    """A scorer stage: each sample with its length in front."""
    _spend(samples, SCORE_COST)
    return [f"{len(s)} {s}" for s in samples]

"""Generation functions for the generation-cluster tests (named as ``tests.gen.genfns:expand``)."""

import os
import time

SHARD_BYTES = 600


def expand(samples: list[str]) -> str:
    """A deterministic 'teacher': the task's samples repeated to SHARD_BYTES bytes, after a pause to be killed in."""
    time.sleep(float(os.environ.get("GENFN_SLEEP", "1.0")))
    text = " | ".join(samples) + "\n"
    return (text * (SHARD_BYTES // len(text) + 1))[:SHARD_BYTES]

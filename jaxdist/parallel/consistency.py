"""Every process issues the same collectives in the same order, or the job does not start.

A multi-process job whose processes compiled different step programs (another ``train.grad_bucket_bytes``,
another JAX, another config) deadlocks in its first mismatched collective, or worse, reduces the wrong
buffers.  Before the first step each process reads the collectives of its compiled step in program order
(kind, replica groups, bytes, executions per step; :func:`jaxdist.parallel.hlo.parse_collectives`), publishes
their hash and list through the job's coordination service, and compares them with every other process's: on a
difference every process refuses to start and names the first one (:func:`first_difference`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from jaxdist.config import ConfigError
from jaxdist.parallel.hlo import parse_collectives

# How long a process waits for its peers' lists (ms): they compile the same program, give them generous time.
WAIT_MS = 300_000


def collective_sequence(hlo_text: str) -> list[str]:
    """The collectives of a compiled program in program order, one line each:
    ``kind groups=... bytes=N xCOUNT`` (loop bodies once, with their trip count)."""
    return [
        f"{c.kind} {c.groups or f'group={c.group}'} bytes={c.bytes} x{c.count}" for c in parse_collectives(hlo_text)
    ]


def sequence_hash(seq: list[str]) -> str:
    """sha256 (hex) of a collective sequence."""
    return hashlib.sha256("\n".join(seq).encode()).hexdigest()


def first_difference(mine: list[str], theirs: list[str], me: int, other: int) -> str | None:
    """One sentence naming the first collective where process ``me``'s sequence and ``other``'s differ, or None."""
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a != b:
            return f"collective #{i} of the train step is '{a}' in process {me} but '{b}' in process {other}"
    if len(mine) != len(theirs):
        n = min(len(mine), len(theirs))
        extra, who = (mine[n], me) if len(mine) > n else (theirs[n], other)
        return (
            f"process {me} issues {len(mine)} collectives per step and process {other} {len(theirs)}: "
            f"the first extra one is #{n} '{extra}' in process {who}"
        )
    return None


_ROUNDS: dict[tuple[str, int], int] = {}  # checks made so far, per tag and process


def check_same_collectives(
    hlo_text: str, process: int, processes: int, kv_set: Callable, kv_get: Callable, tag: str = "step"
) -> str:
    """Publish this process's collective sequence and compare it with every other process's; returns the hash.

    ``kv_set(key, value)`` / ``kv_get(key, timeout_ms) -> value``: the job's key-value store
    (:func:`coordination_store`).  Raises ConfigError, the same sentence in every process, on a difference.
    """
    seq = collective_sequence(hlo_text)
    digest = sequence_hash(seq)
    # A key is written once per job: a process that checks again (another Trainer, another fit) uses the next
    # round's keys; every process checks in the same order, so their rounds match.
    n = _ROUNDS[(tag, process)] = _ROUNDS.get((tag, process), -1) + 1
    tag = f"{tag}/{n}"
    kv_set(f"jaxdist/collectives/{tag}/{process}", json.dumps({"hash": digest, "seq": seq}))
    for other in range(processes):
        if other == process:
            continue
        theirs = json.loads(kv_get(f"jaxdist/collectives/{tag}/{other}", WAIT_MS))
        if theirs["hash"] != digest:
            a, b = sorted((process, other))
            seqs = {process: seq, other: theirs["seq"]}
            diff = first_difference(seqs[a], seqs[b], a, b) or "the hashes differ"
            raise ConfigError(
                f"the processes compiled different train steps, which would deadlock or reduce the wrong "
                f"buffers: {diff}; give every process the same config (train.grad_sync, train.grad_bucket_bytes, "
                "mesh) and the same jaxdist and JAX versions."
            )
    return digest


def coordination_store() -> tuple[Callable, Callable]:
    """(kv_set, kv_get) of the running ``jax.distributed`` job's coordination service."""
    from jax._src import distributed  # the client of jax.distributed.initialize; JAX has no public handle

    client = distributed.global_state.client
    assert client is not None, "jax.distributed is not initialised"
    return client.key_value_set, client.blocking_key_value_get

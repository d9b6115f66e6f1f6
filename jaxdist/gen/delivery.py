"""The training side of generation: receive shards over the network, add each exactly once to the run.

``jaxdist gen receive RUN_DIR`` runs a :class:`Receiver` beside a training run
(the run may be stopped, running or restarting: the two meet only in the run
directory). A generation worker delivers one shard per task::

    {"t": "deliver", "key": <task key>, "sha256": ..., "n_bytes": ...} + payload

and the receiver

1. checks the payload against the SHA-256 and length the signed body names
   (a corrupted shard is refused with the reason; nothing is written);
2. answers ``duplicate`` for a task key or a content hash it already holds
   (a retry after a lost acknowledgement, or a task run twice because its
   first worker died after delivering): added once;
3. writes the shard atomically to ``<run>/gen/shards/`` and appends it to the
   ledger ``<run>/gen/ledger.jsonl`` (flushed to disk), then acknowledges;
4. bundles the shards received so far into one token file of at least one
   global batch (``train.batch_size`` sequences of ``train.seq_len + 1``
   tokens: a batch-list source needs that much; a shard ends with EOS, so the
   texts stay apart) under ``<run>/gen/bundles/``, queues the bundle as a
   batch-list addition (:func:`jaxdist.data.catalog.add_data`: the trainer
   adopts it at its next step boundary and never waits for it) and records
   the bundle in the ledger. Shards that are not yet a batch's worth wait for
   the next ones.

A kill at any point loses nothing and adds nothing twice: before the shard's
ledger line the worker has no acknowledgement and delivers again; after it,
the retry is a duplicate. A bundle is formed again from the same shards (the
same tokens, so the same fingerprint) when its ledger line is missing, and an
addition already queued under that fingerprint is recognised. The trainer
adopts additions on its own schedule, so the cursor may trail the newest
shard: :func:`run_status` says by how many steps.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist.config import ConfigError
from jaxdist.controller.protocol import load_or_create_token
from jaxdist.data.batchlist import unpack_ids
from jaxdist.data.catalog import add_data, fingerprint, read_path, run_token_dtype
from jaxdist.data.journal import Journal, append_lines, atomic_write
from jaxdist.gen.channel import Server, digest

log = logging.getLogger(__name__)

MAX_SHARD_BYTES = 1 << 30
# The requests the receiver reads: anything else authentic is refused at the edge (Server's fields).
REQUEST_FIELDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "deliver": ({"key": str, "sha256": str, "n_bytes": int}, {}),
    "status": ({}, {}),
}


def gen_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "gen"


def run_token(run_dir: str | Path) -> str:
    """The token generation workers of this run must hold: $JAXDIST_JOB_TOKEN or ``<run>/gen/token`` (0600)."""
    return load_or_create_token(gen_dir(run_dir) / "token")


class Ledger:
    """The tasks whose shards the run holds: one JSON line per task, appended and flushed to disk."""

    def __init__(self, path: Path):
        self.path = path
        self.by_key: dict[str, dict[str, Any]] = {}
        self.by_sha: dict[str, dict[str, Any]] = {}
        self.bundles: dict[str, dict[str, Any]] = {}  # bundle name -> its record (its shards' keys, fingerprint)
        self.bundle_of: dict[str, str] = {}  # shard key -> bundle name
        if path.exists():
            for n, line in enumerate(path.read_bytes().splitlines(), 1):
                try:
                    rec = json.loads(line)
                    self._index(rec)
                except (ValueError, KeyError, TypeError):  # a line torn by a kill: that task was never acknowledged
                    log.warning("%s line %d is not a complete record (a torn write): skipped", path, n)

    def _index(self, rec: dict[str, Any]) -> None:
        if "bundle" in rec:
            self.bundles[rec["bundle"]] = rec
            for k in rec["keys"]:
                self.bundle_of[k] = rec["bundle"]
            return
        self.by_key[rec["key"]] = rec
        self.by_sha[rec["sha256"]] = rec

    def waiting(self) -> list[dict[str, Any]]:
        """Shards received but in no bundle yet, oldest first."""
        return [r for k, r in self.by_key.items() if k not in self.bundle_of]

    def append(self, rec: dict[str, Any]) -> None:
        append_lines(self.path, json.dumps(rec, sort_keys=True).encode() + b"\n", fsync=True)
        self._index(rec)


class Receiver:
    """Answers ``deliver`` and ``status`` requests for the run in ``run_dir``."""

    def __init__(self, run_dir: str | Path, host: str = "127.0.0.1", port: int = 0, allow_remote: bool = False):
        self.run_dir = Path(run_dir)
        if not (self.run_dir / "batchlist").is_dir():
            raise ConfigError(
                f"{self.run_dir} is not a training run with a batch list: start the training run first "
                "(jaxdist train), then its receiver."
            )
        self.dir = gen_dir(self.run_dir)
        self.shards = self.dir / "shards"
        self.shards.mkdir(parents=True, exist_ok=True)
        (self.dir / "bundles").mkdir(exist_ok=True)
        self.ledger = Ledger(self.dir / "ledger.jsonl")
        bl = Journal(self.run_dir).load()
        self.min_tokens = bl.batch_size * bl.seq_len + 1  # one global batch: the least a source can hold
        self.token_dtype = run_token_dtype(self.run_dir)
        self._stop = threading.Event()
        self.server = Server(run_token(self.run_dir), "receiver", host, port, allow_remote, REQUEST_FIELDS)
        atomic_write(
            self.dir / "receiver.json",
            json.dumps({"address": self.server.address, "pid": os.getpid(), "started": time.time()}).encode(),
        )
        log.info("receiving shards for %s on %s", self.run_dir, self.server.address)
        self._bundle()  # shards a killed receiver acknowledged but did not bundle yet

    @property
    def address(self) -> str:
        return self.server.address

    def serve(self, until: float | None = None) -> None:
        """Answer requests until ``time.monotonic() >= until`` (forever when None)."""
        while (until is None or time.monotonic() < until) and not self._stop.is_set():
            self.server.serve_once(self.handle, 0.2)

    def stop(self) -> None:
        """Make :meth:`serve` return within its poll interval (from another thread)."""
        self._stop.set()

    def close(self) -> None:
        self.server.close()

    # ------------------------------------------------------------------ requests

    def handle(self, sender: str, msg: dict[str, Any], payload: bytes | None) -> dict[str, Any]:
        kind = msg.get("t")
        if kind == "status":
            return {"ok": True, **run_status(self.run_dir)}
        if kind == "deliver":
            return self._deliver(sender, msg, payload)
        return {"ok": False, "refused": f"unknown request {kind!r}"}

    def _refuse(self, sender: str, key: str, reason: str) -> dict[str, Any]:
        log.warning("refused the shard of task %s from %s: %s", key, sender, reason)
        return {"ok": False, "refused": reason}

    def _deliver(self, sender: str, msg: dict[str, Any], payload: bytes | None) -> dict[str, Any]:
        key, sha = str(msg.get("key", "")), str(msg.get("sha256", ""))
        if not key or "/" in key or len(key) > 200:
            return self._refuse(sender, key, "the task key is missing or malformed")
        if payload is None:
            return self._refuse(sender, key, "no shard came with the delivery")
        if len(payload) != msg.get("n_bytes") or digest(payload) != sha:
            return self._refuse(sender, key, "the shard's SHA-256 or length does not match what was signed (corrupted)")
        if len(payload) > MAX_SHARD_BYTES:
            return self._refuse(sender, key, f"the shard holds {len(payload):,} bytes, more than {MAX_SHARD_BYTES:,}")
        if key in self.ledger.by_key or sha in self.ledger.by_sha:
            prev = self.ledger.by_key.get(key) or self.ledger.by_sha[sha]
            return {"ok": True, "duplicate": True, "tokens": prev["tokens"], "path": prev["path"]}
        path = self.shards / f"{key.replace(':', '-')}-{sha[:12]}.txt"
        atomic_write(path, payload)
        try:
            _, tokens = read_path(path)
        except ConfigError as e:
            path.unlink(missing_ok=True)
            return self._refuse(sender, key, str(e))
        rec = {
            "key": key,
            "sha256": sha,
            "path": str(path),
            "tokens": int(len(tokens)),
            "worker": sender,
            "time": time.time(),
        }
        self.ledger.append(rec)
        log.info("shard of task %s from %s: %d tokens received (%s)", key, sender, len(tokens), path.name)
        self._bundle()
        return {"ok": True, "duplicate": False, "tokens": rec["tokens"], "path": rec["path"]}

    def _bundle(self) -> None:
        """Queue the waiting shards as one addition once they hold at least one global batch."""
        waiting = self.ledger.waiting()
        if sum(r["tokens"] for r in waiting) < self.min_tokens:
            return
        tokens = np.concatenate([read_path(r["path"])[1] for r in waiting]).astype(self.token_dtype)
        fp = fingerprint(tokens)
        name = f"b{len(self.ledger.bundles):06d}-{fp[:12]}.tokens"
        path = self.dir / "bundles" / name
        atomic_write(path, tokens.tobytes())
        try:
            request = add_data(self.run_dir, [path], seed=int(fp[:15], 16), kind="tokens")["request"]
        except ConfigError as e:
            if "holds the same data" not in str(e):
                raise
            request = None  # a receiver killed after queueing it and before recording it: it is queued
        keys = [r["key"] for r in waiting]
        self.ledger.append(
            {"bundle": name, "keys": keys, "fingerprint": fp, "tokens": int(len(tokens)), "request": request}
        )
        log.info("bundle %s: %d shard(s), %d tokens queued as an addition", name, len(keys), len(tokens))


def _last_trained_step(run_dir: Path) -> int:
    """The newest step in the run's metrics log (its last 64 KiB), 0 without one."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 16)))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("kind") == "train":
            return int(r["step"])
    return 0


def run_status(run_dir: str | Path) -> dict[str, Any]:
    """Shards the run received, how many the batch list has adopted, and how far the cursor trails the newest.

    ``received``: shards acknowledged; ``waiting``: received, not yet a batch's worth (no bundle yet);
    ``queued``: in a bundle the trainer has not adopted yet; ``adopted``: in the batch list;
    ``cursor``: the newest trained step (from the metrics log, or the last checkpoint's cursor);
    ``behind_steps``: steps from the cursor to the last position holding a batch of the newest adopted
    bundle (0 once it is trained).
    """
    run_dir = Path(run_dir)
    ledger = Ledger(gen_dir(run_dir) / "ledger.jsonl")
    journal = Journal(run_dir)
    bl = journal.load()
    cursor = max(int((journal.read_cursor() or {}).get("cursor", 0)), _last_trained_step(run_dir))
    by_fp = {s.fingerprint: s.id for s in bl.sources}
    adopted = {name: b for name, b in ledger.bundles.items() if b["fingerprint"] in by_fp}
    behind = 0
    if adopted:
        newest = max(by_fp[b["fingerprint"]] for b in adopted.values())
        src, _, _ = unpack_ids(bl.order)
        where = np.flatnonzero(src == newest)
        behind = max(0, int(where[-1]) + 1 - cursor) if len(where) else 0
    n_adopted = sum(len(b["keys"]) for b in adopted.values())
    n_bundled = sum(len(b["keys"]) for b in ledger.bundles.values())
    return {
        "received": len(ledger.by_key),
        "waiting": len(ledger.by_key) - n_bundled,
        "queued": n_bundled - n_adopted,
        "adopted": n_adopted,
        "bundles": len(ledger.bundles),
        "tokens": sum(r["tokens"] for r in ledger.by_key.values()),
        "cursor": int(cursor),
        "batches": len(bl),
        "behind_steps": int(behind),
    }

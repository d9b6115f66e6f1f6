"""Checking a run's data order: replay the journal, verify it, and hold the training log against it.

* :func:`replay_order` rebuilds any version from the recorded operations
  and seeds alone (never reading the stored orders);
* :func:`read_records` reads a JSON-lines log, naming and skipping a line a
  kill cut short;
* :func:`trained_batches` reads the batch each step trained from
  ``<run>/metrics.jsonl``, keeping only the lineage of the final state: when a
  resumed run logs step ``s`` again, the records of ``s`` and after from the
  interrupted attempt are dropped (their updates were rolled back);
* :func:`check_exactly_once` compares that sequence with the journal;
* :func:`digest_problems` checks each step's logged token digest against the data its batch id names;
* :func:`verify` and :func:`describe` back ``jaxdist data verify`` and ``show``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist.data.batchlist import BatchList, BatchListError, batch_digest, derive, format_id, parse_id, unpack_ids
from jaxdist.data.batchloader import BatchReader
from jaxdist.data.catalog import fingerprint, pack_source, read_source
from jaxdist.data.documents import PackedStream
from jaxdist.data.items import ItemSource
from jaxdist.data.journal import Journal

log = logging.getLogger(__name__)


def replay_order(journal: Journal, version: int | None = None) -> np.ndarray:
    """The order of ``version`` (default newest) rebuilt from version 1's operation and each one after."""
    version = journal.latest() if version is None else version
    chain = []
    v: int | None = version
    while v is not None:
        stored = journal.read(v, orders=False)  # the operation and sources: the stored order is not read
        chain.append(stored)
        v = stored.parent
    parent: BatchList | None = None
    for bl in reversed(chain):
        try:
            sources = bl.all_sources(None if parent is None else parent.sources)
        except ValueError as e:
            raise BatchListError(f"batch list version {bl.version} is damaged: {e}") from None
        order = derive(parent, bl.op, sources, bl.batch_size, bl.seq_len)
        parent = BatchList(bl.version, bl.parent, bl.op, bl.batch_size, bl.seq_len, sources, order)
    assert parent is not None
    return parent.order


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (``<run>/metrics.jsonl``), in order; [] if it does not exist.

    A line that is not a whole JSON object (cut short by a kill mid-write) is skipped with a warning that
    names the file and the line.
    """
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if not isinstance(r, dict):
            log.warning("skipping line %d of %s: a torn record (a write cut short), not a JSON object", n, path)
            continue
        rows.append(r)
    return rows


def trained_batches(run_dir: str | Path) -> list[dict[str, Any]]:
    """``{"step", "batch_id", "batch_version", "batch_digest"}`` of each step of the final lineage, in step order
    (``batch_digest`` None in a log written before the step recorded it)."""
    lineage: dict[int, dict[str, Any]] = {}
    last = 0
    for r in read_records(Path(run_dir) / "metrics.jsonl"):
        if r.get("kind") != "train" or "batch_id" not in r:
            continue
        step = int(r["step"])
        if step <= last:  # a resumed attempt: what the interrupted one did from here was rolled back
            lineage = {s: x for s, x in lineage.items() if s < step}
        lineage[step] = {
            "step": step,
            "batch_id": r["batch_id"],
            "batch_version": r.get("batch_version"),
            "batch_digest": r.get("batch_digest"),
        }
        last = step
    return [lineage[s] for s in sorted(lineage)]


def history_problems(run_dir: str | Path) -> list[str]:
    """What shows that the training log is not one history: two writers whose records interleave (two
    processes trained the run at once), a writer that logs a step twice (a duplicated record), or no log at
    all beside checkpoints past step 0.  Records without a ``writer`` (older runs) are not judged."""
    run = Path(run_dir)
    records = [r for r in read_records(run / "metrics.jsonl") if r.get("kind") == "train" and "batch_id" in r]
    problems: list[str] = []
    if not records:
        steps = [int(p.name) for p in (run / "checkpoints").glob("*") if p.name.isdigit() and int(p.name) > 0]
        if steps:
            problems.append(
                f"no training log ({run / 'metrics.jsonl'} is missing or empty) although checkpoints reach step "
                f"{max(steps)}: which batches were trained cannot be checked"
            )
        return problems
    done: set[str] = set()
    current, last = None, None
    interleaved, repeated = [], []
    for r in records:
        w, step = r.get("writer"), int(r["step"])
        if w is None:
            continue
        if w != current:
            if w in done:
                interleaved.append(step)
            if current is not None:
                done.add(current)
            current, last = w, None
        elif last is not None and step <= last:
            repeated.append(step)
        last = step
    if interleaved:
        problems.append(
            f"two writers' histories: the records of {len(done | {current})} writers interleave "
            f"({len(interleaved)} times, first at step {interleaved[0]}): two processes trained this run at once"
        )
    if repeated:
        problems.append(f"{len(repeated)} step(s) logged twice by one writer (first: step {repeated[0]})")
    return problems


def check_exactly_once(run_dir: str | Path, version: int | None = None) -> dict[str, Any]:
    """Trained batches (from the log) against the journal's ``version`` (default newest).

    Returns counts: ``trained`` steps, ``duplicates`` (ids trained more than
    once), ``missing`` (ids of positions before the last trained step never
    trained), ``misplaced`` (steps whose id is not the journal's at that
    position), ``gaps`` (steps absent from the log), ``unused`` (ids after the
    last trained step), and ``ok`` when the first four are 0.
    """
    journal = Journal(run_dir)
    bl = journal.load(version)
    order = bl.order
    rows = trained_batches(run_dir)
    steps = [r["step"] for r in rows]
    n = steps[-1] if steps else 0
    ids = [r["batch_id"] for r in rows]
    want = [format_id(x) for x in order[:n]]
    by_step = {r["step"]: r["batch_id"] for r in rows}
    counts = Counter(ids)
    out = {
        "trained": len(rows),
        "duplicates": sum(c - 1 for c in counts.values() if c > 1),
        "missing": len(set(want) - set(ids)),
        "misplaced": sum(1 for s, b in by_step.items() if s > len(want) or want[s - 1] != b),
        "gaps": n - len(rows),
        "unused": len(order) - n,
        "version": bl.version,
    }
    out["ok"] = not (out["duplicates"] or out["missing"] or out["misplaced"] or out["gaps"])
    return out


def digest_problems(
    run_dir: str | Path, config_tokens: np.ndarray | PackedStream | ItemSource | None = None, items=()
) -> list[str]:
    """Steps whose logged ``batch_digest`` is not the digest of the tokens their ``batch_id`` names.

    The tokens are read again from the journal's sources (``config_tokens``: the configured data's train split,
    source 0 of a run made from the config, or its Python dataset; ``items``: the Python datasets added to such a
    run), independently of the trainer: a step that trained other tokens than
    the batch it logged shows here, which the ids alone (:func:`check_exactly_once`) cannot see.  A step logged
    without a digest is a problem too.  [] when every trained step's tokens are the ones its id names.
    """
    journal = Journal(run_dir)
    bl = journal.load()  # the newest version's sources include every older version's
    if config_tokens is None and any(s.kind == "config" for s in bl.sources):
        raise ValueError("the run's batches come from the configured data: pass its train split as config_tokens")
    tokens: dict[int, Any] = {}
    for s in bl.sources:  # data.packing=documents: config_tokens is the train split's PackedStream
        if isinstance(config_tokens, PackedStream) and s.kind == "config":
            read_source(s, config_tokens.tokens)
            tokens[s.id] = config_tokens
        elif s.packing == "documents" and s.kind == "config":
            raise ValueError("the run packs the configured data by documents: pass its train split's PackedStream")
        else:
            t = read_source(s, config_tokens, items)
            tokens[s.id] = pack_source(s, t, bl.seq_len) if s.packing == "documents" else t
    reader = BatchReader(bl, tokens)
    problems = []
    for r in trained_batches(run_dir):
        want = int(batch_digest(reader.batch_of_id(parse_id(r["batch_id"]))))
        if r["batch_digest"] != want:
            problems.append(
                f"step {r['step']}: logged digest {r['batch_digest']} but batch {r['batch_id']}'s tokens give {want}"
            )
    return problems


def verify(run_dir: str | Path, full: bool = False) -> tuple[bool, list[str]]:
    """Check every version, the sources and the training log; (all good, report lines).

    Each version must load (checksum), keep its parent's first ``splice`` ids,
    hold each id once and equal its replay from the operations. Each source
    must be present with its recorded length and quick fingerprint (``full``:
    also its full SHA-256).
    """

    journal = Journal(run_dir)
    lines, ok = [], True
    versions = journal.versions()
    if not versions:
        return False, [f"no batch list in {journal.dir}"]
    # One pass, oldest first, holding one order at a time: a version replays when its operation applied to its
    # parent's order gives its order and the parent replays (by induction, the replay from version 1).  The cost is
    # linear in the versions; replaying each from version 1 was quadratic (1,000 additions: 500,000 replays).  Ids
    # are checked once each against the parent's ids kept sorted (a sort of every order was N log N a version).
    intact: set[int] = set()  # versions whose order could be built (their file and their parent's are sound)
    replays: set[int] = set()  # versions whose stored order equals their replay
    newest: BatchList | None = None
    newest_sorted = np.zeros(0, np.int64)
    for v in versions:
        try:
            stored = journal.read(v)
        except BatchListError as e:
            ok = False
            lines.append(f"version {v}: DAMAGED: {e}")
            copy = journal.copy_of(v)
            if copy is None:
                continue
            stored = copy  # the versions built on it are checked through the copy of its change
        problems = []
        parent = None
        if stored.parent is not None and stored.parent in intact:
            parent = newest if newest is not None and newest.version == stored.parent else journal.load(stored.parent)
        if stored.parent is not None and parent is None:
            problems.append(f"its parent version {stored.parent} is not intact")
        bl = None
        if stored.order is not None or parent is not None:
            try:
                bl = stored.resolve(parent)
            except ValueError as e:
                problems.append(str(e))
        if bl is not None:
            if stored.delta is not None and parent is not None and parent is newest:  # newest_sorted: its ids
                ids = np.sort(stored.delta.ids)
                where = np.minimum(np.searchsorted(newest_sorted, ids), max(len(newest_sorted) - 1, 0))
                twice = np.any(ids[1:] == ids[:-1]) or (len(newest_sorted) and np.any(newest_sorted[where] == ids))
                sorted_ids = np.insert(newest_sorted, np.searchsorted(newest_sorted, ids), ids)
            else:
                sorted_ids = np.sort(bl.order)
                twice = np.any(sorted_ids[1:] == sorted_ids[:-1])
            if twice:
                problems.append("an id appears twice")
            splice = int(bl.op.get("splice", 0))
            if parent is not None and not np.array_equal(bl.order[:splice], parent.order[:splice]):
                problems.append(f"its first {splice} ids differ from version {bl.parent}")
        if not problems:
            assert bl is not None
            try:
                if bl.parent is None or bl.parent in replays:
                    replayed = derive(parent, bl.op, bl.sources, bl.batch_size, bl.seq_len)
                else:  # the parent's stored order is not its replay: replay the chain itself
                    replayed = replay_order(journal, v)
                if not np.array_equal(replayed, bl.order):
                    problems.append("replaying its operations gives another order")
            except BatchListError as e:
                problems.append(f"cannot replay: {e}")
        ok &= not problems
        copied = f"rebuilt from the copy of its change in version {stored.copy_in}: " if stored.copy_in else ""
        lines.append(
            f"version {v}: {copied}"
            + ("ok" if not problems else "BAD: " + "; ".join(problems))
            + f" ({stored.op['kind']}, {len(stored):,} batches)"
        )
        if bl is not None:
            intact.add(v)
            newest, newest_sorted = bl, sorted_ids
            if not problems:
                replays.add(v)
    if newest is not None:
        for s in newest.sources:
            if s.kind == "config":
                lines.append(f"source 0: the configured data '{s.name}' (checked when training starts)")
                continue
            if s.kind == "items":
                lines.append(
                    f"source {s.id}: the Python dataset '{s.name}' added to the run, {s.n_tokens:,} items (checked "
                    "when training starts)"
                )
                continue
            try:
                tokens = read_source(s)
                if full and fingerprint(tokens) != s.fingerprint:
                    raise BatchListError(f"source {s.id} ('{s.path}') has another fingerprint than when added")
                lines.append(f"source {s.id}: ok ({s.path})")
            except BatchListError as e:
                ok = False
                lines.append(f"source {s.id}: {e}")
    for problem in history_problems(run_dir):
        ok = False
        lines.append(f"training log: {problem}")
    if newest is not None and trained_batches(run_dir):
        r = check_exactly_once(run_dir, newest.version)
        ok &= r["ok"]
        lines.append(
            f"training log: {r['trained']} batches trained, {r['duplicates']} duplicates, "
            f"{r['missing']} missing, {r['misplaced']} out of order, {r['gaps']} steps unlogged; "
            f"{r['unused']} not yet trained"
        )
    return ok, lines


def describe(run_dir: str | Path, version: int | None = None, head: int = 5) -> str:
    """Human summary: versions, sources, cursor, pending additions and the next ``head`` batch ids."""
    journal = Journal(run_dir)
    bl = journal.load(version)
    out = [
        f"batch list of {journal.run_dir}: version {bl.version} of {journal.versions()}, {len(bl):,} batches "
        f"of {bl.batch_size} x {bl.seq_len + 1} tokens"
    ]
    out.append("versions:")
    for v in journal.versions():
        try:
            x = journal.read(v, orders=False)
            op = x.op
            detail = f"splice {op.get('splice', 0)}, seed {op['seed']}"
            if op["kind"] == "add":
                detail += f", sources {op['sources']}"
            out.append(f"  v{v}: {op['kind']:<6} {len(x):>10,} batches  ({detail})")
        except BatchListError as e:
            out.append(f"  v{v}: DAMAGED ({e})")
    out.append("sources:")
    src_of = unpack_ids(bl.order)[0]
    for s in bl.sources:
        share = float(np.mean(src_of == s.id)) if len(bl) else 0.0
        out.append(
            f"  {s.id}: {s.kind:<8} {s.name}  {s.n_tokens:,} tokens, "
            f"{s.batches_per_epoch(bl.batch_size, bl.seq_len):,} batches/epoch, {100 * share:.1f}% of the list, "
            f"sha256 {s.fingerprint[:12]}"
        )
    cur = journal.read_cursor()
    trained = trained_batches(run_dir)
    last = trained[-1]["step"] if trained else 0
    out.append(
        f"cursor: {last} (last trained step in metrics.jsonl)"
        + (f"; {cur['cursor']} at the newest checkpoint save (version {cur['version']})" if cur else "")
    )
    nxt = [format_id(x) for x in bl.order[last : last + head]]
    out.append(f"next batches: {', '.join(nxt) if nxt else '(list spent: the next epoch is appended on demand)'}")
    pending = journal.pending()
    out.append(f"pending additions: {', '.join(n for n, _ in pending) if pending else 'none'}")
    return "\n".join(out)

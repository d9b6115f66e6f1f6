"""The local tier's newest step restored onto another layout: after the group shrank or grew.

A local step is written for one layout (mesh, shardings, process count): each
file holds the pieces one old rank's devices held.  When the group comes back
with another layout (fewer or more nodes, so another mesh), the same step is
still whole if the new processes' node-local directories together hold every
old rank's file (its own or its replica).  Then, collectively:

1. each process lists the (step, old layout) files it holds and which old
   ranks they cover; the group takes the newest step whose files cover every
   old rank somewhere (and is newer than ``newer_than``);
2. each process reads and checks its files of that step (size, CRC-32) into
   pieces keyed by (array name, index range);
3. the processes exchange a catalogue of the pieces they hold (8-byte hashes);
   a piece a process needs and does not hold is sent by one holder, chosen the
   same way by everyone (spread over the holders), and only the part of it
   that overlaps the receiver's new shards;
4. the parts travel over the job's own interconnect in collective-permutes
   (only the shifts some pair needs), and each process assembles its new
   shards, checking that every element was filled exactly once.

Bytes moved: each new shard's bytes at most once, minus what its process held
already.  The markers written since this module exists carry what this needs
(``global``: names, shapes and dtypes; ``num``: the old process count;
``entries``: the pieces in the file); older files are restored only onto their
own layout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import zlib
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from jax.experimental import multihost_utils

from jaxdist.checkpoint.local_payload import Entry, build_state, held_pieces, pack, signature, unpack
from jaxdist.checkpoint.writer import named_leaves

log = logging.getLogger(__name__)


class LocalTier(Protocol):
    """What a restore onto another layout uses of :class:`jaxdist.checkpoint.local.LocalTier` (named here, not
    imported: that module imports this one)."""

    directory: Path
    not_before: float
    num: int
    rank: int

    def _roll(self, payload: np.ndarray, shift: int, full: int = 0) -> np.ndarray: ...


CANDIDATES = 4  # newest (step, layout) file sets a process checks and offers


def global_signature(tree: Any) -> str:
    """A hash of every array's name, global shape and dtype: what a step must share to be resharded."""
    parts = [[name, list(leaf.shape), str(np.dtype(leaf.dtype))] for name, leaf in named_leaves(tree)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def entries_record(entries: list[Any]) -> list[list[Any]]:
    """A file's pieces as JSON: [name, [[start, stop], ...], dtype] in payload order."""
    return [[e.name, [list(r) for r in e.index], str(e.dtype)] for e in entries]


def _piece_hash(name: str, index: tuple[tuple[int, int], ...]) -> int:
    digest = hashlib.blake2b(json.dumps([name, index]).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _intersect(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...] | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _local(region: tuple[tuple[int, int], ...], within: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
    return tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(region, within))


def _volume(index: tuple[tuple[int, int], ...]) -> int:
    return int(np.prod([b - a for a, b in index], dtype=np.int64))


def allgather_rows(num: int, row: np.ndarray) -> np.ndarray:
    """Every process's int64 ``row`` (the same length everywhere), as [num, len]."""
    flat = np.ascontiguousarray(row, np.int64).reshape(-1)
    if num == 1:
        return flat[None]
    got = np.asarray(multihost_utils.process_allgather(flat.view(np.uint8))).reshape(num, -1)
    return np.ascontiguousarray(got).view(np.int64).reshape(num, -1)


def _scan(tier: LocalTier, gsig: str, sig: str) -> dict[tuple[int, str], dict[str, Any]]:
    """{(step, old layout): {"num": n, "ranks": {old rank: (path, marker)}}} of this node's files of another
    layout of the same arrays (size checked here; the checksum when read)."""
    found: dict[tuple[int, str], dict[str, Any]] = {}
    for marker in tier.directory.glob("*/r*.w*.json"):
        try:
            m = json.loads(marker.read_bytes().decode())
            step, rank, writer = int(m["step"]), int(m["rank"]), int(m["writer"])
            good = m["format"] == "jaxdist-local-v1" and marker.name == f"r{rank}.w{writer}.json"
            good &= marker.parent.name == str(step)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # named by LocalTier._available
        if not good or m.get("global") != gsig or m.get("signature") == sig or "entries" not in m:
            continue
        if tier.not_before and marker.stat().st_mtime < tier.not_before:
            continue
        data = marker.with_name(marker.name[: -len(".json")] + ".bin")
        try:
            if data.stat().st_size != m["bytes"]:
                continue
        except OSError:
            continue
        entry = found.setdefault((step, str(m["signature"])), {"num": int(m["num"]), "ranks": {}})
        entry["ranks"][rank] = (data, m)
    return found


def _layout_id(layout: str) -> int:
    return int(layout[:15], 16)


def restore_resharded(tier: LocalTier, abstract_state: Any, newer_than: int = -1) -> tuple[Any, dict] | None:
    """(state, meta) of the newest local step of another layout that the group's files cover, rebuilt on
    ``abstract_state``'s layout; None when there is none newer than ``newer_than`` (collective)."""
    t0 = time.perf_counter()
    num, me = tier.num, tier.rank
    gsig, sig = global_signature(abstract_state), signature(abstract_state)
    found = _scan(tier, gsig, sig)
    mine = sorted((k for k in found if k[0] > newer_than), reverse=True)[:CANDIDATES]
    # checksums of the candidates' files: a damaged file is no piece (decided before the group agrees)
    pieces_of: dict[tuple[int, str], dict[int, dict[tuple[str, Any], np.ndarray]]] = {}
    metas: dict[tuple[int, str], dict] = {}
    for key in mine:
        for rank, (path, m) in sorted(found[key]["ranks"].items()):
            raw = np.fromfile(path, np.uint8)
            if zlib.crc32(raw) != m["crc32"]:
                log.warning("local checkpoint file %s does not match its checksum; not using it", path)
                continue
            entries = [
                Entry(n, tuple((int(a), int(b)) for a, b in idx), tuple(int(b) - int(a) for a, b in idx), np.dtype(d))
                for n, idx, d in m["entries"]
            ]
            meta, arrays = unpack(raw, entries)
            pieces_of.setdefault(key, {})[rank] = arrays
            metas[key] = meta
    mine = [k for k in mine if k in pieces_of]
    widest = int(allgather_rows(num, np.array([max([found[k]["num"] for k in mine] or [0])]))[:, 0].max())
    if widest == 0:
        return None
    words = -(-widest // 63)
    table = np.full((CANDIDATES, 3 + words), -1, np.int64)
    for i, key in enumerate(mine):
        mask = np.zeros(words, np.int64)
        for rank in pieces_of[key]:
            mask[rank // 63] |= np.int64(1) << np.int64(rank % 63)
        table[i, :3] = key[0], _layout_id(key[1]), found[key]["num"]
        table[i, 3:] = mask
    everyone = allgather_rows(num, table.reshape(-1)).reshape(num, CANDIDATES, 3 + words)
    cover: dict[tuple[int, int, int], np.ndarray] = {}
    for row in everyone.reshape(-1, 3 + words):
        if row[0] < 0:
            continue
        k = (int(row[0]), int(row[1]), int(row[2]))
        cover[k] = cover.get(k, np.zeros(words, np.int64)) | row[3:]
    whole = [
        k
        for k, mask in cover.items()
        if all(int(mask[r // 63]) >> (r % 63) & 1 for r in range(k[2]))  # every old rank somewhere
    ]
    if not whole:
        return None
    step, layout_id, old_num = max(whole)
    key = next((k for k in mine if k[0] == step and _layout_id(k[1]) == layout_id), None)
    held: dict[tuple[str, Any], np.ndarray] = {}
    for arrays in (pieces_of.get(key, {}) if key else {}).values():
        held.update(arrays)
    meta = metas.get(key) if key else None

    # who holds what: a catalogue of piece hashes
    hashes = {_piece_hash(n, idx): (n, idx) for n, idx in held}
    longest = int(allgather_rows(num, np.array([len(hashes)]))[:, 0].max())
    row = np.zeros(longest + 1, np.int64)
    row[0] = len(hashes)
    row[1 : 1 + len(hashes)] = sorted(hashes)
    cat = allgather_rows(num, row)
    holders: dict[int, list[int]] = {}
    for p in range(num):
        for h in cat[p, 1 : 1 + int(cat[p, 0])]:
            holders.setdefault(int(h), []).append(p)

    new_entries = {q: held_pieces(abstract_state, q) for q in range(num)}
    arrays: dict[tuple[str, Any], np.ndarray] = {}
    filled: dict[tuple[str, Any], int] = {}
    for e in new_entries[me]:
        buf = np.empty(e.shape, e.dtype)
        arrays[(e.name, e.index)], filled[(e.name, e.index)] = buf, 0
        for (n, idx), data in held.items():
            if n == e.name and (r := _intersect(idx, e.index)) is not None:
                buf[_local(r, e.index)] = data[_local(r, idx)]
                filled[(e.name, e.index)] += _volume(r)

    # what this process sends to each other one: parts of the pieces it is the chosen holder of
    items: dict[int, list[list[Any]]] = {q: [] for q in range(num)}
    parts: dict[int, list[np.ndarray]] = {q: [] for q in range(num)}
    for h, (n, idx) in hashes.items():
        hs = holders[h]
        for q in range(num):
            if q == me or q in hs or hs[(h + q) % len(hs)] != me:
                continue
            for e in new_entries[q]:
                if e.name == n and (r := _intersect(idx, e.index)) is not None:
                    items[q].append([n, [list(x) for x in e.index], [list(x) for x in r]])
                    parts[q].append(np.ascontiguousarray(held[(n, idx)][_local(r, idx)]))
    payloads = {q: pack({"meta": meta, "items": items[q]}, parts[q]) if items[q] else None for q in range(num)}
    sizes = allgather_rows(num, np.array([0 if payloads[q] is None else payloads[q].size for q in range(num)]))
    dtypes = {name: np.dtype(leaf.dtype) for name, leaf in named_leaves(abstract_state)}
    moved = 0
    for k in range(1, num):
        if not any(sizes[p, (p + k) % num] for p in range(num)):
            continue
        send = payloads[(me + k) % num]
        got = tier._roll(np.zeros(0, np.uint8) if send is None else send, k)
        if got.size == 0:
            continue
        moved += int(got.size)
        head = _unpack_items(got)
        meta = meta or head["meta"]
        off = head["offset"]
        for n, eidx, r in head["items"]:
            eidx, r = tuple(map(tuple, eidx)), tuple(map(tuple, r))
            shape = tuple(b - a for a, b in r)
            nbytes = _volume(r) * dtypes[n].itemsize
            arrays[(n, eidx)][_local(r, eidx)] = got[off : off + nbytes].view(dtypes[n]).reshape(shape)
            filled[(n, eidx)] += _volume(r)
            off += nbytes
    short = [k for k, v in filled.items() if v != _volume(k[1])]
    if short or meta is None:
        raise RuntimeError(
            f"resharding local step {step} left {len(short)} shard(s) of process {me} unfilled "
            f"(first: {short[:1]}): a bug in jaxdist.checkpoint.local_reshard"
        )
    state = build_state(abstract_state, arrays)
    log.info(
        "restored local step %d of another layout (%d processes) onto this one (%d) in %.2f s; %d bytes received",
        step,
        old_num,
        num,
        time.perf_counter() - t0,
        moved,
    )
    return state, meta


def _unpack_items(payload: np.ndarray) -> dict[str, Any]:
    n = int.from_bytes(payload[:8].tobytes(), "little")
    head = json.loads(payload[8 : 8 + n].tobytes())
    return {"meta": head["meta"], "items": head["items"], "offset": 8 + n}


def drop_newer(directory: Path, step: int) -> None:
    """Delete every file (any writer, any layout) of this node's steps after ``step``: an abandoned future."""
    for folder in directory.iterdir():
        if folder.name.isdigit() and int(folder.name) > step:
            for f in folder.iterdir():
                f.unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:
                pass

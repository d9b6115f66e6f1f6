"""The batch list without a model: ids, operations, journal files, reader, additions, resume checks, CLI."""

import hashlib
import json
import os
import time

import numpy as np
import pytest
from scipy import stats

from jaxdist import cli
from jaxdist.config import ConfigError
from jaxdist.data import EOS, BatchListError, Journal, RunBatchList, add_data, format_id, parse_id, replay_order
from jaxdist.data.audit import check_exactly_once, verify
from jaxdist.data.batchlist import (
    add_order,
    create_order,
    epoch_ids,
    epoch_order,
    insert_order,
    make_version,
    pack_ids,
    unpack_ids,
)
from jaxdist.data.catalog import config_entry

B, L, SEED = 4, 8, 3
BASE = np.arange(B * L * 20 + 5, dtype=np.uint32)  # token t == its position: 20 batches, 1 window left over


def open_run(tmp_path, tokens=BASE, seed=SEED, **kw) -> RunBatchList:
    return RunBatchList(tmp_path, tokens, "synthetic", seed, B, L, **kw)


def write_text(path, n_bytes, salt=0):
    rng = np.random.default_rng(salt)
    path.write_bytes(bytes(rng.integers(32, 127, n_bytes, dtype=np.uint8)))
    return path


# --------------------------------------------------------------------------- ids and operations


def test_ids_pack_and_print():
    ids = pack_ids([0, 3, 32767], [0, 7, 65535], [0, 11, 2**32 - 1])
    s, e, i = unpack_ids(ids)
    assert s.tolist() == [0, 3, 32767] and e.tolist() == [0, 7, 65535] and i.tolist() == [0, 11, 2**32 - 1]
    assert format_id(ids[1]) == "3:7:11" and parse_id("3:7:11") == ids[1] == (3 << 48) + (7 << 32) + 11


def test_operations_follow_their_rules():
    base = config_entry(BASE, "synthetic", SEED)
    assert base.batches_per_epoch(B, L) == 20
    order = create_order(base, B, L, SEED)
    np.testing.assert_array_equal(order, np.random.default_rng(SEED).permutation(pack_ids(0, 0, np.arange(20))))

    new = pack_ids(1, 0, np.arange(6))
    with_used = np.concatenate([new, order[:2]])  # two ids already trained: must not come back
    added = add_order(order, 7, with_used, 11)
    np.testing.assert_array_equal(added[:7], order[:7])
    np.testing.assert_array_equal(added[7:], np.random.default_rng(11).permutation(np.concatenate([order[7:], new])))
    assert len(added) == 26 and len(set(added.tolist())) == 26
    # The rule of additions since format /2: the new ids inserted among the unused ones, which keep their order.
    inserted, delta = insert_order(order, 7, new, 11)
    np.testing.assert_array_equal(inserted[:7], order[:7])
    is_new = np.isin(inserted, new)
    np.testing.assert_array_equal(inserted[~is_new], order)
    np.testing.assert_array_equal(np.flatnonzero(is_new), delta.at)
    np.testing.assert_array_equal(inserted[delta.at], delta.ids)
    assert sorted(delta.ids.tolist()) == sorted(new.tolist()) and delta.at.min() >= 7
    np.testing.assert_array_equal(delta.apply(order), inserted)

    ext = epoch_order(added, (base, base.__class__(**{**base.to_dict(), "id": 1})), B, L, [1, 2])
    np.testing.assert_array_equal(ext[:26], added)
    s, e, _ = unpack_ids(ext[26:])
    assert sorted(zip(s.tolist(), e.tolist())) == sorted([(0, 1)] * 20 + [(1, 1)] * 20)  # next epoch of each


def test_every_placement_of_an_insertion_is_equally_likely():
    """Brute force: 2 new ids among 3 unused ones can end in 5!/3! = 20 orders (the unused keep theirs); over
    6,000 seeds each comes about 300 times (chi-square p > 0.001), as a reshuffle of a random order would give."""
    old = pack_ids(0, 0, np.arange(5))
    new = pack_ids(1, 0, np.arange(2))
    seen = {}
    for seed in range(6000):
        tail = tuple(insert_order(old, 2, new, seed)[0][2:].tolist())
        seen[tail] = seen.get(tail, 0) + 1
    assert len(seen) == 20
    assert stats.chisquare(list(seen.values())).pvalue > 0.001


def test_new_data_spreads_within_the_binomial_band():
    """After an addition, new-data batches per window of W follow the binomial 99% band (several seeds)."""
    old = pack_ids(0, 0, np.arange(1000))
    new = pack_ids(1, 0, np.arange(200))
    splice, W = 200, 40  # 800 unused old + 200 new: share p = 0.2, 25 windows per seed
    p = 200 / 1000
    lo, hi = stats.binom.ppf(0.005, W, p), stats.binom.ppf(0.995, W, p)
    counts = []
    for seed in range(12):
        rest = insert_order(old, splice, new, seed)[0][splice:]
        counts += [int(np.sum(unpack_ids(rest[k : k + W])[0] == 1)) for k in range(0, len(rest), W)]
    counts = np.array(counts)
    outside = np.mean((counts < lo) | (counts > hi))
    assert counts.sum() == 12 * 200  # every new batch placed, once
    assert outside <= 0.01, (outside, lo, hi)
    assert abs(counts.mean() / W - p) < 0.01
    # Control: appending the new data instead of shuffling it in puts every window outside the band.
    appended = np.concatenate([old[splice:], new])
    naive = np.array([np.sum(unpack_ids(appended[k : k + W])[0] == 1) for k in range(0, 1000, W)])
    assert np.mean((naive < lo) | (naive > hi)) == 1.0


# --------------------------------------------------------------------------- reader


def test_reader_reads_the_windows_the_id_names(tmp_path):
    run = open_run(tmp_path)
    bl, reader = run.current, run.reader
    assert len(bl) == 20 and bl.op == {"kind": "create", "seed": SEED, "splice": 0}
    n_windows = (len(BASE) - 1) // L
    seen = []
    for pos in range(len(bl)):
        s, e, i = (int(x) for x in unpack_ids(bl.order[pos]))
        perm = np.random.default_rng([SEED, s, e]).permutation(n_windows)
        want = np.stack([BASE[w * L : w * L + L + 1] for w in perm[i * B : (i + 1) * B]]).astype(np.int32)
        np.testing.assert_array_equal(reader.batch(pos), want)
        np.testing.assert_array_equal(reader.rows(pos, slice(1, 3)), want[1:3])
        seen += (want[:, 0] // L).tolist()
    assert len(seen) == len(set(seen)) == 80  # 80 of the 81 windows, each once per epoch


# --------------------------------------------------------------------------- journal


def test_journal_is_append_only_and_atomic(tmp_path):
    run = open_run(tmp_path)
    j = run.journal
    assert j.versions() == [1] and not [n for n in os.listdir(j.dir) if n.endswith(".tmp")]
    again = Journal(tmp_path).load()
    np.testing.assert_array_equal(again.order, run.current.order)
    assert again.checksum == run.current.checksum and len(again.checksum) == 64
    with pytest.raises(AssertionError, match="never rewritten"):
        j.write(run.current)


@pytest.mark.parametrize("damage", ["truncate", "alter_seed", "alter_order"])
def test_a_damaged_version_is_refused_and_the_previous_one_stays_usable(tmp_path, damage):
    run = open_run(tmp_path)
    add_data(tmp_path, [write_text(tmp_path / "a.txt", 400)], seed=1)
    assert run.boundary(5) and run.version == 2
    path = run.journal.path(2)
    text = path.read_text()
    if damage == "truncate":
        path.write_text(text[: len(text) // 2])
        why = "it is not complete JSON, so it was cut short or altered"
    elif damage == "alter_seed":
        path.write_text(text.replace('"seed": 1,', '"seed": 2,', 1))
        why = "its checksum does not match its content, so it was altered"
    else:
        doc = json.loads(text)
        ids = doc["delta"]["ids"]  # version 2 holds its change from version 1: the ids it inserts
        doc["delta"]["ids"] = ids[:10] + ("A" if ids[10] != "A" else "B") + ids[11:]
        path.write_text(json.dumps(doc))
        why = "its checksum does not match its content"
    msg = f"batch list version 2 ({path}) is damaged: {why}"
    with pytest.raises(BatchListError, match="damaged") as e:
        Journal(tmp_path).load()
    assert str(e.value).startswith(msg) and "continue from version 1, which stays usable" in str(e.value)
    with pytest.raises(ConfigError, match="version 2 .* is damaged"):
        open_run(tmp_path)  # the trainer refuses it too
    np.testing.assert_array_equal(Journal(tmp_path).load(1).order, run.journal.load(1).order)
    ok, lines = verify(tmp_path)
    assert not ok and lines[0] == "version 1: ok (create, 20 batches)" and lines[1].startswith("version 2: DAMAGED")
    path.rename(tmp_path / "v2.aside")
    assert open_run(tmp_path).version == 1


# --------------------------------------------------------------------------- additions


def test_addition_becomes_the_next_version_at_the_boundary(tmp_path):
    run = open_run(tmp_path)
    v1 = run.current
    got = add_data(tmp_path, [write_text(tmp_path / "a.txt", 8 * B * L)], seed=42)  # 8 whole batches
    assert got["batches"] == 8 and got["seed"] == 42
    assert run.boundary(3)  # applied at this boundary
    bl = run.current
    assert bl.version == 2 and bl.parent == 1 and len(bl) == 28
    assert bl.op == {"kind": "add", "mix": "insert", "seed": 42, "splice": 3, "sources": [1], "request": got["request"]}
    np.testing.assert_array_equal(bl.order, insert_order(v1.order, 3, epoch_ids(bl.sources[1], 0, B, L), 42)[0])
    assert bl.sources[1].kind == "text" and bl.sources[1].n_tokens == 8 * B * L + 1  # bytes + EOS
    assert os.listdir(run.journal.requests_dir / "applied") == [got["request"]]
    assert not run.boundary(4) and run.version == 2  # nothing new
    # An added batch reads the windows its id names from the file's bytes (then EOS).
    pos = int(np.flatnonzero(unpack_ids(bl.order)[0] == 1)[0])
    _, e, i = (int(x) for x in unpack_ids(bl.order[pos]))
    toks = np.append(np.frombuffer((tmp_path / "a.txt").read_bytes(), np.uint8).astype(np.int32), EOS)
    perm = np.random.default_rng([42, 1, e]).permutation((len(toks) - 1) // L)
    want = np.stack([toks[w * L : w * L + L + 1] for w in perm[i * B : (i + 1) * B]])
    np.testing.assert_array_equal(run.reader.batch(pos), want)
    np.testing.assert_array_equal(replay_order(run.journal), bl.order)


def test_a_crash_between_version_and_request_move_applies_it_once(tmp_path):
    run = open_run(tmp_path)
    got = add_data(tmp_path, [write_text(tmp_path / "a.txt", 3 * B * L)], seed=1)
    req = run.journal.requests_dir / got["request"]
    saved = req.read_bytes()
    run.boundary(2)
    req.write_bytes(saved)  # as if the trainer died before moving it to applied/
    run2 = open_run(tmp_path)
    assert not run2.boundary(2) and run2.version == 2 and not req.exists()


def test_bad_additions_are_refused_with_the_path_named(tmp_path):
    with pytest.raises(BatchListError, match="has no batch list .* start training once"):
        add_data(tmp_path, [tmp_path])
    run = open_run(tmp_path)
    missing = tmp_path / "nope" / "x.txt"
    with pytest.raises(ConfigError, match=f"data path '{missing}' does not exist"):
        add_data(tmp_path, [missing])
    small = write_text(tmp_path / "small.txt", B * L - 1)
    with pytest.raises(ConfigError, match=r"'.*small.txt' holds 32 tokens, fewer than one batch of 4 sequences"):
        add_data(tmp_path, [small])
    a = write_text(tmp_path / "a.txt", 2 * B * L)
    add_data(tmp_path, [a])
    with pytest.raises(ConfigError, match="same data .* as the pending addition"):
        add_data(tmp_path, [a])
    run.boundary(0)
    copy = tmp_path / "copy.txt"
    copy.write_bytes(a.read_bytes())
    with pytest.raises(
        ConfigError,
        match=r"'.*copy.txt' holds the same data \(fingerprint [0-9a-f]{12}\) as "
        r"source 1 \('.*a.txt'\)",
    ):
        add_data(tmp_path, [copy])  # same content, other name
    b = write_text(tmp_path / "b.txt", 2 * B * L, salt=1)
    with pytest.raises(ConfigError, match="given earlier in the same call"):
        add_data(tmp_path, [b, b])
    # A registered source that disappears is named when the run opens.
    a.unlink()
    with pytest.raises(BatchListError, match=f"source 1 of the batch list, '{a}', is missing"):
        open_run(tmp_path)


def test_the_list_grows_by_an_epoch_when_spent(tmp_path):
    run = open_run(tmp_path)
    assert not run.boundary(19)
    assert run.boundary(20) and run.version == 2 and len(run.current) == 40
    s, e, i = unpack_ids(run.current.order[20:])
    assert set(s.tolist()) == {0} and set(e.tolist()) == {1} and sorted(i.tolist()) == list(range(20))
    assert run.current.op["kind"] == "epoch"
    np.testing.assert_array_equal(replay_order(run.journal, 2), run.current.order)


# --------------------------------------------------------------------------- resume checks


def test_resume_checks_version_and_cursor(tmp_path):
    run = open_run(tmp_path)
    meta = run.checkpoint_meta(6)
    assert meta["version"] == 1 and meta["cursor"] == meta["position"] == 6
    assert run.journal.read_cursor()["cursor"] == 6
    open_run(tmp_path).resume(meta, 6)  # fine
    with pytest.raises(ConfigError, match="written without a batch list"):
        run.resume({"sampler": "windows-v1"}, 6)
    with pytest.raises(ConfigError, match="version 7, which .* lacks: copy the run's batchlist folder"):
        run.resume({**meta, "version": 7}, 6)
    with pytest.raises(ConfigError, match="its order differs"):
        run.resume({**meta, "order_sha256": "0" * 64}, 6)
    # A checkpoint copied into a fresh run folder: version 1 is rebuilt from the config and fits.
    fresh = tmp_path / "fresh"
    open_run(fresh).resume(meta, 6)
    # A version that reorders already-trained positions cannot continue that checkpoint.
    bl = run.current
    v2 = make_version(bl, {"kind": "add", "seed": 0, "splice": 2, "sources": []}, bl.sources, B, L)
    assert not np.array_equal(v2.order[:6], bl.order[:6])
    run.journal.write(v2)
    with pytest.raises(BatchListError, match="changes batches before position 6"):
        open_run(tmp_path).resume(meta, 6)


def test_config_changes_are_refused(tmp_path):
    open_run(tmp_path)
    with pytest.raises(ConfigError, match="batches of 4 sequences of 8 tokens, but the config has train.batch_size=8"):
        RunBatchList(tmp_path, BASE, "synthetic", SEED, 8, L)
    with pytest.raises(ConfigError, match="made with data.seed=3 but the config has 4"):
        open_run(tmp_path, seed=4)
    with pytest.raises(BatchListError, match="has changed since it was registered"):
        open_run(tmp_path, tokens=BASE[:-8])


# --------------------------------------------------------------------------- log check and CLI


def _log(run_dir, rows):
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step, bid in rows:
            f.write(
                json.dumps({"kind": "train", "step": step, "loss": 1.0, "batch_id": bid, "batch_version": 1}) + "\n"
            )


def test_exactly_once_reads_the_lineage_of_the_log(tmp_path):
    run = open_run(tmp_path)
    ids = [format_id(x) for x in run.current.order]
    _log(tmp_path, [(s, ids[s - 1]) for s in range(1, 8)])  # killed after step 7
    _log(tmp_path, [(s, ids[s - 1]) for s in range(5, 11)])  # resumed from the step-4 checkpoint
    r = check_exactly_once(tmp_path)
    assert r == {
        "trained": 10,
        "duplicates": 0,
        "missing": 0,
        "misplaced": 0,
        "gaps": 0,
        "unused": 10,
        "version": 1,
        "ok": True,
    }
    _log(tmp_path, [(11, ids[2])])  # a batch trained twice
    r = check_exactly_once(tmp_path)
    assert (r["duplicates"], r["missing"], r["misplaced"], r["ok"]) == (1, 1, 1, False)


def test_cli_show_add_verify(tmp_path, capsys):
    run = open_run(tmp_path)
    text = write_text(tmp_path / "new.txt", 5 * B * L)
    assert cli.main(["data", "add", str(tmp_path), str(text), "--seed", "9"]) == 0
    assert "queued 1 source(s), 5 batches, seed 9" in capsys.readouterr().out
    assert cli.main(["data", "add", str(tmp_path), str(text)]) == 2
    assert "holds the same data" in capsys.readouterr().err
    assert cli.main(["data", "add", str(tmp_path), str(tmp_path / "gone.txt")]) == 2
    assert f"data path '{tmp_path / 'gone.txt'}' does not exist" in capsys.readouterr().err
    run.boundary(4)
    assert cli.main(["data", "show", str(tmp_path), "--head", "3"]) == 0
    out = capsys.readouterr().out
    assert "version 2 of [1, 2], 25 batches of 4 x 9 tokens" in out
    assert f"1: text     {text}  161 tokens, 5 batches/epoch, 20.0% of the list" in out
    assert "next batches: " + ", ".join(format_id(x) for x in run.current.order[:3]) in out
    assert cli.main(["data", "verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "batch list: ok"
    text.write_bytes(b"changed" * 30)
    assert cli.main(["data", "verify", str(tmp_path)]) == 1
    assert "has changed since it was registered" in capsys.readouterr().out
    assert cli.main(["data", "show", str(tmp_path / "nope")]) == 2
    assert "run directory" in capsys.readouterr().err


# --------------------------------------------------------------------------- cost as the journal grows


def _journal_of(tmp_path, additions: int):
    """A run whose journal holds version 1 and ``additions`` addition versions, each applied at a boundary."""
    run = open_run(tmp_path)
    for k in range(additions):
        add_data(tmp_path, [write_text(tmp_path / f"add{k}.txt", 2 * B * L, salt=k + 1)], seed=k)
        assert run.boundary(k)
    return run


def _decodes(monkeypatch) -> list[int]:
    """A counter of the batch-list files decoded (every ``Journal.load`` decodes one)."""
    import jaxdist.data.journal as journal_module

    count = [0]
    real = journal_module.decode

    def counted(data, where, *rest):
        count[0] += 1
        return real(data, where, *rest)

    monkeypatch.setattr(journal_module, "decode", counted)
    return count


@pytest.mark.parametrize("additions", [3, 24])
def test_verify_and_additions_read_each_version_a_bounded_number_of_times(tmp_path, monkeypatch, additions):
    """Counted, not timed: applying A additions decodes O(A) version files (it read every version at every
    addition: A^2/2), and `data verify` decodes each version at most twice (it replayed each from version 1:
    A^2/2).  With 1,000 additions to a run of 10^6 steps that was hours; see benchmarks/scale.py.  A whole order
    every 4 versions here: an addition reads the files since the last one for their sources (at most 4)."""
    import jaxdist.data.batchlist as batchlist_module

    monkeypatch.setattr(batchlist_module, "WHOLE_EVERY", 4)
    count = _decodes(monkeypatch)
    run = _journal_of(tmp_path, additions)
    assert run.version == additions + 1
    assert count[0] <= (3 + 4) * additions + 3, count[0]  # quadratic: 24 -> 300 (plus the writes' own)
    count[0] = 0
    ok, lines = verify(tmp_path)
    assert ok, lines
    assert sum(line.endswith("batches)") and ": ok (" in line for line in lines) == additions + 1
    assert count[0] <= 2 * (additions + 1) + 2, count[0]


def test_verify_still_names_a_version_whose_order_is_not_its_replay(tmp_path):
    """The one-pass replay check (each version against its parent's order) catches what the full replay did:
    a version re-written with another order (and a valid checksum) is BAD, its children still checked."""
    from jaxdist.data.batchlist import encode

    run = _journal_of(tmp_path, 3)
    bl = run.journal.load(2)
    import dataclasses

    swapped = bl.order.copy()
    swapped[-2:] = swapped[-2:][::-1]  # two unused positions swapped: the prefix and the ids stay right
    data, _ = encode(dataclasses.replace(bl, order=swapped, depth=0))  # stored whole
    run.journal.path(2).write_bytes(data)
    ok, lines = verify(tmp_path)
    assert not ok
    v = {line.split(":")[0]: line for line in lines if line.startswith("version ")}
    assert "BAD: replaying its operations gives another order" in v["version 2"]
    assert ": ok (" in v["version 1"]
    assert "version 3" in v and "version 4" in v


# --------------------------------------------------------------------------- the format and its pieces, directly


def _entry(**kw):
    from jaxdist.data.batchlist import SourceEntry

    base = dict(id=0, kind="tokens", name="t", path="t.bin", token_dtype="uint16", n_tokens=201, fingerprint="f")
    return SourceEntry(**{**base, "quick": "q", "seed": 5, "added_in": 1, **kw})


def test_the_token_digest_is_murmurs_finaliser_summed_over_positions():
    """Against a per-token reference in Python integers (mod 2**32), and the same bits from jax.numpy."""
    import jax.numpy as jnp

    from jaxdist.data.batchlist import token_digest

    tokens = np.random.default_rng(0).integers(0, 70000, (3, 5)).astype(np.int32)
    m = 0xFFFFFFFF
    want = 0
    for r in range(3):
        for c in range(5):
            x = int(tokens[r, c]) ^ (((r * 5 + c) * 0x9E3779B9) & m)
            x ^= x >> 16
            x = (x * 0x85EBCA6B) & m
            x ^= x >> 13
            x = (x * 0xC2B2AE35) & m
            x ^= x >> 16
            want = (want + x) & m
    got = token_digest(tokens)
    assert got.dtype == np.uint32 and int(got) == want
    assert int(token_digest(jnp.asarray(tokens), jnp)) == want


def test_ids_out_of_range_are_refused():
    for s, e, i in ((1 << 15, 0, 0), (0, 1 << 16, 0), (0, 0, 1 << 32), (-1, 0, 0), (0, -1, 0), (0, 0, -1)):
        with pytest.raises(AssertionError):
            pack_ids(s, e, i)
    top = pack_ids((1 << 15) - 1, (1 << 16) - 1, (1 << 32) - 1)
    assert [int(a) for a in unpack_ids(top)] == [(1 << 15) - 1, (1 << 16) - 1, (1 << 32) - 1]


def test_windows_and_rows_per_source():
    assert _entry(n_tokens=201).n_windows(100) == 2  # 3 windows would need 301 tokens: neighbours share one
    assert _entry(n_tokens=200).n_windows(100) == 1
    assert _entry(n_tokens=1).n_windows(100) == 0
    assert _entry(n_tokens=201, packing="documents", rows=7).n_windows(100) == 7  # packed rows, not windows


def test_a_version_file_round_trips_and_its_checksum_is_over_compact_sorted_json(tmp_path):
    from jaxdist.data.batchlist import FORMAT, decode, encode

    t0 = time.time()
    bl = make_version(None, {"kind": "create", "seed": [1, 2]}, (_entry(),), 4, 10)
    assert t0 <= bl.created <= time.time()
    with pytest.raises(ValueError):
        bl.order[0] = 1  # a version's order is read-only
    data, checksum = encode(bl)
    body = json.loads(data)
    body.pop("checksum")
    assert checksum == hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    back = decode(data, "v1")
    assert back.order.dtype == np.int64 and np.array_equal(back.order, bl.order) and back.created == bl.created
    assert (back.version, back.parent, back.op, back.sources, back.checksum) == (1, None, bl.op, bl.sources, checksum)
    with pytest.raises(ValueError):
        back.order[0] = 1
    with pytest.raises(IndexError, match=f"position {len(bl)} is outside batch list version 1 of {len(bl)} batches"):
        bl.id_at(len(bl))
    assert bl.id_at(len(bl) - 1) == bl.order[-1]

    def sealed(doc):
        doc = {k: v for k, v in doc.items() if k != "checksum"}
        sha = hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        return json.dumps({**doc, "checksum": sha}).encode()

    with pytest.raises(ValueError, match=f"^not a {FORMAT} file$"):
        decode(b"[1, 2]", "v")
    with pytest.raises(ValueError, match="checksum does not match"):
        decode(json.dumps(body).encode(), "v")  # no checksum at all
    with pytest.raises(ValueError, match="^its order does not match its recorded hash$"):
        decode(sealed({**body, "order_sha256": "0" * 64}), "v")


def test_an_epoch_starts_every_source_at_its_next_epoch_and_a_new_one_at_0():
    from jaxdist.data.batchlist import epoch_seed

    a, b = _entry(id=0, n_tokens=801), _entry(id=1, n_tokens=401)
    parent = create_order(a, 2, 100, 1)  # epoch 0 of a only
    order = epoch_order(parent, (a, b), 2, 100, 3)
    src, ep, _ = unpack_ids(order[len(parent) :])
    assert sorted(zip(src.tolist(), ep.tolist())) == [(0, 1)] * 4 + [(1, 0)] * 2
    assert epoch_seed(7, 3) == [7, 0x45504F43, 3]  # fixed: a run's replayed epochs must not change


def test_an_added_source_keeps_its_ids_exact_whatever_its_number():
    """Ids are int64 up to 2**63 (source << 48): a source numbered 40 is past float64's exact integers."""
    a, b = _entry(id=0, n_tokens=801), _entry(id=40, n_tokens=401)
    v1 = make_version(None, {"kind": "create", "seed": 1}, (a,), 2, 100)
    v2 = make_version(v1, {"kind": "add", "seed": 3, "splice": 1, "sources": [1]}, (a, b), 2, 100)
    assert v2.order.dtype == np.int64 and v2.order[0] == v1.order[0]
    assert sorted(int(x) for x in v2.order[1:]) == sorted(
        [int(x) for x in v1.order[1:]] + [int(pack_ids(40, 0, i)) for i in range(2)]
    )


def test_a_source_entry_round_trips_and_an_unknown_operation_is_named():
    from jaxdist.data.batchlist import SourceEntry, derive

    e = _entry(packing="documents", rows=7)
    assert SourceEntry.from_dict(e.to_dict()) == e
    old = {k: v for k, v in e.to_dict().items() if k not in ("packing", "rows")}  # a list written before them
    assert SourceEntry.from_dict(old) == _entry()
    v1 = make_version(None, {"kind": "create", "seed": 1}, (e,), 2, 100)
    with pytest.raises(ValueError, match="^unknown batch list operation 'merge'$"):
        derive(v1, {"kind": "merge", "seed": 1}, (e,), 2, 100)

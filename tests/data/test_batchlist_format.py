"""The batch list's files: a list of format /1 (every version a whole order) goes on under format /2 (changes),
and the journal's bytes grow with what the additions add, not with the list times the additions (counted)."""

import base64
import hashlib
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from jaxdist.data import BatchListError, RunBatchList, add_data, replay_order
from jaxdist.data.audit import verify
from jaxdist.data.batchlist import FORMAT, WHOLE_EVERY, epoch_ids, insert_order
from jaxdist.data.items import ItemSource
from jaxdist.data.journal import Journal

FIXTURE = Path(__file__).parent / "fixtures" / "batchlist-format1"  # written by jaxdist at 164bec1: create, add, epoch


def _items(n, salt):
    return [{"x": np.array([salt * 1000 + i], np.int32)} for i in range(n)]


def _format1_run(tmp_path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / "run")
    return tmp_path / "run"


def _docs(run: Path) -> dict[int, dict]:
    return {int(p.name[1:7]): json.loads(p.read_text()) for p in sorted((run / "batchlist").glob("v*.json"))}


def test_a_list_of_format_1_loads_verifies_and_takes_a_new_addition_as_a_change(tmp_path):
    run_dir = _format1_run(tmp_path)
    assert {d["format"] for d in _docs(run_dir).values()} == {"jaxdist-batchlist/1"}
    journal = Journal(run_dir)
    assert [journal.read(v).op["kind"] for v in (1, 2, 3)] == ["create", "add", "epoch"]
    assert "mix" not in journal.read(2).op  # format /1's add reshuffled every unused id, and replays so
    np.testing.assert_array_equal(replay_order(journal), journal.load().order)
    ok, lines = verify(run_dir)
    assert ok, lines
    assert lines[:3] == [
        "version 1: ok (create, 12 batches)",
        "version 2: ok (add, 18 batches)",
        "version 3: ok (epoch, 36 batches)",
    ]

    base, extra = ItemSource(_items(48, 0), name="base"), ItemSource(_items(24, 1), name="extra")
    run = RunBatchList(run_dir, base, "base", 7, 4, 8, added_items=[extra])
    v3 = run.current
    assert v3.version == 3 and len(v3) == 36
    more = ItemSource(_items(16, 2), name="more")
    run.add_items(more, seed=5)
    assert run.boundary(20) and run.version == 4
    doc = _docs(run_dir)[4]
    assert doc["format"] == FORMAT and "order" not in doc and doc["depth"] == 1
    assert [s["name"] for s in doc["sources"]] == ["more"] and doc["n_sources"] == 3
    want = insert_order(v3.order, 20, epoch_ids(run.current.sources[2], 0, 4, 8), 5)[0]
    np.testing.assert_array_equal(run.current.order, want)
    np.testing.assert_array_equal(Journal(run_dir).load().order, want)  # a fresh reader builds it from version 3
    again = RunBatchList(run_dir, base, "base", 7, 4, 8, added_items=[extra, more])
    np.testing.assert_array_equal(again.current.order, want)
    assert [s.name for s in again.current.sources] == ["base", "base", "extra", "more"][1:]
    ok, lines = verify(run_dir)
    assert ok and lines[3] == "version 4: ok (add, 40 batches)", lines
    np.testing.assert_array_equal(replay_order(Journal(run_dir)), want)


def test_a_whole_order_of_format_1_that_is_not_its_replay_is_named_and_the_next_ones_still_replay(tmp_path):
    """Format /1 keeps every order whole: version 1 re-written with its last two ids swapped (its checksum
    valid) is BAD, and versions 2 and 3, whose stored orders equal their replay from the operations (version 2
    kept only 3 of version 1's ids), are ok: version 2 is replayed from version 1's operation itself."""
    run_dir = _format1_run(tmp_path)
    path = run_dir / "batchlist" / "v000001.json"
    doc = json.loads(path.read_text())
    order = np.frombuffer(zlib.decompress(base64.b64decode(doc["order"])), "<i8").copy()
    order[-2:] = order[-2:][::-1]
    raw = order.astype("<i8").tobytes()
    doc["order"], doc["order_sha256"] = base64.b64encode(zlib.compress(raw)).decode(), hashlib.sha256(raw).hexdigest()
    doc.pop("checksum")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    path.write_text(json.dumps({**doc, "checksum": hashlib.sha256(canonical).hexdigest()}))
    ok, lines = verify(run_dir)
    assert Journal(run_dir).read(2).op["splice"] == 3
    assert not ok and lines[:3] == [
        "version 1: BAD: replaying its operations gives another order (create, 12 batches)",
        "version 2: ok (add, 18 batches)",
        "version 3: ok (epoch, 36 batches)",
    ]


def _text(path: Path, n_bytes: int, salt: int) -> Path:
    path.write_bytes(bytes(np.random.default_rng(salt).integers(32, 127, n_bytes, dtype=np.uint8)))
    return path


def _journal_bytes(tmp_path: Path, n_batches: int, additions: int) -> dict[int, int]:
    """Bytes of each version file of a run of ``n_batches`` batches (B=1, L=1) after ``additions`` additions of
    4 batches each, applied at every boundary."""
    tokens = np.arange(n_batches + 1, dtype=np.uint32) % 250
    run = RunBatchList(tmp_path, tokens, "synthetic", 3, 1, 1)
    for k in range(additions):
        add_data(tmp_path, [_text(tmp_path / f"a{k}.txt", 4, salt=k)], seed=k)  # 4 bytes + EOS: 4 batches
        assert run.boundary(k)
    journal = Journal(tmp_path)
    return {v: journal.path(v).stat().st_size for v in journal.versions()}


def test_the_journal_grows_with_the_batches_added_not_with_the_list_times_the_additions(tmp_path):
    """Counted in bytes: a version stored as its change holds the ids it inserts and their places, and only the
    sources it adds, so its file is the same size for a list of 2,000 batches as for one of 20,000, and the same
    for the 3rd addition as for the 70th; a whole order comes every WHOLE_EVERY versions.  (Every version held
    its whole order and every source before: 1,000 additions to 10^6 batches made gigabytes.)"""
    assert WHOLE_EVERY == 64
    small = _journal_bytes(tmp_path / "small", 2_000, 8)
    big = _journal_bytes(tmp_path / "big", 20_000, 70)
    assert big[1] > 5 * small[1]  # the whole order grows with the list
    for v in range(2, 10):
        assert big[v] < 1.15 * small[v] and big[v] < 2_500, (
            v,
            big[v],
            small[v],
        )  # a change (and its parent's, copied) does not
    changes = [n for v, n in big.items() if v not in (1, 2, WHOLE_EVERY + 1)]  # version 2 keeps no copy
    assert max(changes) < 1.2 * min(changes), changes  # nor with the additions before it
    assert big[WHOLE_EVERY + 1] > big[1]  # the 64th version after the first is whole again (with every source)
    docs = _docs(tmp_path / "big")
    assert [v for v, d in docs.items() if "order" in d] == [1, WHOLE_EVERY + 1]
    assert verify(tmp_path / "big")[0]


def test_one_damaged_file_is_rebuilt_from_the_copy_of_its_change_the_next_version_keeps(tmp_path, monkeypatch, caplog):
    """A version's file keeps its parent's change (operation, places and ids, added sources): a damaged file, a
    change or a whole order, is built from that copy, so the versions built on it stay readable (the trainer
    reopens the run); `data verify` still reports the damage.  Two damaged files in a row are named."""
    import jaxdist.data.batchlist as batchlist_module

    from .test_batchlist import _journal_of, open_run

    monkeypatch.setattr(batchlist_module, "WHOLE_EVERY", 4)  # whole orders at versions 1 and 5
    run = _journal_of(tmp_path, 7)
    docs = _docs(tmp_path)
    assert [v for v, d in docs.items() if "order" in d] == [1, 5] and "previous" not in docs[2]
    assert all(docs[v]["previous"]["version"] == v - 1 for v in range(3, 9))
    orders = {v: run.journal.load(v).order.copy() for v in range(1, 9)}
    for damaged in (3, 5):  # a change, a whole order
        path = run.journal.path(damaged)
        saved = path.read_bytes()
        path.write_bytes(saved[: len(saved) // 2])
        caplog.clear()
        journal = Journal(tmp_path)
        for v in range(1, 9):
            np.testing.assert_array_equal(journal.load(v).order, orders[v])
        assert f"batch list version {damaged} ({path}) is unreadable (it is not complete JSON" in caplog.text
        assert f"its change is read from the copy in version {damaged + 1}" in caplog.text
        np.testing.assert_array_equal(open_run(tmp_path).current.order, orders[8])
        ok, lines = verify(tmp_path)
        assert not ok
        mine = [line for line in lines if line.startswith(f"version {damaged}: ")]
        assert mine[0].startswith(f"version {damaged}: DAMAGED: batch list version {damaged} ")
        assert mine[1].startswith(
            f"version {damaged}: rebuilt from the copy of its change in version {damaged + 1}: ok ("
        )
        others = [line for line in lines if line.startswith("version ") and line not in mine]
        assert len(others) == 7 and all(": ok (" in line for line in others), others
        path.write_bytes(saved)
    for v in (3, 4):
        run.journal.path(v).write_bytes(b"{")
    np.testing.assert_array_equal(Journal(tmp_path).load().order, orders[8])  # built on version 5's whole order
    with pytest.raises(BatchListError) as e:
        Journal(tmp_path).load(4)
    assert str(e.value).startswith("batch list version 4 is built from version 3's order")
    assert f"batch list version 3 ({run.journal.path(3)}) is damaged: it is not complete JSON" in str(e.value)

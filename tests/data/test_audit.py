"""The data audit (jaxdist/data/audit.py) on hand-made run directories: every verdict and every line it prints.

The batch list is real (tests/data/test_batchlist.py's ``open_run``: 20 batches of 4 x 9 tokens, token t == its
position); the training logs are written here, with the faults each check exists for: a torn line, a resumed
attempt, two writers at once, a step logged twice, a batch trained twice, a gap, a wrong token digest.  The
expected values come from the definitions (the windows a batch id names, read from the tokens directly), not from
the code under test.
"""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from jaxdist.data import BatchListError, add_data, format_id
from jaxdist.data.audit import (
    check_exactly_once,
    describe,
    digest_problems,
    history_problems,
    read_records,
    replay_order,
    trained_batches,
    verify,
)
from jaxdist.data.batchlist import token_digest, unpack_ids

from .test_batchlist import BASE, SEED, B, L, open_run, write_text


def _write(run_dir, records) -> None:
    with open(run_dir / "metrics.jsonl", "a") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def _train(step, bid, digest=None, writer=None, version=1) -> dict:
    r = {"kind": "train", "step": step, "loss": 1.0, "batch_id": bid, "batch_version": version}
    if digest is not None:
        r["batch_digest"] = digest
    if writer is not None:
        r["writer"] = writer
    return r


def _tokens_of(bid: str) -> np.ndarray:
    """The [B, L+1] tokens batch ``bid`` of source 0 names, from the definition (the reader is not used)."""
    s, e, i = (int(x) for x in bid.split(":"))
    perm = np.random.default_rng([SEED, s, e]).permutation((len(BASE) - 1) // L)
    return np.stack([BASE[w * L : w * L + L + 1] for w in perm[i * B : (i + 1) * B]])


# --------------------------------------------------------------------------- reading the log


def test_read_records_skips_blank_torn_and_non_object_lines_naming_each(tmp_path, caplog):
    assert read_records(tmp_path / "metrics.jsonl") == []  # no log yet
    _write(tmp_path, [{"a": 1}, "", '{"kind": "tr', "[1, 2]", "7", {"b": 2}])
    with caplog.at_level(logging.WARNING, logger="jaxdist.data.audit"):
        assert read_records(tmp_path / "metrics.jsonl") == [{"a": 1}, {"b": 2}]
    path = tmp_path / "metrics.jsonl"
    assert [r.getMessage() for r in caplog.records] == [
        f"skipping line {n} of {path}: a torn record (a write cut short), not a JSON object" for n in (3, 4, 5)
    ]


def test_trained_batches_keep_the_final_lineage_and_ignore_other_records(tmp_path):
    _write(
        tmp_path,
        [
            _train(1, "0:0:1", 11),
            {"kind": "eval", "step": 1, "batch_id": "x"},  # not a train record
            {"kind": "train", "step": 2, "loss": 1.0},  # a train record without a batch (an older log)
            _train(2, "0:0:2", 12),
            _train(3, "0:0:3", 13),
            _train(2, "0:0:9", 19, version=2),  # resumed from step 1: the old 2 and 3 were rolled back
            _train(3, "0:0:8"),  # no digest logged
        ],
    )
    assert trained_batches(tmp_path) == [
        {"step": 1, "batch_id": "0:0:1", "batch_version": 1, "batch_digest": 11},
        {"step": 2, "batch_id": "0:0:9", "batch_version": 2, "batch_digest": 19},
        {"step": 3, "batch_id": "0:0:8", "batch_version": 1, "batch_digest": None},
    ]


def test_a_resume_at_the_same_step_replaces_it(tmp_path):
    """A resumed attempt that logs the last step again (step == last, not only below it) drops the old record."""
    _write(tmp_path, [_train(1, "0:0:1"), _train(2, "0:0:2"), _train(2, "0:0:5")])
    assert [r["batch_id"] for r in trained_batches(tmp_path)] == ["0:0:1", "0:0:5"]


# --------------------------------------------------------------------------- one history


def test_no_log_beside_checkpoints_past_step_0_is_a_problem(tmp_path):
    assert history_problems(tmp_path) == []  # nothing at all: nothing to judge
    for name in ("0", "notastep"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert history_problems(tmp_path) == []  # only step 0: nothing was trained
    for name in ("5", "12"):
        (tmp_path / "checkpoints" / name).mkdir()
    assert history_problems(tmp_path) == [
        f"no training log ({tmp_path / 'metrics.jsonl'} is missing or empty) although checkpoints reach step 12: "
        "which batches were trained cannot be checked"
    ]


def test_two_writers_interleaving_are_named_with_their_count_and_first_step(tmp_path):
    _write(
        tmp_path,
        [_train(1, "a", writer="A"), _train(2, "b", writer="A"), _train(3, "c", writer="B")]
        + [_train(3, "c", writer="A"), _train(4, "d", writer="B"), _train(5, "e", writer="C")],
    )
    assert history_problems(tmp_path) == [
        "two writers' histories: the records of 3 writers interleave (2 times, first at step 3): "
        "two processes trained this run at once"
    ]


def test_a_handover_to_a_new_writer_is_one_history(tmp_path):
    """A resumed run is a new writer that starts again below the old one's last step: not a problem; neither are
    records without a writer (older runs)."""
    _write(
        tmp_path,
        [_train(1, "a", writer="A"), _train(2, "b", writer="A"), _train(3, "c", writer="A")]
        + [_train(2, "b"), _train(2, "b", writer="B"), _train(3, "c", writer="B"), _train(4, "d")],
    )
    assert history_problems(tmp_path) == []


def test_a_step_one_writer_logs_twice_is_named(tmp_path):
    _write(
        tmp_path,
        [_train(s, "x", writer="A") for s in (1, 2, 2, 3, 4, 3)],
    )
    assert history_problems(tmp_path) == ["2 step(s) logged twice by one writer (first: step 2)"]


def test_interleaving_and_a_repeat_are_both_named(tmp_path):
    _write(tmp_path, [_train(s, "x", writer=w) for s, w in ((1, "A"), (1, "A"), (2, "B"), (3, "A"))])
    assert history_problems(tmp_path) == [
        "two writers' histories: the records of 2 writers interleave (1 times, first at step 3): "
        "two processes trained this run at once",
        "1 step(s) logged twice by one writer (first: step 1)",
    ]


# --------------------------------------------------------------------------- against the journal


def test_exactly_once_counts_each_kind_of_fault(tmp_path):
    run = open_run(tmp_path)
    ids = [format_id(x) for x in run.current.order]
    _write(tmp_path, [_train(s, ids[s - 1]) for s in (1, 2, 3, 5, 6)])  # step 4 never logged
    assert check_exactly_once(tmp_path) == {
        "trained": 5,
        "duplicates": 0,
        "missing": 1,  # position 4's id
        "misplaced": 0,
        "gaps": 1,
        "unused": 14,
        "version": 1,
        "ok": False,
    }
    _write(tmp_path, [_train(7, ids[0]), _train(8, ids[0]), _train(9, ids[9])])  # ids[0] twice more; 9 <- 10's id
    r = check_exactly_once(tmp_path)
    assert {k: r[k] for k in ("trained", "duplicates", "missing", "misplaced", "gaps", "unused")} == {
        "trained": 8,
        "duplicates": 2,
        "missing": 4,  # positions 4, 7, 8, 9
        "misplaced": 3,
        "gaps": 1,
        "unused": 11,
    }


def test_exactly_once_of_an_empty_log_and_of_steps_past_the_list(tmp_path):
    run = open_run(tmp_path)
    assert check_exactly_once(tmp_path) == {
        "trained": 0,
        "duplicates": 0,
        "missing": 0,
        "misplaced": 0,
        "gaps": 0,
        "unused": 20,
        "version": 1,
        "ok": True,
    }
    ids = [format_id(x) for x in run.current.order]
    _write(tmp_path, [_train(s, ids[s - 1]) for s in range(1, 21)] + [_train(21, "0:1:0")])  # past the 20 batches
    r = check_exactly_once(tmp_path)
    assert (r["trained"], r["misplaced"], r["unused"], r["ok"]) == (21, 1, -1, False)


def test_digest_problems_name_the_steps_whose_tokens_are_not_their_ids(tmp_path):
    run = open_run(tmp_path)
    ids = [format_id(x) for x in run.current.order]
    good = [int(token_digest(_tokens_of(ids[s - 1]))) for s in (1, 2, 3)]
    _write(tmp_path, [_train(1, ids[0], good[0]), _train(2, ids[1], good[0]), _train(3, ids[2])])
    with pytest.raises(ValueError, match="pass its train split as config_tokens"):
        digest_problems(tmp_path)
    assert digest_problems(tmp_path, BASE) == [
        f"step 2: logged digest {good[0]} but batch {ids[1]}'s tokens give {good[1]}",
        f"step 3: logged digest None but batch {ids[2]}'s tokens give {good[2]}",
    ]


def test_digest_problems_read_an_added_source_from_its_file(tmp_path):
    run = open_run(tmp_path)
    text = write_text(tmp_path / "a.txt", 2 * B * L, salt=1)
    add_data(tmp_path, [text], seed=4)
    assert run.boundary(0)
    order = run.current.order
    pos = int(np.flatnonzero(unpack_ids(order)[0] == 1)[0])  # the first batch of the added source
    bid = format_id(order[pos])
    want = int(token_digest(run.reader.batch(pos)))
    _write(tmp_path, [_train(1, bid, want), _train(2, bid, want + 1)])
    assert digest_problems(tmp_path, BASE) == [f"step 2: logged digest {want + 1} but batch {bid}'s tokens give {want}"]
    tokens = np.frombuffer(text.read_bytes(), np.uint8)
    assert int(tokens.max()) < 127 and int(token_digest(run.reader.batch(pos))) == want


# --------------------------------------------------------------------------- verify and describe


def _two_versions(tmp_path):
    run = open_run(tmp_path)
    text = write_text(tmp_path / "a.txt", 2 * B * L, salt=1)
    add_data(tmp_path, [text], seed=4)
    ids = [format_id(x) for x in run.current.order]
    _write(tmp_path, [_train(s, ids[s - 1]) for s in (1, 2, 3)])
    assert run.boundary(3)
    return run, text


def test_verify_reports_every_version_source_and_the_log(tmp_path):
    run, text = _two_versions(tmp_path)
    assert verify(tmp_path) == (
        True,
        [
            "version 1: ok (create, 20 batches)",
            "version 2: ok (add, 22 batches)",
            "source 0: the configured data 'synthetic' (checked when training starts)",
            f"source 1: ok ({text})",
            "training log: 3 batches trained, 0 duplicates, 0 missing, 0 out of order, 0 steps unlogged; "
            "19 not yet trained",
        ],
    )
    np.testing.assert_array_equal(replay_order(run.journal), run.current.order)
    np.testing.assert_array_equal(replay_order(run.journal, 1), run.journal.load(1).order)


def test_verify_fails_on_a_bad_log_and_a_changed_source(tmp_path):
    run, text = _two_versions(tmp_path)
    _write(tmp_path, [_train(4, format_id(run.current.order[0]), writer="A")])  # trained again
    ok, lines = verify(tmp_path)
    assert ok is False
    assert lines[-1] == (
        "training log: 4 batches trained, 1 duplicates, 1 missing, 1 out of order, 0 steps unlogged; 18 not yet trained"
    )
    _write(tmp_path, [_train(5, "x", writer="B"), _train(6, "x", writer="A")])
    ok, lines = verify(tmp_path)
    assert ok is False and any(line.startswith("training log: two writers' histories") for line in lines)


def test_verify_full_reads_the_whole_source_the_quick_check_samples(tmp_path):
    """A source whose bytes changed between the quick fingerprint's 17 slices of 4096 tokens: the quick check
    passes it, ``full`` (the SHA-256 of every token) names it."""
    run = open_run(tmp_path)
    text = write_text(tmp_path / "big.txt", 200_000, salt=3)
    add_data(tmp_path, [text], seed=4)
    assert run.boundary(0)
    data = bytearray(text.read_bytes())
    data[6000] = ord("A") if data[6000] != ord("A") else ord("B")  # between the first slice and the second
    text.write_bytes(bytes(data))
    assert verify(tmp_path)[0]
    assert f"source 1: ok ({text})" in verify(tmp_path)[1]
    ok, lines = verify(tmp_path, full=True)
    assert ok is False
    assert f"source 1: source 1 ('{text}') has another fingerprint than when added" in lines


def test_verify_of_a_run_without_a_batch_list(tmp_path):
    assert verify(tmp_path) == (False, [f"no batch list in {tmp_path / 'batchlist'}"])


def test_describe_summarises_versions_sources_cursor_and_what_comes_next(tmp_path):
    run, text = _two_versions(tmp_path)
    run.journal.write_cursor(2, 3)
    pending = write_text(tmp_path / "later.txt", 2 * B * L, salt=2)
    add_data(tmp_path, [pending], seed=5)
    order = run.current.order
    src = run.current.sources
    nxt = ", ".join(format_id(x) for x in order[3:6])
    assert describe(tmp_path, head=3).splitlines() == [
        f"batch list of {tmp_path}: version 2 of [1, 2], 22 batches of 4 x 9 tokens",
        "versions:",
        "  v1: create         20 batches  (splice 0, seed 3)",
        "  v2: add            22 batches  (splice 3, seed 4, sources [1])",
        "sources:",
        f"  0: config   synthetic  645 tokens, 20 batches/epoch, 90.9% of the list, sha256 {src[0].fingerprint[:12]}",
        f"  1: text     {text}  65 tokens, 2 batches/epoch, 9.1% of the list, sha256 {src[1].fingerprint[:12]}",
        "cursor: 3 (last trained step in metrics.jsonl); 3 at the newest checkpoint save (version 2)",
        f"next batches: {nxt}",
        f"pending additions: {run.journal.pending()[0][0]}",
    ]
    assert len(run.journal.pending()) == 1 and run.journal.pending()[0][0].endswith(".json")
    v1 = describe(tmp_path, version=1, head=2).splitlines()
    assert v1[0] == f"batch list of {tmp_path}: version 1 of [1, 2], 20 batches of 4 x 9 tokens"
    assert v1[-2] == "next batches: " + ", ".join(format_id(x) for x in run.journal.load(1).order[3:5])


def test_describe_a_spent_list_and_a_damaged_version(tmp_path):
    run = open_run(tmp_path)
    ids = [format_id(x) for x in run.current.order]
    _write(tmp_path, [_train(s, ids[s - 1]) for s in range(1, 21)])
    lines = describe(tmp_path).splitlines()
    assert "cursor: 20 (last trained step in metrics.jsonl)" in lines
    assert "next batches: (list spent: the next epoch is appended on demand)" in lines
    assert "pending additions: none" in lines
    add_data(tmp_path, [write_text(tmp_path / "a.txt", 2 * B * L, salt=1)], seed=4)
    assert run.boundary(20)
    path = run.journal.path(1)
    path.write_bytes(path.read_bytes()[:-7])  # version 1 damaged: version 2, stored as its change, cannot be built
    with pytest.raises(BatchListError) as e:
        describe(tmp_path)
    assert str(e.value).startswith("batch list version 2 is built from version 1's order (its file holds only the ")
    assert "is damaged: it is not complete JSON" in str(e.value)
    assert str(e.value).endswith("delete the batchlist folder to rebuild version 1 from the config.")


# --------------------------------------------------------------------------- the remaining corners


def test_read_records_replaces_bytes_that_are_not_utf8(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"a": "x\xffy"}\n{"b": 1}\n')
    assert read_records(tmp_path / "metrics.jsonl") == [{"a": "x\ufffdy"}, {"b": 1}]


def test_only_train_records_with_a_batch_are_judged_and_step_1_counts(tmp_path):
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)
    assert history_problems(tmp_path) == [
        f"no training log ({tmp_path / 'metrics.jsonl'} is missing or empty) although checkpoints reach step 1: "
        "which batches were trained cannot be checked"
    ]
    _write(
        tmp_path,
        [_train(1, "a", writer="A"), _train(2, "b", writer="A")]
        + [{"kind": "eval", "step": 2, "batch_id": "b", "writer": "A"}, {"kind": "train", "step": 2, "writer": "A"}],
    )
    assert history_problems(tmp_path) == []


def test_exactly_once_against_an_older_version(tmp_path):
    run, _ = _two_versions(tmp_path)
    v1 = [format_id(x) for x in run.journal.load(1).order]
    (tmp_path / "metrics.jsonl").unlink()
    _write(tmp_path, [_train(s, v1[s - 1]) for s in range(1, 21)])  # version 1's order, past the splice at 3
    assert check_exactly_once(tmp_path, 1)["ok"] and check_exactly_once(tmp_path, 1)["version"] == 1
    assert check_exactly_once(tmp_path, 1)["unused"] == 0
    assert not check_exactly_once(tmp_path)["ok"]  # the newest version placed other ids after step 3


def test_describe_by_default_shows_five_next_batches_and_every_pending_addition(tmp_path):
    run = open_run(tmp_path)
    names = []
    for k in range(2):
        add_data(tmp_path, [write_text(tmp_path / f"p{k}.txt", 2 * B * L, salt=k + 1)], seed=k)
        names.append(run.journal.pending()[-1][0])
    lines = describe(tmp_path).splitlines()
    assert lines[-2] == "next batches: " + ", ".join(format_id(x) for x in run.current.order[:5])
    assert lines[-1] == f"pending additions: {', '.join(sorted(names))}"


def test_digest_problems_refuse_a_config_source_without_its_tokens_in_one_sentence(tmp_path):
    open_run(tmp_path)
    with pytest.raises(ValueError) as e:
        digest_problems(tmp_path)
    assert str(e.value) == "the run's batches come from the configured data: pass its train split as config_tokens"


def _rewrite(run, version: int, order: np.ndarray) -> None:
    """Version ``version`` stored again with ``order`` and a valid checksum (damage a checksum cannot see)."""
    import dataclasses

    from jaxdist.data.batchlist import encode

    bl = run.journal.load(version)
    run.journal.path(version).write_bytes(encode(dataclasses.replace(bl, order=order, depth=0))[0])  # stored whole


def test_verify_names_a_repeated_id_and_a_changed_prefix(tmp_path):
    run, _ = _two_versions(tmp_path)
    v1, v2 = run.journal.load(1).order, run.journal.load(2).order
    twice = v1.copy()
    twice[5] = twice[4]
    _rewrite(run, 1, twice)
    ok, lines = verify(tmp_path)
    assert ok is False and lines[0] == "version 1: BAD: an id appears twice (create, 20 batches)"
    # Version 2 holds its change from version 1, which no longer gives the order it recorded.
    assert (
        lines[1] == "version 2: BAD: its change applied to version 1 does not give its recorded order (add, 22 batches)"
    )
    _rewrite(run, 1, v1)
    changed = v2.copy()
    changed[[2, 3]] = changed[[3, 2]]  # position 2 (inside the splice of 3) and 3 (after it) swapped
    _rewrite(run, 2, changed)
    ok, lines = verify(tmp_path)
    assert ok is False and lines[:2] == [
        "version 1: ok (create, 20 batches)",
        "version 2: BAD: its first 3 ids differ from version 1 (add, 22 batches)",
    ]


def test_verify_goes_on_past_a_damaged_version_and_checks_the_log_against_the_newest_intact(tmp_path):
    run, _ = _two_versions(tmp_path)
    path = run.journal.path(1)
    path.write_bytes(path.read_bytes()[:-7])
    ok, lines = verify(tmp_path)
    assert ok is False
    assert lines[0].startswith("version 1: DAMAGED: ")
    assert lines[1] == "version 2: BAD: its parent version 1 is not intact (add, 22 batches)"

    other = tmp_path / "b"
    other.mkdir()
    run2, _ = _two_versions(other)
    path = run2.journal.path(2)
    path.write_bytes(path.read_bytes()[:-7])  # the newest damaged: the log is held against version 1
    ok, lines = verify(other)
    assert ok is False
    assert lines[1].startswith("version 2: DAMAGED: ")
    assert lines[-1] == (
        "training log: 3 batches trained, 0 duplicates, 0 missing, 0 out of order, 0 steps unlogged; 17 not yet trained"
    )

    lone = tmp_path / "c"
    lone.mkdir()
    run3 = open_run(lone)
    _write(lone, [_train(1, format_id(run3.current.order[0]))])
    path = run3.journal.path(1)
    path.write_bytes(path.read_bytes()[:-7])  # no intact version at all, a log beside it
    ok, lines = verify(lone)
    assert ok is False and lines[0].startswith("version 1: DAMAGED: ") and len(lines) == 1


def test_verify_fails_on_each_part_alone(tmp_path):
    """One bad part and the rest good: a history of two writers with the right batches, and a missing source with
    a right log, each make verify fail."""
    run = open_run(tmp_path)
    ids = [format_id(x) for x in run.current.order]
    _write(tmp_path, [_train(s, ids[s - 1], writer=w) for s, w in ((1, "A"), (2, "B"), (3, "A"))])
    ok, lines = verify(tmp_path)
    assert ok is False and check_exactly_once(tmp_path)["ok"]
    assert lines[-2].startswith("training log: two writers' histories")

    other = tmp_path / "b"
    other.mkdir()
    run2, text = _two_versions(other)
    text.unlink()
    ok, lines = verify(other)
    assert ok is False and check_exactly_once(other)["ok"]
    assert [line for line in lines if line.startswith("source 1")] != [f"source 1: ok ({text})"]


def test_verify_names_a_version_that_is_not_its_replay_and_what_was_built_on_it_and_lists_every_problem(tmp_path):
    """Version 2 stored (whole) with two unused ids swapped, its checksum valid: it is BAD, version 3 (its change
    from version 2) no longer gives its recorded order, and version 4 has no intact parent.  A version with two
    problems lists both.  (A list of format /1, every version whole, replays past it: test_batchlist_format.)"""
    from .test_batchlist import _journal_of

    run = _journal_of(tmp_path, 3)
    sizes = [len(run.journal.load(v)) for v in (1, 2, 3, 4)]
    v2, v3 = run.journal.load(2).order.copy(), run.journal.load(3).order.copy()
    v2[-2:] = v2[-2:][::-1]
    _rewrite(run, 2, v2)
    ok, lines = verify(tmp_path)
    versions = [line for line in lines if line.startswith("version ")]
    assert ok is False and versions == [
        f"version 1: ok (create, {sizes[0]} batches)",
        f"version 2: BAD: replaying its operations gives another order (add, {sizes[1]} batches)",
        f"version 3: BAD: its change applied to version 2 does not give its recorded order (add, {sizes[2]} batches)",
        f"version 4: BAD: its parent version 3 is not intact (add, {sizes[3]} batches)",
    ]
    both = v3
    both[0] = both[1]  # inside version 3's splice (1: added at the boundary after step 1) and a repeat
    stored = run.journal.read(3)
    assert stored.op["splice"] == 1
    import dataclasses

    from jaxdist.data.batchlist import encode

    whole = dataclasses.replace(stored.resolve(run.journal.load(2), check=False), order=both, depth=0)
    run.journal.path(3).write_bytes(encode(whole)[0])
    assert verify(tmp_path)[1][2] == (
        f"version 3: BAD: an id appears twice; its first 1 ids differ from version 2 (add, {sizes[2]} batches)"
    )


def test_digest_problems_of_a_run_that_packs_the_configured_data_by_documents(tmp_path):
    """data.packing=documents: the batch ids name packed rows, so the check needs the train split's PackedStream
    (the plain tokens are refused in one sentence) and reads each batch's rows through it."""
    from jaxdist.data import RunBatchList
    from jaxdist.data.documents import PackedStream, pack

    tokens = np.arange(900, dtype=np.uint32)
    packing = pack(np.array([0, 50, 120, 121, 300, 610, 777]), len(tokens), L)
    run = RunBatchList(tmp_path, tokens, "docs", SEED, B, L, packing=packing)
    stream = PackedStream(tokens, packing)
    ids = [format_id(x) for x in run.current.order[:3]]

    def want(bid: str) -> int:
        s, e, i = (int(x) for x in bid.split(":"))
        rows = np.random.default_rng([SEED, s, e]).permutation(packing.rows)[i * B : (i + 1) * B]
        return int(token_digest(stream.read(rows)))

    _write(
        tmp_path, [_train(1, ids[0], want(ids[0])), _train(2, ids[1], want(ids[2])), _train(3, ids[2], want(ids[2]))]
    )
    with pytest.raises(ValueError) as e:
        digest_problems(tmp_path, tokens)
    assert str(e.value) == "the run packs the configured data by documents: pass its train split's PackedStream"
    assert digest_problems(tmp_path, stream) == [
        f"step 2: logged digest {want(ids[2])} but batch {ids[1]}'s tokens give {want(ids[1])}"
    ]

"""Commit markers and checksums: damaged or incomplete checkpoints are found, named and skipped."""

import json
import logging
import os
import threading
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxdist.checkpoint import CheckpointDamaged, RunCheckpointer, abstract_like, integrity
from jaxdist.checkpoint.crc import combine
from tests.trees import leaf_pairs


def mesh():
    return jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)


def state(step: int) -> dict:
    """Values in closed form of the step; sharded, replicated, odd-shaped and scalar leaves."""
    m = mesh()
    return {
        "w": jax.device_put(jnp.arange(64.0).reshape(8, 8) * 0.5 + step, NamedSharding(m, P("fsdp"))),
        "r": jax.device_put(jnp.arange(15.0).reshape(3, 5) - step, NamedSharding(m, P())),
        "step": jax.device_put(jnp.int32(step), NamedSharding(m, P())),
    }


def saved(tmp_path, steps=(1, 2, 3), keep=3) -> RunCheckpointer:
    ck = RunCheckpointer(tmp_path / "ck", keep=keep)
    for s in steps:
        ck.save(s, state(s), {"step": s})
    ck.wait()
    return ck


def biggest_data_file(step_dir):
    files = json.loads((step_dir / integrity.COMMIT_FILE).read_text())["files"]
    return step_dir / max((f for f in files if "/d/" in f), key=lambda f: files[f]["size"])


def same(a, b):
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in leaf_pairs(a, b))


def test_commit_marker_records_every_file_with_its_size_and_crc(tmp_path):
    """The reference checksum is google-crc32c's own one-shot ``value`` of the whole file."""
    crc32c = pytest.importorskip("google_crc32c")
    ck = saved(tmp_path, steps=(1,))
    step_dir = tmp_path / "ck" / "1"
    marker = integrity.read_commit(step_dir)
    assert marker["step"] == 1 and marker["num_processes"] == 1
    assert marker["format"] == "jaxdist-checkpoint-v3" and marker["algorithm"] == "crc32c"
    assert sorted(marker["files"]) == integrity.data_files(step_dir)
    for rel, f in marker["files"].items():
        data = (step_dir / rel).read_bytes()
        assert f == {"size": len(data), "crc32c": f"{crc32c.value(data):08x}", "process": 0}
    assert marker["bytes_written_per_process"] == [sum(f["size"] for f in marker["files"].values())]
    assert ck.stats[0].written_bytes == marker["bytes_written_per_process"]
    assert ck.stats[0].planned_bytes == [64 * 4 + 15 * 4 + 4]
    ck.close()


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "delete"])
def test_damaged_latest_is_skipped_with_a_warning_and_the_newest_good_one_restored(tmp_path, caplog, damage):
    ck = saved(tmp_path)
    f = biggest_data_file(tmp_path / "ck" / "3")
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "bitflip":
        data[len(data) // 3] ^= 0x10
        f.write_bytes(data)
    else:
        f.unlink()
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint.manager"):
        got, meta = ck.restore(abstract_like(state(0)))
    assert meta["step"] == 2 and same(got, state(2))
    warning = " ".join(r.getMessage() for r in caplog.records)
    rel = f.relative_to(tmp_path / "ck" / "3").as_posix()
    assert f"checkpoint {tmp_path / 'ck' / '3'} is damaged: {rel}" in warning
    expect = {"truncate": "bytes", "bitflip": "CRC-32C", "delete": "is missing"}[damage]
    assert expect in warning
    # Set aside, so the step can be written again; the committed ones are untouched.
    assert ck.all_steps() == [1, 2] and (tmp_path / "ck" / "3.damaged").is_dir()
    assert ck.save(3, state(3), {"step": 3})
    ck.wait()
    assert ck.restore(abstract_like(state(0)))[1]["step"] == 3
    ck.close()


def test_explicit_damaged_step_raises_and_nothing_good_raises(tmp_path):
    ck = saved(tmp_path, steps=(1, 2))
    for step in (1, 2):
        f = biggest_data_file(tmp_path / "ck" / str(step))
        f.write_bytes(f.read_bytes()[:-1])
    with pytest.raises(CheckpointDamaged, match=r"checkpoint .*/2 is damaged: .* bytes"):
        ck.restore(abstract_like(state(0)), step=2)
    with pytest.raises(FileNotFoundError, match="no good checkpoint"):
        ck.restore(abstract_like(state(0)))
    ck.close()


def test_incomplete_save_is_ignored_then_set_aside(tmp_path, caplog):
    ck = saved(tmp_path, steps=(1, 2))
    ck.close()
    (tmp_path / "ck" / "2" / integrity.COMMIT_FILE).unlink()  # as if killed before the commit
    (tmp_path / "ck" / "5.orbax-checkpoint-tmp").mkdir()  # as if killed while orbax wrote
    states = {f.path.name: f.state for f in integrity.scan(tmp_path / "ck")}
    assert states == {"1": "committed", "2": "incomplete", "5.orbax-checkpoint-tmp": "temporary"}
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint.manager"):
        ck = RunCheckpointer(tmp_path / "ck")
    text = caplog.text
    assert f"ignoring {tmp_path / 'ck' / '2'}: no commit marker" in text and "moved to 2.incomplete" in text
    assert f"removing {tmp_path / 'ck' / '5.orbax-checkpoint-tmp'}: a checkpoint save that never completed" in text
    assert ck.latest_step() == 1 and sorted(os.listdir(tmp_path / "ck")) == ["1", "2.incomplete"]
    assert integrity.scan(tmp_path / "ck")[1].state == "abandoned"
    assert same(ck.restore(abstract_like(state(0)))[0], state(1))
    assert ck.save(2, state(2), {"step": 2})  # the step can be written again
    ck.close()


def test_old_checkpoints_go_only_after_a_newer_one_committed(tmp_path):
    ck = saved(tmp_path, steps=(1, 2, 3, 4), keep=2)
    assert ck.all_steps() == [3, 4]
    assert not ck.save(4, state(9), {"step": 4})  # a committed step is never overwritten
    ck.close()


def test_a_save_still_running_is_waited_for_and_reported_not_stacked(tmp_path, caplog, monkeypatch):
    slow = integrity.record_own_checksums

    def slowly(step_dir, process):
        time.sleep(0.5)
        return slow(step_dir, process)

    monkeypatch.setattr(integrity, "record_own_checksums", slowly)
    ck = RunCheckpointer(tmp_path / "ck")
    ck.save(1, state(1), {"step": 1})
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint.manager"):
        ck.save(2, state(2), {"step": 2})
    assert "checkpoint of step 1 is still being written when step 2 is due" in caplog.text
    assert ck.busy_saves == 1 and ck.stats[1].waited_s >= 0.3
    assert ck.all_steps() == [1]  # step 2 started only after 1 committed, and is not committed yet
    ck.wait()
    assert ck.all_steps() == [1, 2] and ck.stats[1].background_s >= 0.5
    ck.close()


def test_synchronous_save_is_committed_when_save_returns(tmp_path):
    ck = RunCheckpointer(tmp_path / "ck", asynchronous=False)
    assert ck.save(1, state(1), {"step": 1})
    assert ck.all_steps() == [1] and ck.stats[0].written_bytes is not None
    assert same(ck.restore(abstract_like(state(0)))[0], state(1))
    ck.close()


def rewrite_marker(step_dir, change):
    """Rewrite ``step_dir``'s commit marker with ``change`` applied and its own CRC-32 made to hold again."""
    path = step_dir / integrity.COMMIT_FILE
    marker = json.loads(path.read_text())
    change(marker)
    body = {k: v for k, v in marker.items() if k != "marker_crc32"}  # the CRC-32 of the rest, canonical JSON
    marker["marker_crc32"] = f"{zlib.crc32(json.dumps(body, sort_keys=True).encode()):08x}"
    path.write_text(json.dumps(marker))


def flip_in_time(step_dir):
    """Flip the last digit of the marker's ``time``: it still parses, only its own CRC-32 tells."""
    path = step_dir / integrity.COMMIT_FILE
    text = path.read_text()
    at = text.index('"time": ') + len('"time": ') + 3  # a digit of the seconds
    path.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :])


MARKER_DAMAGE = {
    "unparsable": (lambda d: (d / integrity.COMMIT_FILE).write_bytes(b'{"format": "jaxd'), "does not parse"),
    "flipped byte": (flip_in_time, "the commit marker's CRC-32 is"),
    "other step": (lambda d: rewrite_marker(d, lambda m: m.update(step=7)), "is of step 7, not 3"),
    "unknown format": (lambda d: rewrite_marker(d, lambda m: m.update(format="jaxdist-checkpoint-v9")), "format"),
    "byte counts": (
        lambda d: rewrite_marker(d, lambda m: m.update(bytes_written_per_process=[1])),
        "records [1] bytes per process",
    ),
}


@pytest.mark.parametrize("kind", list(MARKER_DAMAGE))
def test_a_marker_that_does_not_parse_or_match_is_damage_not_an_unfinished_save(tmp_path, caplog, kind):
    ck = saved(tmp_path)
    ck.close()
    damage, why = MARKER_DAMAGE[kind]
    damage(tmp_path / "ck" / "3")
    assert {f.path.name: f.state for f in integrity.scan(tmp_path / "ck")}["3"] == "bad-marker"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint.manager"):
        ck = RunCheckpointer(tmp_path / "ck")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {tmp_path / 'ck' / '3'} is damaged: "), lines
    assert why in lines[0] and lines[0].endswith("moved to 3.damaged"), lines
    assert sorted(os.listdir(tmp_path / "ck")) == ["1", "2", "3.damaged"]  # never 3.incomplete
    assert ck.all_steps() == [1, 2] and ck.damaged_steps() == [3]
    got, meta = ck.restore(abstract_like(state(0)))
    assert meta["step"] == 2 and same(got, state(2))  # the previous good step
    ck.close()


# --------------------------------------------------------------------------- the parts, on files made here


def _step_with_two_writers(tmp_path, step="7", algorithms=(None, None)):
    """A step folder as orbax leaves it for 2 processes (process 1's part under ocdbt.process_1), its checksums
    recorded by both (``algorithms``: each one's, default the one a save uses here), and the commit marker written:
    (step folder, marker)."""
    d = tmp_path / step
    for rel, data in {
        "state/manifest.ocdbt": b"m" * 10,
        "state/ocdbt.process_0/d/aa": b"a" * 30,
        "state/ocdbt.process_1/d/bb": b"b" * 20,
        "state/array_metadatas/process_1": b"{}",
    }.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    for p in (0, 1):
        integrity.record_own_checksums(d, p, algorithms[p])  # the second call finds jaxdist_checksums/ there
    return d, integrity.commit(d, 2, {"step": int(step)})


def test_which_process_wrote_a_file_follows_orbax_layout():
    assert integrity.writer_of("state/ocdbt.process_3/d/abc") == 3
    assert integrity.writer_of("state/array_metadatas/process_12") == 12
    assert integrity.writer_of("state/manifest.ocdbt") == 0 and integrity.writer_of("meta/metadata") == 0


def test_a_file_or_a_range_of_it_has_the_libraries_crc_of_those_bytes(tmp_path):
    """The references: CRC-32C's check value (RFC 3720, B.4), google-crc32c's ``value`` and zlib's ``crc32`` of
    the same bytes; a range past the end is cut at the end, an empty file or range is 0 bytes."""
    (tmp_path / "check").write_bytes(b"123456789")
    assert integrity.file_crc32c(tmp_path / "check") == (9, "e3069283")
    crc32c = pytest.importorskip("google_crc32c")
    data = bytes(range(256)) * 40
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    for start, length in [(0, None), (0, 10), (4096, 4096), (100, 7), (10_000, None), (10_000, 5_000), (20_000, 1)]:
        part = data[start : None if length is None else start + length]
        assert integrity.file_crc32c(tmp_path / "f", start, length) == (len(part), f"{crc32c.value(part):08x}")
        assert integrity.file_crc32(tmp_path / "f", start, length) == (len(part), f"{zlib.crc32(part):08x}")
    assert integrity.file_crc32c(tmp_path / "empty") == (0, "00000000")
    assert integrity.file_crc32(tmp_path / "empty") == (0, "00000000")


def test_joined_crcs_of_pieces_are_the_libraries_crcs_of_the_whole():
    """The reference is each library's own CRC of the concatenation (google-crc32c's ``value``, zlib's ``crc32``)."""
    crc32c = pytest.importorskip("google_crc32c")
    rng = np.random.default_rng(0)
    for n1, n2 in [(0, 0), (0, 5), (5, 0), (1, 1), (100, 4096), (4097, 65535), (3, 1_000_003)]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert combine(crc32c.value(a), crc32c.value(b), n2, "crc32c") == crc32c.value(a + b), (n1, n2)
        assert combine(zlib.crc32(a), zlib.crc32(b), n2, "crc32") == zlib.crc32(a + b), (n1, n2)


@pytest.mark.parametrize("algorithm", ["crc32c", "crc32"])
def test_a_file_is_checksummed_in_pieces_on_several_threads_and_joined(tmp_path, monkeypatch, algorithm):
    """Pieces of 10 bytes: every file size around the piece size gives the library's CRC of the whole file; the pieces of one file run on more than one thread."""
    crc32c = pytest.importorskip("google_crc32c")
    reference = {"crc32c": crc32c.value, "crc32": zlib.crc32}[algorithm]
    monkeypatch.setattr(integrity, "_PIECE", 10)
    threads, real = set(), integrity._FILE_SUM[algorithm]

    def spy(path, start, length):
        threads.add(threading.get_ident())
        time.sleep(0.01)  # long enough that the pool's threads share the pieces
        return real(path, start, length)

    monkeypatch.setitem(integrity._FILE_SUM, algorithm, spy)
    sizes = [0, 1, 6, 7, 9, 10, 11, 20, 21, 95]
    rng = np.random.default_rng(1)
    data = {f"f{n}": rng.bytes(n) for n in sizes}
    for name, b in data.items():
        (tmp_path / name).write_bytes(b)
    got = integrity.files_checksums(tmp_path, [*data, "absent"], algorithm)
    assert got == {**{k: (len(b), f"{reference(b):08x}") for k, b in data.items()}, "absent": None}
    assert len(threads) > 1


def test_a_file_that_shrinks_or_goes_while_its_pieces_are_read_is_what_was_read(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "_PIECE", 10)
    monkeypatch.setattr(integrity, "_THREADS", 1)  # the pieces in order: the first call cuts the file
    data = bytes(range(35))
    (tmp_path / "f").write_bytes(data)
    real = integrity._FILE_SUM["crc32"]

    def cut_then_read(path, start, length):
        if start == 0:
            os.truncate(path, 15)
        return real(path, start, length)

    monkeypatch.setitem(integrity._FILE_SUM, "crc32", cut_then_read)
    assert integrity.files_checksums(tmp_path, ["f"], "crc32") == {"f": (15, f"{zlib.crc32(data[:15]):08x}")}

    def remove_then_read(path, start, length):  # a file removed after it was listed is not a file
        if start == 10:
            os.remove(path)
        return real(path, start, length)

    (tmp_path / "f").write_bytes(data)
    monkeypatch.setitem(integrity._FILE_SUM, "crc32", remove_then_read)
    assert integrity.files_checksums(tmp_path, ["f"], "crc32") == {"f": None}


def test_data_files_leave_out_jaxdist_files_and_temporaries(tmp_path):
    d, _ = _step_with_two_writers(tmp_path)
    (d / "state" / "half.tmp").write_bytes(b"x")
    assert integrity.data_files(d) == [
        "state/array_metadatas/process_1",
        "state/manifest.ocdbt",
        "state/ocdbt.process_0/d/aa",
        "state/ocdbt.process_1/d/bb",
    ]


def test_commit_merges_each_writers_checksums_and_counts_bytes_per_process(tmp_path):
    d, marker = _step_with_two_writers(tmp_path)
    assert marker["bytes_written_per_process"] == [10 + 30, 20 + 2]
    assert {rel: f["process"] for rel, f in marker["files"].items()} == {
        "state/manifest.ocdbt": 0,
        "state/ocdbt.process_0/d/aa": 0,
        "state/ocdbt.process_1/d/bb": 1,
        "state/array_metadatas/process_1": 1,
    }
    assert integrity.read_marker(d) == (json.loads((d / integrity.COMMIT_FILE).read_text()), None)


def test_commit_refuses_a_missing_writer_or_an_unrecorded_file(tmp_path):
    d, _ = _step_with_two_writers(tmp_path)
    (d / "state" / "late.bin").write_bytes(b"z")
    with pytest.raises(RuntimeError, match=rf"^1 files of {d} have no checksum, e.g. state/late.bin$"):
        integrity.commit(d, 2, {"step": 7})
    (d / integrity.CHECKSUM_DIR / "process_1.json").unlink()
    with pytest.raises(RuntimeError, match=rf"^process 1 recorded no checksums in {d}$"):
        integrity.commit(d, 2, {"step": 7})


def test_a_file_gone_while_checksummed_is_named(tmp_path, monkeypatch):
    d, _ = _step_with_two_writers(tmp_path)
    real = integrity.files_checksums
    monkeypatch.setattr(integrity, "files_checksums", lambda *a: {**real(*a), "state/manifest.ocdbt": None})
    with pytest.raises(FileNotFoundError, match=rf"^{d}/state/manifest.ocdbt disappeared while its checksum"):
        integrity.record_own_checksums(d, 0)


def _resealed(marker, **changes):
    m = {**marker, **changes}
    m["marker_crc32"] = integrity.marker_crc32(m)
    return m


def test_each_way_a_marker_can_be_wrong_is_named(tmp_path):
    d, good = _step_with_two_writers(tmp_path)
    problem = lambda m: integrity.marker_problem(d, m)  # noqa: E731
    assert problem(good) is None
    assert problem([1]) == "the commit marker is a JSON list, not an object"
    assert problem({**good, "format": "x" * 60}) == (
        f"the commit marker has format '{'x' * 40}', not one of jaxdist-checkpoint-v1, jaxdist-checkpoint-v2, "
        "jaxdist-checkpoint-v3"
    )
    written = "0123456789abcdef"
    assert problem({**good, "marker_crc32": written}) == (
        f"the commit marker's CRC-32 is {good['marker_crc32']}, 0123456789ab was written"
    )
    lacks = "the commit marker lacks its files, num_processes or bytes_written_per_process"
    for field, value in (("files", []), ("num_processes", "2"), ("bytes_written_per_process", 40)):
        assert problem(_resealed(good, **{field: value})) == lacks, field
    assert problem(_resealed(good, step="9" * 30)) == f"the commit marker is of step {'9' * 20}, not 7"
    name = "n" * 100
    malformed = f"the commit marker's entry of {'n' * 80} is malformed"
    for entry in (
        [1],  # not an object
        {"crc32": "00000000", "process": 0},  # no size
        {"size": 1, "crc32": "00000000", "process": "0"},  # the process not a number
        {"size": 1, "crc32": "00000000", "process": 2},  # no such process
        {"size": 1, "process": 0},  # no checksum
        {"size": 1, "crc32c": 0, "process": 0},  # the checksum not a string
        {"size": 1, "crc32": "00000000", "crc32c": "00000000", "process": 0},  # two checksums: which holds?
        {"size": 1, "md5": "00000000", "process": 0},  # an algorithm jaxdist does not know
    ):
        assert problem(_resealed(good, files={**good["files"], name: entry})) == malformed, entry
    assert problem(_resealed(good, bytes_written_per_process=[40, 0])) == (
        "the commit marker records [40, 0] bytes per process, its files sum to [40, 22]"
    )
    empty = _resealed(good, files={}, num_processes=0, bytes_written_per_process=[])
    assert problem(empty) is None  # nothing written by nobody is consistent
    (d / integrity.COMMIT_FILE).write_text("{")
    marker, why = integrity.read_marker(d)
    assert marker is None and why.startswith(f"the commit marker {integrity.COMMIT_FILE} does not parse (Expecting")


def test_verify_names_every_bad_file_and_only_those_asked_for(tmp_path):
    """Process 0 recorded CRC-32C, process 1 CRC-32 (as a host without crc32c does): each file is checked
    with its own entry's algorithm."""
    crc32c = pytest.importorskip("google_crc32c")
    d, marker = _step_with_two_writers(tmp_path, algorithms=("crc32c", "crc32"))
    assert marker["algorithm"] == "crc32c+crc32" and integrity.marker_problem(d, marker) is None
    files = marker["files"]
    assert integrity.verify_files(d, files) == []
    (d / "state/ocdbt.process_0/d/aa").write_bytes(b"z" * 30)
    (d / "state/manifest.ocdbt").unlink()
    (d / "state/ocdbt.process_1/d/bb").write_bytes(b"c" * 20)
    aa, bb = files["state/ocdbt.process_0/d/aa"], files["state/ocdbt.process_1/d/bb"]
    assert aa["crc32c"] == f"{crc32c.value(b'a' * 30):08x}" and bb["crc32"] == f"{zlib.crc32(b'b' * 20):08x}"
    assert integrity.verify_files(d, files) == [
        "state/manifest.ocdbt is missing",
        f"state/ocdbt.process_0/d/aa has CRC-32C {crc32c.value(b'z' * 30):08x}, {aa['crc32c']} was written",
        f"state/ocdbt.process_1/d/bb has CRC-32 {zlib.crc32(b'c' * 20):08x}, {bb['crc32']} was written",
    ]
    assert integrity.verify_files(d, files, ["state/array_metadatas/process_1"]) == []  # one file, asked alone


def test_a_v2_marker_of_crc32_files_is_still_read_and_checked(tmp_path):
    """A checkpoint written before CRC-32C: format v2, every file's entry ``crc32``."""
    d, marker = _step_with_two_writers(tmp_path, algorithms=("crc32", "crc32"))
    v2 = {**marker, "format": "jaxdist-checkpoint-v2", "algorithm": "crc32"}
    v2["marker_crc32"] = integrity.marker_crc32(v2)
    integrity.write_json_atomic(d / integrity.COMMIT_FILE, v2)
    assert integrity.read_marker(d) == (v2, None)
    assert integrity.verify_files(d, v2["files"]) == []
    (d / "state/ocdbt.process_0/d/aa").write_bytes(b"z" * 30)
    assert integrity.verify_files(d, v2["files"]) == [
        f"state/ocdbt.process_0/d/aa has CRC-32 {zlib.crc32(b'z' * 30):08x}, {zlib.crc32(b'a' * 30):08x} was written"
    ]


def test_without_crc32c_saves_record_crc32_and_crc32c_files_are_refused_not_called_damaged(
    tmp_path, monkeypatch, caplog
):
    """A Python without crc32c (installed with --no-deps): its saves fall back to zlib's CRC-32; a checkpoint
    checksummed with CRC-32C is refused in one sentence that says what to install, before any file is read, and is
    neither set aside nor skipped for an older step."""
    ck = saved(tmp_path, steps=(1, 2))
    ck.close()
    assert integrity.read_commit(tmp_path / "ck" / "2")["algorithm"] == integrity.save_algorithm() == "crc32c"
    monkeypatch.setattr(integrity, "_crc32c_module", lambda: None)
    assert integrity.save_algorithm() == "crc32"
    ck = RunCheckpointer(tmp_path / "ck")
    with pytest.raises(integrity.ChecksumUnavailable) as err:
        ck.restore(abstract_like(state(0)))
    step_dir = tmp_path / "ck" / "2"
    assert str(err.value).startswith(f"{step_dir}/") and str(err.value).endswith(
        " is checksummed with CRC-32C and this Python lacks the crc32c package to check it: "
        "install it (pip install crc32c)."
    )
    assert sorted(os.listdir(tmp_path / "ck")) == ["1", "2"] and ck.all_steps() == [1, 2]
    assert ck.save(3, state(3), {"step": 3})  # this Python's own saves: CRC-32, restored with its check
    ck.wait()
    marker = integrity.read_commit(tmp_path / "ck" / "3")
    assert marker["algorithm"] == "crc32" and all("crc32" in f and "crc32c" not in f for f in marker["files"].values())
    got, meta = ck.restore(abstract_like(state(0)))
    assert meta["step"] == 3 and same(got, state(3))
    ck.close()


def test_scan_sees_every_step_folder_among_other_files_and_set_aside_numbers_repeats(tmp_path):
    for i in range(20):
        (tmp_path / f"{i}").mkdir()
        (tmp_path / f"{i}.log").write_text("not a folder")
    assert [s.step for s in integrity.scan(tmp_path)] == list(range(20))
    names = []
    for _ in range(3):
        (tmp_path / "30").mkdir()
        names.append(integrity.set_aside(tmp_path / "30").name)
    assert names == ["30.damaged", "30.damaged-2", "30.damaged-3"]
    assert [s.state for s in integrity.scan(tmp_path) if s.step == 30] == ["damaged"] * 3

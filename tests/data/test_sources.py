import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pytest

from jaxdist.config import ConfigError, DataConfig
from jaxdist.data import EOS, ByteTokenizer, eval_file_mask, load_source, sources, write_token_file

MAX_BYTES = 400_000  # a dozen or so stdlib files: fast, yet more than one per side


def _stdlib_reference():
    """Plain re-implementation of the stdlib listing: sorted (relpath, size) of its .py files."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [
            x for x in dirs if x not in ("site-packages", "dist-packages") and not os.path.islink(os.path.join(d, x))
        ]
        for f in files:
            p = os.path.join(d, f)
            if f.endswith(".py") and os.path.isfile(p):
                out.append((Path(os.path.relpath(p, root)).as_posix(), os.path.getsize(p)))
    return root, sorted(out)


def _expected_streams(root, rels, fraction):
    """train, eval streams built the obvious way: file bytes + EOS, by crc32 bucket."""
    mask = eval_file_mask(rels, fraction)
    sides = ([], [])
    for rel, m in zip(rels, mask):
        data = Path(root, rel).read_bytes()
        sides[int(m)].extend(list(data) + [EOS])
    return np.array(sides[0]), np.array(sides[1]), mask


def test_stdlib_matches_plain_reference_and_is_deterministic():
    cfg = DataConfig(source="stdlib", max_bytes=MAX_BYTES, eval_fraction=0.2)
    split = load_source(cfg)
    root, files = _stdlib_reference()
    ends = np.cumsum([s for _, s in files])
    rels = [r for (r, _), end in zip(files, ends) if end <= MAX_BYTES]
    train, eval_, mask = _expected_streams(root, rels, 0.2)
    np.testing.assert_array_equal(split.train, train)
    np.testing.assert_array_equal(split.eval, eval_)
    assert split.train.dtype == np.uint16
    assert (split.n_files, split.n_eval_files) == (len(rels), int(mask.sum()))
    assert 0 < split.n_eval_files < split.n_files
    # Disjoint by file: one EOS per file, and the two sides' files add up to all.
    assert (split.train == EOS).sum() + (split.eval == EOS).sum() == len(rels)
    # A second, uncached read gives the same arrays.
    sources._read_split.cache_clear()
    again = load_source(cfg)
    np.testing.assert_array_equal(again.train, split.train)
    np.testing.assert_array_equal(again.eval, split.eval)


def test_stdlib_max_bytes_takes_the_largest_prefix_of_files():
    root, files = _stdlib_reference()
    for cap in (50_000, MAX_BYTES):
        split = load_source(DataConfig(max_bytes=cap))
        n_bytes = len(split.train) + len(split.eval) - split.n_files  # minus one EOS per file
        assert n_bytes <= cap
        assert n_bytes == sum(s for _, s in files[: split.n_files])
        assert n_bytes + files[split.n_files][1] > cap  # the next file would not fit


def test_eval_share_matches_fraction_over_whole_stdlib():
    _, files = _stdlib_reference()
    rels = [r for r, _ in files]
    assert len(rels) > 500
    for fraction in (0.05, 0.3):
        mask = eval_file_mask(rels, fraction)
        assert abs(mask.mean() - fraction) < 0.02
        # The rule is the documented one, file by file.
        assert mask.tolist() == [zlib.crc32(r.encode()) % 10000 < fraction * 10000 for r in rels]


def test_eval_file_mask_keeps_both_sides_nonempty():
    assert eval_file_mask(["a", "b"], 1e-4).sum() == 1
    assert eval_file_mask(["a", "b"], 0.9999).sum() == 1
    assert eval_file_mask(["a"], 0.5).shape == (1,)


def _make_dir(tmp_path, files):
    root = tmp_path / "corpus"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return root


def test_text_dir_reads_every_file_recursively(tmp_path):
    files = {f"d{i % 3}/sub/f{i}.txt": f"file {i} " * (i + 1) for i in range(40)}
    files["raw.bin"] = bytes(range(256))
    root = _make_dir(tmp_path, files)
    split = load_source(DataConfig(source="text_dir", path=str(root), eval_fraction=0.25))
    rels = sorted(files)
    train, eval_, mask = _expected_streams(root, rels, 0.25)
    np.testing.assert_array_equal(split.train, train)
    np.testing.assert_array_equal(split.eval, eval_)
    assert split.n_files == 41 and 0 < split.n_eval_files < 41
    tok = ByteTokenizer()
    assert "file 0" in tok.decode(split.train) + tok.decode(split.eval)


def test_text_dir_rereads_a_changed_directory(tmp_path):
    root = _make_dir(tmp_path, {"a.txt": "aaaa", "b.txt": "bbbb"})
    first = load_source(DataConfig(source="text_dir", path=str(root)))
    (root / "c.txt").write_text("cccc")
    second = load_source(DataConfig(source="text_dir", path=str(root)))
    assert (first.n_files, second.n_files) == (2, 3)


def test_text_dir_errors(tmp_path):
    def err(path, **kw):
        with pytest.raises(ConfigError) as e:
            load_source(DataConfig(source="text_dir", path=str(path), **kw))
        return str(e.value)

    assert "needs data.path" in err("")
    assert "is not a directory" in err(tmp_path / "missing")
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    assert "contains no files: add text files" in err(tmp_path / "empty")
    one = _make_dir(tmp_path / "one", {"only.txt": "x" * 100})
    assert "gives only one file, but train and eval are split by file: add at least one more file" in err(one)
    two = _make_dir(tmp_path / "two", {"a.txt": "x" * 100, "b.txt": "y" * 100})
    assert "only one file within data.max_bytes=150" in err(two, max_bytes=150)
    assert "data.max_bytes=10 is smaller than the first file 'a.txt' (100 bytes)" in err(two, max_bytes=10)


def test_text_dir_max_bytes_is_inclusive(tmp_path):
    root = _make_dir(tmp_path, {"a.txt": "x" * 100, "b.txt": "y" * 100, "c.txt": "z" * 100})
    split = load_source(DataConfig(source="text_dir", path=str(root), max_bytes=200))
    assert split.n_files == 2 and len(split.train) + len(split.eval) == 200 + 2


def test_token_file_split_is_a_memmap_tail(tmp_path):
    ids = np.arange(70_000, 71_000, dtype=np.int64)  # above uint16 range
    path = write_token_file(tmp_path / "t.bin", ids, "uint32")
    assert path.stat().st_size == 4000
    split = load_source(DataConfig(source="tokens", path=str(path), token_dtype="uint32", eval_fraction=0.1))
    assert isinstance(split.train, np.memmap) and isinstance(split.eval, np.memmap)
    np.testing.assert_array_equal(split.train, ids[:900])
    np.testing.assert_array_equal(split.eval, ids[900:])
    assert split.n_files == 1

    p16 = write_token_file(tmp_path / "t16.bin", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "uint16")
    split16 = load_source(DataConfig(source="tokens", path=str(p16), eval_fraction=0.2))
    assert split16.train.tolist() == [1, 2, 3, 4, 5, 6, 7, 8] and split16.eval.tolist() == [9, 10]


def test_write_token_file_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match="does not fit uint16"):
        write_token_file(tmp_path / "t.bin", [0, 65536], "uint16")
    with pytest.raises(ValueError, match="dtype must be"):
        write_token_file(tmp_path / "t.bin", [0], "int8")


def test_token_file_errors(tmp_path):
    def err(path, **kw):
        with pytest.raises(ConfigError) as e:
            load_source(DataConfig(source="tokens", path=str(path), **kw))
        return str(e.value)

    assert "needs data.path: set it to the token file" in err("")
    assert "does not exist: point data.path at a flat token file" in err(tmp_path / "nope.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    assert "is empty" in err(tmp_path / "empty.bin")
    (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
    assert "has 6 bytes, not a multiple of 4 (uint32): set data.token_dtype" in err(
        tmp_path / "odd.bin", token_dtype="uint32"
    )
    write_token_file(tmp_path / "short.bin", np.arange(20), "uint16")
    assert "holds only 20 tokens, too few to hold out" in err(tmp_path / "short.bin", eval_fraction=0.05)
    assert "data.token_dtype='int64' is not supported" in err(tmp_path / "short.bin", token_dtype="int64")


def test_bad_source_and_fraction():
    with pytest.raises(ConfigError, match="data.source='web' is unknown: use stdlib, text_dir or tokens"):
        load_source(DataConfig(source="web"))
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        load_source(DataConfig(eval_fraction=1.0))

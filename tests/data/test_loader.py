import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxdist.config import ConfigError
from jaxdist.data import EVAL_SEED, Prefetcher, SequenceSampler, eval_sampler, global_batch_array, write_token_file

L, B, SEED = 8, 6, 3
TOKENS = np.arange(L * 13 + 1, dtype=np.uint32)  # 13 windows: batches straddle epochs


def reference_batch(tokens, seq_len, batch_size, seed, step):
    """The documented sampling rule, written out sample by sample."""
    n = (len(tokens) - 1) // seq_len
    out = []
    for j in range(batch_size):
        epoch, pos = divmod(step * batch_size + j, n)
        w = np.random.default_rng([seed, epoch]).permutation(n)[pos]
        out.append(tokens[w * seq_len : w * seq_len + seq_len + 1])
    return np.array(out, dtype=np.int32)


def test_batches_follow_the_documented_rule():
    s = SequenceSampler(TOKENS, L, B, SEED)
    assert s.n_windows == 13
    for step in range(12):  # ~5.5 epochs
        got = s.batch(step)
        assert got.shape == (B, L + 1) and got.dtype == np.int32
        np.testing.assert_array_equal(got, reference_batch(TOKENS, L, B, SEED, step))


def test_n_windows_definition():
    assert SequenceSampler(np.arange(4 * 5 + 1), 4, 1, 0).n_windows == 5
    assert SequenceSampler(np.arange(4 * 5), 4, 1, 0).n_windows == 4  # last window lacks its target
    assert SequenceSampler(np.arange(5), 4, 1, 0).n_windows == 1


def test_every_window_once_per_epoch():
    s = SequenceSampler(TOKENS, L, B, SEED)
    n_steps = 13  # 78 samples = 6 whole epochs
    starts = np.concatenate([s.batch(k)[:, 0] for k in range(n_steps)])
    epochs = starts.reshape(6, 13) // L
    for e in range(6):
        assert sorted(epochs[e].tolist()) == list(range(13))
    assert len({tuple(e) for e in epochs.tolist()}) > 1  # order changes between epochs
    # Consecutive tokens inside a window, one shared token between neighbours.
    rows = s.batch(0)
    np.testing.assert_array_equal(rows - rows[:, :1], np.broadcast_to(np.arange(L + 1), rows.shape))


def test_rows_subset_equals_batch_subset():
    s = SequenceSampler(TOKENS, L, B, SEED)
    for step in (0, 2, 7):
        full = s.batch(step)
        np.testing.assert_array_equal(s.rows(step, slice(2, 5)), full[2:5])
        np.testing.assert_array_equal(s.rows(step, np.array([5, 0, 3])), full[[5, 0, 3]])
        np.testing.assert_array_equal(s.rows(step, slice(None, None, 2)), full[::2])
    with pytest.raises(IndexError):
        s.rows(0, np.array([B]))


def test_resume_is_identical_to_an_uninterrupted_run():
    run = SequenceSampler(TOKENS, L, B, SEED)
    uninterrupted = [run.batch(k) for k in range(10)]
    resumed = SequenceSampler(TOKENS, L, B, SEED)
    for k in (9, 4, 5, 6, 0):  # any order: each batch is a pure function of its step
        np.testing.assert_array_equal(resumed.batch(k), uninterrupted[k])
    other_seed = SequenceSampler(TOKENS, L, B, SEED + 1)
    assert not np.array_equal(other_seed.batch(0), uninterrupted[0])


def test_memmap_tokens(tmp_path):
    path = write_token_file(tmp_path / "t.bin", np.arange(1000) % 300, "uint16")
    mm = np.memmap(path, dtype=np.uint16, mode="r")
    s = SequenceSampler(mm, 16, 4, 0)
    np.testing.assert_array_equal(s.batch(3), reference_batch(np.arange(1000) % 300, 16, 4, 0, 3))


def test_short_stream_errors_name_the_split():
    with pytest.raises(
        ConfigError, match="the train split has 8 tokens, fewer than one window of seq_len\\+1 = 9: lower train.seq_len"
    ):
        SequenceSampler(np.arange(8), 8, 2, 0)
    with pytest.raises(ConfigError, match="the eval split has 3 tokens"):
        eval_sampler(np.arange(3), 8, 2)


def test_eval_sampler_is_fixed():
    ev = eval_sampler(TOKENS, L, B)
    assert ev.seed == EVAL_SEED
    np.testing.assert_array_equal(ev.batch(1), reference_batch(TOKENS, L, B, EVAL_SEED, 1))
    np.testing.assert_array_equal(eval_sampler(TOKENS, L, B).batch(1), ev.batch(1))


class CountingSampler(SequenceSampler):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.reads = []

    def rows(self, step, rows=None):
        self.reads.append(rows)
        return super().rows(step, rows)


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == 8, "tests/conftest.py must force 8 host devices"
    return Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))


@pytest.mark.parametrize(
    "spec, n_reads",
    [
        (P(("data", "fsdp")), 4),  # tensor replicas share a read
        (P(("data", "fsdp"), "tensor"), 4),  # columns split too: still one read per row block
        (P("data"), 2),
        (P(), 1),
    ],
)
def test_global_batch_array_equals_sampler_batch(mesh, spec, n_reads):
    s = CountingSampler(TOKENS, L - 1, 8, SEED)  # L columns, divisible by tensor=2
    sharding = NamedSharding(mesh, spec)
    for step in (0, 3):  # step 3 straddles an epoch boundary
        s.reads.clear()
        arr = global_batch_array(s, step, sharding)
        assert arr.shape == (8, L) and arr.dtype == np.int32 and arr.sharding == sharding
        expected = s.batch(step)
        np.testing.assert_array_equal(np.asarray(arr), expected)
        for shard in arr.addressable_shards:  # each device holds exactly its slice
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
        assert len(s.reads) - 1 == n_reads  # minus the reference batch() above


def test_prefetcher_hands_out_in_order_and_runs_ahead():
    calls = []

    def fn(step):
        calls.append(step)
        return step * 10

    with Prefetcher(fn, start_step=5, depth=2) as pf:
        assert [pf.get(k) for k in range(5, 12)] == [50, 60, 70, 80, 90, 100, 110]
        deadline = time.time() + 5
        while len(calls) < 7 + 3 and time.time() < deadline:  # 2 queued + 1 waiting to be queued
            time.sleep(0.01)
        assert calls == list(range(5, 15))
        with pytest.raises(ValueError, match="expected step 12, got 13"):
            pf.get(13)
    assert not pf._thread.is_alive()


def test_prefetcher_reraises_at_the_failing_step():
    def fn(step):
        if step == 3:
            raise KeyError("bad shard")
        return step

    pf = Prefetcher(fn, start_step=0, depth=4)
    assert [pf.get(k) for k in range(3)] == [0, 1, 2]
    with pytest.raises(KeyError, match="bad shard"):
        pf.get(3)
    with pytest.raises(KeyError):  # stays failed
        pf.get(4)
    pf.close()


def test_prefetcher_close_unblocks_a_full_queue():
    started = threading.Event()

    def fn(step):
        started.set()
        return np.zeros(4)

    pf = Prefetcher(fn, start_step=0, depth=1)
    started.wait(5)
    t = time.time()
    pf.close()
    assert not pf._thread.is_alive() and time.time() - t < 2
    with pytest.raises(RuntimeError, match="after close"):
        pf.get(0)


def test_importing_data_does_not_start_jax():
    # The CLI loads config and data before it sets XLA_FLAGS, so JAX must stay unimported.
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, jaxdist.data; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])

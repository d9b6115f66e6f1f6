"""The batch list inside the Trainer: an addition joins at the next step boundary; any mesh reads the same batch.

Kills, resumes, resizes and a process-count change: tests/data/test_batchlist_kills.py.
"""

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from jaxdist.config import load_config
from jaxdist.data import (
    RunBatchList,
    add_data,
    check_exactly_once,
    digest_problems,
    format_id,
    global_batch_array,
    load_source,
    replay_order,
)
from jaxdist.data.batchlist import unpack_ids
from jaxdist.data.journal import Journal
from jaxdist.train.metrics import read_metrics
from jaxdist.train.trainer import Trainer

B, L = 8, 32


def config(tmp_path, steps, extra=()):
    return load_config(
        None,
        [
            "model=tiny",
            f"train.steps={steps}",
            f"train.seq_len={L}",
            f"train.batch_size={B}",
            "train.log_every=3",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.every=4",
            "data.max_bytes=100000",
            "train.warmup_steps=2",
            f"train.runs_dir={tmp_path}",
            "train.name=add",
            *extra,
        ],
    )


def test_addition_joins_at_the_next_step_boundary(tmp_path):
    new = tmp_path / "new.txt"
    new.write_bytes(bytes(np.random.default_rng(0).integers(97, 123, 40 * B * L, dtype=np.uint8)))  # 40 batches
    added = {}

    def add_once(trainer, step, metrics):
        if step == 5 and not added:
            added.update(add_data(trainer.run_dir, [new], seed=7))

    with Trainer(config(tmp_path, 12, ["mesh.data=8"])) as t:
        t.add_hook(add_once, every=1)
        t.fit(steps=10)  # 10 of 12 steps; saves at 4, 8 and 10
        v1, v2 = t.batches.journal.load(1), t.batches.current
    run = tmp_path / "add"
    # Picked up at the boundary after step 5, without a restart: splice 5, the new batches shuffled in after it.
    assert v2.version == 2 and v2.op["splice"] == 5 and v2.op["request"] == added["request"]
    np.testing.assert_array_equal(v2.order[:5], v1.order[:5])
    assert np.sum(unpack_ids(v2.order)[0] == 1) == 40
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 11))
    assert [r["batch_version"] for r in rows] == [1] * 5 + [2] * 5
    assert [r["batch_id"] for r in rows] == [format_id(x) for x in v2.order[:10]]

    # The newest checkpoint (step 10) recorded version 2 and cursor 10; the log matches the journal.
    assert Journal(run).read_cursor()["version"] == 2 and Journal(run).read_cursor()["cursor"] == 10
    report = check_exactly_once(run)
    assert report == {
        "trained": 10,
        "duplicates": 0,
        "missing": 0,
        "misplaced": 0,
        "gaps": 0,
        "unused": len(v2) - 10,
        "version": 2,
        "ok": True,
    }
    np.testing.assert_array_equal(replay_order(Journal(run)), v2.order)
    # The tokens each step trained (the step's own digest of its input) are the ones its logged id names, read
    # again from both sources: a trainer feeding one batch while logging another's id fails here.
    cfg = config(tmp_path, 12, ["mesh.data=8"])
    assert digest_problems(run, load_source(cfg.data).train) == []


def test_global_batch_is_the_same_on_any_mesh(tmp_path):
    """Each device (and so each process) reads only its rows, and they always assemble the same global batch."""
    tokens = np.arange(B * L * 6 + 1, dtype=np.uint32)
    run = RunBatchList(tmp_path, tokens, "synthetic", 0, B, L)
    for pos in (0, 5):
        want = run.reader.batch(pos)
        for shape in ((8, 1), (4, 2), (2, 4), (1, 8)):
            mesh = jax.make_mesh(shape, ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
            arr = global_batch_array(run.reader, pos, NamedSharding(mesh, P("data", None)))
            np.testing.assert_array_equal(np.asarray(arr), want)
            for shard in arr.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
        # Two processes of four replicas each: their row slices are the two halves of the same batch.
        np.testing.assert_array_equal(
            np.concatenate([run.reader.rows(pos, slice(0, B // 2)), run.reader.rows(pos, slice(B // 2, B))]), want
        )

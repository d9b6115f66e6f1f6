"""Real multi-process checkpoints: 4 JAX processes x 2 CPU devices (jax.distributed, gloo).

* balance: with fully replicated parameters (``data=8``) and with ``fsdp=8``,
  the bytes of the files each process wrote differ by at most 5% (max/mean);
* restore anywhere: both checkpoints restore bit for bit onto ``fsdp=4,
  tensor=2`` on 2 processes x 4 devices and on this 1-process, 8-device pytest;
* fault injection: process 1 is SIGKILLed in the middle of a save (stalled
  inside orbax's array writes, or after them inside jaxdist's checksum
  phase): the previous checkpoint stays committed and restorable, the partial
  one is ignored (orbax's temporary folder removed, an uncommitted step folder
  set aside), nothing committed is lost (``keep=1``).

The saved values are pseudo-random from a seed (see worker.py), so every
process and this test know the exact expected bits without gathering.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Group, cluster_file  # noqa: E402

TIMEOUT = 180  # seconds for one process group; a healthy one takes ~10 s
MAX_OVER_MEAN = 1.05


def common(tmp: Path, cluster: str) -> list[str]:
    return [
        "model=small",
        "train.seq_len=32",
        "train.batch_size=8",
        "data.max_bytes=200000",
        f"mesh.cluster={cluster}",
        f"train.runs_dir={tmp / 'runs'}",
    ]


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """Save the small model's state (params + Adam moments, ~9.9 MB) from 4 processes, data=8 and fsdp=8."""
    tmp = tmp_path_factory.mktemp("ckpt4")
    cl = str(cluster_file(tmp, 4, 2))
    jobs = [
        {
            "overrides": common(tmp, cl) + [f"mesh.{axis}=8", f"train.name={axis}"],
            "ckpt": str(tmp / f"ck_{axis}"),
            "seed": seed,
        }
        for seed, axis in enumerate(("data", "fsdp"))
    ]
    t0 = time.perf_counter()
    with Group(tmp, 4, 2, ["save", json.dumps({"jobs": jobs})], tag="save") as g:
        g.wait(TIMEOUT)
        results = [g.results(i) for i in range(4)]
    print(f"\n4-process save group: {time.perf_counter() - t0:.1f} s")
    return tmp, jobs, results


def files_by_process(step_dir: Path) -> list[int]:
    """Bytes of the files under ``step_dir``, by the process whose folder holds them (the rest: process 0)."""
    out = [0] * 4
    for root, _, files in os.walk(step_dir):
        rel = Path(root).relative_to(step_dir).as_posix()
        if rel.startswith("jaxdist_checksums"):
            continue
        owner = next((int(part.split("_")[-1]) for part in rel.split("/") if part.startswith("ocdbt.process_")), 0)
        out[owner] += sum(os.path.getsize(Path(root) / f) for f in files if f != "jaxdist_commit.json")
    return out


@pytest.mark.parametrize("axis", ["data", "fsdp"])
def test_four_processes_write_even_bytes(four, axis):
    tmp, _, results = four
    step_dir = tmp / f"ck_{axis}" / "1"
    written = files_by_process(step_dir)
    ratio = max(written) * 4 / sum(written)
    print(f"\n{axis}=8: file bytes per process {written}, max/mean {ratio:.4f}")
    assert ratio <= MAX_OVER_MEAN
    assert all(b > 2_000_000 for b in written)  # everyone wrote a quarter of ~9 MB
    marker = json.loads((step_dir / "jaxdist_commit.json").read_text())
    assert marker["bytes_written_per_process"] == written and marker["num_processes"] == 4
    job = results[0][["data", "fsdp"].index(axis)]
    assert job["written"] == written
    planned = job["planned"]
    assert max(planned) - min(planned) <= 4  # the plan: equal array bytes but for one 4-byte scalar
    assert all(r[["data", "fsdp"].index(axis)]["planned"] == planned for r in results)  # same plan everywhere
    # The plan recomputed from the recorded layout, without devices (what `jaxdist ckpt plan` prints).
    from jaxdist.checkpoint import plan_from_layout

    assert plan_from_layout(marker["layout"], 4).bytes_per_process() == planned
    naive = plan_from_layout(marker["layout"], 4, "replica0").bytes_per_process()
    if axis == "data":
        assert naive == [sum(planned), 0, 0, 0]
    else:  # fsdp=8 shards all but the norms and counters, which replica 0 (process 0) would write
        assert naive[0] > naive[1] == naive[2] == naive[3] > 0


def test_restore_onto_two_processes_with_another_mesh(four):
    tmp, jobs, _ = four
    restore = [
        {
            "overrides": common(tmp, "cpu-2x4") + ["mesh.fsdp=4", "mesh.tensor=2", "train.name=r2"],
            "ckpt": j["ckpt"],
            "seed": j["seed"],
        }
        for j in jobs
    ]
    # Then the fsdp checkpoint again with process 1 lacking crc32c: both processes refuse with one sentence
    # (neither waits for the other at the verification's allgather) and nothing is set aside as damaged.
    lacking = {**restore[1], "no_crc32c": 1}
    with Group(tmp, 2, 4, ["restore", json.dumps({"jobs": restore + [lacking]})], tag="restore") as g:
        g.wait(TIMEOUT)
        for i in range(2):
            got = g.results(i)
            assert [r["ckpt"] for r in got] == [j["ckpt"] for j in jobs] + [jobs[1]["ckpt"]]
            assert all(r["equal"] and r["on_target"] and r["step"] == 1 for r in got[:2]), got
            error, step_dir = got[2]["error"], f"{jobs[1]['ckpt']}/1"
            if i == 0:
                assert error == (
                    f"process 1 cannot check {step_dir}'s CRC-32C checksums (no crc32c there): "
                    "install crc32c on every host (pip install crc32c)."
                )
            else:
                assert error.startswith(f"{step_dir}/") and error.endswith(
                    " is checksummed with CRC-32C and this Python lacks the crc32c package to check it: "
                    "install it (pip install crc32c)."
                ), error
    assert (Path(jobs[1]["ckpt"]) / "1").is_dir()  # not set aside


def test_a_read_that_fails_on_one_process_or_damage_stops_every_process_and_names_it(four):
    """Orbax reads while the checksums are checked: a process whose read fails (files intact) and a damaged
    file both reach every process within the group's timeout (no process left waiting for a peer that gave up)."""
    tmp, jobs, _ = four
    intact, damaged = tmp / "ck_readfail", tmp / "ck_damaged"
    shutil.copytree(jobs[1]["ckpt"], intact)
    shutil.copytree(jobs[1]["ckpt"], damaged)
    data = max(
        (p for p in (damaged / "1").rglob("*") if p.is_file() and "ocdbt.process_1" in str(p)),
        key=lambda p: p.stat().st_size,
    )
    with open(data, "r+b") as f:  # same size, different bytes: only the checksum can tell
        f.seek(data.stat().st_size // 2)
        chunk = f.read(64)
        f.seek(data.stat().st_size // 2)
        f.write(bytes(b ^ 0xFF for b in chunk))
    over = common(tmp, "cpu-2x4") + ["mesh.fsdp=4", "mesh.tensor=2", "train.name=rf"]
    spec = [
        {"overrides": over, "ckpt": str(intact), "read_fails_on": 1, "expect_error": True},
        {"overrides": over, "ckpt": str(damaged), "step": 1, "expect_error": True},
    ]
    with Group(tmp, 2, 4, ["restore", json.dumps({"jobs": spec})], tag="readfail") as g:
        g.wait(TIMEOUT)
        got = [g.results(i) for i in range(2)]
    assert got[1][0]["error"] == "OSError: simulated read failure"
    assert got[0][0]["error"] == (
        f"RuntimeError: another process could not read checkpoint {intact}/1 (its files match their checksums): "
        "see that process's log"
    )
    assert (intact / "1" / "jaxdist_commit.json").is_file()  # intact: not set aside
    rel = data.relative_to(damaged / "1").as_posix()
    for i in range(2):
        error = got[i][1]["error"]
        assert error.startswith(f"CheckpointDamaged: checkpoint {damaged}/1 is damaged: "), error
        assert error.endswith("; restore another step or rewrite it."), error
    assert f"{rel} has CRC-32C " in got[0][1]["error"] + got[1][1]["error"]  # the process that checked it names it
    assert "moved to 1.damaged" in got[0][1]["error"]
    assert (damaged / "1.damaged").is_dir() and not (damaged / "1").exists()


def test_restore_onto_one_process_with_another_mesh(four):
    from worker import matches, reference, trainer_for

    from jaxdist.checkpoint import RunCheckpointer

    tmp, jobs, _ = four
    with trainer_for(common(tmp, "cpu-8") + ["mesh.fsdp=4", "mesh.tensor=2", "train.name=r1"]) as t:
        target = t.abstract_state()
    for job in jobs:
        state, meta = RunCheckpointer(job["ckpt"]).restore(target)
        assert meta["step"] == 1
        assert matches(state, reference(target, job["seed"]))
        assert not matches(state, reference(target, job["seed"] + 7))  # the check can fail


@pytest.mark.parametrize("phase", ["write", "checksum"])
def test_writer_killed_mid_save_loses_nothing_committed(tmp_path, phase, caplog):
    ck = tmp_path / "ck"
    with Group(tmp_path, 2, 2, ["kill", json.dumps({"ckpt": str(ck), "phase": phase, "keep": 1})], tag="kill") as g:
        g.wait_for_line(1, "STALLED 3", TIMEOUT)
        g.wait_for_line(0, "SAVING 3", TIMEOUT)
        time.sleep(0.2)
        g.kill(1)  # SIGKILL the stalled writer, then (as a group restart would) its peer
        g.kill(0)
    left = sorted(os.listdir(ck))
    assert left == ["2", "3"], left
    # write: orbax had begun <step>/state (only its temporary folder there); checksum: orbax had finished
    inside = sorted(os.listdir(ck / "3"))
    if phase == "write":
        assert inside == ["state.orbax-checkpoint-tmp"], inside
    else:
        assert {"meta", "state"} <= set(inside) and not any("tmp" in n for n in inside), inside

    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from jaxdist.checkpoint import RunCheckpointer, integrity

    with caplog.at_level(logging.WARNING, logger="jaxdist.checkpoint.manager"):
        restored = RunCheckpointer(ck)
    if phase == "write":  # orbax's temporary folder: removed
        assert f"removing {ck / left[1]}: a checkpoint save that never completed" in caplog.text
        assert sorted(os.listdir(ck)) == ["2"]
    else:  # renamed but never committed: ignored and set aside
        assert f"ignoring {ck / '3'}: no commit marker" in caplog.text
        assert sorted(os.listdir(ck)) == ["2", "3.incomplete"]
    assert restored.all_steps() == [2] and restored.latest_step() == 2
    marker = integrity.read_commit(ck / "2")
    assert integrity.verify_files(ck / "2", marker["files"]) == []
    # Restore on 1 process x 8 devices with a different layout: the step-2 values of worker.synthetic_state.
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    target = {
        "r": jax.ShapeDtypeStruct((6, 10), np.float32, sharding=NamedSharding(mesh, P())),
        "s": jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(mesh, P())),
        "w": jax.ShapeDtypeStruct((16, 24), np.float32, sharding=NamedSharding(mesh, P(None, "x"))),
    }
    state, meta = restored.restore(target)
    assert meta == {"step": 2} and int(state["s"]) == 2
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(384, dtype=np.float32).reshape(16, 24) * 0.5 + 2)
    np.testing.assert_array_equal(np.asarray(state["r"]), np.arange(60, dtype=np.float32).reshape(6, 10) + 2)
    restored.close()

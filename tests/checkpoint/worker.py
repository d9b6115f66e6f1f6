"""One process of a multi-process checkpoint test or benchmark: ``worker.py MODE JSON``.

Modes (JSON fields in brackets):

* ``save`` [jobs: overrides, ckpt, seed, strategy, saves, keep]: build a
  Trainer per job, fill its train state (params, Adam moments, counters)
  with pseudo-random values from ``seed``, save with RunCheckpointer;
  prints ``RESULT`` per job.
* ``steps`` [overrides, ckpt, steps, every]: time training steps with and
  without an async save in between (benchmark of the blocked time).
* ``restore`` [jobs: overrides, ckpt, seed]: restore onto this job's mesh and
  compare every shard with the values of ``seed`` bit for bit.
* ``fit`` [overrides, crash_at]: ``Trainer.fit`` (checkpoints on); with
  ``crash_at``, every process exits with code 17 at that step, once the
  previous step's local and persistent checkpoints are committed; prints ``RESULT`` with where
  it resumed from and a SHA-256 of the whole final state.
* ``tiers`` [overrides, ckpt, local, steps]: time ``steps`` training steps
  with no checkpoint, with a persistent (orbax, async) save after every step
  and with a local-tier save after every step; then restore both, the local
  one with rank 2's own files deleted (a replaced node: its shards come from
  its peer); prints ``RESULT`` with the times.
* ``kill`` [ckpt, phase, keep]: commit steps 1 and 2 of a synthetic state,
  then start step 3 and stall in ``phase`` ("write": orbax's array writes,
  "checksum": jaxdist's commit) on process 1, printing ``SAVING 3`` /
  ``STALLED 3`` so the parent can SIGKILL it there.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from jaxdist.train.distributed import initialize_from_env

initialize_from_env()
print("INITIALIZED", flush=True)  # procs.Group waits for it (and starts again if the coordinator's port was taken)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from jaxdist.checkpoint import RunCheckpointer, integrity  # noqa: E402
from jaxdist.train.compile_cache import configure_compile_cache  # noqa: E402

if os.environ.get("JAXDIST_TEST_COMPILE_CACHE"):  # the test session's shared cache (tests/conftest.py)
    configure_compile_cache(os.environ["JAXDIST_TEST_COMPILE_CACHE"])
from jaxdist.checkpoint.writer import named_leaves  # noqa: E402
from tests.trees import leaf_pairs  # noqa: E402

_T0 = time.perf_counter()


def mark(what: str) -> None:
    print(f"TIME {time.perf_counter() - _T0:7.2f} s {what}", flush=True)


def result(obj) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


def trainer_for(overrides):
    from jaxdist.config import load_config
    from jaxdist.train.trainer import Trainer

    cfg = load_config(
        None,
        [
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.enabled=false",
            "train.eval_every=0",
            *overrides,
        ],
    )
    return Trainer(cfg)


class Reference(Mapping):
    """Deterministic pseudo-random global values for every leaf of ``abstract`` (same on every process), name ->
    array, each made when asked and only the last one kept: a 4 GB state is not held twice per process."""

    def __init__(self, abstract, seed: int):
        self.seed, self.leaves = seed, {n: (i, a.shape, a.dtype) for i, (n, a) in enumerate(named_leaves(abstract))}
        self._last: tuple[str | None, np.ndarray | None] = (None, None)

    def __getitem__(self, name: str) -> np.ndarray:
        if self._last[0] != name:
            i, shape, dtype = self.leaves[name]
            self._last = (None, None)  # the previous leaf goes before the next is made
            rng = np.random.default_rng([self.seed, i])
            if np.issubdtype(dtype, np.floating):
                value = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
            else:
                value = rng.integers(0, 2**31 - 1, size=shape).astype(dtype)
            self._last = (name, value)
        return self._last[1]

    def __iter__(self):
        return iter(self.leaves)

    def __len__(self) -> int:
        return len(self.leaves)


def reference(abstract, seed: int) -> Reference:
    """:class:`Reference` values of ``abstract``'s leaves for ``seed``."""
    return Reference(abstract, seed)


def random_state(abstract, seed: int):
    """A train state laid out like ``abstract`` holding :func:`reference` values (no compilation)."""
    ref = reference(abstract, seed)
    leaves = [
        jax.make_array_from_callback(a.shape, a.sharding, lambda idx, n=n: ref[n][idx])
        for n, a in named_leaves(abstract)
    ]
    return jax.tree.unflatten(jax.tree.structure(abstract), leaves), ref


def matches(state, ref: Mapping[str, np.ndarray]) -> bool:
    """Every addressable shard of every leaf equals the reference bit for bit (dtype included)."""
    return all(
        s.data.dtype == ref[n].dtype and np.array_equal(np.asarray(s.data), ref[n][s.index])
        for n, a in named_leaves(state)
        for s in a.addressable_shards
    )


def mode_save(spec) -> None:
    """Save each job's state ``saves`` times; ``"strategy": "orbax"`` saves with plain orbax's StandardCheckpointer
    instead, ``"pair"`` with both alternately (benchmarks/checkpoint.py); ``"restores": n`` then times n restores
    of the newest step (each one's seconds in ``restore_s``)."""
    for job in spec["jobs"]:
        mark("start")
        with trainer_for(job["overrides"]) as t:
            abstract = t.abstract_state()
            state, ref = random_state(abstract, job.get("seed", 0))
            mark("state")
            if job.get("strategy") == "orbax":
                result({"ckpt": job["ckpt"], **_orbax_save(job, state, abstract, ref), "process": jax.process_index()})
                continue
            if job.get("strategy") == "pair":
                result({"ckpt": job["ckpt"], **_paired(job, state, abstract, ref), "process": jax.process_index()})
                continue
            ck = RunCheckpointer(
                job["ckpt"],
                keep=job.get("keep", 3),
                strategy=job.get("strategy", "balanced"),
                verify=job.get("verify", True),
            )
            times = _timed_saves(job, lambda s, ck=ck, state=state: ck.save(s, state, {"step": s}), ck.wait)
            restore_s = _timed_restores(job, ref, lambda ck=ck, abstract=abstract: ck.restore(abstract)[0])
            ck.close()
            mark("saved")
            result(
                {
                    "ckpt": job["ckpt"],
                    "save_s": times,
                    "restore_s": restore_s,
                    "planned": ck.stats[-1].planned_bytes,
                    "written": ck.stats[-1].written_bytes,
                    "process": jax.process_index(),
                }
            )


def _timed_saves(job, save, wait) -> list[tuple[float, float]]:
    """``save(step)`` for steps 1..``saves``, each finished (``wait()``) before the next: (blocked, total) seconds."""
    times = []
    for s in range(job.get("saves", 1)):
        t0 = time.perf_counter()
        save(s + 1)
        blocked = time.perf_counter() - t0
        wait()
        times.append((blocked, time.perf_counter() - t0))
    return times


def _timed_restores(job, ref, restore) -> list[float]:
    """Seconds of each of ``restores`` calls of ``restore()`` (the state on the devices), each checked against
    ``ref``."""
    out = []
    for _ in range(job.get("restores", 0)):
        t0 = time.perf_counter()
        got = restore()
        jax.block_until_ready(got)
        out.append(time.perf_counter() - t0)
        assert matches(got, ref), "the restored state differs from the saved one"
        del got  # before the next restore: a 4 GB state is not held twice
    return out


def _orbax_save(job, state, abstract, ref) -> dict:
    """Plain orbax (``StandardCheckpointer``: async, OCDBT) saving ``state`` like mode_save: save times, restore.

    Every step is kept (give the jaxdist job to compare ``keep`` >= ``saves`` so neither deletes a step)."""
    import orbax.checkpoint as ocp

    root = Path(job["ckpt"])
    ck = ocp.StandardCheckpointer()
    times = _timed_saves(job, lambda s: ck.save(root / str(s), state), ck.wait_until_finished)
    restore_s = _timed_restores(job, ref, lambda: ck.restore(root / str(job.get("saves", 1)), abstract))
    ck.close()
    written = [0] * jax.process_count()
    for path in (root / str(job.get("saves", 1))).rglob("*"):
        if path.is_file():
            written[integrity.writer_of(path.relative_to(root / str(job.get("saves", 1))).as_posix())] += (
                path.stat().st_size
            )
    return {"save_s": times, "restore_s": restore_s, "planned": None, "written": written}


def _paired(job, state, abstract, ref) -> dict:
    """jaxdist's RunCheckpointer (balanced, verified, the defaults) and plain orbax's StandardCheckpointer saving
    and restoring the same state alternately, which goes first swapped every round (so neither gains from the
    other's warm-up or the machine's drift): ``{"jaxdist": {...}, "orbax": {...}}`` with save_s, restore_s and
    orbax's bytes written per process (jaxdist's are in its commit marker, ``<ckpt>/jaxdist/<saves>``)."""
    import orbax.checkpoint as ocp

    root, saves = Path(job["ckpt"]), job.get("saves", 1)
    ours, plain = RunCheckpointer(root / "jaxdist", keep=saves), ocp.StandardCheckpointer()
    out = {name: {"save_s": [], "restore_s": []} for name in ("jaxdist", "orbax")}
    save = {
        "jaxdist": lambda s: ours.save(s, state, {"step": s}),
        "orbax": lambda s: plain.save(root / "orbax" / str(s), state),
    }
    wait = {"jaxdist": ours.wait, "orbax": plain.wait_until_finished}
    restore = {
        "jaxdist": lambda: ours.restore(abstract)[0],
        "orbax": lambda: plain.restore(root / "orbax" / str(saves), abstract),
    }
    for k in range(saves):
        for name in ("jaxdist", "orbax") if k % 2 == 0 else ("orbax", "jaxdist"):
            out[name]["save_s"] += _timed_saves({"saves": 1}, lambda _, n=name, s=k + 1: save[n](s), wait[name])
    for k in range(job.get("restores", 0)):
        for name in ("jaxdist", "orbax") if k % 2 == 0 else ("orbax", "jaxdist"):
            out[name]["restore_s"] += _timed_restores({"restores": 1}, ref, restore[name])
    ours.close()
    plain.close()
    written = [0] * jax.process_count()
    for path in (root / "orbax" / str(saves)).rglob("*"):
        if path.is_file():
            written[integrity.writer_of(path.relative_to(root / "orbax" / str(saves)).as_posix())] += (
                path.stat().st_size
            )
    out["orbax"]["written"] = written
    return out


def train(t, steps: int):
    state = t.init_state()
    for i in range(steps):
        state, m = t.train_step(state, t.batch(i))
    jax.block_until_ready(state)
    return state


def mode_steps(spec) -> None:
    with trainer_for(spec["overrides"]) as t:
        state = train(t, 2)  # compiled and warm
        ck = RunCheckpointer(spec["ckpt"], keep=2)
        ck.save(0, state, {"step": 0})  # orbax's first-save warm-up, not timed
        ck.wait()
        step_s = []
        for i in range(spec["steps"]):
            t0 = time.perf_counter()
            state, m = t.train_step(state, t.batch(i))
            jax.block_until_ready(m)
            step_s.append(time.perf_counter() - t0)
            if (i + 1) % spec["every"] == 0:
                ck.save(i + 1, state, {"step": i + 1})
        ck.close()
        timed = ck.stats[1:]
        result(
            {
                "step_s": step_s,
                "blocked_s": [s.blocked_s for s in timed],
                "waited_s": [s.waited_s for s in timed],
                "busy": ck.busy_saves,
                "background_s": [s.background_s for s in timed],
            }
        )


def mode_restore(spec) -> None:
    """Restore each job's checkpoint; a job with ``"no_crc32c": i`` restores as if process i lacked crc32c, one
    with ``"read_fails_on": i`` as if orbax's read failed on process i, one with ``"expect_error"`` (and maybe
    ``"step"``) reports the exception it raised."""
    for job in spec["jobs"]:
        with trainer_for(job["overrides"]) as t:
            target = t.abstract_state()
            if "no_crc32c" in job:
                real = integrity._crc32c_module
                lacking = jax.process_index() == job["no_crc32c"]
                integrity._crc32c_module = (lambda: None) if lacking else real
                try:
                    RunCheckpointer(job["ckpt"]).restore(target)
                    result({"ckpt": job["ckpt"], "error": None})
                except integrity.ChecksumUnavailable as e:
                    result({"ckpt": job["ckpt"], "error": str(e)})
                finally:
                    integrity._crc32c_module = real
                continue
            ck = RunCheckpointer(job["ckpt"])
            if job.get("read_fails_on") == jax.process_index():  # this process's read fails; its files are intact

                def fail(*_, **__):
                    raise OSError("simulated read failure")

                ck._handler.restore = fail
            if "expect_error" in job:
                try:
                    ck.restore(target, step=job.get("step"))
                    result({"ckpt": job["ckpt"], "error": None})
                except Exception as e:
                    result({"ckpt": job["ckpt"], "error": f"{type(e).__name__}: {e}"})
                continue
            state, meta = ck.restore(target)
            on_target = all(a.sharding == b.sharding for a, b in leaf_pairs(state, target))
            result(
                {
                    "ckpt": job["ckpt"],
                    "equal": matches(state, reference(target, job.get("seed", 0))),
                    "on_target": on_target,
                    "step": meta["step"],
                    "process": jax.process_index(),
                }
            )


def synthetic_state(step: int, mesh) -> dict:
    """A state whose values are a closed-form function of ``step``."""

    def make(shape, spec, scale):
        fn = lambda: jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape) * scale + step
        return jax.jit(fn, out_shardings=NamedSharding(mesh, spec))()

    return {
        "w": make((16, 24), P("fsdp"), 0.5),
        "r": make((6, 10), P(), 1.0),
        "s": jax.jit(lambda: jnp.int32(step), out_shardings=NamedSharding(mesh, P()))(),
    }


def mode_fit(spec) -> None:
    import hashlib
    import os

    from jax.experimental import multihost_utils

    from jaxdist.config import load_config
    from jaxdist.train.trainer import Trainer

    cfg = load_config(
        None, ["train.progress=false", "train.tensorboard=false", "train.eval_every=0", *spec["overrides"]]
    )
    with Trainer(cfg) as t:
        crash_at = spec.get("crash_at")

        def crash(tr, step, _):
            if step == crash_at:
                tr.local.wait()
                tr.checkpointer.wait()  # the previous persistent step committed too, however loaded the host
                print(f"CRASH {step}", flush=True)
                os._exit(17)

        t.add_hook(crash)
        t.init_state()
        resumed = t.resumed_from
        print(f"RESUMED {json.dumps(resumed)}", flush=True)
        t.fit()
        digest = hashlib.sha256()
        for name, leaf in named_leaves(multihost_utils.process_allgather(t.state, tiled=True)):
            digest.update(name.encode() + np.ascontiguousarray(leaf).tobytes())
        result(
            {
                "resumed_from": resumed,
                "digest": digest.hexdigest(),
                "step": int(jax.device_get(t.state["step"])),
                "shift": t.local.shift if t.local else None,
                "local_steps": sorted(t.local._own_steps()) if t.local else None,
            }
        )


def mode_tiers(spec) -> None:
    from pathlib import Path

    from jaxdist.checkpoint.local import LocalTier

    with trainer_for(spec["overrides"]) as t:
        state = train(t, 2)  # compiled and warm
        ck = RunCheckpointer(spec["ckpt"], keep=2)
        local = LocalTier(Path(spec["local"]) / f"rank{jax.process_index()}", keep=2)
        for s in (1, 2):  # first saves (orbax set-up, compiling the ring transfer): not timed
            ck.save(s, state, {"step": s})
            local.save(s, state, {"step": s})
        ck.wait()
        local.wait()
        out = {}
        for name, save in (("none", None), ("persistent", ck.save), ("local", local.save)):
            times = []
            for i in range(spec["steps"]):
                t0 = time.perf_counter()
                state, m = t.train_step(state, t.batch(i))
                jax.block_until_ready(m)
                if save is not None:
                    save(100 + i, state, {"step": 100 + i})
                times.append(time.perf_counter() - t0)
            ck.wait()
            local.wait()
            out[name] = times
        n = spec["steps"]
        out["persistent_blocked"] = [x.blocked_s + x.waited_s for x in ck.stats[-n:]]
        out["persistent_background"] = [x.background_s for x in ck.stats[-n:]]
        out["local_blocked"] = [x.blocked_s for x in local.stats[-n:]]
        out["local_replicate"] = [x.replicate_s for x in local.stats[-n:]]
        out["local_background"] = [x.background_s for x in local.stats[-n:]]
        out["local_payload"] = local.stats[-1].payload_bytes
        out["local_sent"] = local.stats[-1].sent_bytes
        abstract = t.abstract_state()
        if jax.process_index() == 2:  # rank 2's node is "replaced": its own files are gone
            for f in local.directory.glob("*/r2.w2.*"):
                f.unlink()
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        restored, meta = local.restore(abstract)
        jax.block_until_ready(restored)
        out["local_restore_s"] = time.perf_counter() - t0
        assert meta["step"] == 99 + n and all(
            np.array_equal(np.asarray(a.addressable_shards[0].data), np.asarray(b.addressable_shards[0].data))
            for a, b in leaf_pairs(restored, state)
        )
        t0 = time.perf_counter()
        restored, meta = ck.restore(abstract)
        jax.block_until_ready(restored)
        out["persistent_restore_s"] = time.perf_counter() - t0
        ck.close()
        result(out)


def mode_kill(spec) -> None:
    n = jax.device_count()
    mesh = jax.make_mesh((2, n // 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    ck = RunCheckpointer(spec["ckpt"], keep=spec.get("keep", 1))
    for step in (1, 2):
        ck.save(step, synthetic_state(step, mesh), {"step": step})
        ck.wait()
    print("COMMITTED 2", flush=True)
    stall = jax.process_index() == 1
    if stall and spec["phase"] == "write":
        from orbax.checkpoint._src.serialization import serialization

        original = serialization.async_serialize_from_host
        calls = []

        async def slow(*args, **kwargs):  # write one array, then hang like a stuck disk
            calls.append(1)
            if len(calls) > 1:
                print("STALLED 3", flush=True)
                await asyncio.sleep(3600)
            return await original(*args, **kwargs)

        serialization.async_serialize_from_host = slow
    if stall and spec["phase"] == "checksum":

        def stuck(step_dir, process):
            print("STALLED 3", flush=True)
            threading.Event().wait(3600)

        integrity.record_own_checksums = stuck
    ck.save(3, synthetic_state(3, mesh), {"step": 3})
    print("SAVING 3", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    {
        "save": mode_save,
        "steps": mode_steps,
        "restore": mode_restore,
        "kill": mode_kill,
        "fit": mode_fit,
        "tiers": mode_tiers,
    }[sys.argv[1]](json.loads(sys.argv[2]))

"""jaxdist's RunCheckpointer against plain orbax on the same state, side by side (issue 41).

One process with 8 simulated CPU devices saves a pytree of pseudo-random
float32 arrays (so compression cannot flatter anyone), sharded over ``fsdp=8``
and fully replicated, at about 200 MB and 1 GB (``--big``: also 4 GB), with

* ``jaxdist``: :class:`jaxdist.checkpoint.RunCheckpointer` (async, balanced plan,
  CRC-32C checksums, commit marker; restore verifies the files first);
* ``jd crc32``: the same with zlib's CRC-32 (what a host without ``google-crc32c``
  records, and what every save recorded before CRC-32C);
* ``orbax std``: ``ocp.StandardCheckpointer`` (async, OCDBT: orbax's defaults);
* ``orbax mgr``: ``ocp.CheckpointManager`` with what a careful orbax user sets:
  ``enable_async_checkpointing=True``, OCDBT and replica-parallel writing (the
  defaults on CPU).

Each keeps one step, the previous one deleted between saves outside the
timing (deleting a step costs the same to all three).

For each it prints, median over ``--rounds`` rounds with the three alternated:
``save s``: from ``save()`` until the checkpoint is committed (jaxdist: its
marker is written; orbax: ``wait_until_finished``), ``blocked s``: of which
``save()`` blocked the caller, ``restore s``: a restore onto the same sharding
(jaxdist: with its checksum verification), and the ratios jaxdist / orbax.

    python benchmarks/checkpoint_vs_orbax.py                  # 200 MB and 1 GB, ~2-3 minutes on 2 cores
    python benchmarks/checkpoint_vs_orbax.py --sizes 200      # one size
    python benchmarks/checkpoint_vs_orbax.py --profile jaxdist  # py-spy-free profile of one save (cProfile,
                                                                # all threads), top functions by own time
    python benchmarks/checkpoint_vs_orbax.py --checksums      # the checksums alone: CRC-32C against CRC-32
                                                              # over 200 MB, 1 GB and 4 GB of files

``--checksums`` writes files of random bytes (64 MiB each, as large as orbax's OCDBT data files get here), reads
them once into the page cache, then times :func:`jaxdist.checkpoint.integrity.files_checksums` over them with each
algorithm (median of 3): wall seconds and the CPU seconds of every thread (``time.process_time``), which the wall
time of 4 threads on few cores hides.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import (  # noqa: E402
    Mesh,
    NamedSharding,
    PartitionSpec as P,  # noqa: E402
)

from jaxdist.checkpoint import RunCheckpointer, abstract_like, integrity  # noqa: E402

ROWS = 2048  # each array is ROWS x COLS float32 = 16 MiB
COLS = 2048


def make_state(mb: int, sharding: str) -> dict:
    """About ``mb`` MB of pseudo-random float32 arrays on 8 devices, ``fsdp``-sharded on rows or replicated."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    spec = P("fsdp") if sharding == "fsdp" else P()
    sh = NamedSharding(mesh, spec)
    n = max(1, round(mb * 1e6 / (ROWS * COLS * 4)))
    make = jax.jit(lambda k: jax.random.normal(k, (ROWS, COLS), jnp.float32), out_shardings=sh)
    keys = jax.random.split(jax.random.key(0), n)
    state = {"params": {f"w{i:03d}": make(keys[i]) for i in range(n)}, "step": jnp.int32(7)}
    jax.block_until_ready(state)
    return state


class Jaxdist:
    name = "jaxdist"

    def __init__(self, root: Path):
        self.root = root
        self.ckpt = RunCheckpointer(root, keep=1000)
        self.step = 0

    def save(self, state) -> tuple[float, float]:
        if self.step:  # like keep=1, outside the timing
            shutil.rmtree(self.root / str(self.step), ignore_errors=True)
        self.step += 1
        t0 = time.perf_counter()
        self.ckpt.save(self.step, state, {"step": self.step})
        blocked = time.perf_counter() - t0
        self.ckpt.wait()
        return time.perf_counter() - t0, blocked

    def restore(self, abstract) -> float:
        t0 = time.perf_counter()
        state, _ = self.ckpt.restore(abstract, self.step)
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    def close(self):
        self.ckpt.close()


class JaxdistCrc32(Jaxdist):
    name = "jd crc32"

    def save(self, state) -> tuple[float, float]:
        real = integrity.save_algorithm
        integrity.save_algorithm = lambda: "crc32"
        try:
            return super().save(state)
        finally:
            integrity.save_algorithm = real


class OrbaxStandard:
    name = "orbax std"

    def __init__(self, root: Path):
        self.root = root
        self.ckpt = ocp.StandardCheckpointer()
        self.step = 0

    def save(self, state) -> tuple[float, float]:
        if self.step:  # like max_to_keep=1, outside the timing
            shutil.rmtree(self.root / str(self.step), ignore_errors=True)
        self.step += 1
        t0 = time.perf_counter()
        self.ckpt.save(self.root / str(self.step), state)
        blocked = time.perf_counter() - t0
        self.ckpt.wait_until_finished()
        return time.perf_counter() - t0, blocked

    def restore(self, abstract) -> float:
        t0 = time.perf_counter()
        state = self.ckpt.restore(self.root / str(self.step), abstract)
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    def close(self):
        self.ckpt.close()


class OrbaxManager:
    name = "orbax mgr"

    def __init__(self, root: Path):
        self.root = root
        opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
        self.mgr = ocp.CheckpointManager(root, options=opts)
        self.step = 0

    def save(self, state) -> tuple[float, float]:
        if self.step:  # like max_to_keep=1, outside the timing
            shutil.rmtree(self.root / str(self.step), ignore_errors=True)
        self.step += 1
        t0 = time.perf_counter()
        self.mgr.save(self.step, args=ocp.args.StandardSave(state))
        blocked = time.perf_counter() - t0
        self.mgr.wait_until_finished()
        return time.perf_counter() - t0, blocked

    def restore(self, abstract) -> float:
        t0 = time.perf_counter()
        state = self.mgr.restore(self.step, args=ocp.args.StandardRestore(abstract))
        jax.block_until_ready(state)
        return time.perf_counter() - t0

    def close(self):
        self.mgr.close()


KINDS = (Jaxdist, JaxdistCrc32, OrbaxStandard, OrbaxManager)


def measure(tmp: Path, mb: int, sharding: str, rounds: int) -> dict[str, dict[str, float]]:
    state = make_state(mb, sharding)
    abstract = abstract_like(state)
    nbytes = sum(a.nbytes for a in jax.tree.leaves(state))
    runners = [k(tmp / f"{mb}-{sharding}-{k.__name__}") for k in KINDS]
    for r in runners:  # warm-up: orbax's and jax's first-call costs
        r.save(state)
        r.restore(abstract)
    times: dict[str, dict[str, list[float]]] = {r.name: {"save": [], "blocked": [], "restore": []} for r in runners}
    for i in range(rounds):
        for r in runners if i % 2 == 0 else runners[::-1]:
            total, blocked = r.save(state)
            t = times[r.name]
            t["save"].append(total)
            t["blocked"].append(blocked)
            t["restore"].append(r.restore(abstract))
    for r in runners:
        r.close()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True, exist_ok=True)
    out = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    out["_bytes"] = {"n": nbytes}
    return out


def profile(tmp: Path, mb: int, which: str) -> None:
    """cProfile (every thread) of one save until committed and one restore, after a warm-up."""
    import cProfile
    import pstats
    import threading

    state = make_state(mb, "fsdp")
    abstract = abstract_like(state)
    kind = {"jaxdist": Jaxdist, "orbax": OrbaxStandard}[which]
    r = kind(tmp / which)
    r.save(state)
    r.restore(abstract)
    profiles: list[cProfile.Profile] = []

    def per_thread(frame, event, arg):  # start a profiler in every thread the save starts
        p = cProfile.Profile()
        profiles.append(p)
        sys.setprofile(None)
        p.enable()

    main = cProfile.Profile()
    threading.setprofile(per_thread)
    main.enable()
    total, blocked = r.save(state)
    restore = r.restore(abstract)
    main.disable()
    threading.setprofile(None)
    for p in profiles:
        p.disable()
    print(f"{which}: save {total:.3f} s (blocked {blocked:.3f} s), restore {restore:.3f} s")
    stats = pstats.Stats(main)
    for p in profiles:
        stats.add(p)
    stats.sort_stats("tottime").print_stats(18)
    stats.sort_stats("cumulative").print_stats(30)
    r.close()


def checksum_costs(tmp: Path, sizes: list[int], rounds: int) -> None:
    """Wall and CPU seconds of checksumming ``sizes`` MB of files (page cache warm), CRC-32C against CRC-32."""
    chunk = 64 * 2**20
    head = f"{'files':>8} {'algorithm':<9} {'wall s':>7} {'cpu s':>7} {'GB/s wall':>9} {'cpu x':>6}"
    print(f"checksums of files in the page cache, {os.cpu_count()} cores, median of {rounds}")
    print(head + "\n" + "-" * len(head))
    for mb in sizes:
        folder = tmp / f"sums-{mb}"
        folder.mkdir(parents=True)
        rng = np.random.default_rng(0)
        rels, left = [], mb * 10**6
        while left > 0:
            n = min(chunk, left)
            rels.append(f"d/{len(rels):04d}")
            (folder / "d").mkdir(exist_ok=True)
            (folder / rels[-1]).write_bytes(rng.bytes(n))
            left -= n
        integrity.files_checksums(folder, rels, "crc32")  # into the page cache
        cpu = {}
        for algorithm in ("crc32c", "crc32"):
            walls, cpus = [], []
            for _ in range(rounds):
                t0, c0 = time.perf_counter(), time.process_time()
                integrity.files_checksums(folder, rels, algorithm)
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
            wall, cpu[algorithm] = statistics.median(walls), statistics.median(cpus)
            ratio = f"{cpu[algorithm] / cpu['crc32c']:>6.2f}"
            print(
                f"{mb:>5} MB {algorithm:<9} {wall:>7.3f} {cpu[algorithm]:>7.3f} {mb / 1e3 / wall:>9.2f} {ratio}",
                flush=True,
            )
        shutil.rmtree(folder)
    print("cpu x: CPU seconds / CRC-32C's")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[200, 1000], help="state sizes in MB")
    ap.add_argument("--big", action="store_true", help="also 4 GB")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration (after one warm-up)")
    ap.add_argument("--sharding", nargs="+", default=["fsdp", "replicated"], choices=["fsdp", "replicated"])
    ap.add_argument("--profile", choices=["jaxdist", "orbax"], help="profile one save + restore instead")
    ap.add_argument("--checksums", action="store_true", help="time the checksums alone (200 MB, 1 GB, 4 GB)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="jaxdist-vs-orbax-"))
    try:
        if args.profile:
            profile(tmp, args.sizes[0], args.profile)
            return 0
        if args.checksums:
            checksum_costs(tmp, [200, 1000, 4000], args.rounds)
            print(f"load: {open('/proc/loadavg').read().strip()}")
            return 0
        sizes = args.sizes + ([4000] if args.big else [])
        head = (
            f"{'state':>8} {'sharding':<10} {'checkpointer':<10} {'save s':>7} {'blocked s':>9} {'restore s':>9}"
            f" {'save x':>7} {'blocked x':>9} {'restore x':>9}"
        )
        print(f"1 process x 8 CPU devices, {os.cpu_count()} cores, median of {args.rounds}; x: jaxdist / this")
        print(head + "\n" + "-" * len(head))
        for mb in sizes:
            for sharding in args.sharding:
                res = measure(tmp / "runs", mb, sharding, args.rounds)
                size = f"{res.pop('_bytes')['n'] / 2**20:.0f} MiB"
                j = res["jaxdist"]
                for name, t in res.items():
                    ratios = (
                        ""
                        if name == "jaxdist"
                        else "".join(
                            f" {j[k] / t[k]:>{w}.2f}" for k, w in (("save", 7), ("blocked", 9), ("restore", 9))
                        )
                    )
                    print(
                        f"{size:>8} {sharding:<10} {name:<10} {t['save']:>7.3f} {t['blocked']:>9.3f}"
                        f" {t['restore']:>9.3f}{ratios}",
                        flush=True,
                    )
        print(f"load: {open('/proc/loadavg').read().strip()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""jaxdist's RunCheckpointer against plain orbax on the same state, side by side (issue 41).

A pytree of pseudo-random float32 arrays (so compression cannot flatter anyone) on 8 simulated CPU devices,
sharded over ``fsdp=8`` and fully replicated, at about 200 MB and 1 GB (``--sizes``; ``--big``: also 4 GB), is
saved and restored by

* ``jaxdist``: :class:`jaxdist.checkpoint.RunCheckpointer` (async, balanced plan,
  CRC-32C checksums, commit marker; restore verifies the files first);
* ``jd crc32``: the same with zlib's CRC-32 (what a host without ``crc32c``
  records, and what every save recorded before CRC-32C);
* ``orbax std``: ``ocp.StandardCheckpointer`` (async, OCDBT: orbax's defaults);
* ``orbax mgr``: ``ocp.CheckpointManager`` with what a careful orbax user sets:
  ``enable_async_checkpointing=True``, OCDBT and replica-parallel writing (the
  defaults on CPU).

Every (size, sharding, checkpointer, round) runs in a child process of its own (this script again, with the
hidden ``--one``), one child at a time, so that no checkpointer's host copies or restored arrays share memory
with another's: a child holds the state, then one save's host copy, then (the state freed) one restored copy.
A child builds the state, saves it twice (a warm-up, then the timed save; the warm-up step deleted outside the
timing, like ``keep=1``), frees it, restores twice (a warm-up, freed, then the timed restore) and prints its
seconds and its peak RSS as one JSON line. The round's children run in the order of ``KINDS``, reversed every
other round, so that host noise hits all of them; a child that runs past ``--timeout`` is killed.

It prints, median over ``--rounds`` rounds: ``save s``: from ``save()`` until the checkpoint is committed
(jaxdist: its marker is written; orbax: ``wait_until_finished``), ``blocked s``: of which ``save()`` blocked the
caller, ``restore s``: a restore onto the same sharding (jaxdist: with its checksum verification), ``peak RSS
GB``: the largest child's peak resident memory (10^9 bytes), and the ratios jaxdist / this checkpointer.

    python benchmarks/checkpoint_vs_orbax.py                  # 200 MB and 1 GB, ~20 minutes on 2 busy cores
    python benchmarks/checkpoint_vs_orbax.py --sizes 200      # one size
    python benchmarks/checkpoint_vs_orbax.py --sizes 200 1000 4000 --sharding fsdp  # the 4 GB row
    python benchmarks/checkpoint_vs_orbax.py --profile jaxdist  # py-spy-free profile of one save (cProfile,
                                                                # all threads), top functions by own time
    python benchmarks/checkpoint_vs_orbax.py --checksums      # the checksums alone: CRC-32C against CRC-32
                                                              # over 200 MB, 1 GB and 4 GB of files
    python benchmarks/checkpoint_vs_orbax.py --codec --sizes 200 1000  # checksums the storage checks as it
                                                              # reads (zarr3's crc32c codec) against the second read

A replicated state is held once per device (8 copies on the CPU backend), so a ``--sharding replicated`` child
needs more than 8x the state's size in memory (benchmarks/README.md has the peaks).

``--checksums`` writes one file of random bytes (orbax's OCDBT puts most of a process's bytes in one data file),
reads it once into the page cache, then times :func:`jaxdist.checkpoint.integrity.files_checksums` over it with each
algorithm, in pieces on several threads (the default) and a thread per file (before): wall seconds and the CPU
seconds of every thread (``time.process_time``), median of ``--rounds``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
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


def n_arrays(mb: int) -> int:
    """How many ROWS x COLS float32 arrays make about ``mb`` MB."""
    return max(1, round(mb * 1e6 / (ROWS * COLS * 4)))


def make_state(mb: int, sharding: str) -> dict:
    """About ``mb`` MB of pseudo-random float32 arrays on 8 devices, ``fsdp``-sharded on rows or replicated."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("fsdp",))
    spec = P("fsdp") if sharding == "fsdp" else P()
    sh = NamedSharding(mesh, spec)
    n = n_arrays(mb)
    make = jax.jit(lambda k: jax.random.normal(k, (ROWS, COLS), jnp.float32), out_shardings=sh)
    keys = jax.random.split(jax.random.key(0), n)
    state = {"params": {f"w{i:03d}": make(keys[i]) for i in range(n)}, "step": jnp.int32(7)}
    jax.block_until_ready(state)
    return state


def free(tree) -> None:
    """Delete the device buffers of ``tree`` now, not when the garbage collector gets to them."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            leaf.delete()
    gc.collect()


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim``); elsewhere, nothing.

    Freed buffers otherwise stay in the process's RSS, and the restore's arrays would be counted on top of
    the state and the save's host copy."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


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
        seconds = time.perf_counter() - t0
        free(state)
        return seconds

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
        seconds = time.perf_counter() - t0
        free(state)
        return seconds

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
        seconds = time.perf_counter() - t0
        free(state)
        return seconds

    def close(self):
        self.mgr.close()


KINDS = (Jaxdist, JaxdistCrc32, OrbaxStandard, OrbaxManager)


def measure_one(root: Path, mb: int, sharding: str, kind: str) -> dict[str, float]:
    """One child's measurement: a warm-up and a timed save, then (the state freed) a warm-up and a timed restore.

    Returns seconds (``save``, ``blocked``, ``restore``), the state's ``bytes`` and this process's
    ``peak_rss`` (bytes)."""
    state = make_state(mb, sharding)
    abstract = abstract_like(state)
    nbytes = sum(a.nbytes for a in jax.tree.leaves(state))
    r = {k.__name__: k for k in KINDS}[kind](root)
    r.save(state)  # warm-up: orbax's and jax's first-call costs
    save, blocked = r.save(state)
    free(state)  # a restore then needs no room for the state beside its own arrays
    del state
    return_freed_memory()  # only here: the timed save and restore reuse their warm-ups' memory, as in training
    r.restore(abstract)
    restore = r.restore(abstract)
    r.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"save": save, "blocked": blocked, "restore": restore, "bytes": nbytes, "peak_rss": peak}


def run_child(root: Path, mb: int, sharding: str, kind: str, timeout: float) -> dict:
    """:func:`measure_one` in a child process (this script with ``--one``), killed after ``timeout`` seconds.

    Returns its JSON line, or ``{"error": ...}``; ``peak_rss`` (bytes) is the child's as the kernel counted it
    (``wait4``), so it is there for a child that was killed too."""
    shutil.rmtree(root, ignore_errors=True)
    out_path, err_path = root.with_suffix(".stdout"), root.with_suffix(".stderr")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", str(mb), sharding, kind, str(root)]
    t0 = time.perf_counter()
    with open(out_path, "w") as out, open(err_path, "w") as err:  # files: a full pipe cannot stall the child
        child = subprocess.Popen(cmd, stdout=out, stderr=err)
        killed = False
        try:
            while True:  # wait4 rather than Popen.wait: it hands back this child's own rusage
                pid, status, usage = os.wait4(child.pid, os.WNOHANG)
                if pid:
                    break
                if not killed and time.perf_counter() - t0 > timeout:
                    child.kill()
                    killed = True
                time.sleep(0.2)
        except BaseException:  # interrupted or terminated: a child left behind would hold its GBs
            child.kill()
            child.wait()
            raise
        child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    lines = [line for line in out_path.read_text().splitlines() if line.startswith("{")]
    if child.returncode == 0 and lines:
        res = json.loads(lines[-1])
    elif killed:
        res = {"error": f"timed out after {timeout:.0f} s"}
    elif child.returncode < 0:  # SIGKILL without our timeout: most likely the OOM killer
        res = {"error": f"killed by signal {-child.returncode}"}
    else:
        tail = err_path.read_text().strip().splitlines()[-3:]
        res = {"error": f"exit status {child.returncode}" + (": " + " | ".join(tail) if tail else "")}
    out_path.unlink(missing_ok=True)
    err_path.unlink(missing_ok=True)
    res["peak_rss"] = max(res.get("peak_rss", 0), usage.ru_maxrss * 1024)
    res["wall"] = wall
    return res


def measure(tmp: Path, mb: int, sharding: str, rounds: int, timeout: float) -> dict[str, dict]:
    """Median seconds and the largest peak RSS of each checkpointer over ``rounds`` rounds, one child each.

    A checkpointer whose child fails is left out of the later rounds; its entry then holds ``error``."""
    names = {k.__name__: k.name for k in KINDS}
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for i in range(rounds):
        for kind in list(names) if i % 2 == 0 else list(names)[::-1]:
            if runs[kind] and "error" in runs[kind][-1]:
                continue
            res = run_child(tmp / f"{mb}-{sharding}-{kind}", mb, sharding, kind, timeout)
            runs[kind].append(res)
            what = res.get("error") or f"save {res['save']:.3f} s, restore {res['restore']:.3f} s"
            print(
                f"  round {i + 1}/{rounds} {mb} MB {sharding} {names[kind]}: {what}, peak RSS"
                f" {res['peak_rss'] / 1e9:.2f} GB, child {res['wall']:.0f} s, load {os.getloadavg()[0]:.1f}",
                file=sys.stderr,
                flush=True,
            )
    out = {}
    for kind, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        t = {k: statistics.median(r[k] for r in ok) for k in ("save", "blocked", "restore")} if ok else {}
        if len(ok) < len(rs):
            t["error"] = rs[-1]["error"]
        t["peak_rss"] = max(r["peak_rss"] for r in rs)
        t["bytes"] = ok[0]["bytes"] if ok else n_arrays(mb) * ROWS * COLS * 4
        t["rounds"] = len(ok)
        out[names[kind]] = t
    return out


def print_rows(res: dict[str, dict], sharding: str) -> None:
    """The table's rows of one (size, sharding): seconds, peak RSS and ratios jaxdist / this."""
    size = f"{next(iter(res.values()))['bytes'] / 2**20:.0f} MiB"
    j = res["jaxdist"]
    for name, t in res.items():
        if "save" in t:
            cells = f" {t['save']:>7.3f} {t['blocked']:>9.3f} {t['restore']:>9.3f}"
        else:
            cells = f" {'-':>7} {'-':>9} {'-':>9}"
        cells += f" {t['peak_rss'] / 1e9:>11.2f}"
        if name != "jaxdist" and "save" in t and "save" in j:
            cells += "".join(f" {j[k] / t[k]:>{w}.2f}" for k, w in (("save", 7), ("blocked", 9), ("restore", 9)))
        if "error" in t:
            cells += f"  ({t['rounds']} rounds; then {t['error']})"
        print(f"{size:>8} {sharding:<10} {name:<10}{cells}", flush=True)


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
    """Wall and CPU seconds of checksumming one file of each of ``sizes`` MB (page cache warm): CRC-32C and
    CRC-32, in pieces on several threads (``integrity._PIECE``, the default) and a thread per file (before)."""
    head = f"{'file':>8} {'algorithm':<9} {'read':<15} {'wall s':>7} {'cpu s':>7} {'GB/s wall':>9} {'wall x':>6}"
    print(f"checksums of one file in the page cache, {os.cpu_count()} cores, median of {rounds}")
    print(head + "\n" + "-" * len(head))
    ways = {"pieces": integrity._PIECE, "thread per file": 2**62}
    for mb in sizes:
        folder = tmp / f"sums-{mb}"
        (folder / "d").mkdir(parents=True)
        with open(folder / "d" / "0000", "wb") as f:  # as OCDBT writes: one data file per process
            rng = np.random.default_rng(0)
            for left in range(mb * 10**6, 0, -(64 * 2**20)):
                f.write(rng.bytes(min(64 * 2**20, left)))
        rels = ["d/0000"]
        integrity.files_checksums(folder, rels, "crc32")  # into the page cache
        for algorithm in ("crc32c", "crc32"):
            wall = {}
            for way, piece in ways.items():
                integrity._PIECE = piece
                walls, cpus = [], []
                for _ in range(rounds):
                    t0, c0 = time.perf_counter(), time.process_time()
                    integrity.files_checksums(folder, rels, algorithm)
                    walls.append(time.perf_counter() - t0)
                    cpus.append(time.process_time() - c0)
                wall[way], cpu = statistics.median(walls), statistics.median(cpus)
                ratio = f"{wall[way] / wall['pieces']:>6.2f}"
                print(
                    f"{mb:>5} MB {algorithm:<9} {way:<15} {wall[way]:>7.3f} {cpu:>7.3f} {mb / 1e3 / wall[way]:>9.2f}"
                    f" {ratio}",
                    flush=True,
                )
            integrity._PIECE = ways["pieces"]
        shutil.rmtree(folder)
    print("wall x: wall seconds / in pieces'")


def codec_costs(tmp: Path, sizes: list[int], rounds: int) -> None:
    """The other way to check a checkpoint's bytes (issue 41): a CRC-32C of every chunk, written by TensorStore
    with zarr3's ``crc32c`` codec and checked as it reads, against jaxdist's way, a CRC-32C of every whole file read
    back after the save (and before the restore). Plain orbax, one process, fsdp=8: ``StandardCheckpointer``
    (zarr2, orbax's default), zarr3, zarr3 with the codec (which orbax has no option for: this benchmark replaces
    orbax's private ``tensorstore_utils._build_zarr3_metadata`` for that variant); each variant's save and restore
    alternated over ``rounds`` rounds after a warm-up, and ``second read``: jaxdist's checksum pass over the
    zarr2 save's files (``integrity.files_checksums``, CRC-32C on 4 threads)."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as tsu  # private: this benchmark only

    build, with_crc = tsu._build_zarr3_metadata, {"on": False}

    def build_with_crc(global_shape, chunk_shape, use_compression):
        metadata = build(global_shape, chunk_shape, use_compression)
        if with_crc["on"]:
            metadata["codecs"][0]["configuration"]["codecs"].append({"name": "crc32c"})
        return metadata

    tsu._build_zarr3_metadata = build_with_crc
    zarr3 = lambda: ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True))  # noqa: E731
    variants = {"orbax std (zarr2)": (ocp.StandardCheckpointer, False), "zarr3": (zarr3, False)}
    variants["zarr3 + crc32c codec"] = (zarr3, True)
    head = f"{'state':>8} {'variant':<22} {'save s':>7} {'restore s':>9} {'save s/GB':>9} {'restore s/GB':>12}"
    print(f"1 process x 8 CPU devices, fsdp=8, {os.cpu_count()} cores, median of {rounds}; s/GB: more than zarr2's")
    print(f"load: {open('/proc/loadavg').read().strip()}")
    print(head + "\n" + "-" * len(head), flush=True)
    for mb in sizes:
        state = make_state(mb, "fsdp")
        abstract = abstract_like(state)
        gb = sum(a.nbytes for a in jax.tree.leaves(state)) / 1e9
        ckpts = {name: make() for name, (make, _) in variants.items()}
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        sums = []
        for r in range(rounds + 1):
            for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
                ck, with_crc["on"] = ckpts[name], variants[name][1]
                path = tmp / f"codec-{mb}-{len(times[name])}-{r}"
                t0 = time.perf_counter()
                if name.startswith("orbax std"):
                    ck.save(path, state)
                else:
                    ck.save(path, args=ocp.args.PyTreeSave(state))
                ck.wait_until_finished()
                t1 = time.perf_counter()
                if name.startswith("orbax std"):
                    got = ck.restore(path, abstract)
                else:
                    restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
                    got = ck.restore(path, args=ocp.args.PyTreeRestore(abstract, restore_args=restore_args))
                jax.block_until_ready(got)
                t2 = time.perf_counter()
                free(got)
                if name.startswith("orbax std"):
                    rels = integrity.data_files(path)
                    t3 = time.perf_counter()
                    integrity.files_checksums(path, rels, integrity.save_algorithm())
                    if r:
                        sums.append(time.perf_counter() - t3)
                if r:
                    times[name].append((t1 - t0, t2 - t1))
                shutil.rmtree(path)
        base = [statistics.median(t[i] for t in times["orbax std (zarr2)"]) for i in (0, 1)]
        for name in variants:
            save, restore = (statistics.median(t[i] for t in times[name]) for i in (0, 1))
            extra = (
                f" {(save - base[0]) / gb:>9.3f} {(restore - base[1]) / gb:>12.3f}"
                if name != "orbax std (zarr2)"
                else ""
            )
            print(f"{mb:>5} MB {name:<22} {save:>7.3f} {restore:>9.3f}{extra}", flush=True)
        second = statistics.median(sums)
        print(f"{mb:>5} MB {'second read (jaxdist)':<22} {second:>7.3f} {'':>9} {second / gb:>9.3f}", flush=True)
        for ck in ckpts.values():
            ck.close()
        free(state)
    tsu._build_zarr3_metadata = build
    print(f"load: {open('/proc/loadavg').read().strip()}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[200, 1000], help="state sizes in MB")
    ap.add_argument("--big", action="store_true", help="also 4 GB")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration (after one warm-up)")
    ap.add_argument("--sharding", nargs="+", default=["fsdp", "replicated"], choices=["fsdp", "replicated"])
    ap.add_argument("--timeout", type=float, default=1200, help="seconds one child may run before it is killed")
    ap.add_argument("--profile", choices=["jaxdist", "orbax"], help="profile one save + restore instead")
    ap.add_argument("--checksums", action="store_true", help="time the checksums alone (200 MB, 1 GB, 4 GB)")
    ap.add_argument("--codec", action="store_true", help="chunk checksums checked by the storage, against files")
    ap.add_argument("--one", nargs=4, metavar=("MB", "SHARDING", "KIND", "DIR"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:  # a child of run_child: one measurement, one JSON line
        mb, sharding, kind, root = args.one
        print(json.dumps(measure_one(Path(root), int(mb), sharding, kind)), flush=True)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` kills the child, removes tmp
    tmp = Path(tempfile.mkdtemp(prefix="jaxdist-vs-orbax-"))
    try:
        if args.profile:
            profile(tmp, args.sizes[0], args.profile)
            return 0
        if args.codec:
            codec_costs(tmp, args.sizes + ([4000] if args.big else []), args.rounds)
            return 0
        if args.checksums:
            checksum_costs(tmp, [200, 1000, 4000], args.rounds)
            print(f"load: {open('/proc/loadavg').read().strip()}")
            return 0
        sizes = args.sizes + ([4000] if args.big else [])
        head = (
            f"{'state':>8} {'sharding':<10} {'checkpointer':<10} {'save s':>7} {'blocked s':>9} {'restore s':>9}"
            f" {'peak RSS GB':>11} {'save x':>7} {'blocked x':>9} {'restore x':>9}"
        )
        print(
            f"1 process x 8 CPU devices, one child process per measurement, {os.cpu_count()} cores,"
            f" median of {args.rounds}; x: jaxdist / this"
        )
        print(f"load: {open('/proc/loadavg').read().strip()}")
        print(head + "\n" + "-" * len(head), flush=True)
        for mb in sizes:
            for sharding in args.sharding:
                print_rows(measure(tmp, mb, sharding, args.rounds, args.timeout), sharding)
        print(f"load: {open('/proc/loadavg').read().strip()}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

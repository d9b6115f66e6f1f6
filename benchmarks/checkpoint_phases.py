"""Where a jaxdist save's time goes, phase by phase, beside plain orbax's ``StandardCheckpointer`` (issue 41).

One process, 8 CPU devices, a pytree of pseudo-random float32 arrays sharded ``fsdp=8`` (the state of
``checkpoint_vs_orbax.py``). After a warm-up save each, ``--rounds`` saves of jaxdist's ``RunCheckpointer`` and of
``ocp.StandardCheckpointer`` alternate (the order reversed every other round); each save is timed until committed
(jaxdist) or finished (orbax), and the phases of jaxdist's background commit are timed by wrapping the functions
that do them: orbax's own part (``AsyncCheckpointer.wait_until_finished``), the checksums read back
(``integrity.record_own_checksums`` and, inside it, ``files_checksums``), the commit marker (``integrity.commit``)
and what the caller was blocked for (``save()``).  Prints the medians (ms).

    python benchmarks/checkpoint_phases.py            # 200 MB, 5 rounds
    python benchmarks/checkpoint_phases.py --mb 1000 --rounds 3
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
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import checkpoint_vs_orbax as bench  # noqa: E402

from jaxdist.checkpoint import integrity, manager  # noqa: E402

PHASES: dict[str, list[float]] = {}


def timed(owner: object, name: str, phase: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds each call's seconds to ``PHASES[phase]``."""
    fn: Callable = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES.setdefault(phase, []).append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)


def instrument() -> None:
    timed(integrity, "record_own_checksums", "checksums read back (record_own_checksums)")
    timed(integrity, "files_checksums", "  of which the checksums (files_checksums)")
    timed(integrity, "commit", "commit marker (integrity.commit)")
    timed(manager.RunCheckpointer, "save", "caller blocked (save())")
    timed(manager.RunCheckpointer, "_commit", "background commit in all (_commit)")
    commit = manager.RunCheckpointer._commit

    def with_orbax_part(self, *args, **kwargs):  # orbax's own part first, timed apart (then a no-op inside)
        t0 = time.perf_counter()
        self._orbax.wait_until_finished()
        PHASES.setdefault("orbax's own part (wait_until_finished)", []).append(time.perf_counter() - t0)
        return commit(self, *args, **kwargs)

    manager.RunCheckpointer._commit = with_orbax_part


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=200, help="state size in MB")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    instrument()
    state = bench.make_state(args.mb, "fsdp")
    root = Path(tempfile.mkdtemp(prefix="jaxdist-ckpt-phases-"))
    kinds = [bench.Jaxdist(root / "jaxdist"), bench.OrbaxStandard(root / "orbax")]
    try:
        for k in kinds:
            k.save(state)  # warm-up
        PHASES.clear()
        saves: dict[str, list[float]] = {k.name: [] for k in kinds}
        for i in range(args.rounds):
            for k in kinds if i % 2 == 0 else kinds[::-1]:
                saves[k.name].append(k.save(state)[0])
        print(f"load (1 min) {os.getloadavg()[0]:.2f}; {args.mb} MB fsdp=8, median of {args.rounds} saves (ms)")
        for name, secs in saves.items():
            print(f"{name} save until committed/finished: {1000 * statistics.median(secs):.1f}")
        ratio = statistics.median(saves["jaxdist"]) / statistics.median(saves["orbax std"])
        print(f"ratio jaxdist / orbax std: {ratio:.2f}")
        for phase, secs in PHASES.items():
            print(f"  {phase}: {1000 * statistics.median(secs):.1f}")
    finally:
        for k in kinds:
            k.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

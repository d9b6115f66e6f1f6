"""A communication probe over the job's own interconnect: timed collectives on the devices, between two steps.

The devices are grouped by node (in a job: by process).  :class:`DeviceProbe` times, on one mesh of all
devices in node order:

* **pairs**: the round-robin matchings of the nodes (:func:`pair_rounds`; each round pairs every node with
  another, disjoint pairs, so ``n - 1`` rounds time all ``n (n - 1) / 2`` pairs): a ``ppermute`` in
  ``shard_map`` where each device of node a swaps its buffer with the same-numbered device of node b.  Each
  process blocks on its own shards only, so its seconds are its pair's transfer: a pair's seconds are the
  larger of its two nodes';
* **ring**: every node sends to the next;
* **all-reduce**: a ``psum`` over all devices;
* **compute**: each node's own devices run a matmul chain, no collective.

Each is compiled once (a warm-up run), then timed ``reps`` times in each of ``passes`` passes over the whole
list; the fastest of all counts (other load on a host only adds time; a slow device or link slows every
repetition). The passes interleave the tests, so a burst of load on a busy host, which makes every repetition
of one test within a few milliseconds slow, must recur in every pass to make a healthy link or node look slow.  The results of all
processes are gathered on every process; the controller's ``health.name_probe`` names a slow node or link.

The probe touches neither the training state nor the data: its buffers are its own and it draws no random
numbers, so training after it is bit-identical to training without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXIS = "probe"


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Round-robin matchings of ``n`` nodes (the circle method): ``n - 1`` rounds (``n`` for odd ``n``, one
    node resting per round) of disjoint pairs ``(a, b)`` with ``a < b``; every pair exactly once."""
    ids: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(ids)
    rounds = []
    for _ in range(m - 1):
        pairs = [(ids[i], ids[m - 1 - i]) for i in range(m // 2)]
        rounds.append(sorted((min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None))
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return rounds


class DeviceProbe:
    """Timed collectives among ``groups`` (the devices of each node, same count each) named ``names``.

    ``nbytes``: bytes each device sends per transfer; ``matmul``: the side of the compute test's square
    matrices; ``delay(what, node)``: seconds a test-only fault hook adds (what: ``"compute"``, or
    ``"pair:a:b"`` for a transfer between nodes a and b).
    """

    def __init__(
        self,
        groups: Sequence[Sequence[Any]],
        names: Sequence[str],
        nbytes: int = 1 << 20,
        matmul: int = 512,
        reps: int = 2,
        delay: Callable[[str, str], float] | None = None,
        passes: int = 3,
    ):
        per = {len(g) for g in groups}
        assert len(per) == 1 and len(groups) == len(names), "every node needs the same number of devices"
        self.groups, self.names, self.per = [list(g) for g in groups], list(names), per.pop()
        self.n, self.nbytes, self.matmul, self.reps, self.delay = len(groups), nbytes, matmul, reps, delay
        self.passes = max(1, passes)
        self._warm: set[int] = set()
        self.mesh = Mesh(np.array([d for g in self.groups for d in g]), (AXIS,))
        me = jax.process_index()
        self.local = [i for i, g in enumerate(self.groups) if all(d.process_index == me for d in g)]
        self.rounds = pair_rounds(self.n)
        self._fns: dict[str, Any] = {}

    # ------------------------------------------------------------------ the collectives

    def _permute(self, key: str, perm: list[tuple[int, int]]):
        if key not in self._fns:
            self._fns[key] = jax.jit(
                jax.shard_map(
                    lambda x: jax.lax.ppermute(x, AXIS, perm), mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS)
                )
            )
        return self._fns[key]

    def pair_perm(self, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Device pairs (mesh positions) of a round: device k of node a <-> device k of node b."""
        return [
            (x * self.per + k, y * self.per + k) for a, b in pairs for x, y in ((a, b), (b, a)) for k in range(self.per)
        ]

    def ring_perm(self) -> list[tuple[int, int]]:
        """Device k of node i -> device k of node i + 1 (mod n)."""
        return [(i * self.per + k, ((i + 1) % self.n) * self.per + k) for i in range(self.n) for k in range(self.per)]

    def _allreduce(self):
        if "allreduce" not in self._fns:
            self._fns["allreduce"] = jax.jit(
                jax.shard_map(lambda x: jax.lax.psum(x, AXIS), mesh=self.mesh, in_specs=P(AXIS), out_specs=P(AXIS))
            )
        return self._fns["allreduce"]

    def buffer(self) -> jax.Array:
        """``nbytes`` of float32 on every device (sharded over the probe's mesh)."""
        elems = max(self.nbytes // 4, 1) * self.mesh.size
        return jax.jit(lambda: jnp.ones((elems,), jnp.float32), out_shardings=NamedSharding(self.mesh, P(AXIS)))()

    def _timed(self, fn: Callable[[], Any], extra_s: float = 0.0, key: Any = None) -> float:
        if key is None or key not in self._warm:
            fn()  # compiles (once) and warms up
            self._warm.add(key)
        times = []
        for _ in range(self.reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())  # this process's shards only: its own part of the collective
            if extra_s > 0:
                time.sleep(extra_s)
            times.append(time.perf_counter() - t0)
        # The fastest repetition: a busy host only ever adds time, an injected or real slowness is in every one.
        return min(times)

    def _extra(self, what: str, node: int) -> float:
        return self.delay(what, self.names[node]) if self.delay is not None else 0.0

    def _compute(self, i: int) -> float:
        """Node ``i``'s devices each run a chain of matmuls, no collective (seconds)."""
        if "matmul" not in self._fns:
            self._fns["matmul"] = jax.jit(lambda a: (a @ a) @ a)
        mats = [
            jax.device_put(jnp.full((self.matmul, self.matmul), 1.0 / self.matmul, jnp.float32), d)
            for d in self.groups[i]
        ]
        f = self._fns["matmul"]
        return self._timed(lambda: [f(a) for a in mats], self._extra("compute", i), ("compute", i))

    # ------------------------------------------------------------------ the probe

    def measure(self) -> np.ndarray:
        """This process's timings (seconds): one row per node, NaN for nodes on other processes; columns:
        compute, one per pair round (its pair's transfer), ring, all-reduce. The fastest of ``passes`` passes."""
        x = self.buffer()
        out = self._measure_pass(x)
        for _ in range(self.passes - 1):
            out = np.fmin(out, self._measure_pass(x))
        return out

    def _measure_pass(self, x: jax.Array) -> np.ndarray:
        out = np.full((self.n, 3 + len(self.rounds)), np.nan)
        for i in self.local:
            out[i, 0] = self._compute(i)
        # One process holding several nodes (pseudo-nodes: tests, the benchmark) times each pair on its own;
        # in a job (one node per process) a round's pairs run at once and each process times its own pair.
        split = jax.process_count() == 1
        for r, pairs in enumerate(self.rounds):
            for unit in [[p] for p in pairs] if split else [pairs]:
                fn = self._permute(f"{unit}", self.pair_perm(unit))
                ends = [i for p in unit for i in p if i in self.local]
                # A slowed link (test-only hook) delays both ends of that pair, the way a slow transfer would.
                extra = max(
                    (
                        self._extra(f"pair:{self.names[a]}:{self.names[b]}", a)
                        for a, b in unit
                        if a in ends or b in ends
                    ),
                    default=0.0,
                )
                t = self._timed(lambda fn=fn: fn(x), extra, f"{unit}")
                for i in ends:
                    out[i, 1 + r] = t
        ring = self._permute("ring", self.ring_perm())
        t_ring = self._timed(lambda: ring(x), key="ring")
        t_all = self._timed(lambda: self._allreduce()(x), key="allreduce")
        for i in self.local:
            out[i, 1 + len(self.rounds)], out[i, 2 + len(self.rounds)] = t_ring, t_all
        return out

    def run(self) -> dict[str, Any]:
        """Measure on every process, gather, and return the probe's record (JSON-ready): ``compute_s`` per
        node, ``pairs`` (``[a, b, seconds, bytes/s]``), ``ring_s``, ``allreduce_s`` (the slowest node's),
        ``bytes`` per device per transfer and the probe's own ``seconds``."""
        t0 = time.perf_counter()
        mine = self.measure()
        if jax.process_count() > 1:
            every = np.asarray(multihost_utils.process_allgather(mine))  # (processes, nodes, columns)
            table = np.nanmax(every, axis=0)
        else:
            table = mine
        return self.record(table, time.perf_counter() - t0)

    def record(self, table: np.ndarray, seconds: float) -> dict[str, Any]:
        """The JSON record of a gathered timing ``table`` (see :meth:`measure`)."""
        pairs = []
        for r, round_pairs in enumerate(self.rounds):
            for a, b in round_pairs:
                s = float(max(table[a, 1 + r], table[b, 1 + r]))
                # Each direction carries nbytes per device at once: bytes one node sends over the seconds.
                pairs.append([self.names[a], self.names[b], s, self.nbytes * self.per / s if s > 0 else None])
        k = len(self.rounds)
        return {
            "nodes": self.names,
            "compute_s": {self.names[i]: float(table[i, 0]) for i in range(self.n)},
            "pairs": pairs,
            "ring_s": float(np.nanmax(table[:, 1 + k])),
            "allreduce_s": float(np.nanmax(table[:, 2 + k])),
            "bytes": self.nbytes,
            "devices_per_node": self.per,
            "seconds": seconds,
        }


class ProbeOnRequest:
    """A loop callback: at the metric flushes (every ``every`` steps), run the device probe if the controller
    asked for one; every process agrees on it through rank 0's request (a tiny broadcast), so all run it at
    the same step.  ``requested()`` returns the newest request id (0: none); ``report(id, record)`` gets
    the result.  Syncs (the flush is due anyway at these steps), so the probe's time is not step time."""

    syncs = True
    part = "probe"  # the loop clock books its time apart from the training parts

    def __init__(
        self,
        every: int,
        probe: Callable[[], DeviceProbe],
        requested: Callable[[], int],
        report: Callable[[int, dict], None],
    ):
        self.every, self.make, self.requested, self.report = every, probe, requested, report
        self.done = 0
        self.probe: DeviceProbe | None = None

    def due(self, step: int, last: bool) -> bool:
        return self.every > 0 and step % self.every == 0 and not last

    def __call__(self, ctx: Any) -> None:
        want = int(self.requested())
        if jax.process_count() > 1:
            want = int(multihost_utils.broadcast_one_to_all(np.int32(want)))
        if want > self.done:
            self.done = want
            self.probe = self.probe or self.make()
            record = self.probe.run()
            self.report(want, {"step": ctx.step, **record})


def probe_for_agent(trainer: Any, agent: Any) -> ProbeOnRequest:
    """The probe callback of a multi-process job under the controller: ``agent`` (the worker agent, duck-typed)
    gives the requests and node names and takes the results; one node per process."""
    groups = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]

    def make() -> DeviceProbe:
        names = agent.probe_nodes() or [f"process{p}" for p in range(len(groups))]
        faults = getattr(trainer, "faults", None)  # set by fit (test-only hooks)
        return DeviceProbe(groups, names, delay=faults.probe_delay if faults is not None else None)

    return ProbeOnRequest(trainer.config.train.log_every, make, agent.probe_requested, agent.probe_report)

"""A chaos run at the defaults: 12 faults of every kind on a real job, against an uninterrupted run.

Real processes on this machine, as ``jaxdist launch`` runs them: a controller,
4 node agents and a standby, JAX workers of 2 simulated CPU devices each (the
tiny model). Every ``controller.*``, ``checkpoint.*`` and ``train.log_every``
setting is the product default: the launch waits for every node of the
cluster description (``start_grace``), the local tier is on (``auto``), a
crashed rank restarts on its own node. The test-only fault hooks are on
(``JAXDIST_FAULT_HOOKS=1``) for the hang inside the step.

The faults, each a few steps after the previous recovery's first step:

* ``kill``: SIGKILL of a rank's worker (rank 0 first);
* ``stop``: SIGSTOP of a worker (found by the heartbeat timeout);
* ``hang``: the device program of a step never finishes (a host callback in rank 0's jitted step);
* ``save``: SIGKILL of a worker just after a persistent save began (``checkpoint.every``);
* ``controller``: the controller killed and restarted (the job trains on meanwhile);
* ``node``: a node lost (agent and worker): the standby takes the rank;
* ``shrink``: a second node lost with no standby left: the group shrinks to 2 (``--no-shrink``: skipped);
* ``back``: the lost nodes' agents start again (standbys once checked);
* ``grow``: a worker killed: the recovery grows the group back to 4.

At the end: each generation's size, the steps each recovery recomputed, the exactly-once check of the batch
list against the training log, and the final parameters against the uninterrupted run of the same job (equal
arrays, max difference): bit-identical when the group kept its size; after a shrink, the steps trained on 2
nodes reduce their sums in another order, unless ``--set train.grad_sync=ordered`` (one order on every size).

    python benchmarks/chaos.py              # ~10 minutes on 2 loaded cores
    python benchmarks/chaos.py --no-shrink  # every fault but the shrink and growth: bit-identical expected
    python benchmarks/chaos.py --set train.grad_sync=ordered  # sums in one order on any group size: bit-identical
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the final comparison

import numpy as np  # noqa: E402

from jaxdist.controller.local import LocalJob  # noqa: E402
from jaxdist.controller.timeline import generations_trained  # noqa: E402
from jaxdist.data.audit import check_exactly_once  # noqa: E402

COMMON = [  # model, mesh, data and output only: every controller, checkpoint and log setting at its default
    "model=tiny",
    "mesh.cluster=cpu-4x2",
    "train.batch_size=16",
    "train.seq_len=32",
    "data.max_bytes=300000",
    "train.progress=false",
    "train.tensorboard=false",
    "train.runs_dir=runs",
]
PLAN = ["kill", "stop", "hang", "save", "controller", "node", "kill", "shrink", "back", "grow", "stop", "kill"]


def _params(run_dir: Path, step: int):
    import jax

    from jaxdist.checkpoint import RunCheckpointer
    from jaxdist.config import load_config
    from jaxdist.train.trainer import Trainer

    cfg = load_config(None, [*COMMON, "mesh.cluster=cpu-8", "checkpoint.enabled=false", f"train.runs_dir={run_dir}/x"])
    with Trainer(cfg) as t:
        target = t.abstract_state()
    state, _ = RunCheckpointer(run_dir / "checkpoints").restore(target, step)
    return jax.tree.leaves(jax.device_get(state["params"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--no-shrink", action="store_true")
    p.add_argument("--dir", help="work directory (default: a fresh temporary one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override for both runs")
    a = p.parse_args(argv)
    common = [*COMMON, *a.set]
    cwd = Path(a.dir or tempfile.mkdtemp(prefix="jaxdist-chaos-"))
    cwd.mkdir(parents=True, exist_ok=True)
    plan = [k for k in PLAN if not (a.no_shrink and k in ("shrink", "back", "grow"))]
    t0 = time.time()
    ref = LocalJob([*common, f"train.steps={a.steps}", "train.name=ref"], nodes=4, cwd=cwd)
    try:
        ref.start(timeout=a.timeout)
        assert ref.wait(a.timeout) == 0, ref.summary()
    finally:
        ref.close()
    print(f"uninterrupted run: {time.time() - t0:.0f} s", flush=True)
    job = LocalJob(
        [*common, f"train.steps={a.steps}", "train.name=chaos"], nodes=5, cwd=cwd, env={"JAXDIST_FAULT_HOOKS": "1"}
    )
    kills, lost_nodes = [], []
    every = job.cfg.checkpoint.every
    t0 = time.time()
    try:
        job.start(timeout=a.timeout)
        gen = 0
        for k, kind in enumerate(plan):
            s = job.wait_until(
                lambda s, gen=gen: s["generation"] == gen and s["phase"] == "running", a.timeout, f"gen {gen}"
            )
            base = s["last_step"]
            target = base + 3
            if kind == "save":  # just after the next persistent save began
                target = (base // every + 1) * every
            job.wait_until(
                lambda s, target=target: s["last_step"] >= target or s["phase"] != "running",
                a.timeout,
                f"step {target}",
            )
            s = job.state()
            assert s["phase"] == "running", f"the job ended before fault {k + 1}: raise --steps"
            members = s["members"]
            rank = {"kill": k % len(members), "stop": 1, "save": 2, "grow": 1}.get(kind, 0) % len(members)
            node = members[str(rank)]
            if kind in ("kill", "save", "grow"):
                job.inject(rank, signal.SIGKILL)
            elif kind == "stop":
                job.inject(rank, signal.SIGSTOP)
            elif kind == "hang":
                (job.run_dir / "faults.json").write_text(json.dumps([{"kind": "hang", "step": s["last_step"] + 3}]))
            elif kind == "controller":
                job.kill_controller()
                time.sleep(2.0)
                job.start_controller()
                gen -= 1  # no recovery: the job trains on
            elif kind in ("node", "shrink"):
                node = members[str(len(members) - 1)]
                job.lose_node(node)
                lost_nodes.append(node)
            elif kind == "back":
                for n in lost_nodes:
                    job.start_node(n)
                job.wait_until(lambda s: len(s["standbys"]) >= len(lost_nodes), a.timeout, "the nodes back")
                gen -= 1
            gen += 1
            kills.append({"kind": kind, "rank": rank, "node": node, "step": s["last_step"]})
            print(f"fault {k + 1}: {kind} (rank {rank} on {node}) at step {s['last_step']}", flush=True)
        rc = job.wait(a.timeout)
    finally:
        job.close()
    events = job.events()
    starts = [e for e in events if e["event"] == "start"]
    sizes = [len(e["members"]) for e in starts]
    segs = list(generations_trained(job.run_dir).values())
    lost = [segs[i][-1][0] - (segs[i + 1][0][0] - 1) for i in range(len(segs) - 1)]
    sources = [e.get("resumed_from") for e in events if e["event"] == "first_step"]
    report = check_exactly_once(job.run_dir)
    mine, theirs = _params(job.run_dir, a.steps), _params(ref.run_dir, a.steps)
    equal = sum(bool(np.array_equal(x, y)) for x, y in zip(mine, theirs))
    diff = max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(mine, theirs))
    print(f"\nfaults: {[(x['kind'], x['node'], x['step']) for x in kills]}")
    print(
        f"chaos run: exit {rc}; {len(starts)} generations of sizes {sizes}; steps recomputed per recovery {lost} "
        f"(restored from {sources}); {report['trained']} steps trained, exactly once: {report['ok']} "
        f"({report['duplicates']} duplicates, {report['missing']} missing); final parameters: {equal}/{len(mine)} "
        f"arrays bit-identical to the uninterrupted run, max difference {diff:.2e}; load {os.getloadavg()}; "
        f"{time.time() - t0:.0f} s in {cwd}"
    )
    return 0 if rc == 0 and report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

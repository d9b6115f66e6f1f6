"""The health monitor against injected faults: a real job of 4 workers x 2 CPU devices under the controller.

One job (the tiny model, every controller, health and checkpoint setting at its default: ``train.log_every=10``,
``controller.health_every=10``, ``heartbeat_timeout=1.5``; ``--hog N`` busy processes load the host) first trains
fault-free for ``--quiet-s`` seconds (every alarm then is a false one), then takes the injections one after the
other through the test-only fault hooks (``JAXDIST_FAULT_HOOKS=1``, ``<run>/faults.json``, see
jaxdist/train/faults.py), each cleared once it is detected (or after ``--timeout-periods``):

* ``compute``: one node's host sleeps 10-30 % of a step at each dispatch;
* ``data``: one node waits 30 % of a step more for each batch;
* ``link``: two nodes sleep ``--link-frac`` of a step (1.0) where the processes wait for each other before a
  step, and in the device probe's transfer between them (the job slows down, no rank stands out: the probe must name the link);
* ``stuck``: one rank stops in its data wait, still heartbeating (last: it restarts the group).

Per kind: periods from the first period the fault touched to the alarm (target <= 3), node or link named
correctly (target >= 95 %), kind named correctly, and for stuck ranks the seconds from injection to detection
against 3 step times + the heartbeat timeout.  Then the device probes of the job (their own duration and
figures), and in this process a probe over 4 pseudo-nodes of 2 CPU devices against a direct timing of the same
collectives (the same jitted programs, timed 30 times each).

    python benchmarks/health.py                   # ~20 injections
    python benchmarks/health.py --injections 4 --quiet-s 30     # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the in-process comparison

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "controller"))
from helpers import BUSY_LOOP  # noqa: E402  (a busy process that ends with its parent: tests/controller/helpers.py)

from jaxdist.controller.local import LocalJob  # noqa: E402

COMMON = [  # the defaults of every controller, health, checkpoint and train.log_every setting
    "model=tiny",
    "mesh.cluster=cpu-4x2",
    "mesh.fsdp=2",
    "train.batch_size=16",
    "train.seq_len=32",
    "data.max_bytes=300000",
    "train.progress=false",  # no progress bar or TensorBoard files: output only, no effect on what is measured
    "train.tensorboard=false",
    "train.runs_dir=runs",
]


def events(job: LocalJob, kinds: tuple[str, ...], after: float) -> list[dict]:
    return [e for e in job.events() if e["event"] in kinds and e["time"] > after]


def rounds(job: LocalJob) -> list[dict]:
    """Each complete round of health.jsonl with its end time (the newest period's)."""
    path = job.run_dir / "controller" / "health.jsonl"
    periods, out = {}, []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r["record"] == "period":
            periods.setdefault((r["gen"], r["index"]), []).append(r["t_end"])
        elif r["record"] == "round":
            out.append({**r, "t_end": max(periods.get((r["gen"], r["round"]), [0.0]))})
    return out


def read_fired(run_dir: Path) -> list[dict]:
    """When the fault hooks' injections took effect (jaxdist/train/faults.py FIRED)."""
    path = run_dir / "faults.fired.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def plan(rng: random.Random, n: int, nodes: list[str], kinds: list[str]) -> list[dict]:
    """``n`` injections: ``kinds`` in turn (random nodes, compute 10-30 % of a step), up to 3 stuck last."""
    with_stuck = "stuck" in kinds
    kinds = [k for k in kinds if k != "stuck"]
    out = []
    stuck = min(3, max(1, n // 7)) if with_stuck else 0
    stuck = n if not kinds else stuck
    for i in range(n - stuck):
        kind = kinds[i % len(kinds)]
        if kind == "link":
            out.append({"kind": "link", "nodes": sorted(rng.sample(nodes, 2))})
        else:
            out.append(
                {"kind": kind, "node": rng.choice(nodes), "frac": rng.uniform(0.1, 0.3) if kind == "compute" else 0.3}
            )
    out += [{"kind": "stuck", "node": rng.choice(nodes)} for _ in range(stuck)]
    return out


def detect(job: LocalJob, inj: dict, t0: float, timeout: float) -> dict | None:
    """The first detection after ``t0``: a health alarm naming a rank, a device probe's verdict, a stuck failure."""
    end = time.time() + timeout
    while time.time() < end and job.controller.poll() is None:
        for e in events(job, ("health", "device_probe", "failure"), t0):
            if e["event"] == "failure":
                return {
                    "kind": "stuck" if "stuck" in e["kinds"] else ",".join(e["kinds"]),
                    "named": e["nodes"],
                    "event": e,
                }
            if e["event"] == "health" and e.get("rank") is not None:
                return {"kind": e["finding"], "named": [e["node"]], "event": e}
            if e["event"] == "device_probe" and (inj["kind"] == "link" or e["finding"]):
                named = e["link"] or ([e["node"]] if e["node"] else [])
                return {"kind": e["finding"] or "none", "named": sorted(named), "event": e}
        time.sleep(0.2)
    if job.controller.poll() is not None:
        raise RuntimeError(f"the controller exited: {job.summary()}")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--injections", type=int, default=21)
    ap.add_argument("--quiet-s", type=float, default=120.0, help="seconds of fault-free training first")
    ap.add_argument(
        "--health-every",
        type=int,
        default=10,
        help="steps per efficiency record (the product default, controller.health_every)",
    )
    ap.add_argument("--link-frac", type=float, default=1.0, help="the link delay, a fraction of a step")
    ap.add_argument("--timeout-periods", type=int, default=8)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--kinds", default="compute,data,link,stuck", help="the kinds injected, in turn (stuck last)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--hog", type=int, default=0, help="busy processes loading the host for the whole run")
    args = ap.parse_args(argv)
    import subprocess

    hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.hog)]
    try:
        return _run(args, hogs)
    finally:
        for h in hogs:
            h.kill()


def _run(args: argparse.Namespace, hogs: list) -> int:
    rng = random.Random(args.seed)
    cwd = Path(args.dir or tempfile.mkdtemp(prefix="jaxdist-health-"))
    cwd.mkdir(parents=True, exist_ok=True)
    job = LocalJob(
        [*COMMON, "train.steps=100000", "train.name=health", f"controller.health_every={args.health_every}"],
        nodes=4,
        cwd=cwd,
        env={"JAXDIST_FAULT_HOOKS": "1"},
    )
    faults = job.run_dir / "faults.json"
    results, quiet = [], {}
    try:
        job.start(timeout=900)
        job.wait_until(lambda s: s["phase"] == "running", 900, "generation 0 running")
        while len(rounds(job)) < 3:
            time.sleep(0.5)
        t_quiet = time.time()
        time.sleep(args.quiet_s)
        quiet = {
            "load": os.getloadavg(),
            "seconds": time.time() - t_quiet,
            "steps": job.state()["last_step"],
            "alarms": len(events(job, ("health", "device_probe", "failure", "node_lost"), t_quiet)),
            "alarm_kinds": sorted(
                {
                    e.get("finding") or e["event"]
                    for e in events(job, ("health", "device_probe", "failure", "node_lost"), t_quiet)
                }
            ),
            "agent_silent": len(events(job, ("agent_silent",), t_quiet)),
            "agent_stalls": [e["seconds"] for e in events(job, ("agent_stall",), t_quiet)],
        }
        step_s = statistics.median(r["step_s"] for r in rounds(job)[1:])
        nodes = sorted(job.state()["members"].values())
        print(f"fault-free: {quiet['seconds']:.0f} s, alarms {quiet['alarms']}, step {step_s * 1e3:.0f} ms", flush=True)
        for _k, inj in enumerate(plan(rng, args.injections, nodes, args.kinds.split(","))):
            gen = job.state()["generation"]
            fault = dict(inj)
            if inj["kind"] in ("compute", "data"):
                fault["delay_s"] = inj["frac"] * step_s
            elif inj["kind"] == "link":
                fault["delay_s"] = args.link_frac * step_s
            t0 = time.time()
            faults.write_text(json.dumps([fault]))
            period_s = args.health_every * step_s * (1 + inj.get("frac", args.link_frac))
            found = detect(job, inj, t0, max(30.0, args.timeout_periods * period_s * 2))
            faults.write_text("[]")
            t_found = found["event"]["time"] if found else None
            want = inj.get("nodes") or [inj["node"]]
            touched = [r for r in rounds(job) if r["gen"] == gen and r["t_end"] > t0]
            alarm_round = found["event"].get("round") if found else None
            if found and found["event"]["event"] == "device_probe":  # the probe follows the slowdown alarm
                alarms = [e for e in events(job, ("health",), t0) if e["gen"] == gen]
                alarm_round = alarms[0]["round"] if alarms else None
            periods = alarm_round - touched[0]["round"] + 1 if (alarm_round is not None and touched) else None
            row = {
                **inj,
                "delay_s": fault.get("delay_s"),
                "detected": found is not None,
                "kind_named": found["kind"] if found else None,
                "named": found["named"] if found else None,
                "node_ok": bool(found) and sorted(found["named"]) == sorted(want),
                "kind_ok": bool(found) and found["kind"] == inj["kind"],
                "periods": periods,
                "detect_s": (t_found - t0) if t_found else None,
            }
            if inj["kind"] == "stuck" and t_found:  # also from the moment the rank stopped (its next data wait)
                fired = [r for r in read_fired(job.run_dir) if r["node"] == inj["node"] and r["time"] >= t0]
                row["detect_from_stop_s"] = t_found - fired[0]["time"] if fired else None
            results.append(row)
            print(json.dumps(row), flush=True)
            if inj["kind"] == "stuck":  # the group restarts: wait for it, its warm-up round and its history
                job.wait_until(lambda s, gen=gen: s["generation"] > gen and s["phase"] == "running", 600, "the restart")
                n = len(rounds(job))
                while len(rounds(job)) < n + 4:
                    time.sleep(0.3)
            else:  # let the streak end and the job settle: two rounds after the fault is gone
                n = len(rounds(job))
                while len(rounds(job)) < n + 3 and job.controller.poll() is None:
                    time.sleep(0.3)
        probes = events(job, ("device_probe",), 0)
        hb = job.cfg.controller.heartbeat_timeout
    finally:
        job.close()
    report(results, quiet, probes, step_s, hb)
    compare_in_process()
    print(f"run directory: {job.run_dir}")
    return 0


def report(results: list[dict], quiet: dict, probes: list[dict], step_s: float, hb: float) -> None:
    print(
        f"\nfault-free: {quiet['seconds']:.0f} s ({quiet['steps']} steps so far, load {quiet['load']}), alarms (health, device probe, "
        f"failure, node lost): {quiet['alarms']} {quiet['alarm_kinds']}; agents silent while their workers trained: "
        f"{quiet['agent_silent']}, agent loop stalls: {quiet['agent_stalls']} s"
    )
    print("kind    | n  | detected | periods to flag (median, max) | node/link named | kind named | detect s (median)")
    for kind in ("compute", "data", "link", "stuck"):
        rows = [r for r in results if r["kind"] == kind]
        if not rows:
            continue
        per = [r["periods"] for r in rows if r["periods"] is not None]
        det = [r["detect_s"] for r in rows if r["detect_s"] is not None]
        print(
            f"{kind:7} | {len(rows):2} | {sum(r['detected'] for r in rows):8} | "
            f"{(statistics.median(per) if per else float('nan')):5.1f}, {max(per) if per else '-':>3}"
            f"{'':18}| {100 * sum(r['node_ok'] for r in rows) / len(rows):14.0f}% | "
            f"{100 * sum(r['kind_ok'] for r in rows) / len(rows):9.0f}% | "
            f"{(statistics.median(det) if det else float('nan')):.1f}"
        )
    stuck = [r for r in results if r["kind"] == "stuck" and r["detect_s"] is not None]
    if stuck:
        fmt = lambda xs: ", ".join("-" if x is None else f"{x:.1f}" for x in xs)  # noqa: E731
        print(
            f"stuck: detected {fmt(r['detect_s'] for r in stuck)} s after the injection was written, "
            f"{fmt(r.get('detect_from_stop_s') for r in stuck)} s after the rank stopped (its next data wait); "
            f"target 3 x {step_s:.3f} s + {hb} s = {3 * step_s + hb:.1f} s"
        )
    for p in probes:
        pairs = ", ".join(f"{q['a']}-{q['b']} {q['seconds'] * 1e3:.1f} ms" for q in p["pairs"])
        comp = ", ".join(f"{n} {s * 1e3:.1f}" for n, s in p["compute_s"].items())
        print(
            f"job probe at step {p['step']}: {p['probe_s']:.2f} s; compute ms {comp}; pairs {pairs}; "
            f"ring {p['ring_s'] * 1e3:.1f} ms, all-reduce {p['allreduce_s'] * 1e3:.1f} ms -> {p['finding']}: {p['why']}"
        )


def compare_in_process(reps: int = 30) -> None:
    """A probe over 4 pseudo-nodes of 2 CPU devices in this process, against the same programs timed directly."""
    import jax

    from jaxdist.train.device_probe import DeviceProbe

    devs = jax.devices()[:8]
    probe = DeviceProbe([devs[i : i + 2] for i in range(0, 8, 2)], ["p0", "p1", "p2", "p3"])
    rec = probe.run()
    x = probe.buffer()
    print(f"\nin-process probe (4 pseudo-nodes x 2 CPU devices, {probe.nbytes} B per device): {rec['seconds']:.2f} s")
    print("pair   | probe ms | direct ms (min, median of 30)")
    for a, b, s, _ in rec["pairs"]:
        fn = probe._fns[str([(probe.names.index(a), probe.names.index(b))])]  # the probe's own program
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        print(f"{a}-{b}  | {s * 1e3:8.2f} | {min(times) * 1e3:.2f}, {statistics.median(times) * 1e3:.2f}")
    for name, key in (("ring", "ring"), ("all-reduce", "allreduce")):
        fn = probe._fns[key]
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        print(f"{name:6} | {rec[key + '_s'] * 1e3:8.2f} | {min(times) * 1e3:.2f}, {statistics.median(times) * 1e3:.2f}")


if __name__ == "__main__":
    sys.exit(main())

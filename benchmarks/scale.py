"""How the costs of the data order, the checkpoint plan, the planner, Slurm parsing and the controller grow.

Issue 37's subsystems at scale, one table each, with a fitted growth exponent per cost (the slope of
log(cost) against log(size) over the rows: 1.0 is linear, 2.0 quadratic).

**The batch list** at up to 10^6 steps and 1,000 online additions:

- rows ``steps``: a run whose base source has N batches (B=1 sequence of L=1 token per batch, so N
  batches cost 2N tokens of memory, and the order is what grows), with 20 additions;
- rows ``additions``: a run of 10^4 batches with A = 10, 100, 1,000 additions, and the same at 10^6
  batches (the issue's point: 10^6 steps and 1,000 additions, measured, not projected).

Each addition is a real ``jaxdist data add`` of a small token file (``add_data``), applied at the next
step boundary as the trainer applies it (``RunBatchList.boundary``).  Costs:

- ``lookup us``: one ``id_at`` (what each step asks), microseconds;
- ``add ms``: the mean over the additions of registering one and applying it (a new version written);
- ``resume ms``: opening the run's batch list as a restarting trainer does (newest version, sources checked);
- ``journal MB``: the bytes of ``<run>/batchlist/`` on disk;
- ``verify s``: ``jaxdist data verify`` (every version loaded, checked against its parent and replayed);
- ``held MB``: the open list's order in memory (8 bytes a batch; a step's lookup allocates nothing);
- ``add peak MB`` and ``resume peak MB``: the most memory allocated at once (``tracemalloc``, numpy's arrays
  included) by the last addition (registering it and applying it at a boundary) and by a resume, beyond what
  was held before; the time columns leave those traced calls out;
- ``decodes``: version files decoded by the additions plus verify (counted, not timed): an addition reads the
  files back to the last whole order for their sources (at most ``WHOLE_EVERY`` = 64, small ones).

**The checkpoint write plan** (``checkpoint/plan.py``, what every process computes before a save) of
llama-70b and mixtral-8x7b train states (parameters, Adam's two moments, the step; float32) over P = 64,
256 and 1,024 processes of 8 devices, mesh tensor=8 x fsdp=min(P, 64) x data=P/64 (mixtral: expert=8 in
place of part of fsdp): layouts built from the partition specs (no devices), ``plan_writes`` time, pieces,
and max/mean bytes per process.

**``jaxdist plan``** (the planner's search) of llama-70b on 1,024, 4,096 and 16,384 H100s (the h100x8 node
figures, nodes multiplied; batch = GPUs / 4 sequences of 4,096 tokens): seconds and strategies evaluated.

**Slurm parsing** of ``scontrol show node -d`` text of 100, 1,000 and 10,000 nodes (the format Slurm 22
writes, 8 GPUs each, some drained or allocated): ``parse_nodes`` seconds.

**The health detector** (``--tables health``): 64, 256 and 1,024 ranks' efficiency periods added one at a
time, with the complete rounds judged after each, as the controller does: milliseconds per round, microseconds
per period.

**The controller** (``--tables controller``, not in the default set: about 10 minutes) at its defaults against
N = 64, 256 and 1,024 simulated nodes (``tests/controller/sim_cluster.py``: the real protocol, CURVE and HMAC,
heartbeats every 0.25 s, stub workers; N - 6 train, 6 are standbys; one host process per 128 nodes on the
same machine as the controller): seconds to the first step; over 10 fault-free seconds (``--quiet-s``) the
controller's CPU share (of one core; ``IO thread``: ZeroMQ's, which encrypts and decrypts), its memory and
event-log growth, and its own load figures from ``state.json`` (``controller_load``: messages a second, the
time to handle one p50/p99 in microseconds, how late one is read p99); failures in that phase (false
alarms); ``state.json`` size and save time; then 5 member nodes lost one after the other: seconds from each
loss to the failure (``detect s``) and from it to the new group's assignments sent (``told s``), p50 and
p99 (the largest of 5); pings of the link checks, and the share of the workers' heartbeats sent to the
controller directly rather than through their node agent (``jaxdist.controller.relay``).

    python benchmarks/scale.py                  # every table but the controller's (about 5 minutes here)
    python benchmarks/scale.py --tables controller
    python benchmarks/scale.py --tables controller --nodes 1024 --quiet-s 600   # a 10-minute fault-free phase
    python benchmarks/scale.py --quick          # smaller sizes, for a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import shutil
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

import jaxdist.data.journal as journal_module
from jaxdist.checkpoint.plan import layout_from_spec, plan_writes
from jaxdist.cluster import load_cluster
from jaxdist.config import load_config
from jaxdist.controller.health import HealthHistory, Period
from jaxdist.controller.state import JobState
from jaxdist.data import RunBatchList, add_data
from jaxdist.data.audit import verify
from jaxdist.models.arithmetic import param_count
from jaxdist.models.moe import moe_param_specs
from jaxdist.models.names import block_param_specs
from jaxdist.parallel.rules import DEFAULT_RULES
from jaxdist.planner.plan import plan
from jaxdist.slurm.parse import parse_nodes


def _count_decodes() -> list[int]:
    count = [0]
    real = journal_module.decode

    def counted(data, where, *rest):
        count[0] += 1
        return real(data, where, *rest)

    journal_module.decode = counted
    return count


DECODES = _count_decodes()


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def batch_list_row(n_batches: int, additions: int) -> dict:
    """The costs of one run with ``n_batches`` base batches and ``additions`` online additions."""
    with tempfile.TemporaryDirectory(prefix="jaxdist-scale-") as tmp:
        run_dir = Path(tmp) / "run"
        tokens = np.arange(n_batches + 1, dtype=np.uint32) % 250  # B=1, L=1: N windows of 2 tokens
        run = RunBatchList(run_dir, tokens, "synthetic", 0, 1, 1)
        assert len(run.current) == n_batches
        DECODES[0] = 0
        rng = np.random.default_rng(0)
        cursor, t_add = 0, 0.0
        step = max(1, n_batches // (additions + 1))
        add_peak = 0.0
        for k in range(additions):
            f = Path(tmp) / f"add{k}.bin"
            rng.integers(0, 250, 64, dtype=np.uint16).tofile(f)
            last = k == additions - 1  # its memory traced (tracemalloc slows it: not in the time unless alone)
            if last:
                tracemalloc.start()
            t0 = time.perf_counter()
            add_data(run_dir, [f], seed=k, kind="tokens", token_dtype="uint16")
            assert run.boundary(cursor)
            if not last or additions == 1:
                t_add += time.perf_counter() - t0
            if last:
                add_peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            cursor += step
        t0 = time.perf_counter()
        lookups = 20000
        bl = run.current
        for p in rng.integers(0, len(bl), lookups):
            bl.id_at(int(p))
        lookup_us = (time.perf_counter() - t0) / lookups * 1e6
        t0 = time.perf_counter()
        again = RunBatchList(run_dir, tokens, "synthetic", 0, 1, 1)
        resume_ms = (time.perf_counter() - t0) * 1e3
        assert again.version == additions + 1
        del again
        tracemalloc.start()
        again = RunBatchList(run_dir, tokens, "synthetic", 0, 1, 1)
        resume_peak, held = tracemalloc.get_traced_memory()[1], again.current.order.nbytes
        tracemalloc.stop()
        t0 = time.perf_counter()
        ok, lines = verify(run_dir)
        verify_s = time.perf_counter() - t0
        assert ok, lines
        return {
            "batches": n_batches,
            "additions": additions,
            "lookup us": lookup_us,
            "add ms": t_add / max(additions - 1, 1) * 1e3,
            "resume ms": resume_ms,
            "journal MB": _dir_bytes(run_dir / "batchlist") / 1e6,
            "verify s": verify_s,
            "decodes": DECODES[0],
            "held MB": held / 1e6,
            "add peak MB": add_peak / 1e6,
            "resume peak MB": resume_peak / 1e6,
        }


# --------------------------------------------------------------------------- the checkpoint write plan

AXES = ("data", "fsdp", "expert", "tensor")
RULES = dict(DEFAULT_RULES)


def _spec(names, sizes: dict) -> tuple:
    """The partition spec of an array with logical ``names`` (the default rules, axes of size 1 left out)."""
    used, out = set(), []
    for n in names:
        axes = tuple(a for a in RULES.get(n, ()) if sizes.get(a, 1) > 1 and a not in used) if n else ()
        used |= set(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(out)


def model_arrays(preset: str) -> list[tuple[str, tuple[int, ...], tuple]]:
    """(name, shape, logical names) of every parameter of ``preset``, layers stacked as the model stacks them."""
    m = load_config(None, [f"model={preset}"]).model
    d, v, L = m.d_model, m.vocab_size, m.n_layers
    arrays = [("embed", (v, d), ("vocab", "embed")), ("final_norm", (d,), ("norm",))]
    if not m.tie_embeddings:
        arrays.append(("lm_head", (d, v), ("embed", "vocab")))
    blocks = dict(block_param_specs(m))
    if m.moe.experts:  # every block is an MoE block in these presets: the experts replace the dense MLP
        assert m.moe.every == 1
        for k in ("w_gate", "w_up", "w_down"):
            del blocks[k]
        blocks.update(moe_param_specs(m))
    arrays += [(k, (L, *shape), ("layers", *names)) for k, (shape, names) in blocks.items()]
    assert sum(int(np.prod(s)) for _, s, _ in arrays) == param_count(m), preset  # the model's own count
    return arrays


def checkpoint_plan_row(preset: str, processes: int) -> dict:
    per_node = 8
    fsdp = min(processes, 64)
    sizes = {"tensor": 8, "fsdp": fsdp, "data": processes // fsdp, "expert": 1}
    if load_config(None, [f"model={preset}"]).model.moe.experts:
        sizes.update(expert=8, fsdp=fsdp // 8)
    grid = np.arange(processes * per_node).reshape([sizes[a] for a in AXES])
    process_of = {int(dv): int(dv) // per_node for dv in grid.ravel()}
    t0 = time.perf_counter()
    layouts = []
    for name, shape, names in model_arrays(preset):
        spec = _spec(names, sizes)
        for part in ("param", "mu", "nu"):
            layouts.append(layout_from_spec(f"{part}/{name}", shape, 4, spec, AXES, grid.tolist(), process_of))
    layouts.append(layout_from_spec("step", (), 4, (), AXES, grid.tolist(), process_of))
    t_layout = time.perf_counter() - t0
    t0 = time.perf_counter()
    wp = plan_writes(layouts, processes)
    t_plan = time.perf_counter() - t0
    per = wp.bytes_per_process()
    return {
        "model": preset,
        "processes": processes,
        "mesh": " ".join(f"{a}={n}" for a, n in sizes.items() if n > 1),
        "state GB": sum(per) / 1e9,
        "layouts s": t_layout,
        "plan s": t_plan,
        "pieces": sum(len(a.pieces) for a in wp.arrays),
        "max/mean": max(per) / (sum(per) / len(per)),
    }


# --------------------------------------------------------------------------- the planner and Slurm


def planner_row(gpus: int) -> dict:
    m = load_config(None, ["model=llama-70b"]).model
    cluster = dataclasses.replace(load_cluster("h100x8"), nodes=gpus // 8, name=f"h100x{gpus}")
    t0 = time.perf_counter()
    p = plan(m, cluster, batch_size=gpus // 4, seq_len=4096)
    return {"gpus": gpus, "plan s": time.perf_counter() - t0, "evaluations": p.evaluations,
            "best": p.best.strategy.describe().replace(" | ", "; ")}  # fmt: skip


NODE = """NodeName=gpu{i:05d} Arch=x86_64 CoresPerSocket=32
   CPUAlloc={alloc} CPUEfctv=128 CPUTot=128 CPULoad=1.00
   AvailableFeatures=h100
   ActiveFeatures=h100
   Gres=gpu:h100:8(S:0-1)
   GresDrain=N/A
   GresUsed=gpu:h100:{used}(IDX:{idx})
   NodeAddr=10.1.{hi}.{lo} NodeHostName=gpu{i:05d} Version=22.05.8
   OS=Linux 5.15.0 #1 SMP
   RealMemory=2000000 AllocMem=0 FreeMem=1900000 Sockets=2 Boards=1
   State={state} ThreadsPerCore=2 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A
   Partitions=gpu
   BootTime=2026-11-01T00:00:00 SlurmdStartTime=2026-11-01T00:00:10
   LastBusyTime=2026-12-01T00:00:00
   CfgTRES=cpu=128,mem=2000000M,billing=128,gres/gpu=8
   AllocTRES=
   CapWatts=n/a
   CurrentWatts=0 AveWatts=0
   ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s

"""


def scontrol_text(n: int) -> str:
    out = []
    for i in range(n):
        used = (0, 4, 8)[i % 3]
        state = ("IDLE", "MIXED", "ALLOCATED", "IDLE+DRAIN")[i % 4]
        idx = "N/A" if used == 0 else f"0-{used - 1}"
        out.append(NODE.format(i=i, alloc=16 * used, used=used, idx=idx, hi=i // 250, lo=i % 250, state=state))
    return "".join(out)


def slurm_row(n: int) -> dict:
    text = scontrol_text(n)
    t0 = time.perf_counter()
    nodes = parse_nodes(text)
    dt = time.perf_counter() - t0
    assert len(nodes) == n and nodes[-1].gpus == 8
    return {"nodes": n, "text MB": len(text) / 1e6, "parse s": dt, "usable": sum(x.usable for x in nodes)}


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` by thread name (the Python main thread is named as the process;
    ZeroMQ's I/O thread ``ZMQbg/IO/0``), summed over threads of one name."""
    out: dict[str, float] = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        text = (t / "stat").read_text()
        name, fields = text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _quantile(xs: list[float], p: float) -> float:
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


LOSSES = 5  # member nodes lost one after the other in each controller row (detection and "told" p50/p99)


def controller_row(n: int, quiet_s: float) -> dict:
    """The real controller at its defaults against ``n`` simulated nodes (tests/controller/sim_cluster.py, one
    host process per 128 nodes, at least 2): the start, a fault-free phase of ``quiet_s`` seconds, then LOSSES
    member nodes lost one after the other (its sockets closed, nothing said), each recovered onto a standby."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "controller"))
    from sim_cluster import SimCluster  # the test harness: simulated agents speaking the real protocol

    root, keep = Path(tempfile.mkdtemp(prefix=f"jaxdist-sim{n}-")), False
    job = SimCluster(n, n - LOSSES - 1, max(2, math.ceil(n / 128)), root, steps=100_000, step_s=0.5)
    row: dict = {"nodes": n}
    try:
        t0 = time.monotonic()
        job.start()
        pid = job.controller.pid
        try:
            job.wait_until(lambda s: s["phase"] == "running", 300, "generation 0 running")
        except TimeoutError:  # the row says what happened instead
            row["start s"] = float("nan")
            row["false losses"] = sum(1 for e in job.events() if e["event"] == "node_lost")
            row["ctl CPU share"] = _proc_cpu_s(pid) / (time.monotonic() - t0)
            return row
        row["start s"] = time.monotonic() - t0
        events0 = (job.dir / "events.jsonl").stat().st_size
        c0, th0, w0, w0_wall = _proc_cpu_s(pid), _thread_cpu_s(pid), time.monotonic(), time.time()
        time.sleep(quiet_s)
        c1, th1, w1 = _proc_cpu_s(pid), _thread_cpu_s(pid), time.monotonic()
        row["ctl CPU share"] = (c1 - c0) / (w1 - w0)
        row["IO thread"] = (th1.get("ZMQbg/IO/0", 0) - th0.get("ZMQbg/IO/0", 0)) / (w1 - w0)
        row["ctl RSS MB"] = _proc_rss_mb(pid)
        load = job.state().get("controller_load", {})  # the controller's own figures (state.LoadMeter)
        row["msgs/s"] = load.get("messages_per_s", float("nan"))
        row["handle us p50"] = load.get("handle_us_p50", float("nan"))
        row["handle us p99"] = load.get("handle_us_p99", float("nan"))
        row["lag ms p99"] = load.get("lag_ms_p99", float("nan"))
        row["events KB/h"] = ((job.dir / "events.jsonl").stat().st_size - events0) / (w1 - w0) * 3600 / 1e3
        alarms = [e for e in job.events() if e["event"] in ("node_lost", "failure")]
        row["false losses"] = sum(1 for e in alarms if e["time"] >= w0_wall)  # in the fault-free phase
        row["start losses"] = len(alarms) - row["false losses"]  # nodes taken for lost while the job started
        state_path = job.dir / "state.json"
        row["state KB"] = state_path.stat().st_size / 1e3
        st = JobState.load(state_path)
        t = time.perf_counter()
        for _ in range(10):
            st.save(root / "state-copy.json")
        row["state save ms"] = (time.perf_counter() - t) / 10 * 1e3
        detect, told = [], []
        for k in range(LOSSES):
            try:
                job.wait_until(lambda s, g=k: s["generation"] == g and s["phase"] == "running", 300, f"gen {k} running")
            except TimeoutError as e:  # kept for a look: the row says where
                row["stuck"], keep = f"{e} ({root})", True
                break
            lost, host = job.rank_host(1 + k)
            at = time.time()
            job.command(host, "lose", nodes=[lost])
            job.wait_until(lambda s, g=k: s["generation"] >= g + 1, 300, f"generation {k + 1} assigned")
            ev = job.events()
            found = [e for e in ev if e["event"] == "failure" and e["time"] >= at]
            started = [e for e in ev if e["event"] == "start" and e["time"] >= at]
            detect.append(found[0]["time"] - at if found else float("nan"))
            told.append(started[0]["time"] - found[0]["time"] if found and started else float("nan"))
        row["detect s p50"], row["detect s p99"] = _quantile(detect, 0.5), _quantile(detect, 0.99)
        row["told s p50"], row["told s p99"] = _quantile(told, 0.5), _quantile(told, 0.99)
    finally:
        job.close()
        counts = job.host_counts()
        row["pings"] = counts.get("ping_sent", 0)
        row["direct hb share"] = counts.get("hb_direct", 0) / max(counts.get("hb", 0), 1)
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return row


def health_row(ranks: int, rounds: int = 20) -> dict:
    """The controller's health detector over ``ranks`` ranks (in this process): periods added one at a time and
    rounds asked for after each, as the controller does; milliseconds per round (the median and MAD over ranks
    of each part included) and per period."""
    rng = random.Random(0)
    h = HealthHistory(0, ranks)
    t = time.perf_counter()
    for i in range(rounds):
        for r in range(ranks):
            j = 1 + rng.gauss(0, 0.1)
            h.add(Period(0, r, f"n{r}", i, 10 * i + 1, 10 * i + 10, 0.0, 80, 1.0 * j, 0.01 * j, 0.1 * j, 0.8 * j))
            for _ in h.complete_rounds():
                pass
    dt = time.perf_counter() - t
    return {"ranks": ranks, "ms per round": dt / rounds * 1e3, "us per period": dt / (rounds * ranks) * 1e6}


def print_rows(title: str, rows: list[dict], x: str, costs: list[str]) -> None:
    print(f"\n{title}")
    head = list(rows[0])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        vals = [r.get(h, "-") for h in head]  # a row that stopped early (a job that never started) has fewer
        cells = [f"{v:,}" if isinstance(v, int) else f"{v:.3g}" if isinstance(v, float) else v
                 for v in vals]  # fmt: skip
        print("| " + " | ".join(cells) + " |")
    print(f"growth exponent in {x}: " + ", ".join(f"{c} {growth(rows, x, c):.2f}" for c in costs))


def growth(rows: list[dict], x: str, y: str) -> float:
    """Least-squares slope of log(y) against log(x) over the rows (nan where a value is not positive)."""
    pts = [(math.log(r[x]), math.log(r[y])) for r in rows if r.get(y, 0) > 0 and r[x] > 0]
    if len(pts) < 2:
        return float("nan")
    xs, ys = np.array(pts).T
    return float(np.polyfit(xs, ys, 1)[0])


COLUMNS = ["lookup us", "add ms", "resume ms", "journal MB", "verify s", "decodes", "held MB", "add peak MB"]
COLUMNS += ["resume peak MB"]


def print_table(title: str, rows: list[dict], x: str) -> None:
    print(f"\n{title}")
    head = ["batches", "additions", *COLUMNS]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(f"{r[h]:,}" if isinstance(r[h], int) else f"{r[h]:.3g}" for h in head) + " |")
    print("| growth exponent in " + x + " | | " + " | ".join(f"{growth(rows, x, c):.2f}" for c in COLUMNS) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument(
        "--tables", default="batchlist,checkpoint,planner,slurm,health", help="which tables, comma-separated"
    )
    ap.add_argument("--quiet-s", type=float, default=10.0, help="controller: the fault-free phase's seconds")
    ap.add_argument("--nodes", default="", help="controller: node counts, comma-separated (default 64,256,1024)")
    args = ap.parse_args()
    tables, q = set(args.tables.split(",")), args.quick
    print(f"host load (1 min) at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if "batchlist" in tables:
        steps = [batch_list_row(n, 20) for n in ((1_000, 10_000, 100_000) if q else (10_000, 100_000, 1_000_000))]
        print_table("Batch list, growing steps (20 additions)", steps, "batches")
        for n in (1_000,) if q else (10_000, 1_000_000):
            adds = [batch_list_row(n, a) for a in ((1, 10, 100) if q else (10, 100, 1000))]
            print_table(f"Batch list of {n:,} batches, growing additions", adds, "additions")
    if "checkpoint" in tables:
        for preset in ("llama-70b", "mixtral-8x7b"):
            rows = [checkpoint_plan_row(preset, p) for p in ((8, 16, 64) if q else (64, 256, 1024))]
            print_rows(f"Checkpoint write plan, {preset}", rows, "processes", ["layouts s", "plan s", "pieces"])
    if "planner" in tables:
        rows = [planner_row(g) for g in ((64, 256, 1024) if q else (1024, 4096, 16384))]
        print_rows("jaxdist plan, llama-70b", rows, "gpus", ["plan s", "evaluations"])
    if "health" in tables:
        rows = [health_row(n) for n in (64, 256, 1024)]
        print_rows("The controller's health detector", rows, "ranks", ["ms per round", "us per period"])
    if "controller" in tables:
        sizes = [int(n) for n in args.nodes.split(",") if n] or ([16, 32, 64] if q else [64, 256, 1024])
        rows = [controller_row(n, args.quiet_s) for n in sizes]
        costs = ["start s", "ctl CPU share", "IO thread", "msgs/s", "ctl RSS MB", "state KB", "state save ms"]
        costs += ["events KB/h", "pings"]
        print(f"(fault-free phase: {args.quiet_s:g} s per row)")
        print_rows("The controller against simulated nodes (defaults)", rows, "nodes", costs)
    if "slurm" in tables:
        rows = [slurm_row(n) for n in ((10, 100, 1000) if q else (100, 1000, 10000))]
        print_rows("Slurm: parse_nodes of scontrol show node -d", rows, "nodes", ["parse s"])
    print(f"\nhost load (1 min) at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

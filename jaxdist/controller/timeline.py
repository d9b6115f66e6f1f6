"""What happened to a controlled job: generations, recoveries and a timeline of steps.

Reads only files: the controller's ``events.jsonl``, ``progress.jsonl`` and
``injections.jsonl`` (under ``<run>/controller/``) and the run's
``metrics.jsonl`` (the train records process 0 of every generation wrote).
Used by the fault-tolerance notebook and ``benchmarks/recovery.py``.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from jaxdist.controller.state import read_events


def generations_trained(run_dir: str | Path) -> dict[int, list[tuple[int, float | None]]]:
    """Generation -> the (step, loss) its process 0 trained, in order (from ``controller/trained.jsonl``)."""
    out: dict[int, list[tuple[int, float | None]]] = {}
    for r in read_events(Path(run_dir) / "controller" / "trained.jsonl"):
        out.setdefault(int(r["gen"]), []).append((int(r["step"]), r.get("loss")))
    return dict(sorted(out.items()))


def recoveries(run_dir: str | Path) -> list[dict[str, Any]]:
    """One row per failure: what failed, how it was found, and what the recovery cost.

    ``detect_s``: injection to detection (seconds; None without a recorded injection),
    ``to_first_step_s``: detection to the first step of the next generation (seconds),
    ``lost_steps``: steps the failed generation completed beyond the checkpoint the next one resumed from,
    ``resumed_from``: "local" (the node-local tier), "persistent" or "init".
    """
    ctl = Path(run_dir) / "controller"
    events = read_events(ctl / "events.jsonl")
    injections = read_events(ctl / "injections.jsonl")
    trained = generations_trained(run_dir)
    rows = []
    for f in (e for e in events if e["event"] == "failure"):
        inj = next((j for j in injections if j["gen"] == f["gen"]), None)
        nxt = next((e for e in events if e["event"] == "first_step" and e["gen"] > f["gen"]), None)
        start = next((e for e in events if e["event"] == "start" and e["gen"] > f["gen"]), None)
        prev = next((e for e in events if e["event"] == "start" and e["gen"] == f["gen"]), None)
        last = trained[f["gen"]][-1][0] if trained.get(f["gen"]) else None
        lost = None if nxt is None else max(0, (last if last is not None else nxt["resume_step"]) - nxt["resume_step"])
        swapped = (
            {r: n for r, n in start["members"].items() if prev is None or prev["members"].get(r) != n} if start else {}
        )
        rows.append(
            {
                "gen": f["gen"],
                "kind": ",".join(f["kinds"]),
                "ranks": f["ranks"],
                "nodes": f["nodes"],
                "signal": inj["signal"] if inj else None,
                "detect_s": f["time"] - inj["time"] if inj else None,
                "to_first_step_s": nxt["time"] - f["time"] if nxt else None,
                "lost_steps": lost,
                "resume_step": nxt["resume_step"] if nxt else None,
                "swapped": swapped,
                "resumed_from": nxt.get("resumed_from") if nxt else None,
            }
        )
    return rows


def summary(values: list[float]) -> dict[str, float]:
    """n, median, 90th percentile (nearest rank) and max of ``values`` (None ignored)."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return {"n": 0, "median": float("nan"), "p90": float("nan"), "max": float("nan")}
    return {
        "n": len(v),
        "median": statistics.median(v),
        "p90": v[min(len(v) - 1, int(0.9 * len(v) + 0.5) - 1)],
        "max": v[-1],
    }


def plot_timeline(run_dir: str | Path, ax=None):
    """Steps over wall-clock time, one colour per generation, injections and failures marked (matplotlib Axes)."""
    import matplotlib.pyplot as plt  # optional (the [notebooks] and [test] extras): only for the picture

    ctl = Path(run_dir) / "controller"
    trained = read_events(ctl / "trained.jsonl")
    events = read_events(ctl / "events.jsonl")
    injections = read_events(ctl / "injections.jsonl")
    starts = {e["gen"]: e for e in events if e["event"] == "start"}
    t0 = min((e["time"] for e in starts.values()), default=0.0)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    for g in sorted({r["gen"] for r in trained}):
        pts = [(r["time"] - t0, r["step"]) for r in trained if r["gen"] == g]
        ranks = ", ".join(f"{r}:{n}" for r, n in sorted(starts[g]["members"].items())) if g in starts else ""
        ax.plot(*zip(*pts), marker=".", label=f"generation {g} ({ranks})")
    for e in events:
        if e["event"] in ("failure", "start"):
            ax.axvline(e["time"] - t0, color="black" if e["event"] == "failure" else "green", ls=":", lw=1)
    top = max((r["step"] for r in trained), default=1)
    for j in injections:
        ax.axvline(j["time"] - t0, color="red", ls="--", lw=1)
        what = f"rank {j['rank']}" if "rank" in j else j.get("node", "")  # a lost node's record names the node
        ax.text(j["time"] - t0, top, f" {j['signal']} {what}", color="red", rotation=90, va="top", fontsize=8)
    ax.set_xlabel("seconds since the first start (dotted: green start, black failure detected)")
    ax.set_ylabel("step completed")
    ax.legend(fontsize=7, loc="lower right")
    return ax

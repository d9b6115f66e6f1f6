"""`jaxdist status RUN_DIR`: the job's health per node, from ``<run>/controller/health.jsonl``, and an MoE run's
router per block, from ``<run>/metrics.jsonl`` (no JAX).

:func:`node_table` summarises the newest generation's last periods per rank; :func:`plot_heatmap`
draws step time per node and period (matplotlib, imported only there), with the periods that raised a
finding marked.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from jaxdist.config import ConfigError
from jaxdist.controller.health import Period

RECENT_PERIODS = 3  # the table's figures: the median over each rank's last few periods


def read_health(run_dir: str | Path) -> tuple[list[Period], list[dict[str, Any]]]:
    """(periods, rounds) recorded by the controller, in order; a torn last line is skipped."""
    path = Path(run_dir) / "controller" / "health.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"{path} does not exist: `jaxdist status` reads a run started by `jaxdist launch` with "
            "controller.health_every > 0 (give the run directory, <runs_dir>/<name>)."
        )
    periods, rounds = [], []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line torn by a kill mid-write
        if rec.get("record") == "period":
            periods.append(Period.from_dict(rec))
        elif rec.get("record") == "round":
            rounds.append(rec)
    return periods, rounds


def last_probe(run_dir: str | Path) -> dict[str, Any] | None:
    """The newest probe the controller ran after a slowdown (its ``device_probe`` event: timed collectives on
    the devices, or a ``probe`` event: TCP pings between the node agents), or None."""
    path = Path(run_dir) / "controller" / "events.jsonl"
    found = None
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") in ("probe", "device_probe"):
                found = e
    return found


def node_table(periods: list[Period], rounds: list[dict[str, Any]], probe: dict[str, Any] | None = None) -> list[dict]:
    """One row per rank of the newest generation: samples/s, seconds per step (training, data wait, the host's
    dispatch, blocked on the device, checkpoint), the findings that named it, and the last probe's word on it."""
    if not periods:
        return []
    gen = max(p.gen for p in periods)
    mine = [p for p in periods if p.gen == gen]
    flags: dict[int, list[str]] = {}
    for r in rounds:
        if r.get("gen") == gen:
            for f in r.get("findings", []):
                if f.get("rank") is not None:
                    flags.setdefault(int(f["rank"]), []).append(f"{f['kind']}@{r['round']}")
    slow = set(probe.get("slow_nodes", [])) if probe else set()
    rows = []
    for rank in sorted({p.rank for p in mine}):
        last = [p for p in mine if p.rank == rank][-RECENT_PERIODS:]
        med = lambda f: statistics.median(f(p) for p in last)  # noqa: E731, B023
        rows.append(
            {
                "rank": rank,
                "node": last[-1].node,
                "periods": len([p for p in mine if p.rank == rank]),
                "last_step": last[-1].last_step,
                "samples_per_s": med(lambda p: p.samples / p.train_s if p.train_s > 0 else 0.0),
                "step_s": med(lambda p: p.step_s),
                "data_wait_s": med(lambda p: p.per_step("data_wait_s")),
                "dispatch_s": med(lambda p: p.per_step("dispatch_s")),
                "blocked_s": med(lambda p: p.per_step("blocked_s")),
                "checkpoint_s": med(lambda p: p.per_step("checkpoint_s")),
                "flags": " ".join(flags.get(rank, [])) or "-",
                "probe": _probe_word(probe, last[-1].node, slow),
            }
        )
    return rows


def _probe_word(probe: dict[str, Any] | None, node: str, slow: set[str]) -> str:
    if probe is None:
        return "-"
    if probe.get("event") == "device_probe":  # health.name_probe's word per node
        return str(probe.get("words", {}).get(node, "-"))
    return "slow links" if node in slow else "ok"


def format_table(rows: list[dict]) -> str:
    """The table as text (seconds per step; the flags name the finding and the round)."""
    head = ["rank", "node", "periods", "last_step", "samples/s", "step s", "data s", "dispatch s", "blocked s"]
    head += ["ckpt s", "flags", "probe"]
    lines = [" | ".join(head)]
    for r in rows:
        cells = [r["rank"], r["node"], r["periods"], r["last_step"], f"{r['samples_per_s']:.1f}"]
        cells += [f"{r[k]:.4f}" for k in ("step_s", "data_wait_s", "dispatch_s", "blocked_s", "checkpoint_s")]
        cells += [r["flags"], r["probe"]]
        lines.append(" | ".join(str(c) for c in cells))
    return "\n".join(lines)


def plot_heatmap(periods: list[Period], rounds: list[dict[str, Any]], path: str | Path) -> Path:
    """Write a heat map (nodes x periods of the newest generation, colour: seconds per step) to ``path``; the
    periods with a finding naming the node are marked with a cross, job-wide findings with a bar on top."""
    import matplotlib  # only here: `jaxdist status` without a picture needs no matplotlib

    matplotlib.use("Agg")
    # after choosing the backend; numpy with it (the controller itself runs without)
    import matplotlib.pyplot as plt
    import numpy as np

    gen = max(p.gen for p in periods)
    mine = [p for p in periods if p.gen == gen]
    ranks = sorted({p.rank for p in mine})
    n = max(p.index for p in mine) + 1
    grid = np.full((len(ranks), n), np.nan)
    for p in mine:
        grid[ranks.index(p.rank), p.index] = p.step_s
    nodes = {p.rank: p.node for p in mine}
    fig, ax = plt.subplots(figsize=(max(6, 0.25 * n + 2), 0.5 * len(ranks) + 1.5))
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="seconds per step")
    for r in rounds:
        if r.get("gen") != gen:
            continue
        for f in r.get("findings", []):
            if f.get("rank") in ranks:
                ax.plot(r["round"], ranks.index(f["rank"]), "rx", markersize=8)
            else:
                ax.axvspan(r["round"] - 0.5, r["round"] + 0.5, ymin=0.97, color="red")
    ax.set_yticks(range(len(ranks)), [f"{nodes[r]} (rank {r})" for r in ranks])
    ax.set_xlabel(f"period (generation {gen})")
    ax.set_title("step time per node and period; x: a finding naming the node")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def router_lines(run_dir: str | Path, tail_bytes: int = 1 << 20) -> list[str]:
    """An MoE run's router per block at its newest train record (``<run>/metrics.jsonl``, its last
    ``tail_bytes``): tokens per expert (least loaded / mean / most loaded), the load-balancing and z losses and the
    dropped share; [] when the run has no such record (a dense model, or no step logged yet)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - tail_bytes))
        text = f.read().decode(errors="replace")
    last = None
    for line in reversed(text.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn line, or the first one of the tail
        if rec.get("kind") == "train" and any(str(k).startswith("moe/") for k in rec):
            last = rec
            break
    if last is None:
        return []
    blocks = sorted({k.split("/")[1] for k in last if k.startswith("moe/")}, key=lambda b: int(b.removeprefix("block")))
    lines = [f"router at step {last['step']} (tokens per expert: least loaded / mean / most loaded):"]
    for b in blocks:
        v = {k.split("/")[2]: last[k] for k in last if k.startswith(f"moe/{b}/")}
        lines.append(
            f"  {b}: {v['tokens_min']:.0f} / {v['tokens_mean']:.0f} / {v['tokens_max']:.0f} tokens, "
            f"load-balancing loss {v['aux_loss']:.4f}, z-loss {v['z_loss']:.4f}, dropped {v['drop_rate']:.2%}"
        )
    return lines


def status(run_dir: str | Path, heatmap: str | Path | None = None) -> int:
    """`jaxdist status RUN_DIR`: print an MoE run's router per block (:func:`router_lines`), the per-node table
    and write the heat map (default ``<run>/controller/health.png``); 0.  A run without the controller's health
    record but with router figures prints those and says where the health table comes from."""
    router = router_lines(run_dir)
    for line in router:
        print(line)
    if router and not (Path(run_dir) / "controller" / "health.jsonl").is_file():
        print("no per-node health: a run started by `jaxdist launch` with controller.health_every > 0 records it")
        return 0
    periods, rounds = read_health(run_dir)
    if not periods:
        print(f"{run_dir}: no efficiency record yet (each rank sends one per controller.health_every steps)")
        return 0
    probe = last_probe(run_dir)
    print(format_table(node_table(periods, rounds, probe)))
    if probe is not None and probe.get("event") == "device_probe":
        print(f"device probe at step {probe.get('step')} ({probe.get('probe_s', 0):.2f} s): {probe['why']}")
    findings = [(r["round"], f) for r in rounds for f in r.get("findings", [])]
    for r, f in findings[-10:]:
        print(f"round {r}: {f['kind']}: {f['why']}")
    out = plot_heatmap(periods, rounds, heatmap or Path(run_dir) / "controller" / "health.png")
    print(f"heat map: {out}")
    return 0

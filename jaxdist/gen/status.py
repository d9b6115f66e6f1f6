"""``jaxdist gen status``: a generation job's last status (``<state_dir>/status.json``) as text.

Per stage: its function, workers and why, streams (samples per task) and
why, its task counts; the planned chain throughput; the last round's selected nodes, the importance per stage and the
compute used of ``gen.compute_budget``; tokens delivered, workers, and the
training run's side asked live from its receiver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jaxdist.config import ConfigError
from jaxdist.gen.channel import Client
from jaxdist.gen.config import GenConfig


def read_status(cfg: GenConfig) -> dict[str, Any]:
    """The job's last status (``status.json``), with the training run's side asked live from its receiver."""
    path = Path(cfg.state_path) / "status.json"
    try:
        s = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"no status in {path}: start the job with jaxdist gen --config ... first.") from None
    client = Client(cfg.token(), "g:status", cfg.deliver_to)
    try:
        r = client.request({"t": "status"}, deadline_s=3.0, try_s=1.5)
    finally:
        client.close()
    if r is not None:
        s["run"] = {k: v for k, v in r.items() if k not in ("rid", "sender", "sid", "seq", "ts", "ok")}
    return s


def format_status(s: dict[str, Any]) -> str:
    streams, why = s.get("streams", []), s.get("streams_why", [])
    stages = s.get("stages") or ["?"] * len(streams)
    nodes, nodes_why = s.get("nodes") or [None] * len(streams), s.get("nodes_why") or [""] * len(streams)
    lines = [
        f"generation job {s['name']}: {s['tasks']} tasks: {s['pending']} pending, {s['running']} running, "
        f"{s['delivered']} delivered, {s['refused']} refused ({s['reassigned']} handed out again)",
    ]
    for k, (fn, n, w) in enumerate(zip(stages, streams, why)):
        c = s["stages_counts"][k] if "stages_counts" in s else {}
        workers = f"{nodes[k]} workers ({nodes_why[k]}); " if nodes[k] is not None else ""
        lines.append(
            f"  stage {k} {fn}: {workers}{n} samples per task (parallel streams): {w}"
            + (f"; {c['tasks']} tasks, {c['pending']} pending, {c['running']} running" if c else "")
        )
    if s.get("pool") and s.get("planned_items_s"):
        spare = s["pool"] - sum(nodes)
        lines.append(
            f"  plan: {s['planned_items_s']:.4g} items/s on {sum(nodes)} of {s['pool']} nodes"
            + (f" ({spare} not started: more would not raise it)" if spare else "")
        )
    budget = f"{s['compute_budget']:g}" if s.get("compute_budget") else "no limit"
    lines += [
        f"  last round (of {s.get('rounds', 0)}): selected {', '.join(s.get('selected') or []) or 'none'}; "
        f"importance per stage {', '.join(f'{x:g}' for x in s.get('importance') or []) or '-'}; compute {s.get('compute_used', 0):g} of {budget} "
        f"(now {s.get('compute_now', 0):g}, at most {s.get('compute_max', 0):g} in any round)",
        f"  {s['tokens']:,} tokens delivered, {s['tokens_per_s']:,.1f} tokens/s over {s['elapsed_s']:.0f} s; "
        f"workers alive: {', '.join(s['alive']) or 'none'}",
    ]
    for name, w in sorted(s["workers"].items()):
        lines.append(
            f"  {name}: {int(w['shards'])} shards, {int(w['tokens']):,} tokens, {w['seconds']:.1f} s generating"
        )
    r = s.get("run") or {}
    if r:
        lines.append(
            f"  training run: {r['received']} shards received: {r['adopted']} in the batch list, {r['queued']} "
            f"queued for the trainer, {r['waiting']} waiting for a batch's worth; cursor {r['cursor']} of "
            f"{r['batches']} batches, {r['behind_steps']} steps behind the newest shard"
        )
    else:
        lines.append("  training run: its receiver did not answer")
    return "\n".join(lines)

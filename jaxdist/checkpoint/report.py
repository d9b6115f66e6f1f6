"""What ``jaxdist ckpt list | inspect | verify | plan`` print (plain functions returning text).

They read the checkpoint folders and commit markers only (no devices, no
orbax restore), so they run anywhere the run directory is visible.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist.checkpoint import integrity
from jaxdist.checkpoint.manager import plan_from_layout
from jaxdist.checkpoint.plan import max_over_mean


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint folder of a run directory (``<run>/checkpoints``), or ``path`` itself if it is one."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    if path.is_dir() and (path.name == "checkpoints" or integrity.scan(path)):  # step folders: a checkpoint folder
        return path
    why = "a folder without checkpoints/ or step folders" if path.is_dir() else "it does not exist"
    raise FileNotFoundError(
        f"{path} is neither a run directory nor a checkpoint directory ({why}): pass the run's folder, "
        "e.g. runs/<train.name>."
    )


def _committed(ckdir: Path, step: int | None) -> integrity.StepFolder:
    folders = [f for f in integrity.scan(ckdir) if f.state == "committed"]
    if step is not None:
        folders = [f for f in folders if f.step == step]
    if not folders:
        which = "" if step is None else f" of step {step}"
        raise FileNotFoundError(f"{ckdir} has no committed checkpoint{which}: see `jaxdist ckpt list`.")
    return folders[-1]


def list_text(ckdir: Path) -> str:
    """One line per step folder: step, state, processes, bytes, max/mean bytes written per process, time."""
    rows = [f"{'step':>8}  {'state':<10} {'procs':>5} {'files':>6} {'bytes':>14} {'max/mean':>8}  written"]
    for f in integrity.scan(ckdir):
        m = f.marker or {}
        written = m.get("bytes_written_per_process")
        when = datetime.datetime.fromtimestamp(m["time"]).isoformat(" ", "seconds") if "time" in m else ""
        total = f"{sum(written):,}" if written else ""
        ratio = f"{max_over_mean(written):.3f}" if written else ""
        files = len(m.get("files", {})) or ""
        rows.append(
            f"{f.step:>8}  {f.state:<10} {m.get('num_processes', ''):>5} {files:>6} {total:>14} "
            f"{ratio:>8}  {when or f.path.name}"
        )
    if len(rows) == 1:
        rows.append("(no checkpoints)")
    return "\n".join(rows)


def inspect_text(ckdir: Path, step: int | None = None) -> str:
    """A committed step: meta (data position), arrays (shape, dtype, sharding) and bytes per process."""
    f = _committed(ckdir, step)
    m = f.marker
    lines = [f"checkpoint {f.path} (step {f.step}, {m['num_processes']} processes, strategy {m.get('strategy')})"]
    meta_file = f.path / "meta" / "metadata"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        lines.append(f"data: {json.dumps(meta.get('data', {}), sort_keys=True)}")
    layout = m.get("layout", {})
    for mesh in layout.get("meshes", []):
        shape = dict(zip(mesh["axis_names"], np.shape(mesh["devices"])))
        lines.append("mesh: " + " ".join(f"{k}={v}" for k, v in shape.items()))
    lines.append(f"{'array':<48} {'shape':<20} {'dtype':<9} sharding")
    for a in layout.get("arrays", []):
        lines.append(f"{a['name'][:48]:<48} {str(tuple(a['shape'])):<20} {a['dtype']:<9} {a.get('spec', '?')}")
    written, planned = m["bytes_written_per_process"], m.get("planned_bytes_per_process")
    lines.append(
        "bytes written per process (files): "
        + ", ".join(f"{b:,}" for b in written)
        + f"  (max/mean {max_over_mean(written):.4f})"
    )
    if planned:
        lines.append(
            "array bytes per process (plan):    "
            + ", ".join(f"{b:,}" for b in planned)
            + f"  (max/mean {max_over_mean(planned):.4f})"
        )
    return "\n".join(lines)


def verify_text(ckdir: Path, step: int | None = None) -> tuple[bool, str]:
    """Check the checksums of every committed step (or one); (all good, report)."""
    folders = [f for f in integrity.scan(ckdir) if step is None or f.step == step]
    if step is not None and not any(f.state in ("committed", "bad-marker") for f in folders):
        raise FileNotFoundError(f"{ckdir} has no committed checkpoint of step {step}: see `jaxdist ckpt list`.")
    ok, lines = True, []
    for f in folders:
        if f.state == "bad-marker":  # a marker that does not parse or match: damage, not an unfinished save
            ok = False
            lines += [f"step {f.step}: DAMAGED ({f.path})", f"  {f.problem}"]
            continue
        if f.state != "committed":
            lines.append(f"step {f.step}: {f.state} ({f.path.name}), not a checkpoint")
            continue
        problems = integrity.verify_files(f.path, f.marker["files"])
        ok &= not problems
        lines.append(
            f"step {f.step}: "
            + ("ok" if not problems else f"DAMAGED ({f.path})")
            + f", {len(f.marker['files'])} files checked"
        )
        lines += [f"  {p}" for p in problems]
    if not lines:
        lines.append(f"no checkpoints in {ckdir}")
    return ok, "\n".join(lines)


def plan_text(ckdir: Path, step: int | None = None, strategy: str = "balanced", top: int = 0) -> str:
    """The write plan recomputed from a committed step's recorded layout, next to the bytes its files hold."""

    f = _committed(ckdir, step)
    m: dict[str, Any] = f.marker
    plan = plan_from_layout(m["layout"], m["num_processes"], strategy)
    written = m["bytes_written_per_process"]
    return "\n".join(
        [
            f"write plan of {f.path} ({m['num_processes']} processes, strategy {strategy}; "
            "rules: owner = sharded, orbax = replica-parallel slices, jaxdist = greedy slices, replica0 = naive)",
            plan.table(top),
            "file bytes per process as written: "
            + ", ".join(f"{b:,}" for b in written)
            + f"  (max/mean {max_over_mean(written):.4f}, strategy {m.get('strategy')})",
        ]
    )

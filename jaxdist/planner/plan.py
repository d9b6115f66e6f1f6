"""The planner's answer: :func:`plan` (model, cluster -> :class:`Plan`), its table, and its config.

    from jaxdist.planner import plan
    p = plan(load_config(None, ["model=llama-70b"]).model, "h100x64", batch_size=256, seq_len=4096)
    print(p.table())            # the best plans: mesh, microbatches, remat, time, tokens/s, MFU, memory
    print(p.to_toml())          # a config that `jaxdist train --config` runs

``mesh.auto = true`` (or ``mesh=auto``) in a train config makes
:func:`jaxdist.resolve.resolve` call :func:`resolve_auto` before the Trainer is
built: it plans on the devices at hand, and the run trains with the chosen
mesh, microbatches and remat.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxdist.cluster import ClusterSpec, cluster_path, load_cluster
from jaxdist.config import MESH_AXES, Config, ConfigError, ModelConfig, load_config
from jaxdist.parallel.mesh import cluster_from_devices
from jaxdist.planner.calibrate import default_calibration
from jaxdist.planner.candidates import REMAT_CHOICES, RematChoice, candidates, register_remat_choice, remat_choice
from jaxdist.planner.cluster import Calibration, ClusterView, cluster_view, smaller_views
from jaxdist.planner.computation import computation_view
from jaxdist.planner.cost import XLA_CPU_MEMORY, Estimate, MemoryCoefficients, estimate
from jaxdist.planner.search import SearchResult, exhaustive, search

GIB = 2**30


class PlanError(ConfigError):
    """No strategy fits: the message says how much memory per device the best one would need."""


@dataclass(frozen=True)
class Plan:
    """The evaluated strategies for one model on one cluster, best first (``ranked[0]``).

    ``evaluations`` is how many strategies the search costed; ``space`` the
    number of candidates when they were enumerated (exhaustive mode), else None;
    ``seconds`` the planning time.
    """

    model: ModelConfig
    cluster: ClusterView
    batch_size: int
    seq_len: int
    ranked: tuple[Estimate, ...]
    evaluations: int
    space: int | None
    seconds: float
    cluster_source: str = ""

    @property
    def best(self) -> Estimate:
        """The chosen strategy's estimate."""
        return self.ranked[0]

    def fitting(self) -> list[Estimate]:
        """The evaluated strategies that fit in memory, best first."""
        return [e for e in self.ranked if e.fits]

    def table(self, n: int = 8) -> str:
        """The best ``n`` fitting strategies as a text table (and how many were rejected for memory)."""
        head = (
            f"{'#':>2}  {'mesh':<34} {'mb':>4} {'remat':<6} {'step s':>9} {'tokens/s':>10} {'MFU':>6} "
            f"{'GiB/dev':>8}  dominated by"
        )
        lines = [head, "-" * len(head)]
        for i, e in enumerate(self.fitting()[:n], 1):
            s = e.strategy
            mesh = " ".join(f"{a}={v}" for a, v in s.mesh.items() if v != 1) or "single device"
            if s.pipeline > 1:
                mesh += f" ({s.schedule}{f' x{s.chunks}' if s.schedule == 'seq1f1b' else ''})"
            lines.append(
                f"{i:>2}  {mesh:<34} {s.microbatches:>4} {s.remat:<6} {e.step_time:>9.4g} "
                f"{e.tokens_per_s:>10.4g} {e.mfu:>6.1%} {e.memory.total / GIB:>8.2f}  {e.dominant}"
            )
        rejected = [e for e in self.ranked if not e.fits]
        if rejected:
            closest = min(rejected, key=lambda e: e.memory.total)
            lines.append(
                f"({len(rejected)} of {len(self.ranked)} evaluated plans do not fit; the closest, "
                f"{closest.strategy.describe()}, {closest.reason})"
            )
        return "\n".join(lines)

    def explain(self) -> str:
        """A few lines on the chosen plan: where the time and the memory go."""
        e = self.best
        m = e.memory
        lines = [
            f"chosen: {e.strategy.describe()}",
            f"  step {e.step_time:.4g} s = compute {e.compute_time:.4g} s + exposed communication "
            f"{e.comm_time:.4g} s + pipeline bubble {e.bubble_time:.4g} s; "
            f"{e.tokens_per_s:.4g} tokens/s, MFU {e.mfu:.1%}",
            f"  memory per device {m.total / GIB:.2f} GiB of {e.memory_limit / GIB:.2f} usable: params "
            f"{m.params / GIB:.2f}, optimizer {m.optimizer / GIB:.2f}, grads {m.grads / GIB:.2f}, "
            f"activations {m.activations / GIB:.2f}, working {m.working / GIB:.2f}",
        ]
        for c in sorted(e.comm, key=lambda c: -c.seconds)[:4]:
            lines.append(
                f"  {c.name}: {c.kind} over {' x '.join(c.axes)} ({c.group} devices, {c.link}-node), "
                f"{c.count} x {c.bytes / 2**20:.3g} MiB, {c.seconds:.3g} s"
            )
        return "\n".join(lines)

    def to_config(self, base: Config | None = None) -> Config:
        """``base`` (default: a fresh Config) with this plan's model, cluster, mesh, batch, microbatches and remat."""
        cfg = base if base is not None else Config()
        s = self.best.strategy
        remat = remat_choice(s.remat).train_remat
        cluster = self.cluster_source or self.cluster.spec.name
        if cluster == "live":  # no file describes the live devices: keep the base config's cluster
            cluster = cfg.mesh.cluster
        changes = {
            "model": self.model,
            "mesh.cluster": cluster,
            **{f"mesh.{a}": getattr(s, a) for a in MESH_AXES},
            "mesh.auto": False,
            "train.batch_size": self.batch_size,
            "train.seq_len": self.seq_len,
            "train.microbatches": s.microbatches,
            "train.remat": remat,
        }
        if s.pipeline > 1:
            changes.update({"pipeline.schedule": s.schedule, "pipeline.chunks": max(1, s.chunks)})
        return cfg.set(**changes)

    def to_toml(self, base: Config | None = None) -> str:
        """The config of :meth:`to_config` as TOML, headed by a comment with the plan."""
        e = self.best
        head = [
            f"# jaxdist plan: {self.model.preset} on {self.cluster.describe()}",
            f"# {e.strategy.describe()}: predicted {e.step_time:.4g} s/step, {e.tokens_per_s:.4g} tokens/s, "
            f"MFU {e.mfu:.1%}, {e.memory.total / GIB:.2f} GiB/device",
            "",
        ]
        return "\n".join(head) + self.to_config(base).to_toml()


def trainable_axes() -> tuple[str, ...]:
    """The mesh axes ``jaxdist train`` accepts today (validate() is asked; pipeline joins once supported)."""
    axes = ["data", "fsdp", "tensor"]
    probes = {
        "context": ["model=small", "mesh.context=2"],
        "expert": ["model=moe-tiny", "mesh.expert=2"],
        "pipeline": ["model=small", "mesh.pipeline=2"],
    }
    for axis, overrides in probes.items():
        try:
            load_config(None, overrides)
        except ConfigError:
            continue
        axes.append(axis)
    return tuple(a for a in MESH_AXES if a in axes)


def _as_view(cluster: Any, busy: Any, calibration: Calibration | None) -> tuple[ClusterView, str]:
    if isinstance(cluster, ClusterView):
        return cluster, cluster.spec.name
    if isinstance(cluster, ClusterSpec):
        spec, source = cluster, cluster.name
    elif cluster == "live":  # the devices this process sees (their kind's preset gives the figures)
        spec = cluster_from_devices()
        source = spec.name
    else:
        source = str(cluster)
        if cluster_path(source) != Path(source):  # a preset: by name, or as meshes/NAME.toml from elsewhere
            source = cluster_path(source).stem
        spec = load_cluster(source)
    if calibration is None:
        calibration = default_calibration(spec.device_kind)
    return cluster_view(spec, busy, calibration), source


def plan(
    model: ModelConfig,
    cluster: ClusterSpec | ClusterView | str,
    *,
    batch_size: int = 32,
    seq_len: int | None = None,
    busy: Any = None,
    calibration: Calibration | None = None,
    remat: Sequence[RematChoice] = REMAT_CHOICES,
    axes: Sequence[str] | None = None,
    enumerate_all: bool = False,
    budget: int = 4000,
    memory_fraction: float = 0.9,
    max_microbatches: int = 64,
    coefficients: MemoryCoefficients = XLA_CPU_MEMORY,
) -> Plan:
    """Plan ``model`` on the free devices of ``cluster`` (a ClusterSpec, ClusterView, a name or path of a
    meshes/ file, or ``"live"`` for the devices JAX sees).

    ``batch_size`` sequences of ``seq_len`` tokens (default: the model's
    max_seq_len) per step.  ``busy``: devices other jobs hold (list or
    allocation file).  ``calibration``: measured efficiency and links (default:
    the file ``jaxdist calibrate`` wrote for this device kind, if any).
    ``axes``: mesh axes the plan may use (default: those ``jaxdist train``
    runs today).  ``remat``: the remat choices to consider (the remat
    selector's own ``RematChoice`` objects may join the built-in ones).  ``enumerate_all`` evaluates every candidate instead of
    searching.  Raises :class:`PlanError` when no strategy fits in
    ``memory_fraction`` of a device's memory.
    """
    t0 = time.perf_counter()
    seq_len = seq_len or model.max_seq_len
    view, source = _as_view(cluster, busy, calibration)
    comp = computation_view(model, seq_len)
    axes = tuple(axes) if axes is not None else trainable_axes()
    remat = [register_remat_choice(r) for r in remat]
    full_view = view

    def evaluate(s, view):
        return estimate(comp, view, s, batch_size, memory_fraction, coefficients)

    space = None
    for view in itertools.chain([view], smaller_views(view)):  # fewer devices only when no mesh of all of them suits  # noqa: B020 (the chosen view is the loop's last)
        if enumerate_all:
            points = list(
                candidates(
                    comp, view.n_devices, view.nodes, view.devices_per_node, batch_size, remat, axes, max_microbatches
                )
            )
            if not points:
                continue
            space = len(points)
            result: SearchResult = exhaustive(lambda s, view=view: evaluate(s, view), points)
            break
        try:
            result = search(
                lambda s, view=view: evaluate(s, view),
                comp,
                view.nodes,
                view.devices_per_node,
                batch_size,
                remat,
                axes,
                max_microbatches,
                budget=budget,
            )
            break
        except ValueError:
            continue
    else:
        raise PlanError(_no_candidate(model, full_view, batch_size))
    p = Plan(
        model=model,
        cluster=view,
        batch_size=batch_size,
        seq_len=seq_len,
        ranked=result.ranked,
        evaluations=result.evaluations,
        space=space,
        seconds=time.perf_counter() - t0,
        cluster_source=source,
    )
    if not p.best.fits:
        e = p.best
        raise PlanError(
            f"model '{model.preset}' ({comp.param_count / 1e9:.3g}B parameters, batch {batch_size} x {seq_len} "
            f"tokens) does not fit on {view.describe()}: the least memory any plan needs is "
            f"{e.memory.total / GIB:.1f} GiB per device ({e.strategy.describe()}) but {e.memory_limit / GIB:.1f} GiB "
            "are usable; use more devices, a smaller train.batch_size or train.seq_len, or devices with more memory."
        )
    return p


def _no_candidate(model: ModelConfig, view: ClusterView, batch_size: int) -> str:
    return (
        f"no mesh of the {view.n_devices} free devices (or of fewer) suits model '{model.preset}' with batch "
        f"{batch_size}: make train.batch_size a multiple of the number of devices to use."
    )


def resolve_auto(cfg: Config, devices: Sequence[Any]) -> Config:
    """``cfg`` with ``mesh.auto`` resolved: a plan on these devices picks mesh sizes, microbatches and remat.

    Not validated here: :func:`jaxdist.resolve.resolve` validates what it returns.
    """
    per_process = Counter(d.process_index for d in devices)
    spec = load_cluster(cfg.mesh.cluster)
    spec = dataclasses.replace(spec, nodes=len(per_process), devices_per_node=len(devices) // len(per_process))
    p = plan(cfg.model, spec, batch_size=cfg.train.batch_size, seq_len=cfg.train.seq_len)
    return p.to_config(cfg).set(**{"mesh.cluster": cfg.mesh.cluster})

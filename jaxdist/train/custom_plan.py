"""``mesh=auto`` and ``jaxdist plan`` for your own model: a measured computation view, every mesh compiled.

jaxdist's transformer has a closed-form cost model (:mod:`jaxdist.planner`); a model it did not write has none,
so its computation view is measured from the model's own compiled train step, and the choice is made on the
compiled programs of the meshes its parameter names allow:

1. **Candidates**: every ``data x fsdp x tensor x context`` of the devices (pipeline stages are not available to
   a user's model) that the config's rules accept: the batch divides over ``data x fsdp x microbatches``, each
   axis splits some parameter (its logical names say where; ``context`` splits the activations the model
   constrains with ``"seq"``, and a model that constrains none is refused it), every split dimension divides.
   The others are listed with the one sentence that refuses them.
2. **Predicted** (the computation view of a model the planner does not know): the train state's bytes per
   device are exact, from the abstract state and each candidate's shardings; the step's working space is
   measured by compiling the step on one device for two batch sizes (``temp = fixed + per_example x b``),
   then taken as ``fixed x`` (the share of the parameters a device holds: gradients and update temporaries
   are parameter-shaped) ``+ per_example x`` (examples per device and microbatch) ``x (1 - a + a / tensor)``.
   Which activations a tensor split divides depends on the model, so ``a`` is measured too: one more compile,
   on two devices with ``mesh.tensor=2``, gives the share of the per-example working space that halved.  A
   context split is counted like a data split: it divides the activations the model constrains with ``"seq"``,
   as a data split divides the examples (for the mixer model of the tests the two agree within 0.1 %).
   FSDP gathers the others' shards into the working space: one more compile, two devices with ``mesh.fsdp=2``,
   measures that space per byte of parameters a device holds (``gathered``), counted ``fsdp - 1`` times.
3. **Compiled**: each candidate's train step is compiled for its mesh (nothing runs): peak bytes per device
   (``memory_analysis``), executed FLOPs per device (``cost_analysis``) and the collectives in its HLO
   (:func:`jaxdist.parallel.hlo.parse_collectives`), timed with the cluster's links (ring algorithm,
   :func:`jaxdist.planner.cost.collective_seconds`).  The step's estimated time is FLOPs / (peak FLOP/s x
   efficiency) + collective time (no overlap assumed).
4. **Chosen**: the least estimated time among the compiled peaks within ``train.memory_budget_bytes`` (default:
   the cluster's device memory less the reserve); with ``train.remat=auto`` a mesh whose step does not fit
   without remat is compiled again with full recomputation (the remat choice itself is made on the chosen mesh,
   :mod:`jaxdist.train.custom_remat`).  A mesh that still does not fit is compiled again with twice the
   microbatches (``train.microbatches``: each device's examples in smaller passes, the gradients summed), doubling
   while each device's share of the batch divides, until it fits.  None fits: ConfigError with the least peak
   seen.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from jaxdist.cluster import load_cluster, memory_budget
from jaxdist.config import Config, ConfigError, Remat
from jaxdist.parallel.hlo import parse_collectives
from jaxdist.planner.calibrate import default_calibration
from jaxdist.planner.cluster import cluster_view
from jaxdist.planner.cost import collective_seconds
from jaxdist.remat.plan import format_bytes
from jaxdist.train import custom
from jaxdist.train.aot import peak_of
from jaxdist.train.custom_remat import settle_user_remat
from jaxdist.train.program import Program
from jaxdist.train.programs import executed_flops
from jaxdist.train.resolved import Resolved, settle

log = logging.getLogger(__name__)

AXES = ("data", "fsdp", "tensor", "context")  # the mesh axes a user's model may use


@dataclass(frozen=True)
class Probe:
    """The measured computation view: the one-device step's working space ``fixed_temp + per_example x b``
    (bytes), its FLOPs ``flops_per_example x b`` (plus a fixed part), the parameters' bytes (one full copy)."""

    fixed_temp: float
    per_example_temp: float
    flops_fixed: float
    flops_per_example: float
    param_bytes: int
    examples: tuple[int, int]  # the two batch sizes compiled
    seconds: float
    tensor_share: float = 0.0  # the share of the per-example working space a tensor split divides (measured)
    gathered: float = 0.0  # fsdp's extra working space per byte of parameters a device holds (measured)


@dataclass(frozen=True)
class MeshTrial:
    """One candidate mesh: predicted and compiled peak bytes per device, executed FLOPs per device, collective
    bytes per device per step (by kind) and their time, the estimated step time; ``refused`` says why a mesh
    that cannot run this model was not compiled, ``remat`` the train.remat it was compiled with."""

    sizes: dict[str, int]
    microbatches: int = 1
    predicted_bytes: float = 0.0
    state_bytes: int = 0  # the train state's bytes per device (exact, from the shardings)
    peak_bytes: int | None = None
    flops: float | None = None
    comm_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    comm_seconds: float = 0.0
    step_seconds: float | None = None
    remat: str = ""
    refused: str = ""
    seconds: float = 0.0

    def describe(self) -> str:
        mesh = " ".join(f"{a}={n}" for a, n in self.sizes.items() if n > 1) or "one device"
        return mesh + (f" microbatches={self.microbatches}" if self.microbatches > 1 else "")

    @property
    def error(self) -> float | None:
        """(predicted - compiled) / compiled, when compiled."""
        return None if not self.peak_bytes else (self.predicted_bytes - self.peak_bytes) / self.peak_bytes


@dataclass(frozen=True)
class UserMeshPlan:
    """What ``mesh=auto`` chose for a user's model on ``n_devices``: the fastest compiled mesh within ``budget``
    bytes per device, every candidate (``trials``) and the measured view (``probe``)."""

    chosen: MeshTrial
    budget: float
    trials: tuple[MeshTrial, ...]
    probe: Probe
    n_devices: int
    seconds: float

    def describe(self) -> str:
        c = self.chosen
        return (
            f"{c.describe()} (compiled peak {format_bytes(c.peak_bytes or 0)} of a {format_bytes(self.budget)} "
            f"budget, predicted {format_bytes(c.predicted_bytes)}; estimated {c.step_seconds * 1e3:.3g} ms per "
            f"step; {sum(1 for t in self.trials if t.peak_bytes)} meshes compiled in {self.seconds:.1f} s)"
        )

    def table(self) -> str:
        """Every candidate, fastest first: predicted vs compiled peak, FLOPs, collectives, estimated time."""
        head = (
            f"{'mesh':<24} {'predicted':>10} {'compiled':>10} {'error':>7} {'GFLOP/dev':>10} {'comm/dev':>10} "
            f"{'est. ms':>8}  fits"
        )
        rows = [head, "-" * len(head)]
        compiled = sorted((t for t in self.trials if t.peak_bytes), key=lambda t: (not self._fits(t), t.step_seconds))
        for t in compiled:
            mark = "  <- chosen" if t is self.chosen else ""
            remat = f" (remat {t.remat})" if t.remat not in ("", "none") else ""
            rows.append(
                f"{t.describe():<24} {format_bytes(t.predicted_bytes):>10} {format_bytes(t.peak_bytes):>10} "
                f"{t.error:>+7.1%} {(t.flops or 0) / 1e9:>10.4g} {format_bytes(sum(t.comm_bytes.values())):>10} "
                f"{t.step_seconds * 1e3:>8.3g}  {'yes' if self._fits(t) else 'no'}{remat}{mark}"
            )
        for t in self.trials:
            if t.refused:
                rows.append(f"{t.describe():<24} not a candidate: {t.refused}")
        return "\n".join(rows)

    def _fits(self, t: MeshTrial) -> bool:
        return t.peak_bytes is not None and t.peak_bytes <= self.budget

    def to_config(self, config: Config) -> Config:
        """``config`` with the chosen mesh's sizes and microbatches (``mesh.auto`` off)."""
        sets = {f"mesh.{a}": n for a, n in self.chosen.sizes.items()}
        return config.set(**{"mesh.auto": False, "train.microbatches": self.chosen.microbatches, **sets})


def mesh_sizes(n_devices: int) -> list[dict[str, int]]:
    """Every ``data x fsdp x tensor x context`` whose product is ``n_devices``, data-parallel first."""
    out = []
    for d, f, t in itertools.product(range(n_devices, 0, -1), repeat=3):
        if n_devices % (d * f * t) == 0:
            out.append({"data": d, "fsdp": f, "tensor": t, "context": n_devices // (d * f * t)})
    return out


def more_microbatches(config: Config, sizes: dict[str, int]) -> list[int]:
    """Microbatch counts above ``config``'s, doubling, while each device's share of the batch divides by them."""
    per_device = config.train.batch_size // (sizes["data"] * sizes["fsdp"])
    out, m = [], config.train.microbatches * 2
    while m <= per_device and per_device % m == 0:
        out.append(m)
        m *= 2
    return out


def _with_mesh(config: Config, sizes: dict[str, int], **extra: Any) -> Config:
    return config.set(**{"mesh.auto": False, "mesh.pipeline": 1, "mesh.context": 1, "mesh.expert": 1,
                         **{f"mesh.{a}": n for a, n in sizes.items()}, **extra})  # fmt: skip


def _compile(program: Program) -> tuple[Any, float]:
    """The train step of ``program`` compiled (at LLVM level 0 on CPU: the same buffers, a faster compile)."""
    t0 = time.perf_counter()
    lowered = program._train_step.lower(program.abstract_state(), program.abstract_batch())
    cpu = program.devices[0].platform == "cpu"
    options = {"xla_backend_optimization_level": 0} if cpu else dict(program.xla_options)
    return lowered.compile(compiler_options=options or None), time.perf_counter() - t0


def _temp_and_flops(compiled: Any) -> tuple[float, float]:
    _, tmp, *_ = peak_of(compiled)
    return float(tmp), float(executed_flops(compiled, 1) or 0.0)


def probe(config: Config, devices: Sequence[Any], user: custom.UserModel, remat: Remat) -> Probe:
    """The measured computation view of ``user``'s step (see the module docstring, 2.): compiled on the first
    of ``devices`` alone at two batch sizes, and on the first two with ``mesh.tensor=2`` and with ``mesh.fsdp=2``."""
    t0 = time.perf_counter()
    b1 = max(1, config.train.batch_size // len(devices) // config.train.microbatches)
    points = []
    for b in (b1, 2 * b1):
        cfg = _with_mesh(config, {a: 1 for a in AXES}, **{"train.batch_size": b, "train.microbatches": 1})
        compiled, _ = _compile(Program(Resolved(cfg, tuple(devices[:1]), remat, user=user)))
        points.append(_temp_and_flops(compiled))
    (t1, f1), (t2, f2) = points
    per_t, per_f = max(0.0, (t2 - t1) / b1), max(0.0, (f2 - f1) / b1)
    fixed = max(0.0, t1 - per_t * b1)
    _, abstract, names = custom.abstract_module(user, config.train.seed)
    params = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    view = Probe(fixed, per_t, max(0.0, f1 - per_f * b1), per_f, params, (b1, 2 * b1), 0.0)
    share = gathered = 0.0
    # Two devices, tensor=2 (batch b1): the share of the per-example working space a tensor split divides.
    two = _two_device_temp(config, devices, user, remat, {"tensor": 2}, b1, names, abstract)
    if two is not None and per_t > 0:
        temp, held = two
        share = min(1.0, max(0.0, 2.0 * (1.0 - (temp - fixed * held / params) / (per_t * b1))))
    # Two devices, fsdp=2 (batch 2 x b1, so b1 per device): the working space beyond the scaled fixed part and
    # the examples, per byte a device holds of the parameters (what it gathers of the others' shards).
    two = _two_device_temp(config, devices, user, remat, {"fsdp": 2}, 2 * b1, names, abstract)
    if two is not None:
        temp, held = two
        gathered = max(0.0, (temp - fixed * held / params - per_t * b1) / max(held, 1))
    return dataclasses.replace(view, tensor_share=share, gathered=gathered, seconds=time.perf_counter() - t0)


def _two_device_temp(config, devices, user, remat, sizes, batch, names, abstract) -> tuple[float, int] | None:
    """(working space, parameter bytes a device holds) of the step on the first two devices with ``sizes``,
    or None when there are fewer devices or no parameter splits over that axis."""
    if len(devices) < 2:
        return None
    cfg = _with_mesh(config, {a: 1 for a in AXES} | sizes, **{"train.batch_size": batch, "train.microbatches": 1})
    try:
        custom.check_user_config(cfg, 2, names, abstract)
        program = Program(Resolved(cfg, tuple(devices[:2]), remat, user=user))
        held = _device_bytes(program.abstract_state()["params"])
    except (ConfigError, ValueError):  # no parameter splits over that axis: no such candidate to predict
        return None
    compiled, _ = _compile(program)
    return _temp_and_flops(compiled)[0], held


def _device_bytes(tree: Any) -> int:
    """Bytes one device holds of an abstract tree with shardings (ValueError: a dimension does not divide)."""
    total = 0
    for a in jax.tree.leaves(tree):
        shard = a.sharding.shard_shape(a.shape)
        total += int(np.prod(shard)) * a.dtype.itemsize
    return total


def predicted_bytes(program: Program, view: Probe) -> float:
    """A candidate's predicted peak bytes per device: its arguments exactly (state and batch, from the
    shardings), the measured working space scaled as the module docstring (2.) says, and with microbatches one
    more parameter-sized buffer (their gradients' sum)."""
    state = program.abstract_state()
    args = _device_bytes(state) + _device_bytes(program.abstract_batch())
    params = _device_bytes(state["params"])
    sizes, t = program.config.mesh.checked_sizes(), program.config.train
    examples = t.batch_size / (sizes["data"] * sizes["fsdp"] * sizes["context"]) / t.microbatches  # context: as data
    split = 1.0 - view.tensor_share + view.tensor_share / sizes["tensor"]
    fsdp = view.gathered * params * (sizes["fsdp"] - 1)
    summed = params if t.microbatches > 1 else 0  # the microbatches' gradients are summed in one more copy
    working = view.fixed_temp * params / max(view.param_bytes, 1) + view.per_example_temp * examples * split
    return args + working + fsdp + summed


def _comm(compiled: Any, n_devices: int, per_node: int, view: Any) -> tuple[dict[str, int], float]:
    """Collective bytes per device per step, by kind, and their time on the cluster's links."""
    by_kind: Counter = Counter()
    secs = 0.0
    for c in parse_collectives(compiled.as_text(), n_devices):
        by_kind[c.kind] += c.bytes * c.count
        inter = c.group > per_node and view.nodes > 1
        bw = view.inter_node_bandwidth if inter else view.intra_node_bandwidth
        lat = view.inter_node_latency if inter else view.intra_node_latency
        secs += c.count * collective_seconds(c.kind, c.bytes, c.group, bw, lat, view.collective_overhead)
    return dict(by_kind), secs


def plan_user_mesh(
    config: Config,
    devices: Sequence[Any],
    user: custom.UserModel,
    nodes: int | None = None,
    measured: Probe | None = None,
) -> UserMeshPlan:
    """Choose ``data x fsdp x tensor x context`` (and the microbatches) for ``user``'s model on ``devices`` (see the module
    docstring), as ``nodes`` hosts (default: one per process) whose links are ``mesh.cluster``'s.  ``measured``:
    the computation view of an earlier plan of the same model, batch and remat (default: measured here)."""
    t0 = time.perf_counter()
    devices = tuple(devices)
    n = len(devices)
    nodes = nodes or len(Counter(d.process_index for d in devices))
    spec = load_cluster(config.mesh.cluster)
    spec = dataclasses.replace(spec, nodes=nodes, devices_per_node=n // nodes)
    view = cluster_view(spec, None, default_calibration(spec.device_kind))
    budget = memory_budget(config.train.memory_budget_bytes, spec.memory_bytes)
    auto_remat = config.train.remat_spec.kind == "auto"
    first = Remat("none") if auto_remat else config.train.remat_spec
    measured = measured or probe(config, devices, user, first)
    _, abstract, names = custom.abstract_module(user, config.train.seed)
    dtype = max(jax.tree.leaves(abstract), key=lambda a: int(np.prod(a.shape))).dtype
    peak_flops = spec.peak_flops("bfloat16" if dtype == jax.numpy.bfloat16 else "float32") * view.efficiency
    trials = []
    for sizes in mesh_sizes(n):
        cfg = _with_mesh(config, sizes, **({"train.remat": "none"} if auto_remat else {}))
        try:
            custom.check_user_config(cfg, n, names, abstract)
            program = Program(Resolved(cfg, devices, first, user=user))
            predicted = predicted_bytes(program, measured)
            state = _device_bytes(program.abstract_state())
        except (ConfigError, ValueError) as e:
            trials.append(MeshTrial(sizes, refused=str(e).split("\n")[0]))
            continue
        if state > budget:  # no remat or microbatch count shrinks the train state: nothing to compile
            why = f"its train state alone is {format_bytes(state)} per device, over the budget"
            trials.append(MeshTrial(sizes, predicted_bytes=predicted, state_bytes=state, refused=why))
            continue
        remat = first
        compiled, secs = _compile(program)
        peak = peak_of(compiled)[0]
        if auto_remat and peak > budget:  # full recomputation may fit where saving everything does not
            remat = Remat.parse("full")
            cfg = cfg.set(**{"train.remat": "full"})
            compiled, more = _compile(Program(Resolved(cfg, devices, remat, user=user)))
            peak, secs = peak_of(compiled)[0], secs + more
        microbatches = cfg.train.microbatches
        for m in more_microbatches(cfg, sizes) if peak > budget else []:  # smaller passes, the gradients summed
            cfg = cfg.set(**{"train.microbatches": m})
            program = Program(Resolved(cfg, devices, remat, user=user))
            compiled, more = _compile(program)
            peak, secs, microbatches = peak_of(compiled)[0], secs + more, m
            predicted = predicted_bytes(program, measured)
            if peak <= budget:
                break
        flops = float(executed_flops(compiled, 1) or 0.0)
        comm, comm_s = _comm(compiled, n, spec.devices_per_node, view)
        step_s = flops / peak_flops + comm_s
        trials.append(
            MeshTrial(sizes, microbatches, predicted, state, peak, flops, comm, comm_s, step_s, str(remat), "", secs)
        )
    fits = [t for t in trials if t.peak_bytes is not None and t.peak_bytes <= budget]
    if not fits:
        compiled = [t for t in trials if t.peak_bytes is not None]
        too_big = [t for t in trials if t.refused and t.state_bytes]
        if not compiled and too_big:
            least = min(too_big, key=lambda t: t.state_bytes)
            raise ConfigError(
                f"no mesh of {n} devices fits your model's train state in {format_bytes(budget)} per device "
                f"({least.describe()}: {least.refused}); raise train.memory_budget_bytes or use more devices."
            )
        if not compiled:
            raise ConfigError(
                f"no mesh of {n} devices suits your model: {trials[0].refused.rstrip('.')}; change "
                "train.batch_size or the devices."
            )
        least = min(compiled, key=lambda t: t.peak_bytes)
        raise ConfigError(
            f"no mesh of {n} devices fits your model's train step in {format_bytes(budget)} per device: the least "
            f"peak is {format_bytes(least.peak_bytes)} ({least.describe()}; each mesh compiled with up to the "
            "microbatches its share of the batch allows); raise train.memory_budget_bytes, use more devices or "
            "lower train.batch_size."
        )
    best = min(fits, key=lambda t: (t.step_seconds, t.peak_bytes))
    return UserMeshPlan(best, budget, tuple(trials), measured, n, time.perf_counter() - t0)


def settle_user(config: Config | Resolved, devices: Sequence[Any] | None, user: custom.UserModel | None) -> Resolved:
    """:func:`jaxdist.train.resolved.settle`, and for a user's model what ``auto`` leaves open: ``mesh=auto``
    planned here (logged with its table), then ``train.remat=auto`` on that mesh
    (:func:`jaxdist.train.custom_remat.settle_user_remat`)."""
    if user is not None and isinstance(config, Config) and config.mesh.auto:
        devices = tuple(devices) if devices is not None else tuple(jax.devices())
        plan = plan_user_mesh(config, devices, user)
        log.info("planned mesh for your model: %s\n%s", plan.describe(), plan.table())
        config = plan.to_config(config)
    return settle_user_remat(settle(config, devices, user))

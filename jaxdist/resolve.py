"""Resolve before build: settle what a config leaves to jaxdist, for the devices at hand, and validate once.

    resolved = resolve(load_config(path, overrides), jax.devices())
    with Trainer(resolved) as trainer: ...

``mesh=auto`` becomes the planner's mesh sizes, microbatches and remat
(:func:`jaxdist.planner.plan.resolve_auto`); ``train.remat=auto`` becomes the
remat selector's choice for this mesh, closed against the compiler
(:func:`verified_remat`: the fastest candidate whose compiled peak fits ``train.memory_budget_bytes``,
:mod:`jaxdist.remat.verify`; with ``train.remat_verify=false`` the prediction alone,
:func:`jaxdist.remat.policy.resolve_remat_policy`); the device-dependent checks (mesh product, batch
divisibility, ``model.attention=cudnn`` off a GPU) run here, and the
attention ``auto`` picks for ``train.seq_len`` is logged.  The result is a value of its own
(:class:`~jaxdist.train.resolved.Resolved`: the config, the devices, the remat choice, the program the
choice compiled), never hidden inside the config; the Trainer takes it as it is: it plans nothing.  ``jaxdist train``, the notebooks and the Python API all come
through here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from jaxdist.cluster import load_cluster, memory_budget
from jaxdist.config import Config, ConfigError, unused_devices_note, validate, validate_devices
from jaxdist.data.manifest import settle_tokenizer
from jaxdist.models.arithmetic import param_count, train_state_bytes
from jaxdist.models.attention import attention_note, check_attention_platform
from jaxdist.parallel.mesh import mesh_devices
from jaxdist.planner.plan import resolve_auto
from jaxdist.remat.plan import plan_remat
from jaxdist.remat.policy import HEADROOM, memory_breakdown, profile_for_config, resolve_remat_policy
from jaxdist.remat.verify import PeakModel, VerifiedChoice, candidates, choose
from jaxdist.remat.working import load_working, record_working
from jaxdist.train.aot import block_working, compiled_peak
from jaxdist.train.resolved import Resolved

log = logging.getLogger(__name__)


def resolve(config: Config, devices: Sequence[Any]) -> Resolved:
    """``config`` with ``mesh.auto`` and ``train.remat=auto`` settled for ``devices`` (the global devices of the
    job), validated for them: a :class:`~jaxdist.train.resolved.Resolved` (``config`` is left as it is).  A mesh whose axis sizes, all given, multiply to fewer devices runs on the first
    ones (a warning says how many are left unused; the Trainer takes the same ones, ``mesh_devices``).

    Raises ConfigError (one sentence) when the config cannot run on these devices.
    """
    note = unused_devices_note(config.mesh, len(devices))
    devices = mesh_devices(config.mesh, devices)
    if note:
        log.warning("%s", note)
    config = settle_tokenizer(config)  # model.vocab_size follows data.tokenizer; checks a prepared corpus
    if config.mesh.auto:
        config = resolve_auto(config, devices)
        validate(config)  # a new config: the planner's choices meet every rule
        log.info("planned mesh: %s", " ".join(f"{a}={n}" for a, n in config.mesh.sizes().items()))
    validate_devices(config, len(devices))
    check_fits(config, devices)
    check_attention_platform(config.model, devices[0].platform)
    log.info("%s", attention_note(config.model, config.train.seq_len, devices[0]))
    resolved = Resolved(config, tuple(devices), config.train.remat_spec)
    if config.train.remat_spec.kind == "auto":  # every process computes the same plan (FLOPs over peak)
        if config.train.remat_verify:  # compiled, not only predicted: every process compiles the same programs
            plan = verified_remat(config, devices)
        else:
            _, plan = resolve_remat_policy(
                config, config.mesh.resolved(len(devices)), load_cluster(config.mesh.cluster)
            )
        resolved = resolved.with_remat(plan)
        log.info("remat plan: %s", plan.describe())
    return resolved


def device_memory_bytes(config: Config, device: Any) -> tuple[float, str]:
    """(bytes one device can hold, where that figure comes from): the runtime's limit on accelerators, this
    host's memory shared by its devices on CPU, else the cluster file's ``memory_bytes``."""
    local = jax_local_devices(device)
    device = local[0] if local else device  # memory_stats() answers only for this process's devices
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{device.device_kind}'s memory"
    if device.platform == "cpu":
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            return host / max(len(local), 1), "this host's memory shared by its CPU devices"
        except (OSError, ValueError):
            pass
    return float(load_cluster(config.mesh.cluster).memory_bytes), f"mesh.cluster={config.mesh.cluster}"


def jax_local_devices(device: Any) -> list:
    """The devices of ``device``'s process (its client's addressable devices)."""
    client = getattr(device, "client", None)
    return list(client.local_devices()) if client is not None else [device]


def check_fits(config: Config, devices: Sequence[Any]) -> None:
    """Refuse (one sentence) a model whose train state cannot fit the devices even split over all of them:
    allocating it would fail or page the host for minutes."""
    n = len(devices)
    need = train_state_bytes(param_count(config.model) / n, config.model.param_dtype).total
    have, where = device_memory_bytes(config, devices[0])
    if need > have:
        gib = 1 << 30
        raise ConfigError(
            f"the train state of this model (parameters, gradients and AdamW moments: {need * n / gib:,.1f} GiB) "
            f"cannot fit {n} devices of {have / gib:,.1f} GiB ({where}) even split over all of them: make the "
            "model smaller (model.d_model, model.n_layers, model.vocab_size) or use more devices."
        )


def setting_key(config: Config, mesh_sizes: dict) -> str:
    """What the learned working space is kept under: model shape, dtype, mesh, microbatch and sequence."""
    m, t = config.model, config.train
    mesh = ",".join(f"{a}={s}" for a, s in mesh_sizes.items() if s > 1) or "1"
    return (
        f"{m.preset}:d{m.d_model}:f{m.d_ff}:l{m.n_layers}:h{m.n_heads}:v{m.vocab_size}:{m.dtype}:{mesh}:"
        f"b{t.batch_size // t.microbatches}x{t.microbatches}:s{t.seq_len}"
    )


# Probed working space by (setting, devices, saved set): a process choosing for several budgets probes once.
_PROBED: dict[tuple, float] = {}


def _probed(config: Config, devices: Sequence[Any], c: Any, profile: Any, key: tuple) -> float:
    """Candidate ``c``'s working space per device (jaxdist.train.aot.block_working), remembered per process."""
    k = (*key, c.saved)
    if k not in _PROBED:
        _PROBED[k] = block_working(config, devices, c.policy(), c.activation_bytes / profile.n_layers)
    return _PROBED[k]


def verified_remat(
    config: Config, devices: Sequence[Any], compile_peak=None, learn: bool = True, probe: bool = True
) -> VerifiedChoice:
    """``train.remat=auto`` closed against the compiler on ``devices`` (the job's, or the first of them the
    mesh uses): the fastest candidate whose compiled train step peaks within ``train.memory_budget_bytes``.

    ``compile_peak(resolved) -> CompiledPeak`` (a :class:`~jaxdist.train.resolved.Resolved` with the
    candidate as its remat; default :func:`jaxdist.train.aot.compiled_peak`); the working-space ratios the compiles show are stored for the device kind when ``learn``.
    ``probe``: the loop compiles one block's forward and backward under each candidate it weighs
    (:func:`jaxdist.train.aot.block_working`) so the prediction follows how XLA's working space moves
    between them; without it, one learned ratio and its range stand for all.  The probed ratio is stored
    under its own key (the setting's with ``:probed``).
    """
    compile_peak = compile_peak or compiled_peak
    base = Resolved(config, tuple(devices), config.train.remat_spec)
    cluster = load_cluster(config.mesh.cluster)
    sizes = config.mesh.resolved(len(devices))
    profile = profile_for_config(config, sizes, cluster.peak_flops(config.model.dtype))
    b = memory_breakdown(config, sizes, cluster.memory_bytes, profile)
    fixed = b["parameters"] + b["gradients"] + b["optimizer"]
    reference = b["working"] - HEADROOM * b["memory"]  # logits and one block's backward values, no headroom
    kind, key = devices[0].device_kind, setting_key(config, sizes)
    typical = load_working(kind, key).ratio  # the whole working space (x reference), learned without probes
    if probe:  # the ratio is what the step adds beyond the probed working space: about 0 until learned
        key += ":probed"
    known = load_working(kind, key)
    if probe and known.source != "learned for this setting":
        model = PeakModel(fixed, reference, 0.0)
    else:
        model = PeakModel(fixed, reference, known.ratio, known.low, known.high)
    t = config.train
    budget = memory_budget(t.memory_budget_bytes, cluster.memory_bytes)
    first = budget - fixed - typical * reference  # the activation budget the prediction leaves
    if t.remat_budget_bytes:  # its own plan joins; below the block inputs: InfeasibleBudget names the least
        plan_remat(profile, t.remat_budget_bytes, slack_share=t.remat_slack)
    pool = candidates(profile, [first, t.remat_budget_bytes], slack_share=t.remat_slack, prune_beaten=not probe)
    probe_key = (key, tuple(d.id for d in devices))
    spent = [0.0]

    def probe_candidate(c):  # its working space from a one-block compile: what moves the step's peak
        t0 = time.perf_counter()
        w = _probed(config, devices, c, profile, probe_key)
        spent[0] += time.perf_counter() - t0
        return w

    runnable = {}  # candidate -> its program, where compiled as the run will run it (off CPU)

    def compile_candidate(c):
        p = compile_peak(base.with_remat(c))
        if getattr(p, "runnable", None) is not None:
            runnable[id(c)] = p.runnable
        return p.peak_bytes, p.flops, p.seconds

    choice = choose(
        pool,
        budget,
        model,
        compile_candidate,
        activation_cap=t.remat_budget_bytes or None,
        probe=probe_candidate if probe else None,
    )
    choice = dataclasses.replace(choice, runnable=runnable.get(id(choice.chosen)), probe_seconds=spent[0])
    if learn:
        record_working(kind, key, choice.seen_ratios)
    return choice

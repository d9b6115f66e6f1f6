"""Resolve before build: settle what a config leaves to jaxdist, for the devices at hand, and validate once.

    cfg = resolve(load_config(path, overrides), jax.devices())
    with Trainer(cfg) as trainer: ...

``mesh=auto`` becomes the planner's mesh sizes, microbatches and remat
(:func:`jaxdist.planner.plan.resolve_auto`); ``train.remat=auto`` becomes the
remat selector's plan for this mesh and budget
(:func:`jaxdist.remat.policy.resolve_remat_policy`, the plan in
``train.remat_spec``); the device-dependent checks (mesh product, batch
divisibility, ``model.attention=cudnn`` off a GPU) run here, and the
attention ``auto`` picks for ``train.seq_len`` is logged.  The Trainer takes the resolved config as it is: it
plans nothing.  ``jaxdist train``, the notebooks and the Python API all come
through here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from jaxdist.cluster import load_cluster
from jaxdist.config import Config
from jaxdist.config_checks import mark_resolved, unused_devices_note, validate, validate_devices
from jaxdist.data.manifest import settle_tokenizer
from jaxdist.models.attention import attention_note, check_attention_platform
from jaxdist.parallel.mesh import mesh_devices
from jaxdist.planner.plan import resolve_auto
from jaxdist.remat.policy import resolve_remat_policy

log = logging.getLogger(__name__)


def resolve(config: Config, devices: Sequence[Any]) -> Config:
    """``config`` with ``mesh.auto`` and ``train.remat=auto`` settled for ``devices`` (the global devices of the
    job), validated for them.  A mesh whose axis sizes, all given, multiply to fewer devices runs on the first
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
    check_attention_platform(config.model, devices[0].platform)
    log.info("%s", attention_note(config.model, config.train.seq_len, devices[0]))
    if config.train.remat_spec.kind == "auto":  # every process computes the same plan (FLOPs over peak)
        _, plan = resolve_remat_policy(config, config.mesh.resolved(len(devices)), load_cluster(config.mesh.cluster))
        config = dataclasses.replace(config, train=config.train.with_remat_plan(plan))
        log.info("remat plan: %s", plan.describe())
    mark_resolved(config, len(devices))
    return config

"""``train.remat`` -> a ``jax.checkpoint`` policy for each scanned block.

Values of ``train.remat``:

* ``none``: save everything (no checkpointing); ``full``: save nothing;
* a name from ``jax.checkpoint_policies`` (``dots_saveable``, ...);
* ``save:NAME[,NAME]``: save only these checkpoint_name tags;
* ``auto``: profile the block at the run's shapes and shardings, take the
  budget from ``train.remat_budget_bytes`` or from the device memory in
  ``meshes/`` (:func:`auto_budget`), and save what :func:`plan_remat`
  chooses (the least recompute, or with ``train.remat_slack`` the fewest
  bytes within that slack of it).  Times are XLA FLOPs / the device's peak, so every process of a
  multi-host job computes the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxdist.cluster import load_cluster
from jaxdist.config import Config, ConfigError
from jaxdist.models.arithmetic import DTYPE_BYTES, train_state_bytes
from jaxdist.models.transformer import create_abstract
from jaxdist.parallel.rules import DEFAULT_RULES, logical_to_spec
from jaxdist.remat.named import remat_policy
from jaxdist.remat.plan import RematPlan, format_bytes, plan_remat
from jaxdist.remat.profile import BlockProfile, abstract_mesh, profile_block
from jaxdist.remat.trace import shard_fraction, spec_from_partition

# Working space the auto budget keeps free, beyond logits and one block's backward pass (share of memory).
HEADROOM = 0.10


def _mesh_sizes(config: Config, mesh_sizes: Mapping[str, int] | None, n_devices: int) -> dict[str, int]:
    if mesh_sizes is not None:
        return dict(mesh_sizes)
    return config.mesh.resolved(config.mesh.devices_used(n_devices))  # a smaller mesh runs on the first devices


def profile_for_config(
    config: Config, mesh_sizes: Mapping[str, int], peak_flops: float, measure: bool = False
) -> BlockProfile:
    """The block profile at the run's microbatch (global) x seq_len, on a mesh of ``mesh_sizes``."""
    t = config.train
    return profile_block(
        config.model, t.batch_size // t.microbatches, t.seq_len, mesh_sizes, measure=measure, peak_flops=peak_flops
    )


def memory_breakdown(
    config: Config, mesh_sizes: Mapping[str, int], memory_bytes: int, profile: BlockProfile
) -> dict[str, float]:
    """Bytes per device: parameters, gradients, optimizer state, working space, and what is left for activations.

    Parameters, gradients and AdamW's two moments in ``model.param_dtype``
    (:func:`jaxdist.models.arithmetic.train_state_bytes`), sharded as the
    rules shard the parameters.  Working space: the
    float32 logits of a microbatch three times (logits, softmax, gradient),
    twice the values one block's backward pass reads (when nothing is saved
    it recomputes them all, and their gradients take as much again), and
    ``HEADROOM`` of the memory.
    """
    mesh = abstract_mesh(mesh_sizes)
    sizes = dict(mesh.shape)
    _, abstract, names = create_abstract(config.model)
    leaves = jax.tree.leaves(abstract)
    name_leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    local = 0.0  # parameter elements on one device
    for a, n in zip(leaves, name_leaves):
        assert np.dtype(a.dtype).itemsize == DTYPE_BYTES[config.model.param_dtype], n  # weights in param_dtype
        spec = spec_from_partition(logical_to_spec(n, DEFAULT_RULES, mesh, a.shape), len(a.shape))
        local += int(np.prod(a.shape)) * shard_fraction(spec, sizes)
    state = train_state_bytes(local, config.model.param_dtype)
    t, m = config.train, config.model
    micro = t.batch_size // t.microbatches
    logit_spec = spec_from_partition(
        logical_to_spec(("batch", "seq", "vocab"), DEFAULT_RULES, mesh, (micro, t.seq_len, m.vocab_size)), 3
    )
    logits = 3 * 4 * micro * t.seq_len * m.vocab_size * shard_fraction(logit_spec, sizes)
    needed = sum(op.bytes for op in profile.operators if op.needed)
    working = logits + 2 * needed + HEADROOM * memory_bytes
    return {
        "memory": float(memory_bytes),
        "parameters": state.params,
        "gradients": state.grads,
        "optimizer": state.optimizer,
        "working": working,
        "activations": memory_bytes - state.total - working,
    }


def auto_budget(config: Config, mesh_sizes: Mapping[str, int], memory_bytes: int, profile: BlockProfile) -> float:
    """Bytes per device left for saved activations; ConfigError if not even the block inputs fit."""
    b = memory_breakdown(config, mesh_sizes, memory_bytes, profile)
    floor = profile.n_layers * profile.input_bytes
    if b["activations"] < floor:
        raise ConfigError(
            f"device memory {format_bytes(b['memory'])} minus parameters, gradients and optimizer state "
            f"({format_bytes(b['parameters'] + b['gradients'] + b['optimizer'])}) and working space "
            f"({format_bytes(b['working'])}) leaves {format_bytes(b['activations'])} for activations, less than the "
            f"{format_bytes(floor)} the block inputs need: shard more (mesh.fsdp), lower train.batch_size, raise "
            "train.microbatches, or set train.remat_budget_bytes."
        )
    return b["activations"]


def resolve_remat_policy(
    config: Config, mesh_sizes: Mapping[str, int] | None = None, cluster: Any = None, n_devices: int | None = None
) -> tuple[Any, RematPlan | None]:
    """(policy for the Transformer, the plan when ``train.remat=auto``).

    ``cluster`` (a ClusterSpec; default ``load_cluster(config.mesh.cluster)``)
    gives the device memory and peak FLOP/s.
    """
    spec = config.train.remat_spec
    if spec.kind != "auto":
        return remat_policy(spec), None
    if cluster is None:
        cluster = load_cluster(config.mesh.cluster)
    sizes = _mesh_sizes(config, mesh_sizes, n_devices or cluster.n_devices)
    peak = cluster.peak_flops(config.model.dtype)
    profile = profile_for_config(config, sizes, peak)
    budget = config.train.remat_budget_bytes or auto_budget(config, sizes, cluster.memory_bytes, profile)
    plan = plan_remat(profile, budget, slack_share=config.train.remat_slack)
    return plan.policy(), plan

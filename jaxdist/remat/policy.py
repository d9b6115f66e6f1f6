"""``train.remat`` -> a ``jax.checkpoint`` policy for each scanned block.

Values of ``train.remat``:

* ``none``: save everything (no checkpointing); ``full``: save nothing;
* a name from ``jax.checkpoint_policies`` (``dots_saveable``, ...);
* ``save:NAME[,NAME]``: save only these checkpoint_name tags;
* ``auto``: profile the block at the run's shapes and shardings, take the
  budget from ``train.remat_budget_bytes`` or from the device memory in
  ``meshes/`` (:func:`auto_budget`), and save what :func:`plan_remat`
  chooses.  Times are XLA FLOPs / the device's peak, so every process of a
  multi-host job computes the same plan.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax

from jaxdist.config import Config, ConfigError
from jaxdist.remat.plan import RematPlan, format_bytes, plan_remat
from jaxdist.remat.profile import BlockProfile, abstract_mesh, profile_block

# The common hand-written recipes and the train.remat value of each.
RECIPES: dict[str, str] = {
    "save q/k/v projections": "save:query_proj,key_proj,value_proj",
    "save attention output projection": "save:attn_out",
    "save everything but MLP": "save:attn_norm,query_proj,key_proj,value_proj,attn_context,attn_out,mlp_norm",
}
BUILTINS = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")

# Working space the auto budget keeps free, beyond logits and one block's backward pass (share of memory).
HEADROOM = 0.10


def remat_policy(name: str) -> Any:
    """The policy for a named ``train.remat``: None (save everything), "full", or a jax.checkpoint policy.

    ``auto`` needs the model and mesh: use :func:`resolve_remat_policy`.
    """
    if name in ("none", ""):
        return None
    if name == "full":
        return "full"
    if name.startswith("save:"):
        names = [n for n in name[5:].split(",") if n]
        if not names:
            raise ConfigError(f"train.remat='{name}' names no checkpoint tags: write save:NAME[,NAME], e.g. save:attn_out.")
        return jax.checkpoint_policies.save_only_these_names(*names)
    policy = getattr(jax.checkpoint_policies, name, None)
    if name == "auto" or policy is None or not callable(policy) or name.startswith("save_"):
        hint = " (auto is resolved with the model and mesh: call resolve_remat_policy)" if name == "auto" else ""
        raise ConfigError(f"train.remat='{name}' is unknown{hint}: use none, full, auto, save:NAME[,NAME] or one of "
                          "nothing_saveable, dots_saveable, dots_with_no_batch_dims_saveable, everything_saveable.")
    return policy


def named_policies() -> dict[str, Any]:
    """jax's built-in policies (by name) and the named recipes (by what they save; see RECIPES)."""
    out = {name: getattr(jax.checkpoint_policies, name) for name in BUILTINS}
    for meaning, value in RECIPES.items():
        out[meaning] = remat_policy(value)
    return out


def _mesh_sizes(config: Config, mesh_sizes: Mapping[str, int] | None, n_devices: int) -> dict[str, int]:
    return dict(mesh_sizes) if mesh_sizes is not None else config.mesh.resolved(n_devices)


def profile_for_config(config: Config, mesh_sizes: Mapping[str, int], peak_flops: float,
                       measure: bool = False) -> BlockProfile:
    """The block profile at the run's microbatch (global) x seq_len, on a mesh of ``mesh_sizes``."""
    t = config.train
    return profile_block(config.model, t.batch_size // t.microbatches, t.seq_len, mesh_sizes,
                         measure=measure, peak_flops=peak_flops)


def memory_breakdown(config: Config, mesh_sizes: Mapping[str, int], memory_bytes: int,
                     profile: BlockProfile) -> dict[str, float]:
    """Bytes per device: parameters, gradients, optimizer state, working space, and what is left for activations.

    Parameters and gradients in ``model.param_dtype``, sharded as the rules
    shard them; AdamW keeps two moments per parameter.  Working space: the
    float32 logits of a microbatch three times (logits, softmax, gradient),
    twice the values one block's backward pass reads (when nothing is saved
    it recomputes them all, and their gradients take as much again), and
    ``HEADROOM`` of the memory.
    """
    import numpy as np

    from jaxdist.models.transformer import create_abstract
    from jaxdist.parallel.rules import DEFAULT_RULES, logical_to_spec
    from jaxdist.remat.trace import shard_fraction, spec_from_partition

    mesh = abstract_mesh(mesh_sizes)
    sizes = dict(mesh.shape)
    _, abstract, names = create_abstract(config.model)
    leaves = jax.tree.leaves(abstract)
    name_leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    params = 0.0
    for a, n in zip(leaves, name_leaves):
        spec = spec_from_partition(logical_to_spec(n, DEFAULT_RULES, mesh, a.shape), len(a.shape))
        params += int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize * shard_fraction(spec, sizes)
    t, m = config.train, config.model
    micro = t.batch_size // t.microbatches
    logit_spec = spec_from_partition(logical_to_spec(("batch", "seq", "vocab"), DEFAULT_RULES, mesh,
                                                     (micro, t.seq_len, m.vocab_size)), 3)
    logits = 3 * 4 * micro * t.seq_len * m.vocab_size * shard_fraction(logit_spec, sizes)
    needed = sum(op.bytes for op in profile.operators if op.needed)
    working = logits + 2 * needed + HEADROOM * memory_bytes
    state = 4 * params
    return {"memory": float(memory_bytes), "parameters": params, "gradients": params, "optimizer": 2 * params,
            "working": working, "activations": memory_bytes - state - working}


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
            "train.microbatches, or set train.remat_budget_bytes.")
    return b["activations"]


def resolve_remat_policy(config: Config, mesh_sizes: Mapping[str, int] | None = None, cluster: Any = None,
                         n_devices: int | None = None) -> tuple[Any, RematPlan | None]:
    """(policy for the Transformer, the plan when ``train.remat=auto``).

    ``cluster`` (a ClusterSpec; default ``load_cluster(config.mesh.cluster)``)
    gives the device memory and peak FLOP/s.
    """
    name = config.train.remat
    if name != "auto":
        return remat_policy(name), None
    if cluster is None:
        from jaxdist.parallel.mesh import load_cluster
        cluster = load_cluster(config.mesh.cluster)
    sizes = _mesh_sizes(config, mesh_sizes, n_devices or cluster.n_devices)
    peak = cluster.peak_flops_bf16 if config.model.dtype == "bfloat16" else cluster.peak_flops_fp32
    profile = profile_for_config(config, sizes, peak)
    budget = config.train.remat_budget_bytes or auto_budget(config, sizes, cluster.memory_bytes, profile)
    plan = plan_remat(profile, budget)
    return plan.policy(), plan

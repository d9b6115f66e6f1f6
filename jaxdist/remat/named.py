"""Named remat policies: the ``train.remat`` values that name a ``jax.checkpoint`` policy directly.

``none`` (save everything), ``full`` (save nothing), ``save:NAME[,NAME]``
(only these checkpoint_name tags), jax's built-in policies by name, and the
hand-written recipes (:data:`RECIPES`) the selector's plan is compared with
(:func:`jaxdist.remat.plan.compare_policies`).  ``auto`` needs the model and
mesh: :func:`jaxdist.remat.policy.resolve_remat_policy` resolves it.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxdist.config import ConfigError, Remat
from jaxdist.config.fields import check_checkpoint_names
from jaxdist.models.names import CHECKPOINT_NAMES

# The common hand-written recipes and the train.remat value of each.
RECIPES: dict[str, str] = {
    "save q/k/v projections": "save:query_proj,key_proj,value_proj",
    "save attention output projection": "save:attn_out",
    "save everything but MLP": "save:attn_norm,query_proj,key_proj,value_proj,attn_context,attn_out,mlp_norm",
}
# Beside them in `jaxdist remat`'s comparison: no remat at all, and the selective policy saving every tag.
ALL_NAMES = "save:" + ",".join(CHECKPOINT_NAMES)
BASELINES: dict[str, str] = {"none (no remat)": "none", "save every checkpoint name": ALL_NAMES}
BUILTINS = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable")


def remat_policy(remat: str | Remat, *, own_model: bool = False) -> Any:
    """The policy for ``train.remat`` (a string or its parsed :class:`~jaxdist.config.Remat`): None (save
    everything), "full", or a jax.checkpoint policy.

    ``save:NAME`` must name tags of jaxdist's transformer (a misspelt one would save nothing, silently); with
    ``own_model`` they are a user's model's tags, checked against its traced forward (jaxdist.train.custom).

    ``auto`` needs the model and mesh: use :func:`jaxdist.remat.policy.resolve_remat_policy`.
    """
    spec = remat if isinstance(remat, Remat) else Remat.parse(remat)
    if spec.kind == "none":
        return None
    if spec.kind == "full":
        return "full"
    if spec.kind == "names":
        if not own_model:
            check_checkpoint_names(str(spec), spec.names)
        return jax.checkpoint_policies.save_only_these_names(*spec.names)
    if spec.kind == "selected":  # what the selector chose for auto (jaxdist.resolve.resolve)
        return spec.plan.policy()
    policy = getattr(jax.checkpoint_policies, spec.policy, None)
    if spec.kind == "auto" or policy is None or not callable(policy):
        hint = " (auto is resolved with the model and mesh: call resolve_remat_policy)" if spec.kind == "auto" else ""
        raise ConfigError(
            f"train.remat='{spec}' is unknown{hint}: use none, full, auto, save:NAME[,NAME] or one of "
            "nothing_saveable, dots_saveable, dots_with_no_batch_dims_saveable, everything_saveable."
        )
    return policy


def named_policies() -> dict[str, Any]:
    """jax's built-in policies (by name) and the named recipes (by what they save; see RECIPES)."""
    out = {name: getattr(jax.checkpoint_policies, name) for name in BUILTINS}
    for meaning, value in RECIPES.items():
        out[meaning] = remat_policy(value)
    return out

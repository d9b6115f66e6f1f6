"""What a Trainer is built from: a config settled for the devices at hand, as a value of its own.

:func:`jaxdist.resolve.resolve` makes one (``mesh=auto`` planned, ``train.remat=auto`` chosen, validated for
the devices); :func:`settle` makes one from a config that leaves nothing to choose (the same checks, no
planning).  The choices live here, beside the config, never inside it: a ``dataclasses.replace`` of the
config cannot drop them, and a config saved with a run holds only what the user set.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from jaxdist.config import Config, ConfigError, Remat, validate
from jaxdist.parallel.mesh import mesh_devices
from jaxdist.train.custom import check_user_config


@dataclass(frozen=True)
class Resolved:
    """A config settled for ``devices``.

    ``config``: the job's config, ``mesh=auto`` replaced by the planner's sizes and ``model.vocab_size`` by the
    tokenizer's; ``devices``: those the mesh uses (the first ones when its sizes, all given, ask for fewer);
    ``remat``: ``train.remat`` parsed, ``auto`` settled to the remat selector's choice (kind ``selected``, the
    choice in ``remat.plan``); ``program``: the train step the selector's closed loop compiled as the run
    will run it (off CPU: a :class:`jaxdist.train.aot.RunnableStep`), or None; ``user``: the user's own model,
    loss and optimizer (:class:`jaxdist.train.custom.UserModel`), or None for jaxdist's transformer.
    """

    config: Config
    devices: tuple
    remat: Remat
    program: Any = None
    user: Any = None

    def with_remat(self, plan: Any) -> Resolved:
        """A copy whose remat is the selector's ``plan`` (a jaxdist.remat.plan.RematPlan or the closed loop's
        jaxdist.remat.verify.VerifiedChoice: both have ``policy()``), and the program it compiled, if any."""
        runnable = getattr(plan, "runnable", None)
        return Resolved(self.config, self.devices, Remat("selected", plan=plan), runnable, self.user)


def settle(config: Config | Resolved, devices: Sequence[Any] | None = None, user: Any = None) -> Resolved:
    """``config`` as a :class:`Resolved` for ``devices`` (default: all JAX sees), checked for them; a Resolved
    is returned as it is.  ConfigError (one sentence) when the config leaves something to choose
    (``mesh=auto``, ``train.remat=auto``: :func:`jaxdist.resolve.resolve` chooses) or cannot run here.
    ``user``: the user's own model (:class:`jaxdist.train.custom.UserModel`), checked by its own rules."""
    if isinstance(config, Resolved):
        if user is not None and config.user is not None and user is not config.user:
            raise ConfigError("the Resolved config already holds a model: pass model=... to resolve() or to Trainer.")
        return config if user is None else Resolved(config.config, config.devices, config.remat, config.program, user)
    chosen = tuple(mesh_devices(config.mesh, list(devices) if devices is not None else jax.devices()))
    left = [
        w
        for w, open_ in (("mesh=auto", config.mesh.auto), ("train.remat=auto", config.train.remat_spec.kind == "auto"))
        if open_
    ]
    if user is not None and config.mesh.auto:
        raise ConfigError(
            "mesh=auto for your own model is planned by compiling it: build a Trainer(config, model=...) or call "
            "jaxdist.train.custom_plan.settle_user."
        )
    if user is not None:  # train.remat=auto is chosen by compiling your model (jaxdist.train.custom_remat)
        left = []
    if left:
        raise ConfigError(
            f"{left[0]} is settled before the Trainer is built: pass jaxdist.resolve.resolve(config, devices) "
            "to Trainer."
        )
    if user is not None:
        check_user_config(config, len(chosen))
    else:
        validate(config, len(chosen))
    return Resolved(config, chosen, config.train.remat_spec, user=user)

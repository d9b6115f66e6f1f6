"""Model definitions: logical axis names only, no mesh or device code.

The names are imported on first use, so ``jaxdist.models.names`` (and the
planner, which reads it) does not import JAX.
"""

import importlib

from jaxdist.models.names import CHECKPOINT_NAMES

__all__ = [
    "CHECKPOINT_NAMES",
    "Transformer",
    "apply",
    "apply_with_aux",
    "block_forward",
    "create_abstract",
    "init_params",
]


def __getattr__(name):
    if name in __all__:
        return getattr(importlib.import_module("jaxdist.models.transformer"), name)
    raise AttributeError(f"module 'jaxdist.models' has no attribute {name!r}")

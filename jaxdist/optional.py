"""The optional dependencies: imported where used, one sentence when one is missing.

jaxdist imports and trains with only JAX, flax, optax, orbax-checkpoint and
numpy installed (the GPU image has no pyzmq or tensorboardX).  What needs one
of the packages below either says so in one sentence (a feature the user asked
for: the controller, ``jaxdist export``, a Parquet corpus) or is skipped with
one warning (a default that is only a convenience: the progress bar,
TensorBoard's event files).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from jaxdist.errors import ConfigError

log = logging.getLogger(__name__)

# import name -> the pip package that provides it
PACKAGES = {
    "zmq": "pyzmq",
    "tensorboardX": "tensorboardX",
    "tqdm": "tqdm",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "sentencepiece": "sentencepiece",
    "pyarrow": "pyarrow",
    "jinja2": "jinja2",
}

_warned: set[str] = set()


def _import(module: str) -> ModuleType | None:
    """``module``, or None when its optional package is absent (a module missing inside an installed package, or
    any other error, is raised)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module.split(".")[0] and e.name in PACKAGES:
            return None
        raise


def load(module: str, skipped: str, setting: str | None = None) -> ModuleType | None:
    """``module``, or None with one warning (once per package) naming what is ``skipped`` and the ``setting``
    that silences it."""
    found = _import(module)
    if found is not None:
        return found
    package = PACKAGES[module.split(".")[0]]
    if package not in _warned:
        _warned.add(package)
        silence = f", or {setting}" if setting else ""
        log.warning(
            "%s: the Python package %s is not installed (pip install %s%s).", skipped, package, package, silence
        )
    return None


def require(module: str, purpose: str) -> ModuleType:
    """``module``, or a ConfigError that says ``purpose`` needs its package and how to install it."""
    found = _import(module)
    if found is None:
        package = PACKAGES[module.split(".")[0]]
        raise ConfigError(
            f"{purpose} needs the Python package {package}, which is not installed: pip install {package}."
        )
    return found


def missing_package(e: ModuleNotFoundError) -> str | None:
    """The sentence for a command that stopped because an optional package is absent, or None for any other."""
    if e.name not in PACKAGES:
        return None
    return f"this command needs the Python package {PACKAGES[e.name]}, which is not installed: pip install {PACKAGES[e.name]}."

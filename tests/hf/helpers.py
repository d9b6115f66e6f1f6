"""jaxdist on a mesh for the Hugging Face tests: a Config for an HF directory, abstract sharded params, logits."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from jaxdist.config import load_config
from jaxdist.models import create_abstract
from jaxdist.models.transformer import apply
from jaxdist.parallel.layout import Parallelism


def config_for(hf_dir: Path, *overrides: str):
    """A Config whose model comes from hf_dir's config.json (model.init_from), float32, on 8 CPU devices."""
    return load_config(
        None,
        [f"model.init_from={hf_dir}", "model.max_seq_len=64", "train.seq_len=32", "mesh.cluster=cpu-8", *overrides],
    )


def sharded_abstract(cfg, devices):
    """(parallelism, graphdef, abstract params with their target shardings) of cfg's model on devices."""
    par = Parallelism.build(cfg, devices)
    graphdef, abstract, names = create_abstract(cfg.model)
    shardings = par.param_shardings(names, abstract)
    return (
        par,
        graphdef,
        jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings),
    )


def logits(par, graphdef, params, tokens: np.ndarray) -> np.ndarray:
    """jaxdist's logits [B, T, V] for tokens [B, T] with params on par's mesh."""
    fn = jax.jit(par.bind(lambda p, t: apply(graphdef, p, t)), in_shardings=(None, par.batch_sharding))
    return np.asarray(fn(params, jax.numpy.asarray(tokens, jax.numpy.int32)))

"""Packed documents (data.packing=documents) on the context ring and on pipeline stages: the loss and every gradient
of a packed batch equal those of each document run alone through the same model on one device (fp32, 1e-5).

The path under test is the one the Trainer takes: ``Parallelism.build`` for the config, its gradient function
(the pipeline executor with mesh.pipeline > 1) or the model's own ``loss_and_grads`` (the ring with
mesh.context > 1), jitted with the config's shardings.  The rows hold documents of 2 to 33 tokens: documents
cross the context chunks, the pipeline's sequence chunks and the attention's key/value blocks (4 tokens), and
the ring meets blocks that share no document with a query block (skipped).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist.config import load_config, validate
from jaxdist.data.documents import pack, targets
from jaxdist.models.transformer import apply, create_abstract
from jaxdist.parallel.layout import Parallelism
from jaxdist.train.step import loss_and_grads
from tests.parallel.test_context import random_params, rel_err

SEQ, ROWS = 32, 8
# GQA (8 query heads over 2 key/value heads), 4 layers (2 per stage), key/value blocks of 4 tokens.
MODEL = [
    "model=tiny",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=2",
    "model.head_dim=8",
    "model.attention_block=4",
    f"train.seq_len={SEQ}",
    f"train.batch_size={ROWS}",
    "data.packing=documents",
]


@pytest.fixture(scope="module")
def reference():
    """(params, packed rows, the mean loss over every document's targets and its gradients, each document run
    alone and unpacked, one device)."""
    cfg = load_config(None, MODEL)
    graphdef, _, _ = create_abstract(cfg.model)
    params = random_params(cfg.model, seed=4)
    rng = np.random.default_rng(5)
    lengths = rng.integers(2, 16, 60)
    lengths[::6] = rng.integers(16, SEQ + 2, 10)  # some long ones, none longer than a row: every document whole
    docs = [rng.integers(0, cfg.model.vocab_size, n).astype(np.int32) for n in lengths]
    p = pack(np.concatenate([[0], np.cumsum(lengths)[:-1]]), int(lengths.sum()), SEQ)
    rows = p.read(np.concatenate(docs).astype(np.uint16), np.arange(ROWS))
    whole = docs[: p.row_ptr[ROWS]]  # the documents of the first ROWS rows, in order
    assert len(whole) > 2 * ROWS  # several in a row
    count = int(targets(rows).sum())
    assert count == sum(len(d) - 1 for d in whole)

    # Each document alone in a row of its own from position 0, right-padded: under the causal mask no real token
    # sees the padding, so its predictions are those of the document run by itself (one program, not one per
    # document length); the padding's predictions are left out.
    rows_alone = np.zeros((len(whole), SEQ + 1), np.int32)
    for i, d in enumerate(whole):
        rows_alone[i, : len(d)] = d
    real = np.arange(SEQ)[None] < np.array([len(d) - 1 for d in whole])[:, None]

    def alone(params):
        logits = apply(graphdef, params, rows_alone[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, rows_alone[:, 1:])
        return jnp.sum(jnp.where(real, ce, 0.0)) / count

    loss, grads = jax.jit(jax.value_and_grad(alone))(params)
    return params, rows, loss, grads


@pytest.mark.parametrize(
    "overrides",
    [
        ["mesh.context=2", "mesh.data=2", "mesh.tensor=2", "model.attention=xla"],
        ["mesh.context=4", "mesh.data=2", "train.remat=full"],
        ["mesh.pipeline=2", "pipeline.schedule=seq1f1b", "pipeline.chunks=2", "train.microbatches=2", "mesh.data=2",
         "mesh.tensor=2", "model.attention=xla"],
        ["mesh.pipeline=2", "pipeline.schedule=seq1f1b", "pipeline.chunks=4", "train.microbatches=2", "mesh.data=4",
         "model.attention=blockwise", "train.remat=full"],
    ],
    ids=["context2-data2-tensor2", "context4-data2-remat-full", "pipeline2-seq1f1b-xla", "pipeline2-seq1f1b-blockwise-remat-full"],
)  # fmt: skip
def test_packed_documents_on_the_ring_and_the_pipeline_equal_each_document_alone(reference, overrides):
    params, rows, ref_loss, ref_grads = reference
    cfg = load_config(None, MODEL + overrides)
    validate(cfg, len(jax.devices()))
    graphdef, _, names = create_abstract(cfg.model, remat_policy="full" if cfg.train.remat == "full" else None)
    par = Parallelism.build(cfg, jax.devices())
    p_sh = par.param_shardings(names, params)
    fn = par.grads_fn(cfg, graphdef, p_sh, None)
    if fn is None:  # the model's own gradients: the ring runs inside its attention
        fn = functools.partial(loss_and_grads, graphdef, microbatches=cfg.train.microbatches, packed=True)
    else:
        assert cfg.mesh.pipeline == 2
        fn = (lambda f: lambda p, t: (lambda out: (out[0], out[2]))(f(p, t)))(fn)  # (loss, {}, grads) -> (loss, grads)
    jitted = jax.jit(par.bind(fn), in_shardings=(p_sh, par.batch_sharding), out_shardings=(par.replicated, p_sh))
    loss, grads = jitted(jax.device_put(params, p_sh), jax.device_put(rows, par.batch_sharding))
    text = jitted.lower(params, rows).as_text()
    assert "collective_permute" in text or "ppermute" in text  # the ring or the stages really ran
    assert rel_err(loss, ref_loss) < 1e-5
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        ref = functools.reduce(lambda t, k: t[k.key], path, ref_grads)
        assert rel_err(g, ref) < 1e-5, jax.tree_util.keystr(path)

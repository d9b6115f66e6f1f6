"""A stack of identical blocks in a model of your own, run so that jaxdist can split it into pipeline stages.

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def stack(rngs):                      # the blocks' parameters stacked on a leading axis named "layers"
        return Block(width, rngs=rngs)

    self.blocks = stack(rngs)
    ...
    x = run_blocks(self.blocks, x)        # in __call__: block 0, then block 1, ...

:func:`run_blocks` applies each block of the stack in order to ``x`` (an array, or a pytree of arrays, whose
leading axis is the batch's rows; a block returns the same structure).  Each block is recomputed in the
backward pass as ``train.remat`` says (:func:`jaxdist.models.hooks.remat_block`).  By default the blocks run as
a scan; with ``mesh.pipeline > 1`` jaxdist runs them as pipeline stages (stage k holds blocks k*L/p ..
(k+1)*L/p - 1, ``jaxdist.parallel.pipeline_blocks``): the batch's rows split into ``train.microbatches``
microbatches that flow through the stages.  What runs before and after the stack (an embedding, a head, the
loss) runs once on the whole batch, not per microbatch, its rows split over the data axes and the stages.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from jaxdist.models import hooks


def run_blocks(blocks: nnx.Module, x: Any) -> Any:
    """``x`` through every block of ``blocks`` (a module made by ``nnx.vmap``: each parameter's leading axis is
    the block's index, named ``"layers"``), in order; see the module docstring."""
    graphdef, state = nnx.split(blocks)

    def body(h, one):  # one block: its parameters are the stack's at one index
        return hooks.remat_block(nnx.merge(graphdef, one))(h), None

    run = hooks.layer_scan()
    return (jax.lax.scan if run is None else run)(body, x, state)[0]

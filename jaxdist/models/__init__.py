"""Model definitions: logical axis names only, no mesh or device code."""

from jaxdist.models.transformer import (CHECKPOINT_NAMES, Transformer, apply, apply_with_aux, block_forward,
                                        create_abstract, init_params)

__all__ = ["CHECKPOINT_NAMES", "Transformer", "apply", "apply_with_aux", "block_forward", "create_abstract",
           "init_params"]

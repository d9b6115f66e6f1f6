"""A packed row's token word (``data.packing=documents``): the flags above the token id.

A word is a token id below 2**29 (:data:`ID_MASK`) with two flags above it: :data:`START` on the first token of
a document (or of a piece of one, or of a row's padding) and :data:`NO_LOSS` on a token that is never a target.
:mod:`jaxdist.data.documents` writes them (without JAX); :mod:`jaxdist.models.packed` reads them on the device.
"""

START = 1 << 29  # first token of a document (or piece of one), and of a row's padding
NO_LOSS = 1 << 30  # never a target: padding, the non-assistant tokens of a conversation
ID_MASK = START - 1  # token ids stay below 2**29

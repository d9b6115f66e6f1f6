"""Data: byte tokenizer, token sources and deterministic, resumable batch sampling.

Importing this package does not import JAX (only ``global_batch_array`` needs
it, and imports it when called), so configs and data can be prepared before
devices are set up.
"""

from jaxdist.data.loader import EVAL_SEED, Prefetcher, SequenceSampler, eval_sampler, global_batch_array
from jaxdist.data.sources import TokenSplit, eval_file_mask, load_source, write_token_file
from jaxdist.data.tokenizer import BOS, EOS, PAD, UNK, VOCAB_SIZE, ByteTokenizer

__all__ = [
    "BOS", "EOS", "EVAL_SEED", "PAD", "UNK", "VOCAB_SIZE",
    "ByteTokenizer", "Prefetcher", "SequenceSampler", "TokenSplit",
    "eval_file_mask", "eval_sampler", "global_batch_array", "load_source", "write_token_file",
]

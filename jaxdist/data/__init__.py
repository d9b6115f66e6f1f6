"""Data: byte tokenizer, token sources, the batch list (exact data order) and its loader.

Importing this package does not import JAX (only ``global_batch_array`` needs
it, and imports it when called), so configs and data can be prepared before
devices are set up.
"""

from jaxdist.data.audit import check_exactly_once, digest_problems, replay_order, trained_batches
from jaxdist.data.batchlist import BatchList, BatchListError, SourceEntry, format_id, parse_id
from jaxdist.data.batchloader import BatchLoader, BatchReader, RunBatchList
from jaxdist.data.catalog import add_data
from jaxdist.data.journal import Journal
from jaxdist.data.loader import EVAL_SEED, Prefetcher, SequenceSampler, eval_sampler, global_batch_array
from jaxdist.data.sources import TokenSplit, eval_file_mask, load_source, write_token_file
from jaxdist.data.tokenizer import BOS, EOS, PAD, UNK, VOCAB_SIZE, ByteTokenizer

__all__ = [
    "BatchList",
    "BatchListError",
    "BatchLoader",
    "BatchReader",
    "Journal",
    "RunBatchList",
    "SourceEntry",
    "add_data",
    "check_exactly_once",
    "digest_problems",
    "format_id",
    "parse_id",
    "replay_order",
    "trained_batches",
    "BOS",
    "EOS",
    "EVAL_SEED",
    "PAD",
    "UNK",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "Prefetcher",
    "SequenceSampler",
    "TokenSplit",
    "eval_file_mask",
    "eval_sampler",
    "global_batch_array",
    "load_source",
    "write_token_file",
]

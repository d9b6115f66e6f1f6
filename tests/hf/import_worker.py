"""One process of the multi-process import test: import a Hugging Face checkpoint onto fsdp=4 x tensor=2.

Run by tests/hf/test_memory.py with jax.distributed settings in the environment
(4 processes x 2 CPU devices).  Prints ``RESULT {json}``: the growth of this
process's peak resident memory during the import (bytes), the bytes of the
shards it holds and the ids of its devices.
"""

from __future__ import annotations

import json
import resource
import sys

from jaxdist.train.distributed import initialize_from_env

initialize_from_env()

import jax  # noqa: E402  (after jax.distributed)
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from jaxdist.hf.load import load_params  # noqa: E402
from tests.hf.helpers import config_for, sharded_abstract  # noqa: E402


def main(hf_dir: str) -> None:
    cfg = config_for(hf_dir, "mesh.fsdp=4", "mesh.tensor=2")
    _, _, abstract = sharded_abstract(cfg, jax.devices())
    # Warm up the runtime's own first-transfer allocations on a tiny array, outside the measurement.
    everywhere = NamedSharding(jax.tree.leaves(abstract)[0].sharding.mesh, PartitionSpec())
    jax.block_until_ready(jax.make_array_from_callback((8,), everywhere, lambda i: np.zeros(8, np.float32)[i]))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    params = load_params(hf_dir, cfg.model, abstract)
    jax.block_until_ready(params)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(s.data.nbytes for leaf in jax.tree.leaves(params) for s in leaf.addressable_shards)
    devices = sorted({d.id for leaf in jax.tree.leaves(params) for d in leaf.sharding.addressable_devices})
    print("RESULT " + json.dumps({"growth": after - before, "held": held, "devices": devices}), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])

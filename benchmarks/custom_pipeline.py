"""Pipeline stages for your own model (jaxdist/parallel/pipeline_blocks.py): what a device holds and how long a
step takes as the stages and the microbatches grow.

The model is the mixer language model of tests/train/test_custom_model.py run through ``run_blocks``
(tests/train/test_custom_pipeline.py's StagedLM), ``--layers`` blocks of width ``--width`` (hidden 4x), batch
``--batch`` of ``--seq`` tokens, fp32, on 8 CPU devices: ``data = 8 / pipeline``.  For each stage count p and
microbatch count m: the median step time over ``--steps`` steps against the 8-way data-parallel step's (the 8 CPU
devices share this machine's cores, so the time follows the work all devices do, and the bubble's ticks compute
too: gpipe's closed form for the stack's share is (m + p - 1) / m); the compiled step's FLOPs per device
(``cost_analysis`` plus the loop bodies it counts once: ``jaxdist.train.programs.executed_flops``) against
the data=8 step's, an operation count the host's load does not move; the train state's bytes per device (the
stack's parameters and optimizer state divide by p; ``memory_analysis``) and the compiled temporaries.

    python benchmarks/custom_pipeline.py
    python benchmarks/custom_pipeline.py --width 256 --layers 16
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import statistics  # noqa: E402  (after XLA_FLAGS)
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the model

import jax  # noqa: E402
import optax  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.train.metrics import read_metrics  # noqa: E402
from jaxdist.train.programs import executed_flops  # noqa: E402
from jaxdist.train.trainer import Trainer  # noqa: E402
from tests.train.test_custom_model import lm_loss  # noqa: E402
from tests.train.test_custom_pipeline import StagedLM  # noqa: E402


def measure(a, stages: int, micro: int, runs: str):
    """(median step seconds, FLOPs per device, state bytes per device, temporaries) of one configuration's step."""
    cfg = load_config(
        None,
        [
            f"mesh.pipeline={stages}",
            f"mesh.data={8 // stages}",
            "mesh.fsdp=1",
            "pipeline.schedule=gpipe",
            f"train.microbatches={micro}",
            f"train.batch_size={a.batch}",
            f"train.seq_len={a.seq}",
            "checkpoint.enabled=false",
            f"train.steps={a.steps}",
            "train.log_every=1",
            "train.progress=false",
            "train.tensorboard=false",
            f"train.runs_dir={runs}",
            f"train.name=p{stages}m{micro}",
        ],
        own_model=True,
    )

    def build(rngs):
        return StagedLM(width=a.width, hidden=4 * a.width, layers=a.layers, rngs=rngs)

    with Trainer(cfg, model=build, loss=lm_loss, optimizer=optax.adamw(1e-3)) as t:
        compiled = t.compile_train_step()
        mem, flops = compiled.memory_analysis(), executed_flops(compiled, 1)  # every loop trip counted
        t.fit()
        times = [r["step_time"] for r in read_metrics(t.config.run_dir)[2:]]  # the first two: compile, warm-up
        return statistics.median(times), flops, mem.argument_size_in_bytes, mem.temp_size_in_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    assert len(jax.devices()) >= 8
    runs = tempfile.mkdtemp(prefix="jd-pipe-")
    base = measure(a, 1, 1, runs)
    print(
        f"{'stages':>6} {'micro':>5} {'step ms':>8} {'x data=8':>8} {'GFLOP/dev':>9} {'x data=8':>8} "
        f"{'(m+p-1)/m':>9} {'state MB':>8} {'x data=8':>8} {'temp MB':>7}"
    )
    rows = [(1, 1)] + [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p) if a.batch % (m * (8 // p)) == 0]
    for p, m in rows:
        secs, flops, state, temp = base if (p, m) == (1, 1) else measure(a, p, m, runs)
        print(
            f"{p:>6} {m:>5} {secs * 1e3:>8.1f} {secs / base[0]:>8.2f} {flops / 1e9:>9.3f} {flops / base[1]:>8.2f} "
            f"{(m + p - 1) / m:>9.2f} {state / 2**20:>8.2f} {state / base[2]:>8.2f} {temp / 2**20:>7.2f}"
        )


if __name__ == "__main__":
    main()

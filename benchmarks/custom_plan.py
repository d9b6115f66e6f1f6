"""``mesh=auto`` for your own model (jaxdist/train/custom_plan.py): the measured prediction against each compiled
peak, and what planning costs, as the model and the device count grow.

The model is a causal mixer language model (embedding, ``--layers`` scanned MLP-mixer blocks, output projection;
the one of tests/train/test_custom_model.py) at widths ``--widths`` (hidden width 4x), batch ``--batch`` of 32
tokens.  For each width and device count: the meshes compiled, the largest and mean |predicted - compiled| /
compiled peak over them, the mesh chosen, the compiles (probes + meshes) and the planning seconds.

    python benchmarks/custom_plan.py
    python benchmarks/custom_plan.py --widths 64,128 --devices 4
"""

from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import sys  # noqa: E402  (after XLA_FLAGS)
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ holds the model

import jax  # noqa: E402
import optax  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.train.custom import user_model  # noqa: E402
from jaxdist.train.custom_plan import plan_user_mesh  # noqa: E402
from tests.train.test_custom_model import MixerLM, lm_loss  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="64,128,256")
    ap.add_argument("--devices", default="4,8")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args()
    print(
        f"{'width':>5} {'params':>9} {'devices':>7} {'meshes':>6} {'max |err|':>9} {'mean |err|':>10} "
        f"{'chosen':<22} {'compiles':>8} {'seconds':>8}"
    )
    for n in (int(x) for x in a.devices.split(",")):
        for w in (int(x) for x in a.widths.split(",")):
            cfg = load_config(
                None,
                ["mesh.auto=true", "train.seq_len=32", f"train.batch_size={a.batch}", "train.runs_dir=/tmp/jd-plan"],
                own_model=True,
            )
            user = user_model(
                lambda rngs, w=w: MixerLM(width=w, hidden=4 * w, layers=a.layers, rngs=rngs),
                lm_loss,
                optax.adamw(1e-3),
                None,
            )
            p = plan_user_mesh(cfg, jax.devices()[:n], user)
            errs = [abs(t.error) for t in p.trials if t.peak_bytes]
            probes = 4 if p.probe.tensor_share or p.probe.gathered else 2
            print(
                f"{w:>5} {p.probe.param_bytes / 4 / 1e6:>8.2f}M {n:>7} {len(errs):>6} {max(errs):>9.1%} "
                f"{sum(errs) / len(errs):>10.1%} {p.chosen.describe():<22} {len(errs) + probes:>8} {p.seconds:>8.1f}"
            )


if __name__ == "__main__":
    main()

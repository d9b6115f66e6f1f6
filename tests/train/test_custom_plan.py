"""mesh=auto and `jaxdist plan --entry` for your own model (jaxdist/train/custom_plan.py): the mixer language model
of test_custom_model.py, planned on 4 devices by compiling every data x fsdp x tensor x context (it constrains its
activations' sequence axis, so context splits them); the prediction from the
measured view (one device at two batch sizes, two devices with tensor=2 and with fsdp=2) against each compiled peak; the choice
against a brute-force pass over the compiled table at a budget that rules out the fastest mesh; the Trainer
training on what mesh=auto chose; and a budget nothing fits refused in one sentence."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from jaxdist.cli import main
from jaxdist.config import ConfigError, load_config
from jaxdist.controller.local import write_cpu_cluster
from jaxdist.train.custom import user_model
from jaxdist.train.custom_plan import mesh_sizes, plan_user_mesh
from jaxdist.train.trainer import Trainer
from tests.train.test_custom_model import MixerLM, lm_loss

N = 4  # devices planned on: 10 meshes


def build(rngs):
    return MixerLM(width=64, hidden=256, layers=2, rngs=rngs)


def entry(config):
    """`jaxdist plan --entry tests.train.test_custom_plan:entry`."""
    return {"model": build, "loss": lm_loss, "optimizer": optax.adamw(1e-2)}


def config(tmp_path, *extra):
    return load_config(
        None,
        [
            "mesh.auto=true",
            "train.seq_len=32",
            "train.batch_size=8",
            "train.steps=2",
            "train.log_every=1",
            "train.progress=false",
            "train.tensorboard=false",
            "data.max_bytes=200000",
            f"train.runs_dir={tmp_path}",
            "train.name=auto",
            *extra,
        ],
        own_model=True,
    )


def test_every_mesh_is_compiled_the_prediction_holds_and_mesh_auto_trains_on_the_choice(tmp_path):
    devices = jax.devices()[:N]
    user = user_model(build, lm_loss, optax.adamw(1e-2), None)
    p = plan_user_mesh(config(tmp_path), devices, user)
    print(p.table())
    assert [t.sizes for t in p.trials] == mesh_sizes(N)  # every data x fsdp x tensor x context of 4 devices
    assert len(mesh_sizes(N)) == 10 and sum(t.sizes["context"] > 1 for t in p.trials) == 4
    compiled = [t for t in p.trials if t.peak_bytes]
    assert len(compiled) == len(mesh_sizes(N)), p.table()  # the model's names allow every split
    for t in compiled:  # the measured view predicts each mesh's compiled peak
        assert abs(t.error) <= 0.10, (t.describe(), t.error)
    assert p.probe.tensor_share > 0.5  # most of this model's activations are split by tensor (its hidden width)

    # A budget between the least and the largest compiled peak: the fastest mesh within it, by brute force over
    # the table, is what mesh=auto trains on.
    peaks = sorted({t.peak_bytes for t in compiled})
    budget = (peaks[0] + peaks[-1]) // 2
    fitting = [t for t in compiled if t.peak_bytes <= budget]
    want = min(fitting, key=lambda t: (t.step_seconds, t.peak_bytes))
    assert len(fitting) < len(compiled)
    cfg = config(tmp_path, f"train.memory_budget_bytes={budget}")
    with Trainer(cfg, devices, model=build, loss=lm_loss, optimizer=optax.adamw(1e-2)) as t:
        sizes = t.config.mesh.sizes()
        assert {a: sizes[a] for a in ("data", "fsdp", "tensor", "context")} == want.sizes
        assert t.config.train.microbatches == want.microbatches == 1
        assert not t.config.mesh.auto
        peak = t.compile_train_step().memory_analysis()
        ran = peak.argument_size_in_bytes + peak.output_size_in_bytes + peak.temp_size_in_bytes
        assert ran - peak.alias_size_in_bytes <= budget  # the Trainer's own program fits the budget
        history = t.fit()
    assert len(history) == 2 and all(np.isfinite(h["loss"]) for h in history)

    # A budget only the most sharded train state fits in: the other meshes are refused without a compile, that
    # one compiled with every microbatch count its share allows, and none fits: refused in one sentence.
    least = min(t.state_bytes for t in p.trials)
    for budget, why in ((least + 1, "microbatches its share of the batch allows"), (least - 1, "train state")):
        with pytest.raises(ConfigError) as e:
            plan_user_mesh(config(tmp_path, f"train.memory_budget_bytes={budget}"), devices, user, None, p.probe)
        msg = str(e.value)
        assert "no mesh of 4 devices fits" in msg and msg.count(". ") == 0 and msg.endswith("."), msg
        assert why in msg, msg


def test_a_step_that_does_not_fit_is_planned_with_more_microbatches(tmp_path):
    """One device (one mesh, a cheap probe): under its one-microbatch peak the step is compiled again with 2, 4, ...
    microbatches until it fits; the smaller passes lower the compiled peak, and the config carries the count."""
    one = jax.devices()[:1]
    user = user_model(build, lm_loss, optax.adamw(1e-2), None)
    p = plan_user_mesh(config(tmp_path), one, user)
    assert p.chosen.microbatches == 1
    budget = p.chosen.peak_bytes - 1
    p2 = plan_user_mesh(config(tmp_path, f"train.memory_budget_bytes={budget}"), one, user, None, p.probe)
    print(p2.table())
    assert p2.chosen.microbatches > 1 and 8 % p2.chosen.microbatches == 0, p2.table()
    assert p2.chosen.peak_bytes <= budget < p.chosen.peak_bytes
    assert abs(p2.chosen.error) <= 0.10  # the prediction counts the microbatches' gradient sum
    chosen = p2.to_config(config(tmp_path))
    assert chosen.train.microbatches == p2.chosen.microbatches and not chosen.mesh.auto


def test_jaxdist_plan_entry_prints_the_table_and_writes_a_config_that_loads(tmp_path, capsys):
    """In this process: jaxdist plan compiles on the devices the cluster file names (a 4-device CPU node; the
    suite's 8 simulated devices are already there)."""
    cluster = write_cpu_cluster(tmp_path / "cpu-4.toml", 1, N)
    out = tmp_path / "plan.toml"
    args = ["plan", "--entry", "tests.train.test_custom_plan:entry", f"mesh.cluster={cluster}", "--out", str(out)]
    assert main([*args, "train.seq_len=32", "train.batch_size=8"]) == 0
    printed = capsys.readouterr().out
    assert "predicted" in printed and "<- chosen" in printed and "fsdp=4" in printed, printed
    planned = load_config(out, own_model=True)
    assert not planned.mesh.auto and planned.train.entry == "tests.train.test_custom_plan:entry"
    assert planned.mesh.data * planned.mesh.fsdp * planned.mesh.tensor == N
    # --verify is the closed-form planner's: refused with one sentence for your own model
    assert main([*args, "--verify", "--force"]) == 2

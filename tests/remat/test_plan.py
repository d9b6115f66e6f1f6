"""Plans against XLA (memory, FLOPs, Pareto), exact gradients, budgets, train.remat and the CLI.

The plans' Pareto position in XLA is checked at PARETO_BUDGETS by test_plans_not_dominated_by_named_policies_in_xla
(the slow ten-budget repeat of it, which ran nowhere, was removed: issue 42).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.config import ConfigError, load_config
from jaxdist.measure.remat import dominated_by, measure_policies
from jaxdist.models.arithmetic import param_count
from jaxdist.parallel.mesh import build_mesh
from jaxdist.parallel.rules import activation_sharding
from jaxdist.remat import (
    InfeasibleBudget,
    budget_range,
    memory_breakdown,
    named_policies,
    plan_remat,
    policy_point,
    profile_block,
    remat_policy,
)
from jaxdist.train.aot import peak_of
from tests.trees import leaf_pairs

# The XLA checks: a tiny model with 16 scanned layers on one device, batch 16 x 64 tokens.
XLA_MODEL = ["model=tiny", "model.n_layers=16", "mesh.data=1"]
B, T = 16, 64
# Shares of the range between save nothing and save everything.  The memory check uses the plain
# optimum (slack_share=0, train.remat_slack's default: five different plans); the Pareto check plans with
# train.remat_slack=0.03 (the default before it was a knob; they converge once the budget holds every matmul
# output).  The plain optimum is not Pareto in XLA at every budget: at 0.64 it saves 74 MB for 0.7 MFLOP less
# than dots_saveable's 48 MB, within XLA's FLOP noise (the compile-verified choice of issue 20 item 1).
PARETO_SLACK = 0.03
MEMORY_BUDGETS = (0.36, 0.45, 0.55, 0.73, 0.91)
PARETO_BUDGETS = (0.09, 0.27, 0.45, 0.64, 0.91)


@pytest.fixture(scope="module")
def xla():
    cfg = load_config(None, XLA_MODEL)
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    profile = profile_block(cfg.model, B, T, {}, peak_flops=5e10)
    lo, hi = budget_range(profile)
    plans = {("memory", f): plan_remat(profile, lo + f * (hi - lo), slack_share=0.0) for f in MEMORY_BUDGETS}
    plans.update(
        {("pareto", f): plan_remat(profile, lo + f * (hi - lo), slack_share=PARETO_SLACK) for f in PARETO_BUDGETS}
    )
    named = named_policies()
    measured = measure_policies(cfg.model, mesh, B, T, {**{k: p.policy() for k, p in plans.items()}, **named})
    base, full = measured["nothing_saveable"], measured["everything_saveable"]
    floor = profile.n_layers * profile.input_bytes
    points = {k: (c.temp_bytes - base.temp_bytes, c.flops - full.flops) for k, c in measured.items()}
    return dict(profile=profile, plans=plans, named=named, points=points, floor=floor)


def test_predicted_memory_within_10_percent_of_xla(xla):
    memory_plans = {k: p for k, p in xla["plans"].items() if k[0] == "memory"}
    assert len({p.saved_signatures for p in memory_plans.values()}) == len(MEMORY_BUDGETS)  # five plans
    for k, plan in memory_plans.items():
        predicted = plan.activation_bytes - xla["floor"]  # saved beyond the block inputs, all layers
        measured = xla["points"][k][0]  # temp bytes minus nothing_saveable's
        assert abs(predicted - measured) <= 0.10 * measured, (k, predicted, measured)
    everything = policy_point(xla["profile"], "everything", jax.checkpoint_policies.everything_saveable)
    assert (
        abs(everything.activation_bytes - xla["floor"] - xla["points"]["everything_saveable"][0])
        <= 0.10 * xla["points"]["everything_saveable"][0]
    )


def _tolerance(points):
    # Measurement noise: 1% of everything_saveable's saved bytes and of nothing_saveable's recompute FLOPs
    # (XLA's FLOP count moves by ~0.5% of the latter between plans that save the same values).
    return 0.01 * points["everything_saveable"][0], 0.01 * points["nothing_saveable"][1]


def test_plans_not_dominated_by_named_policies_in_xla(xla):
    named = {k: xla["points"][k] for k in xla["named"]}
    tol = _tolerance(xla["points"])
    for k in xla["plans"]:
        if k[0] == "pareto":
            assert dominated_by(xla["points"][k], named, tol) is None, (k, xla["points"][k], named)
    # and the check can fail: twice everything_saveable's memory at its recompute is dominated
    assert dominated_by((2 * named["everything_saveable"][0], 0.0), named, tol) is not None


def test_predicted_pareto_at_ten_budgets(xla):
    profile = xla["profile"]
    lo, hi = budget_range(profile)
    named = {n: policy_point(profile, n, p) for n, p in xla["named"].items()}
    for f in np.linspace(0.0, 1.0, 12)[1:-1]:
        plan = plan_remat(profile, lo + f * (hi - lo), slack_share=0.0)
        point = (plan.activation_bytes, plan.recompute_time)
        others = {n: (p.activation_bytes, p.recompute_time) for n, p in named.items()}
        assert dominated_by(point, others, (1e-6 * hi, 1e-9 * point[1])) is None


def test_gradients_equal_no_remat_gradients():
    cfg = load_config(None, ["model=tiny", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])
    mesh = build_mesh(cfg.mesh)
    from jaxdist.models.transformer import create_abstract, init_params
    from jaxdist.train.step import next_token_loss

    params = jax.jit(lambda: init_params(cfg.model))()  # one compile instead of eager per-op init
    tokens = jax.random.randint(jax.random.key(0), (8, 33), 0, cfg.model.vocab_size)
    profile = profile_block(cfg.model, 8, 32, dict(mesh.shape), peak_flops=5e10)
    lo, hi = budget_range(profile)

    def grads(policy):
        graphdef, _, _ = create_abstract(cfg.model, remat_policy=policy)
        with activation_sharding(mesh):
            lowered = jax.jit(jax.grad(lambda p: next_token_loss(graphdef, p, tokens))).lower(params)
        # LLVM's optimisation level changes nothing here but compile time.
        return lowered.compile(compiler_options={"xla_backend_optimization_level": 0})(params)

    ref = grads(None)
    for f in (0.1, 0.5, 0.9):
        got = grads(plan_remat(profile, lo + f * (hi - lo)).policy())
        for a, b in leaf_pairs(got, ref):
            assert float(jnp.max(jnp.abs(a - b))) <= 1e-6 * float(jnp.max(jnp.abs(b)))


def test_budget_below_the_block_inputs_names_the_smallest(xla):
    profile = xla["profile"]
    floor = profile.n_layers * profile.input_bytes
    with pytest.raises(InfeasibleBudget, match=r"raise the budget to at least 4\.00 MiB \(4194304 bytes\)") as e:
        plan_remat(profile, floor - 1)
    assert e.value.smallest == floor == 16 * B * T * 64 * 4
    assert plan_remat(profile, floor).block_bytes == 0


def test_auto_budget_breakdown_closed_form():
    cfg = load_config(None, ["model=tiny", "mesh.fsdp=8", "train.batch_size=16", "train.seq_len=64"])
    profile = profile_block(cfg.model, 16, 64, {"fsdp": 8}, peak_flops=5e10)
    b = memory_breakdown(cfg, {"fsdp": 8}, 2**30, profile)
    m = cfg.model
    # fsdp shards every weight along embed (d_model = 64, divisible by 8); norms are replicated.
    norms = (2 * m.n_layers + 1) * m.d_model
    params = (param_count(m) - norms) * 4 / 8 + norms * 4
    assert b["parameters"] == pytest.approx(params) and b["optimizer"] == pytest.approx(2 * params)
    logits = 3 * 4 * 16 * 64 * m.vocab_size / 8  # float32, batch split 8 ways
    blocks = 2 * sum(op.bytes for op in profile.operators if op.needed)
    assert b["working"] == pytest.approx(logits + blocks + 0.1 * 2**30)
    assert b["activations"] == pytest.approx(2**30 - 4 * params - b["working"])


def test_remat_policy_names():
    cp = jax.checkpoint_policies
    assert remat_policy("none") is None and remat_policy("full") == "full"
    assert remat_policy("dots_saveable") is cp.dots_saveable
    assert remat_policy("save:attn_out")(jax.ad_checkpoint.checkpoint_name.__globals__["name_p"], None, name="attn_out")
    for bad, msg in (
        ("dotz", "train.remat='dotz' is unknown"),
        ("save:", "names no checkpoint tags"),
        ("auto", "resolve_remat_policy"),
    ):
        with pytest.raises(ConfigError, match=msg):
            remat_policy(bad)


def test_trainer_with_auto_remat(tmp_path):
    from jaxdist.resolve import resolve
    from jaxdist.train.trainer import Trainer

    common = [
        "model=tiny",
        "train.batch_size=16",
        "train.seq_len=64",
        f"train.runs_dir={tmp_path}",
        "data.max_bytes=200000",
        "checkpoint.enabled=false",
        "train.tensorboard=false",
    ]
    cfg = load_config(
        None,
        [
            *common,
            "train.remat=auto",
            "train.remat_budget_bytes=400000",  # 3 MB let the plan save everything on 8 devices: no remat at all
            "train.remat_verify=false",  # the prediction alone chooses: tests/remat/test_verify.py closes the loop
        ],
    )
    with Trainer(resolve(cfg, jax.devices())) as trainer:
        plan = trainer.remat_plan
        assert plan is not None and plan.activation_bytes <= 400_000
        assert plan.profile.mesh_shape == tuple(sorted(dict(trainer.mesh.shape).items()))
        assert trainer.remat_policy is not None
        auto_peak = peak_of(trainer.compiled_train_step())[0]
    # The compiled step, not only the plan: against the same step under full remat (which keeps each block's input
    # alone), the bytes the plan's policy adds to the program's peak are at most what the plan saves beyond the
    # inputs (measured on XLA:CPU, 8 devices: 0.07 MB for a planned 0.33 MB; the step saving everything peaks
    # 1.68 MB above full remat), so a policy the step ignores or a plan that saves more than it says fails here.
    full = load_config(None, [*common, "train.remat=full"])
    full_peak = peak_of(Trainer.for_compiling(resolve(full, jax.devices()), jax.devices()).compiled_train_step())[0]
    inputs = plan.profile.n_layers * plan.profile.input_bytes
    assert 0 < auto_peak - full_peak <= plan.activation_bytes - inputs
    with pytest.raises(ConfigError, match="cannot be met"):
        Trainer(
            resolve(
                load_config(
                    None,
                    [
                        "model=tiny",
                        "train.remat=auto",
                        "train.remat_budget_bytes=1000",
                        f"train.runs_dir={tmp_path}",
                        "checkpoint.enabled=false",
                    ],
                ),
                jax.devices(),
            )
        )


def test_cli_remat_llama_8b(capsys):
    from jaxdist.cli import main

    assert main(["remat", "--model", "llama-8b", "--mesh", "meshes/h100x8.toml", "--budget", "20GiB"]) == 0
    out = capsys.readouterr().out
    for text in (
        "selected (auto)",
        "dots_with_no_batch_dims_saveable",
        "save q/k/v projections",
        "save attention output projection",
        "save everything but MLP",
        "per block:",
    ):
        assert text in out
    # nothing_saveable keeps only the block inputs: 32 layers x (32 x 128 tokens / 8 devices) x 4096 x bf16
    nothing = next(line for line in out.splitlines() if line.startswith("nothing_saveable"))
    assert "128.00 MiB" in nothing and nothing.rstrip().endswith("yes")


def test_cli_remat_budget_errors(capsys):
    from jaxdist.cli import main

    assert main(["remat", "--model", "tiny", "--budget", "1KiB"]) == 2
    assert "raise the budget to at least" in capsys.readouterr().err
    assert main(["remat", "--model", "tiny", "--budget", "lots"]) == 2
    assert "is not a size" in capsys.readouterr().err


def test_parse_bytes():
    from jaxdist.remat.command import parse_bytes

    assert parse_bytes("20GiB") == 20 * 2**30 and parse_bytes("512MB") == 512_000_000
    assert parse_bytes("1e9") == 10**9 and parse_bytes("1.5 KiB") == 1536
    for bad in ("-1GiB", "0", "12 parsecs"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)

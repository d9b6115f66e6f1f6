"""`jaxdist remat` at the edge (misspelt tags, a negative --budget, one device) and the selector's slack knob."""

import dataclasses

import jax
import pytest

from jaxdist.cli import main
from jaxdist.cluster import load_cluster
from jaxdist.config import ConfigError, load_config
from jaxdist.models.names import CHECKPOINT_NAMES
from jaxdist.remat import budget_range, compare_policies, format_comparison, plan_remat, policy_point, profile_block
from jaxdist.remat.command import run_remat
from jaxdist.remat.graph import evaluate
from jaxdist.remat.named import ALL_NAMES, remat_policy
from jaxdist.remat.plan import recompute_slack
from jaxdist.remat.policy import resolve_remat_policy
from jaxdist.remat.select import select_exact

B, T = 8, 32
SHARES = (0.1, 0.3, 0.5, 0.7, 0.9)  # of the range between saving nothing and saving everything useful


@pytest.fixture(scope="module")
def profile():
    return profile_block(load_config(None, ["model=tiny"]).model, B, T, {}, peak_flops=5e10)


@pytest.fixture(scope="module")
def optimum_plans(profile):
    return {share: plan_remat(profile, _budget(profile, share)) for share in SHARES}  # train.remat_slack's default: 0


def _budget(profile, share):
    lo, hi = budget_range(profile)
    return lo + share * (hi - lo)


# --------------------------------------------------------------------------- checks at the edge


def test_misspelt_checkpoint_names_are_a_config_error_at_load():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.remat=save:attn_outt,mlp_gatee"])
    assert str(e.value) == (
        "train.remat='save:attn_outt,mlp_gatee' names 'attn_outt', 'mlp_gatee', which the model does not tag: "
        f"use save: with some of {', '.join(CHECKPOINT_NAMES)}."
    )
    with pytest.raises(ConfigError, match="names 'attn_outt', which"):  # a good name beside a bad one
        load_config(None, ["train.remat=save:attn_out,attn_outt"])
    assert load_config(None, [f"train.remat={ALL_NAMES}"]).train.remat_spec.names == CHECKPOINT_NAMES


@pytest.mark.parametrize("argv", [["--budget", "-5MiB"], ["--budget=-5MiB"], ["--budget", "-.5e3"], ["--budget", "0"]])
def test_remat_budget_negative_or_zero_is_one_sentence(argv, capsys):
    assert main(["remat", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxdist: budget '") and "' is not a positive size: it is the bytes per device" in err
    assert len(err.splitlines()) == 1


def test_remat_on_the_one_device_cluster_and_a_smaller_mesh(capsys):
    assert load_cluster("cpu-1").n_devices == 1
    cfg = load_config(None, ["model=tiny", "mesh.cluster=cpu-1", f"train.batch_size={B}", f"train.seq_len={T}"])
    assert run_remat(cfg, "1MiB") == 0
    out = capsys.readouterr().out
    assert "cluster cpu-1" in out and "mesh one device" in out and "note:" not in out
    # the same mesh asked for explicitly on the 8-device cluster: the same plan, with a note on the 7 left unused
    cfg8 = load_config(None, ["model=tiny", "mesh.data=1", f"train.batch_size={B}", f"train.seq_len={T}"])
    assert run_remat(cfg8, "1MiB") == 0
    out8 = capsys.readouterr().out
    assert out8.splitlines()[0] == (
        "note: mesh data=1 runs on the first 1 of the 8 devices; 7 left unused (mesh.data=-1 uses them all)"
    )
    assert (
        out8.split("\n\n", 1)[1].replace("cpu-8", "cpu-1").split("exact (MILP)")[0]
        == out.split("\n\n", 1)[1].split("exact (MILP)")[0]
    )


# --------------------------------------------------------------------------- the slack knob


def test_slack_zero_is_the_exact_optimum_at_several_budgets(profile, optimum_plans):
    graph, _ = profile.graph()
    for share, plan in optimum_plans.items():
        budget = _budget(profile, share)
        optimum = select_exact(graph, budget / profile.n_layers - profile.input_bytes)
        assert plan.selection.time == pytest.approx(optimum.time, rel=1e-9, abs=1e-15), share
        assert plan.activation_bytes <= budget
        assert plan.recompute_time == plan.optimum_recompute_time
        assert plan.gap_to_optimum() == "the least recompute at this budget"


def test_slack_three_percent_is_the_old_choice(profile, optimum_plans):
    graph, _ = profile.graph()
    slack = recompute_slack(profile, 0.03)
    leaner = 0
    for share, optimum in optimum_plans.items():
        plan = plan_remat(profile, _budget(profile, share), slack_share=0.03)
        # the old rule: the fewest bytes within 3% of the save-nothing recompute above the optimum
        assert plan.selection.time <= optimum.selection.time + slack * (1 + 1e-9)
        assert plan.selection.bytes <= optimum.selection.bytes
        assert plan.optimum_recompute_time == pytest.approx(optimum.recompute_time)
        assert evaluate(graph, plan.selection.saved_units).time == pytest.approx(plan.selection.time)
        if plan.selection.bytes < optimum.selection.bytes:
            leaner += 1
            assert "more recompute than the optimum at this budget" in plan.gap_to_optimum()
            assert "train.remat_slack=0.03" in plan.gap_to_optimum()
    assert leaner >= 2  # the slack does something: fewer bytes at two budgets or more


def test_train_remat_slack_reaches_the_selector(profile):
    base = [
        "model=tiny",
        "train.remat=auto",
        "train.remat_budget_bytes=400000",
        f"train.batch_size={B}",
        f"train.seq_len={T}",
    ]
    _, plan = resolve_remat_policy(load_config(None, base + ["train.remat_slack=0.03"]), {"data": 1})
    assert plan.slack_share == 0.03 and plan.saved == plan_remat(profile, 400000, slack_share=0.03).saved
    for bad in ("-0.1", "1.5", "nan"):
        with pytest.raises(ConfigError, match=f"train.remat_slack={bad} is not a share between 0 and 1"):
            load_config(None, [f"train.remat_slack={bad}"])


# --------------------------------------------------------------------------- the comparison table


def test_comparison_has_none_and_all_names_rows(profile, optimum_plans):
    plan = optimum_plans[0.5]
    rows = {r.name: r for r in compare_policies(profile, plan)}
    none, every = rows["none (no remat)"], rows["save every checkpoint name"]
    assert none.recompute_time == 0 and none.activation_bytes == rows["everything_saveable"].activation_bytes
    ref = policy_point(profile, "ref", jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES))
    assert (every.activation_bytes, every.recompute_time) == (ref.activation_bytes, ref.recompute_time)
    assert 0 < every.recompute_time < rows["nothing_saveable"].recompute_time
    text = format_comparison(compare_policies(profile, plan))
    assert f"  save every checkpoint name: train.remat={ALL_NAMES}" in text
    assert "  none (no remat): train.remat=none" in text


def test_group_rows_say_what_they_hold_and_plans_say_their_names(profile, optimum_plans):
    table = optimum_plans[0.5].table(by_group=True)
    assert "a group is named by the checkpoint_name tag that ends it" in table
    assert "\n  query_proj: 1 operator: dot_general\n" in table
    assert all(f"\n  {g}: " in table for g in {op.group for op in profile.operators})
    assert plan_remat(profile, budget_range(profile)[0]).names_equivalent == "full"
    for plan in optimum_plans.values():  # on tiny these save untagged values too: no save: list says the same
        assert plan.names_equivalent is None
        assert any(s and not op.tag for op, s in zip(profile.operators, plan.saved))
    # a selection of tagged values only is spelled as those names, in the block's order
    tagged = dataclasses.replace(
        optimum_plans[0.5], saved=tuple(op.tag in ("mlp_gate", "attn_out") for op in profile.operators)
    )
    assert tagged.names_equivalent == "save:attn_out,mlp_gate"
    assert tuple(bool(x) for x in profile.evaluate(remat_policy(tagged.names_equivalent)).saved) == tagged.saved

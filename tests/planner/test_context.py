"""The planner and the context axis: memory per device, ring transfers, refusals as constraints, the choice."""

import dataclasses
import subprocess
import sys
import tomllib

import jax
import pytest

from jaxdist.cluster import load_cluster
from jaxdist.config import load_config
from jaxdist.measure.steps import measure_step, measurement_config
from jaxdist.planner import plan
from jaxdist.planner.candidates import Strategy, candidates, mesh_allowed, strategy_of
from jaxdist.planner.cluster import cluster_view
from jaxdist.planner.computation import computation_view
from jaxdist.planner.cost import collectives, estimate, memory, memory_terms
from jaxdist.planner.plan import PlanError
from jaxdist.planner.ring import ring_block

NO_CONTEXT = ("data", "fsdp", "tensor", "expert", "pipeline")


@pytest.fixture(autouse=True)
def no_saved_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_CALIBRATION_DIR", str(tmp_path / "calibration"))


def _model(*overrides):
    return load_config(None, list(overrides)).model


def test_sequence_sharded_terms_halve_and_the_state_does_not():
    view = computation_view(_model("model=small", "model.attention=blockwise"), 4096)
    t = {c: memory_terms(view, Strategy(context=c), 1) for c in (1, 2, 4)}
    for c in (2, 4):
        assert t[c].activations == pytest.approx(t[1].activations / c)  # kept activations: T / c tokens each
        assert t[c].scaled["logits_working"] == pytest.approx(t[1].scaled["logits_working"] / c)
        assert t[c].state == t[1].state  # weights, gradients, optimizer state: replicated over context
        assert t[c].ring > 0 and t[1].ring == 0
    # xla attention under context runs the blockwise ring: no [T, T] scores are kept
    xla = computation_view(_model("model=small", "model.attention=xla"), 4096)
    assert memory_terms(xla, Strategy(context=2), 1).activations == t[2].activations
    assert memory_terms(xla, Strategy(), 1).activations > 10 * t[1].activations


def test_ring_transfers_count_and_bytes():
    m = _model("model=small", "model.attention=blockwise")
    view = computation_view(m, 4096)
    for c, remat, forwards in ((4, "none", 1), (8, "full", 2)):
        items = {i.name: i for i in collectives(view, Strategy(context=c, remat=remat), 1)}
        fwd, bwd = items["context ring k/v (forward)"], items["context ring k/v + grads (backward)"]
        kv_block = 2 * 4096 // c * m.n_kv_heads * m.head_dim * 4  # k and v of one device, float32
        assert fwd.bytes == kv_block and fwd.count == (c - 1) * m.n_layers * forwards
        # backward: c - 1 hops of k/v and c hops of their float32 gradients
        assert bwd.total_bytes == pytest.approx((c - 1) * m.n_layers * kv_block + c * m.n_layers * 2 * kv_block)
        # weights are replicated over context: their gradients are reduced over it
        assert items["gradient reduce"].axes == ("data", "fsdp", "context") and items["gradient reduce"].group == c
    assert not any("context" in i.name for i in collectives(view, Strategy(data=1), 1))


def test_a_hop_is_exposed_only_by_what_its_transfer_exceeds_the_compute():
    view = computation_view(_model("model=small", "model.attention=blockwise"), 16384)
    spec = load_cluster("cpu-8")
    slow = cluster_view(dataclasses.replace(spec, intra_node_bandwidth=1e3))
    fast = cluster_view(dataclasses.replace(spec, intra_node_bandwidth=1e15, intra_node_latency=0.0))
    s = Strategy(context=4)
    hops = {c.name: c for c in estimate(view, fast, s, 1).comm}
    assert hops["context ring k/v (forward)"].seconds == 0.0  # hidden behind the block's compute
    e = estimate(view, slow, s, 1)
    ring = [c for c in e.comm if c.name.startswith("context ring")]
    compute = sum(c.count * c.overlap_flops for c in ring) / (slow.peak_flops(view.model.dtype) * slow.efficiency)
    transfer = sum(c.count * c.bytes / slow.intra_node_bandwidth for c in ring)
    assert sum(c.seconds for c in ring) == pytest.approx(transfer - compute, rel=1e-3)


def test_refusals_are_constraints_of_the_search():
    dense = computation_view(_model("model=small"), 4096)
    base = dict(data=1, fsdp=1, tensor=1, expert=1, pipeline=1)
    assert mesh_allowed(dense, {**base, "context": 2, "pipeline": 2}, 1, 8).startswith("context=2 does not run with")
    moe = computation_view(_model("model=moe-tiny"), 64)
    assert "MoE" in mesh_allowed(moe, {**base, "context": 2}, 1, 8)
    odd = computation_view(_model("model=small"), 4104)  # 4104 = 8 * 513: splits into 2*4 chunks, not 2*8
    assert mesh_allowed(odd, {**base, "context": 4}, 1, 8) is None
    assert "2*context=16" in mesh_allowed(odd, {**base, "context": 8}, 1, 8)
    assert {s.context for s in candidates(odd, 8, 1, 8, 1)} == {1, 2, 4}
    assert all(s.context == 1 or s.pipeline == 1 for s in candidates(dense, 8, 1, 8, 1))
    assert {s.context for s in candidates(moe, 8, 1, 8, 8)} == {1}


def test_planner_picks_context_when_only_it_fits():
    m = _model("model=llama-1b")
    with pytest.raises(PlanError, match="does not fit"):
        plan(m, "h100x8", batch_size=1, seq_len=65536, axes=NO_CONTEXT)
    p = plan(m, "h100x8", batch_size=1, seq_len=65536)
    assert p.best.fits and p.best.strategy.context > 1
    assert p.to_config().mesh.context == p.best.strategy.context


def test_planner_keeps_context_at_one_when_the_sequence_fits_without():
    m = _model("model=llama-1b")
    p = plan(m, "h100x8", batch_size=8, seq_len=4096)
    q = plan(m, "h100x8", batch_size=8, seq_len=4096, axes=NO_CONTEXT)
    assert p.best.strategy.context == 1 and p.best.step_time == q.best.step_time
    assert any(e.strategy.context > 1 for e in p.ranked)  # it was considered, and is slower


def test_cli_plan_names_the_context_axis(tmp_path):
    args = [
        "plan",
        "--model",
        "llama-1b",
        "--cluster",
        "h100x8",
        "train.batch_size=1",
        "train.seq_len=65536",
        "model.max_seq_len=65536",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", *args, "--axes", "data,fsdp,context,tensor", "--top", "3"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    chosen = next(line for line in out.stdout.splitlines() if line.startswith("chosen:"))
    assert "context=" in chosen and "context ring k/v" in out.stdout
    assert tomllib.loads((tmp_path / "plan.toml").read_text())["mesh"]["context"] > 1


# Compiled step (Trainer, adam, blockwise attention) of the tiny model at 1024 tokens, blocks of 128, batch 1,
# on 1, 2 and 4 devices; tolerance 10 % (the fitted memory model's in-sample worst is 8 %).  Measured here:
# prediction / compiled = 0.933, 1.063, 0.980 (17.2 / 18.5, 11.3 / 10.6, 7.1 / 7.2 MiB).  Context 2 exercises
# every ring term and is the one run; 1 is the model without the ring (tests/planner/test_measured.py checks it
# against compiled steps) and 4 only compiles twice as many hops of the same terms (both were `slow`, run nowhere,
# and removed: issue 42).
@pytest.mark.parametrize("context", [2])
def test_memory_against_the_compiled_step(context, tmp_path):
    seq = 1024
    cfg = measurement_config(
        [
            "model=tiny",
            f"model.max_seq_len={seq}",
            f"train.seq_len={seq}",
            "model.attention=blockwise",
            "model.attention_block=128",
            f"mesh.context={context}",
            "mesh.data=1",
            "train.batch_size=1",
        ],
        str(tmp_path),
    )
    assert ring_block(seq, context, 128) == 128
    measured = measure_step(cfg, jax.devices()[:context]).memory_bytes
    predicted = memory(computation_view(cfg.model, seq), strategy_of(cfg, context), 1).total
    assert abs(predicted / measured - 1) < 0.10, (predicted, measured)

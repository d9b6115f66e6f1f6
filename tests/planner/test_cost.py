"""Cost model: closed forms, exact parameter bytes under the real shardings, monotone memory."""

import math

import jax
import pytest
from jax.sharding import NamedSharding

from jaxdist.cluster import load_cluster
from jaxdist.config import MeshConfig, load_config
from jaxdist.models import create_abstract
from jaxdist.parallel.mesh import build_mesh
from jaxdist.parallel.rules import logical_to_spec
from jaxdist.planner.candidates import Strategy
from jaxdist.planner.cluster import Calibration, cluster_view
from jaxdist.planner.computation import computation_view
from jaxdist.planner.cost import collective_seconds, collectives, estimate, memory


def test_ring_collective_times():
    bw, lat = 1e9, 1e-5
    assert collective_seconds("all-reduce", 8e6, 8, bw, lat) == pytest.approx(14 * lat + 2 * 7 / 8 * 8e6 / bw)
    assert collective_seconds("all-gather", 8e6, 4, bw, lat) == pytest.approx(3 * lat + 3 / 4 * 8e6 / bw)
    assert collective_seconds("collective-permute", 1e6, 2, bw, lat) == pytest.approx(lat + 1e6 / bw)
    assert collective_seconds("all-reduce", 1e6, 1, bw, lat) == 0.0


@pytest.mark.parametrize("mesh", [dict(data=8), dict(fsdp=8), dict(data=2, fsdp=2, tensor=2), dict(fsdp=2, tensor=4)])
def test_parameter_bytes_equal_the_real_shardings(mesh):
    m = load_config(None, ["model=small"]).model
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 1, "pipeline": 1, **mesh}
    jmesh = build_mesh(MeshConfig(**sizes), jax.devices()[:8])
    _, abstract, names = create_abstract(m)
    per_device = jax.tree.map(
        lambda n, a: (
            math.prod(NamedSharding(jmesh, logical_to_spec(n, mesh=jmesh, shape=a.shape)).shard_shape(a.shape)) * 4
        ),
        names,
        abstract,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    exact = sum(jax.tree.leaves(per_device))
    mem = memory(computation_view(m, 128), Strategy(**sizes), 32)
    assert mem.params == exact and mem.optimizer == 2 * exact


def test_data_parallel_collectives_closed_form():
    m = load_config(None, ["model=small"]).model
    d, f, h, kv, hd, v, L = m.d_model, m.d_ff, m.n_heads, m.n_kv_heads, m.head_dim, m.vocab_size, m.n_layers
    block = d * h * hd * 2 + 2 * d * kv * hd + 3 * d * f + 2 * d
    for mb in (1, 2, 4):
        items = collectives(computation_view(m, 128), Strategy(data=8, microbatches=mb), 32)
        # Per microbatch: every block's gradients, then the embedding's two uses and the final norm.
        assert sum(c.total_bytes for c in items) == mb * 4 * (L * block + 2 * v * d + d)
        assert all(c.axes == ("data", "fsdp") and c.group == 8 for c in items)


def test_tensor_parallel_activation_all_reduces():
    m = load_config(None, ["model=small"]).model
    view = computation_view(m, 128)
    X = 32 // 4 * 128 * m.d_model * 4  # local rows x seq x width x float32
    for remat, per_layer in (("none", 7), ("full", 8)):
        items = collectives(view, Strategy(data=4, tensor=2, remat=remat), 32)
        (tp,) = [c for c in items if c.name == "tensor activation all-reduce"]
        assert (tp.bytes, tp.count, tp.group) == (X, per_layer * m.n_layers, 2)


def test_pipeline_bubble_is_the_closed_form():
    m = load_config(None, ["model=llama-8b"]).model
    view = computation_view(m, 2048)
    cl = cluster_view(load_cluster("h100x8"))
    for p, mb in ((2, 4), (4, 8), (8, 8)):
        e = estimate(view, cl, Strategy(data=8 // p, pipeline=p, microbatches=mb, schedule="1f1b", remat="full"), 64)
        critical = sum(c.seconds for c in e.comm if not c.overlappable)
        busy = e.compute_time + critical
        assert e.bubble_time / (busy + e.bubble_time) == pytest.approx((p - 1) / (mb + p - 1))


def test_memory_falls_with_remat_fsdp_and_microbatches():
    view = computation_view(load_config(None, ["model=llama-1b"]).model, 2048)
    total = lambda **kw: memory(view, Strategy(**kw), 64).total
    assert total(data=8) > total(data=8, remat="names") > total(data=8, remat="full")
    assert total(data=8) > total(data=4, fsdp=2) > total(fsdp=8)
    assert total(data=8, microbatches=1) > total(data=8, microbatches=4)
    a = memory(view, Strategy(data=8, remat="none"), 64).activations
    assert a == pytest.approx(2 * memory(view, Strategy(data=8, remat="none", microbatches=2), 64).activations)


def test_estimate_rejects_what_does_not_fit_with_the_reason():
    view = computation_view(load_config(None, ["model=llama-8b"]).model, 8192)
    cl = cluster_view(load_cluster("h100x8"), calibration=Calibration("x", efficiency=0.5))
    e = estimate(view, cl, Strategy(data=8), 64)
    assert not e.fits and "GiB per device" in e.reason and e.memory.total > e.memory_limit
    ok = estimate(view, cl, Strategy(fsdp=8, microbatches=8, remat="full"), 64)
    assert ok.fits and ok.reason == ""
    # Compute time is FLOPs over peak x efficiency.
    flops = 64 * 8192 * view.flops_per_token({"dense": view.blocks[0].flops_fwd}) / 8
    assert ok.compute_time == pytest.approx(flops / (0.5 * cl.peak_flops("bfloat16")), rel=1e-9)
    assert 0 < ok.mfu < 0.5


def test_pipeline_closed_forms_match_the_schedules_module():
    """In-flight microbatches and bubble share equal jaxdist.parallel.schedule's closed forms (issue #4)."""
    schedule = pytest.importorskip("jaxdist.parallel.schedule")
    view = computation_view(load_config(None, ["model=small"]).model, 128)
    cl = cluster_view(load_cluster("cpu-8"))
    for kind in ("gpipe", "1f1b"):
        for p, mb in ((2, 1), (2, 8), (4, 4), (4, 16)):
            s = Strategy(data=8 // p, pipeline=p, microbatches=mb, schedule=kind)
            per_microbatch = memory(
                view, Strategy(data=8 // p, pipeline=p, microbatches=mb, schedule="1f1b"), 16 * mb
            ).activations / min(p, mb)
            assert memory(view, s, 16 * mb).activations / per_microbatch == pytest.approx(
                schedule.peak_in_flight_formula(kind, p, mb)
            )
            e = estimate(view, cl, s, 16 * mb)
            busy = e.compute_time + sum(c.seconds for c in e.comm if not c.overlappable)
            assert e.bubble_time / (busy + e.bubble_time) == pytest.approx(schedule.bubble_formula(kind, p, mb))


def test_a_remat_choice_from_outside_is_costed_by_what_it_keeps():
    from jaxdist.planner import plan
    from jaxdist.planner.candidates import REMAT_NAMES, RematChoice

    attention_only = RematChoice(
        "attention",
        "save:query_proj,key_proj,value_proj,attn_context",
        ("query_proj", "key_proj", "value_proj", "attn_context"),
        0.5,
    )
    m = load_config(None, ["model=small"]).model
    view = computation_view(m, 128)
    p = plan(m, "cpu-8", batch_size=32, seq_len=128, remat=[REMAT_NAMES, attention_only], enumerate_all=True)
    assert {e.strategy.remat for e in p.ranked} == {"names", "attention"}
    mem = memory(view, Strategy(data=8, remat="attention"), 32)
    full = memory(view, Strategy(data=8, remat="full"), 32)
    h, kv, hd = m.n_heads, m.n_kv_heads, m.head_dim
    # The block input plus query, key, value and context, float32, for 4 x 128 tokens per device per block.
    extra = m.n_layers * 4 * 128 * 4 * (2 * h * hd + 2 * kv * hd)
    assert mem.activations - full.activations == extra

"""Search over evaluation points against exhaustive enumeration; planning large models; known practice."""

import random
import time

import pytest

from jaxdist.cluster import ClusterSpec, load_cluster
from jaxdist.config import ModelConfig, load_config
from jaxdist.models.arithmetic import param_count
from jaxdist.planner import PlanError, plan
from jaxdist.planner.search import objective

AXES = ("data", "fsdp", "tensor", "pipeline")


@pytest.fixture(autouse=True)
def no_saved_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXDIST_CALIBRATION_DIR", str(tmp_path))


def random_case(rng: random.Random):
    heads = rng.choice([8, 16, 32, 64])
    model = ModelConfig(
        preset="random",
        vocab_size=rng.choice([32000, 50304, 128256]),
        d_model=heads * 128,
        n_layers=rng.choice([8, 12, 16, 24, 32, 48]),
        n_heads=heads,
        n_kv_heads=rng.choice([h for h in (1, 2, 4, 8) if heads % h == 0]),
        head_dim=128,
        d_ff=heads * 128 * rng.choice([3, 4]),
        max_seq_len=4096,
        dtype="bfloat16",
    )
    per_node, nodes = rng.choice([4, 8]), rng.choice([2, 4, 8, 16])
    spec = ClusterSpec(
        name="random",
        device_kind="gpu",
        nodes=nodes,
        devices_per_node=per_node,
        memory_bytes=rng.choice([40, 80, 141]) * 10**9,
        peak_flops_bf16=989e12,
        peak_flops_fp32=67e12,
        intra_node_bandwidth=rng.choice([150e9, 450e9]),
        inter_node_bandwidth=rng.choice([12.5e9, 25e9, 50e9]),
        intra_node_latency=3e-6,
        inter_node_latency=1e-5,
    )
    return model, spec, nodes * per_node * rng.choice([1, 2, 4, 8]), rng.choice([1024, 2048, 4096])


def test_search_finds_the_exhaustive_optimum_with_a_tenth_of_the_evaluations():
    rng = random.Random(2024)
    cases = 0
    while cases < 30:
        model, spec, batch, seq = random_case(rng)
        try:
            full = plan(model, spec, batch_size=batch, seq_len=seq, axes=AXES, enumerate_all=True)
        except PlanError:
            continue  # nothing fits: no optimum to find
        if full.space < 1000:
            continue
        found = plan(model, spec, batch_size=batch, seq_len=seq, axes=AXES)
        assert objective(found.best) == objective(full.best), (model, spec, batch, seq)
        assert found.evaluations <= 0.10 * full.space, (found.evaluations, full.space)
        cases += 1


def test_a_96_layer_175b_model_on_1024_gpus_plans_in_under_200_evaluations():
    """The search's cost counted, not timed: it evaluated 99 strategies here (0.08 s of CPU, 0.44 s of wall time
    at load 12 on 2 cores); 200 leaves 2x for changes to the search, and the CPU bound of 10 s over 100x for a
    slow host (CPU time: the machine is shared, so wall time would measure the other processes)."""
    gpt3 = ModelConfig(
        preset="gpt-175b",
        vocab_size=50304,
        d_model=12288,
        n_layers=96,
        n_heads=96,
        n_kv_heads=96,
        head_dim=128,
        d_ff=32768,
        max_seq_len=2048,
        tie_embeddings=False,
        dtype="bfloat16",
    )
    spec = ClusterSpec(**{**load_cluster("h100x64").__dict__, "name": "h100x1024", "nodes": 128})
    t0 = time.process_time()
    p = plan(gpt3, spec, batch_size=1536, seq_len=2048, axes=AXES)
    assert p.evaluations <= 200 and time.process_time() - t0 < 10, p.evaluations
    assert p.best.fits and p.best.strategy.n_devices == 1024
    assert 170e9 < param_count(p.model) < 180e9  # SwiGLU with d_ff = 8/3 d: GPT-3's size


def test_llama_70b_on_8_nodes_keeps_tensor_parallelism_inside_a_node():
    m = load_config(None, ["model=llama-70b"]).model
    p = plan(m, "h100x64", batch_size=64, seq_len=4096)
    best = p.best
    assert best.fits and best.memory.total <= 0.9 * 85_520_809_984
    assert best.strategy.tensor * best.strategy.pipeline <= 8 and best.strategy.tensor > 1
    assert best.strategy.n_devices == 64
    # The tensor all-reduces use NVLink; only data/fsdp collectives cross nodes.
    assert all(c.link == "intra" for c in best.comm if "tensor" in c.axes)
    assert any(c.link == "inter" for c in best.comm)


def test_a_model_too_large_for_the_cluster_names_the_memory_it_needs():
    m = load_config(None, ["model=llama-70b"]).model
    with pytest.raises(PlanError) as err:
        plan(m, "h100x8", batch_size=8, seq_len=4096)
    msg = str(err.value)
    assert "does not fit on h100x8" in msg and "GiB per device" in msg and msg.endswith("more memory.")
    needed = float(msg.split("the least memory any plan needs is ")[1].split(" GiB")[0])
    # At least the fully sharded fp32 weights, gradients and Adam state: 16 bytes per parameter / 8 devices.
    assert needed > 16 * param_count(m) / 8 / 2**30

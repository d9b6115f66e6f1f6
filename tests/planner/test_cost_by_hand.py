"""The cost model's parts worked out by hand for the tiny model: every collective of a step, the memory terms, the
link each collective takes and the step time built from them.

The tiny model: d_model 64, 4 heads and 2 kv heads of 16, d_ff 128, vocab 260, 2 layers, tied, float32.  One
layer's matmul weights: wq 4,096, wk 2,048, wv 2,048, wo 4,096, gate, up and down 8,192 each (36,864 elements); its
norms 2 x 64.  The default rules split heads, kv_heads, mlp and vocab over ``tensor`` and the weights' embed
dimension over ``fsdp``.  A step of 16 sequences of 32 tokens; a block's output per device per microbatch is
``rows x 32 x 64 x 4`` bytes (X).
"""

from __future__ import annotations

import math

import pytest

from jaxdist.cluster import load_cluster
from jaxdist.config import load_config
from jaxdist.models.arithmetic import train_flops_per_token
from jaxdist.planner.candidates import Strategy
from jaxdist.planner.cluster import ClusterView
from jaxdist.planner.computation import computation_view
from jaxdist.planner.cost import (
    XLA_CPU_MEMORY,
    MemoryCoefficients,
    MemoryTerms,
    collective_seconds,
    collectives,
    crosses_nodes,
    estimate,
    in_flight,
    memory,
    memory_terms,
)

TINY = load_config(None, ["model=tiny"]).model
VIEW = computation_view(TINY, 32)
BATCH = 16
E = 260 * 64 * 4  # the embedding table's bytes


def _rows(items) -> list[tuple]:
    return [(c.name, c.kind, c.axes, c.group, c.bytes, c.count, c.overlappable, c.overlap_flops) for c in items]


def test_the_collectives_of_data_fsdp_tensor_and_microbatches():
    """data=2 x fsdp=2 x tensor=2, 2 microbatches, full remat: 2 rows per device per microbatch, X = 16,384 B;
    each layer's blocks run 2 x 2 = 4 times a step."""
    s = Strategy(data=2, fsdp=2, tensor=2, microbatches=2, remat="full")
    gather = ("fsdp weight gather", "all-gather", ("fsdp",), 2)
    # A weight's bytes after the gather: its elements over tensor (heads, kv_heads, mlp) x 4 B; forward and backward.
    assert _rows(collectives(VIEW, s, BATCH)) == [
        (*gather, 4096 / 2 * 4, 8, True, 0.0),  # wq
        (*gather, 2048 / 2 * 4, 8, True, 0.0),  # wk
        (*gather, 2048 / 2 * 4, 8, True, 0.0),  # wv
        (*gather, 4096 / 2 * 4, 8, True, 0.0),  # wo
        (*gather, 8192 / 2 * 4, 8, True, 0.0),  # w_gate
        (*gather, 8192 / 2 * 4, 8, True, 0.0),  # w_up
        (*gather, 8192 / 2 * 4, 8, True, 0.0),  # w_down
        # 2 forward, 5 backward (q, k, v, gate, up) and the attention output recomputed: 8 per block pass
        ("tensor activation all-reduce", "all-reduce", ("tensor",), 2, 16384.0, 8 * 4, False, 0.0),
        # the layer's gradient at full size over fsdp (36,864 / 2 elements on a device), then its shard over data
        ("gradient reduce (fsdp)", "all-reduce", ("fsdp",), 2, 36864 / 2 * 4, 4, True, 0.0),
        ("gradient reduce (data)", "all-reduce", ("data",), 2, 36864 / 4 * 4, 4, True, 0.0),
        ("gradient reduce (norms)", "all-reduce", ("data", "fsdp"), 4, 128 * 4, 4, True, 0.0),
        # the table: gathered over fsdp twice a step (hoisted out of the microbatch loop), vocab split over tensor
        ("embedding gather (fsdp)", "all-gather", ("fsdp",), 2, E / 2, 2, True, 0.0),
        ("embedding lookup all-reduce", "all-reduce", ("tensor",), 2, 16384.0, 2, False, 0.0),
        # the logits' softmax: the block output and 4 float32 per token (64 tokens)
        ("logits softmax all-reduce", "all-reduce", ("tensor",), 2, 16384.0 + 4 * 64 * 4, 2, False, 0.0),
        # the table's lookup and head gradients and the final norm's
        ("embedding gradient reduce", "all-reduce", ("data", "fsdp"), 4, E + E / 2 + 64 * 4, 2, True, 0.0),
    ]


def test_the_collectives_of_a_seq1f1b_pipeline():
    """data=4 x pipeline=2, seq1f1b in 2 chunks, 2 microbatches: X = 2 x 32 x 64 x 4, a chunk half of it; one layer
    per stage; no fsdp or tensor collectives (groups of one are left out)."""
    s = Strategy(data=4, pipeline=2, microbatches=2, schedule="seq1f1b", chunks=2, remat="full")
    assert in_flight(s) == (2, 3)
    assert _rows(collectives(VIEW, s, BATCH)) == [
        ("gradient reduce", "all-reduce", ("data", "fsdp"), 4, (36864 + 128) * 4, 2, True, 0.0),
        ("embedding gradient reduce", "all-reduce", ("data", "fsdp"), 4, E + E + 64 * 4, 2, True, 0.0),
        # forward activations and backward gradients of each chunk of each microbatch
        ("pipeline send/recv", "collective-permute", ("pipeline",), 2, 16384 / 2, 2 * 2 * 2, False, 0.0),
    ]


def test_the_experts_all_to_all():
    """moe-tiny on expert=2 x data=4: each token goes to 2 experts, there and back, forward and backward."""
    moe = load_config(None, ["model=moe-tiny"]).model
    view = computation_view(moe, 32)
    ((kind, count, rows),) = [(b.name, b.count, b.dispatch_rows) for b in view.blocks]
    assert (kind, count, rows) == ("moe", 2, 2)
    (a2a,) = [c for c in collectives(view, Strategy(data=4, expert=2), BATCH) if c.kind == "all-to-all"]
    X = 16 // 8 * 32 * moe.d_model * 4
    assert _rows([a2a]) == [("expert all-to-all", "all-to-all", ("expert",), 2, X * 2, 4 * 2, False, 0.0)]


@pytest.mark.parametrize(
    "mesh,want",
    [
        # fsdp alone: one reduce of the whole gradient (36,864 / 8 x 8 gathered, and the norms)
        (dict(fsdp=8), [("gradient reduce", ("data", "fsdp"), 8, (36864 + 128) * 4)]),
        # tensor=4 does not divide the 2 kv heads: wk and wv stay whole (4,096 / 4 + 2 x 2,048 + 4,096 / 4 + 3 x
        # 8,192 / 4 = 12,288 elements)
        (dict(fsdp=2, tensor=4), [("gradient reduce", ("data", "fsdp"), 2, (12288 + 128) * 4)]),
        # fsdp and a context ring without data: the shard is reduced over context (weights replicated over it)
        (
            dict(fsdp=2, context=2, data=1, tensor=2),
            [
                ("gradient reduce (fsdp)", ("fsdp",), 2, 36864 / 2 * 4),
                ("gradient reduce (data)", ("data", "context"), 2, 36864 / 4 * 4),
                ("gradient reduce (norms)", ("data", "fsdp", "context"), 4, 128 * 4),
            ],
        ),
        (
            dict(data=2, context=2, tensor=2),
            [("gradient reduce", ("data", "fsdp", "context"), 4, (36864 / 2 + 128) * 4)],
        ),
    ],
)
def test_the_gradient_reduces_follow_fsdp_data_and_context(mesh, want):
    got = [c for c in collectives(VIEW, Strategy(**mesh), BATCH) if c.name.startswith("gradient")]
    assert [(c.name, c.axes, c.group, c.bytes) for c in got] == want
    assert {c.count for c in got} == {2}  # once per layer, one microbatch
    (emb,) = [c for c in collectives(VIEW, Strategy(**mesh), BATCH) if c.name == "embedding gradient reduce"]
    assert emb.axes == ("data", "fsdp") + (("context",) if mesh.get("context", 1) > 1 else ())


def test_a_single_device_has_no_collectives():
    assert collectives(VIEW, Strategy(), BATCH) == []


def test_in_flight_per_schedule():
    assert in_flight(Strategy()) == (1, 1)
    assert in_flight(Strategy(pipeline=2, microbatches=8, schedule="gpipe")) == (1, 8)
    assert in_flight(Strategy(pipeline=4, microbatches=8, schedule="1f1b")) == (1, 4)
    assert in_flight(Strategy(pipeline=4, microbatches=2, schedule="1f1b")) == (1, 2)
    # seq1f1b: the chunks of one microbatch plus one per later stage, at most every chunk of the step
    assert in_flight(Strategy(pipeline=4, microbatches=8, schedule="seq1f1b", chunks=2)) == (2, 5)
    assert in_flight(Strategy(pipeline=4, microbatches=1, schedule="seq1f1b", chunks=2)) == (2, 2)


def test_which_axes_cross_nodes():
    """hybrid_shapes' layout: data spans gcd(data, nodes) nodes, fsdp the rest of them; other axes stay inside."""
    assert not crosses_nodes(("data", "fsdp"), Strategy(data=8), 1)
    two = 2
    assert crosses_nodes(("data",), Strategy(data=2, fsdp=4), two)
    assert not crosses_nodes(("fsdp",), Strategy(data=2, fsdp=4), two)
    assert crosses_nodes(("fsdp",), Strategy(data=1, fsdp=8), two)
    assert not crosses_nodes(("data",), Strategy(data=1, fsdp=8), two)
    assert crosses_nodes(("data", "fsdp"), Strategy(data=1, fsdp=8), two)
    assert crosses_nodes(("fsdp",), Strategy(data=2, fsdp=4), 4)  # 2 nodes of data, fsdp over the other 2
    assert not crosses_nodes(("tensor",), Strategy(tensor=8), two)
    assert not crosses_nodes(("tensor", "pipeline"), Strategy(data=2, tensor=4), two)


def _two_nodes() -> ClusterView:
    spec = load_cluster("cpu-2x4")
    return ClusterView(
        spec=spec,
        nodes=2,
        devices_per_node=4,
        devices=tuple(range(8)),
        busy=(),
        efficiency=0.5,
        intra_node_bandwidth=1e10,
        intra_node_latency=1e-5,
        inter_node_bandwidth=1e9,
        inter_node_latency=1e-4,
        overlap=0.25,
        collective_overhead=3e-6,
        pass_overhead=2e-5,
    )


def test_the_estimate_assembled_by_hand():
    cl = _two_nodes()
    s = Strategy(data=2, fsdp=2, tensor=2, microbatches=2, remat="full")
    coeff = MemoryCoefficients(fixed=12345.0)
    e = estimate(VIEW, cl, s, BATCH, coeff=coeff)
    assert e.memory == memory(VIEW, s, BATCH, coeff) and e.memory.working > memory(VIEW, s, BATCH).working
    peak = cl.peak_flops("float32")
    # data spans the 2 nodes (gcd(2, 2)), fsdp and tensor stay inside one
    for c, raw in zip(e.comm, collectives(VIEW, s, BATCH), strict=True):
        inter = "data" in c.axes
        bw, lat = (1e9, 1e-4) if inter else (1e10, 1e-5)
        assert c.link == ("inter" if inter else "intra"), c
        assert c.seconds == pytest.approx(c.count * collective_seconds(c.kind, c.bytes, c.group, bw, lat, 3e-6))
        assert (c.name, c.bytes, c.count) == (raw.name, raw.bytes, raw.count)
    assert e.extra["collectives"] == sum(c.count for c in e.comm) == 7 * 8 + 32 + 3 * 4 + 2 + 2 + 2 + 2
    # compute: 128 tokens a device (512 over data x fsdp), each layer 3 passes of FLOPs plus the full recompute,
    # the head's 3, over tensor; 2 microbatches x (head 2 + 2 layers x 3 passes) block passes
    f, h = VIEW.blocks[0].flops_fwd, VIEW.head_flops_fwd
    assert e.flops_per_device == pytest.approx(128 * (2 * (3 * f + f) + 3 * h) / 2)
    assert e.extra["passes"] == 2 * (2 + 2 * 3) == 16
    assert e.compute_time == pytest.approx(e.flops_per_device / (peak * 0.5) + 16 * 2e-5)
    critical = sum(c.seconds for c in e.comm if not c.overlappable)
    hidden = sum(c.seconds for c in e.comm if c.overlappable)
    assert critical > 0 and hidden > 0.25 * e.compute_time  # both terms below are live
    assert e.comm_time == pytest.approx(critical + hidden - 0.25 * e.compute_time)
    assert e.bubble_time == 0 and e.step_time == pytest.approx(e.compute_time + e.comm_time)
    assert e.tokens_per_step == 512 and e.peak_flops == peak
    assert e.extra["model_flops_per_device"] == pytest.approx(512 * train_flops_per_token(TINY, 32) / 8)
    assert e.memory_limit == pytest.approx(0.9 * cl.memory_bytes) and e.fits and e.reason == ""


def test_a_pipeline_estimate_adds_its_bubble():
    cl = _two_nodes()
    s = Strategy(data=4, pipeline=2, microbatches=2, schedule="seq1f1b", chunks=2, remat="full")
    e = estimate(VIEW, cl, s, BATCH)
    critical = sum(c.seconds for c in e.comm if not c.overlappable)
    # 2 microbatches x (head 2 + 2 chunks x 1 layer per stage x 3 passes)
    assert e.extra["passes"] == 2 * (2 + 2 * 1 * 3) == 16
    assert e.bubble_time == pytest.approx((e.compute_time + critical) * (2 - 1) / (2 * 2))
    assert e.step_time == pytest.approx(e.compute_time + e.comm_time + e.bubble_time)
    # one layer per stage: a device computes half the layers on a quarter of the tokens
    f, h = VIEW.blocks[0].flops_fwd, VIEW.head_flops_fwd
    assert e.flops_per_device == pytest.approx(512 / 4 * (2 / 2 * (3 * f + f) + 3 * h))


def test_a_context_ring_estimate_counts_a_devices_tokens():
    e = estimate(VIEW, _two_nodes(), Strategy(data=2, context=2, tensor=2), BATCH)
    f, h = VIEW.blocks[0].flops_fwd, VIEW.head_flops_fwd
    assert e.flops_per_device == pytest.approx(512 / 2 / 2 * (2 * 3 * f + 3 * h) / 2)


def test_what_does_not_fit_says_by_how_much():
    cl = _two_nodes()
    s = Strategy(data=2, fsdp=2, tensor=2, microbatches=2, remat="full")
    total = memory(VIEW, s, BATCH).total
    e = estimate(VIEW, cl, s, BATCH, memory_fraction=total / cl.memory_bytes)
    assert e.memory_limit == total and e.fits  # exactly at the limit fits
    e = estimate(VIEW, cl, s, BATCH, memory_fraction=0.5 * total / cl.memory_bytes)
    assert not e.fits
    assert e.reason == f"needs {total / 2**30:.1f} GiB per device, {0.5 * total / 2**30:.1f} GiB usable"
    big = computation_view(load_config(None, ["model=llama-8b"]).model, 8192)
    e = estimate(big, cl, Strategy(data=8), 64)
    assert e.reason == f"needs {e.memory.total / 2**30:.1f} GiB per device, {0.9 * 2:.1f} GiB usable"


def test_the_memory_terms_by_hand():
    """data=2 x fsdp=2 x tensor=2, 2 microbatches, full remat: 64 tokens a device per microbatch."""
    s = Strategy(data=2, fsdp=2, tensor=2, microbatches=2, remat="full")
    t = memory_terms(VIEW, s, BATCH)
    # parameters on a device: the table 260 x 64 over tensor and fsdp, the final norm, 2 layers of 36,864 / 4
    # matmul elements and 128 norm elements
    local = 260 * 64 / 4 + 64 + 2 * (36864 / 4 + 128)
    assert (t.state.params, t.state.grads, t.state.optimizer) == (local * 4, local * 4, 2 * local * 4)
    assert t.activations == 2 * 64 * 64 * 4  # full remat keeps each layer's input: 64 floats a token
    assert t.batch == 16 // 4 * 33 * 4  # each sequence with its next-token target
    assert t.ring == 0
    working = t.scaled["layer_working:full"]
    assert t.scaled == {
        "layer_working:full": working,
        "microbatch_working": working,  # 2 microbatches: once more
        "logits_working": 64 * 130 * 4,  # float32 logits of a device's tokens, vocab over tensor
        "gathered_weights": 36864 / 2 * 4,  # one layer's weights gathered over fsdp
        "grad_copies": local * 4,
        "gathered_embedding": E,  # the whole table, split by fsdp and tensor
        "fixed": 1.0,
    }
    # One microbatch, no fsdp, tensor alone: no microbatch or gradient copies, no gathered weights.
    t1 = memory_terms(VIEW, Strategy(data=4, tensor=2), BATCH).scaled
    assert (t1["microbatch_working"], t1["grad_copies"], t1["gathered_weights"]) == (0.0, 0.0, 0.0)
    assert t1["gathered_embedding"] == E and t1["logits_working"] == 16 // 4 * 32 * 130 * 4
    t2 = memory_terms(VIEW, Strategy(data=4, fsdp=2), BATCH).scaled
    assert t2["gathered_embedding"] == E and t2["gathered_weights"] == 36864 * 4
    t8 = memory_terms(VIEW, Strategy(data=8), BATCH).scaled
    assert (t8["gathered_embedding"], t8["gathered_weights"]) == (0.0, 0.0)


def test_seq1f1b_keeps_the_chunks_keys_and_values():
    """data=4 x pipeline=2, seq1f1b in 2 chunks, 2 microbatches, full remat: stage 0 holds 3 chunks of layer input
    (16 tokens x 64 floats each) and the keys and values (2 x 32 floats a token) of the 2 microbatches it has
    started, whole."""
    s = Strategy(data=4, pipeline=2, microbatches=2, schedule="seq1f1b", chunks=2, remat="full")
    t = memory_terms(VIEW, s, BATCH)
    assert t.activations == 1 * 64 / 2 * 64 * 4 * 3 + 1 * 64 * (32 + 32) * 4 * 2


def test_memory_from_terms():
    t = memory_terms(VIEW, Strategy(data=2, context=2, tensor=2), BATCH)
    assert t.ring > 0
    m = t.memory(XLA_CPU_MEMORY)
    working = sum(
        (XLA_CPU_MEMORY.working("none") if k == "layer_working:none" else getattr(XLA_CPU_MEMORY, k)) * v
        for k, v in t.scaled.items()
        if k != "grad_copies"
    )
    assert m.working == pytest.approx(working + t.ring)
    # Terms without gradient copies (a fit's hand-made row): the gradients are the state's.
    bare = MemoryTerms(state=t.state, activations=0.0, batch=0.0, scaled={"fixed": 1.0})
    assert bare.memory(XLA_CPU_MEMORY).grads == t.state.grads
    assert math.isclose(bare.memory(MemoryCoefficients(fixed=7.0)).working, 7.0)


def test_a_group_of_one_costs_nothing_even_with_an_overhead():
    assert collective_seconds("all-reduce", 1e6, 1, 1e9, 1e-5, overhead=1e-3) == 0.0
    assert collective_seconds("all-gather", 1e6, 2, 1e9, 1e-5, overhead=1e-3) == pytest.approx(1e-3 + 1e-5 + 5e-4)


def test_seq1f1b_chunks_multiply_the_tensor_all_reduces():
    """data=2 x tensor=2 x pipeline=2, seq1f1b in 2 chunks: every block pass is over half a sequence, twice as
    many of them, each all-reducing half the bytes."""
    s = Strategy(data=2, tensor=2, pipeline=2, microbatches=2, schedule="seq1f1b", chunks=2, remat="full")
    (tp,) = [c for c in collectives(VIEW, s, BATCH) if c.name == "tensor activation all-reduce"]
    X = 16 // 2 // 2 * 32 * 64 * 4
    assert (tp.bytes, tp.count) == (X / 2, 8 * (1 * 2) * 2)  # 8 per pass x (1 layer x 2 microbatches) x 2 chunks


def test_a_vocabulary_tensor_does_not_divide_stays_whole():
    """tensor=8 does not divide the 260 ids: the table is not split over it (the rules keep a dimension whole
    when the axis does not divide it)."""
    s = Strategy(data=2, tensor=8)
    (emb,) = [c for c in collectives(VIEW, s, BATCH) if c.name == "embedding gradient reduce"]
    assert emb.bytes == E + E + 64 * 4
    assert memory_terms(VIEW, s, BATCH).scaled["logits_working"] == 16 // 2 * 32 * 260 * 4
    (emb4,) = [c for c in collectives(VIEW, Strategy(data=2, tensor=4), BATCH) if c.name == "embedding gradient reduce"]
    assert emb4.bytes == E + E / 4 + 64 * 4


def test_the_context_rings_transfers_are_exposed_beyond_their_blocks_compute():
    cl = _two_nodes()
    s = Strategy(data=2, context=2, tensor=2)
    e = estimate(VIEW, cl, s, BATCH)
    ring = [c for c in e.comm if c.name.startswith("context")]
    assert ring and all(c.overlappable is False and c.link == "intra" for c in ring)
    hides = [c for c in ring if c.overlap_flops > 0]
    assert hides
    for c in hides:
        one = collective_seconds(c.kind, c.bytes, c.group, 1e10, 1e-5, 3e-6)
        exposed = max(0.0, one - c.overlap_flops / (cl.peak_flops("float32") * 0.5))
        assert 0 < exposed < one and c.seconds == pytest.approx(c.count * exposed)


def test_data_that_does_not_fill_whole_nodes():
    """data=6 on 4 nodes: data spans gcd(6, 4) = 2 of them, fsdp the other factor 2."""
    assert crosses_nodes(("data",), Strategy(data=6, fsdp=4), 4)
    assert crosses_nodes(("fsdp",), Strategy(data=6, fsdp=4), 4)


def test_block_passes_without_remat():
    """No recompute: a block pass forward and one backward, 2 per layer; the head's 2."""
    e = estimate(VIEW, _two_nodes(), Strategy(data=2, fsdp=2, tensor=2, microbatches=2), BATCH)
    assert e.extra["passes"] == 2 * (2 + 2 * 2) == 12


def test_every_block_kind_keeps_its_activations():
    """moe-tiny with an MoE block every 2 layers: one dense and one MoE layer, each keeping its input under full
    remat (64 tokens a device x 64 floats)."""
    mixed = computation_view(load_config(None, ["model=moe-tiny", "model.moe.every=2"]).model, 32)
    assert [(b.name, b.count) for b in mixed.blocks] == [("dense", 1), ("moe", 1)]
    assert memory_terms(mixed, Strategy(data=8, remat="full"), BATCH).activations == 2 * 64 * 64 * 4


def test_a_working_term_is_looked_up_by_the_whole_remat_name():
    """``layer_working:<name>`` takes the coefficient of the whole name, whatever it holds."""
    t = memory_terms(VIEW, Strategy(data=8), BATCH)
    terms = MemoryTerms(state=t.state, activations=0.0, batch=0.0, scaled={"layer_working:save:a:b": 10.0})
    coeff = MemoryCoefficients(layer_working=(("save:a:b", 3.0), ("a", 5.0), ("b", 7.0)), default_working=1.0)
    assert terms.memory(coeff).working == 30.0

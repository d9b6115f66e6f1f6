"""The gradient communication plan (jaxdist.parallel.comm) against plans computed by hand."""

from __future__ import annotations

import dataclasses

import pytest

from jaxdist.cli import main
from jaxdist.cluster import load_cluster
from jaxdist.config import Config, ConfigError, apply_preset
from jaxdist.parallel.comm import (
    _fmt_bytes,
    block_grad_bytes,
    default_threshold,
    describe_xla_options,
    plan_comm,
    xla_gpu_options,
)

# The default model: d=128, 4 heads, 2 kv heads, head_dim 32, d_ff 384, vocab 260, 4 layers, tied, float32.
M = Config().model
# One layer's elements: two norms 256, wq 16384, wk 8192, wv 8192, wo 16384, gate/up/down 3 x 49152.
LAYER = 256 + 16384 + 8192 + 8192 + 16384 + 3 * 49152
CPU8 = load_cluster("cpu-8")


def test_block_bytes_by_hand():
    assert LAYER == 196864
    g = block_grad_bytes(M, {"data": 8})
    # Tied: the head bucket carries the final norm and the table's head gradient; the embed bucket its lookup's.
    table = 260 * 128 * 4
    assert g == {"layer": (LAYER * 4,) * 2, "head": (128 * 4 + table,) * 2, "embed": (table,) * 2}
    # tensor=2 halves everything but the norms; fsdp=2 then halves every weight with an embed dimension.
    g = block_grad_bytes(M, {"data": 2, "fsdp": 2, "tensor": 2})
    assert g["layer"] == ((256 + (LAYER - 256) // 2) * 4, (256 + (LAYER - 256) // 4) * 4)
    assert g["embed"] == (130 * 128 * 4, 130 * 64 * 4)
    assert g["head"] == (128 * 4 + 130 * 128 * 4, 128 * 4 + 130 * 64 * 4)
    untied = dataclasses.replace(M, tie_embeddings=False)
    assert block_grad_bytes(untied, {"tensor": 2})["head"] == ((128 + 128 * 130) * 4,) * 2


def test_buckets_by_hand():
    layer = LAYER * 4
    # Two layers fit: buckets head, layers 3-2, layers 1-0, embed; each issued after its last backward block.
    p = plan_comm(M, {"data": 8}, CPU8, 2 * layer)
    assert [b.blocks for b in p.buckets] == [("head",), ("layer 3", "layer 2"), ("layer 1", "layer 0"), ("embed",)]
    assert [b.issue_after for b in p.buckets] == [
        "backward of head",
        "backward of layer 2",
        "backward of layer 0",
        "backward of embed",
    ]
    assert [b.bytes for b in p.buckets] == [512 + 260 * 128 * 4, 2 * layer, 2 * layer, 260 * 128 * 4]
    assert {b.collective for b in p.buckets} == {"all-reduce(data)"}
    # Three layers fit but do not divide four: two per bucket.  Less than one layer: one per bucket.
    assert plan_comm(M, {"data": 8}, CPU8, 3 * layer).layers_per_bucket == 2
    assert plan_comm(M, {"data": 8}, CPU8, layer - 1).layers_per_bucket == 1
    assert len(plan_comm(M, {"data": 8}, CPU8, layer - 1).buckets) == 6
    assert plan_comm(M, {"data": 8}, CPU8, 4 * layer).layers_per_bucket == 4
    fsdp = plan_comm(M, {"data": 2, "fsdp": 4}, CPU8, 1)
    assert fsdp.buckets[1].collective == "reduce-scatter(fsdp) + all-reduce(data)"
    assert fsdp.buckets[1].reduced_bytes == (256 + (LAYER - 256) // 4) * 4
    # The lookup's gradient: one sum over data x fsdp (as automatic sharding sums it), then the shard's parts.
    assert fsdp.buckets[-1].collective == "reduce-scatter(data, fsdp) + all-gather(data)"
    assert plan_comm(M, {"fsdp": 8}, CPU8, 1).buckets[-1].collective == "reduce-scatter(fsdp)"


def test_pipeline_buckets_by_hand():
    # Two stages of two layers: each stage's buckets (k divides its 2 layers) after its last backward, the
    # shared weights' after the tick loop, summed over the stages first.
    layer = LAYER * 4
    p = plan_comm(M, {"data": 4, "pipeline": 2}, CPU8, 3 * layer)
    assert p.layers_per_bucket == 2
    assert [(b.blocks, b.issue_after) for b in p.buckets] == [
        (("layer 3", "layer 2"), "last backward of stage 1"),
        (("layer 1", "layer 0"), "last backward of stage 0"),
        (("head",), "the tick loop"),
        (("embed",), "the tick loop"),
    ]
    assert p.buckets[2].collective == "all-reduce(pipeline) + all-reduce(data)"
    assert p.buckets[3].collective == "all-reduce(pipeline) + all-reduce(data)"  # the lookup's, summed over stages
    assert plan_comm(M, {"data": 4, "pipeline": 4}, CPU8, 3 * layer).layers_per_bucket == 1


def test_default_threshold_from_the_cluster_file():
    # cpu-8: 10 x 8 devices x 1e-5 s x 1e10 B/s, one node: the intra-node link.
    p = plan_comm(M, {"data": 8}, CPU8)
    assert p.threshold_bytes == default_threshold(1e10, 1e-5, 8) == 8_000_000
    assert p.link == "intra" and p.layers_per_bucket == 4  # all 4 layers (4 x 787,456 B) fit in 8 MB
    # h100x64 with data=64 spans nodes: InfiniBand, 10 x 64 x 1e-5 s x 50e9 B/s = 320 MB.
    big = apply_preset(M, "llama-70b")
    p = plan_comm(big, {"data": 8, "fsdp": 8}, load_cluster("h100x64"))
    assert (p.link, p.threshold_bytes) == ("inter", 320_000_000)
    assert plan_comm(big, {"fsdp": 8}, load_cluster("h100x64")).link == "intra"


def test_xla_gpu_options_follow_the_plan():
    import jax  # the names are checked by the compiler: an unknown option is refused ("No such compile option")

    p = plan_comm(M, {"data": 2, "fsdp": 4}, CPU8, 2 * LAYER * 4)
    opts = xla_gpu_options(p)
    assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True
    largest = 2 * LAYER * 4  # a bucket of two layers, fsdp-gathered (bytes in)
    assert {v for k, v in opts.items() if k.endswith("_threshold_bytes")} == {largest}
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=" in describe_xla_options(opts)
    # These are fields of XLA's DebugOptions in this jaxlib, on any platform (a CPU compile takes them, unused).
    jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=opts)
    with pytest.raises(Exception, match="No such compile option"):
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options={"xla_gpu_no_such_option": 1})


def test_cli_prints_the_table(capsys):
    assert main(["comm", "plan", "mesh.data=2", "mesh.fsdp=4", f"train.grad_bucket_bytes={LAYER * 4}"]) == 0
    out = capsys.readouterr().out
    assert "layer 3 " in out and "reduce-scatter(fsdp) + all-reduce(data)" in out and "6 buckets" in out
    assert main(["comm", "plan", "mesh.data=3"]) == 2
    with pytest.raises(ConfigError):
        plan_comm(M, {"data": 8}, CPU8, -1)


@pytest.mark.parametrize(
    "over,match",
    [
        (["train.microbatches=2"], "without pipeline stages"),
        (["mesh.context=2"], "mesh.context=2"),
        (
            ["model=moe-tiny", "mesh.pipeline=2", "pipeline.schedule=gpipe", "train.microbatches=2"],
            "does not run an MoE model's gpipe stages",
        ),
        (["model=moe-tiny", "mesh.expert=2", "mesh.tensor=2", "mesh.expert_tensor=1"], "each expert on all of"),
        (["train.grad_bucket_bytes=-1"], "grad_bucket_bytes"),
    ],
)
def test_per_block_refuses_what_it_does_not_cover(over, match):
    from jaxdist.config import load_config  # validates what it loads

    with pytest.raises(ConfigError, match=match):
        load_config(None, ["train.grad_sync=per_block", *over])
    # Microbatches as pipeline microbatches are per_block's (jaxdist.parallel.pipeline_sync); an MoE model on
    # the expert axis is (jaxdist.parallel.grad_sync).
    load_config(None, ["train.grad_sync=per_block", "mesh.pipeline=2", "train.microbatches=2"])
    load_config(None, ["train.grad_sync=per_block", "model=moe-tiny", "mesh.expert=2", "mesh.tensor=2"])


def test_the_table_by_hand():
    """The printed plan, every figure worked out by hand: a layer is 196,864 float32 weights (787,456 B); fsdp=4
    quarters every weight with an embed dimension after the reduce-scatter (not the norms)."""
    p = plan_comm(M, {"data": 2, "fsdp": 4}, CPU8, 2 * LAYER * 4)
    assert p.reduce_devices == 8 and p.threshold_rule == "train.grad_bucket_bytes"
    assert all(type(b.bytes) is int and type(b.reduced_bytes) is int for b in p.buckets)
    assert p.table().splitlines() == [
        "gradient collectives per step: 4 buckets, 2 layer(s) per layer bucket; mesh data=2 fsdp=4; 8 devices per "
        "reduction over the intra-node link (10 GB/s, 10 us)",
        "threshold 1.502 MiB: train.grad_bucket_bytes",  # 2 x 787,456 B
        "  #  blocks                   bytes in  bytes out  collective                                    issued after",
        # the final norm (128) and the table's head gradient (260 x 128), then with the table's embed dim / 4
        "  0  head                    130.5 KiB     33 KiB  reduce-scatter(fsdp) + all-reduce(data)       "
        "backward of head",
        # two layers: 1,574,912 B in, 2 x (256 + 196,608 / 4) x 4 = 395,264 B out
        "  1  layer 3 .. 2            1.502 MiB    386 KiB  reduce-scatter(fsdp) + all-reduce(data)       "
        "backward of layer 2",
        "  2  layer 1 .. 0            1.502 MiB    386 KiB  reduce-scatter(fsdp) + all-reduce(data)       "
        "backward of layer 0",
        "  3  embed                     130 KiB   32.5 KiB  reduce-scatter(data, fsdp) + all-gather(data) "
        "backward of embed",
    ]
    # All four layers in one bucket; axes of size 1 are not named.
    whole = plan_comm(M, {"data": 8, "tensor": 1}, CPU8).table().splitlines()
    assert "mesh data=8; 8 devices" in whole[0] and whole[4].split()[:5] == ["1", "layer", "3", "..", "0"]
    # One device at the default rule (10 x 2 devices at least x 10 us x 10 GB/s = 2,000,000 B); one layer a bucket.
    one = plan_comm(M, {}, CPU8, 0).table().splitlines()
    assert one[0].endswith("mesh one device; 1 devices per reduction over the intra-node link (10 GB/s, 10 us)")
    assert (
        one[1] == "threshold 1.907 MiB: 10 x 2 devices x 10 us x 10 GB/s (latency about a tenth of the transfer time)"
    )
    assert one[4].split() == ["1", "layer", "3", "..", "2", "1.502", "MiB", "1.502", "MiB", "all-reduce(data)",
                              "backward", "of", "layer", "2"]  # fmt: skip


def test_byte_units():
    assert [_fmt_bytes(n) for n in (0, 1023, 1024, 1536, 2**20 - 1, 2**20, 3 * 2**29, 2**40)] == [
        "0 B",
        "1023 B",
        "1 KiB",
        "1.5 KiB",
        "1024 KiB",
        "1 MiB",
        "1.5 GiB",
        "1024 GiB",
    ]


def test_the_link_is_the_inter_node_one_when_the_reduction_spans_nodes():
    """cpu-2x4: 2 nodes of 4 devices, 10 GB/s and 10 us within a node, 1 GB/s and 100 us between them."""
    two = load_cluster("cpu-2x4")
    p = plan_comm(M, {"data": 8}, two)
    assert (p.link, p.bandwidth, p.latency) == ("inter", 1e9, 1e-4)
    assert p.threshold_bytes == 10 * 8 * 100 * 1000 == 8_000_000
    assert "over the inter-node link (1 GB/s, 100 us)" in p.table()
    # The reduction's groups of 2 are laid over a mesh of data x tensor: 2 x 4 devices span both nodes ...
    assert plan_comm(M, {"data": 2, "tensor": 4}, two).link == "inter"
    # ... 2 x 2 fit in one.
    assert plan_comm(M, {"data": 2, "tensor": 2}, two).link == "intra"
    assert plan_comm(M, {"data": 4}, two).link == "intra"


def test_the_default_threshold_counts_at_least_two_devices():
    assert default_threshold(1e10, 1e-5, 1) == default_threshold(1e10, 1e-5, 2) == 2_000_000
    assert default_threshold(1e10, 1e-5, 3) == 3_000_000


def test_an_untied_head_is_split_over_fsdp_by_its_embed_dimension():
    untied = dataclasses.replace(M, tie_embeddings=False)
    assert block_grad_bytes(untied, {"fsdp": 2})["head"] == ((128 + 128 * 260) * 4, (128 + 64 * 260) * 4)


def test_an_moe_models_plan_by_hand():
    """An MoE model's unit is a group of moe.every layers; its dense weights reduce over data x expert."""
    moe = apply_preset(M, "moe-tiny")  # d 64, 4 heads x 16, 2 kv heads, 2 layers, 8 experts of width 64, every 1
    attention = 2 * 64 + 64 * 64 + 2 * (64 * 32) + 64 * 64  # norms, wq, wk, wv, wo
    router, experts = 64 * 8, 3 * (8 // 2) * 64 * 64  # the experts split over expert=2
    g = block_grad_bytes(moe, {"data": 2, "fsdp": 2, "expert": 2})
    assert g["layer"] == ((attention + router + experts) * 4, (128 + (attention - 128 + router + experts) // 2) * 4)
    p = plan_comm(moe, {"data": 2, "fsdp": 2, "expert": 2}, CPU8)
    assert p.reduce_devices == 8 and p.layers_per_bucket == 2
    assert [b.collective for b in p.buckets] == [
        "reduce-scatter(fsdp) + all-reduce(data, expert)",
        "reduce-scatter(fsdp) + all-reduce(data, expert)",
        "reduce-scatter(data, expert, fsdp) + all-gather(data, expert)",
    ]
    # Every other layer an MoE layer: a unit is 2 layers, one dense MLP (gate/up/down, 64 x 128) and one MoE.
    every2 = dataclasses.replace(moe, n_layers=4, moe=dataclasses.replace(moe.moe, every=2))
    unit = block_grad_bytes(every2, {"data": 8})["layer"][0]
    assert unit == (2 * attention + 3 * 64 * 128 + router + 3 * 8 * 64 * 64) * 4
    p = plan_comm(every2, {"data": 8}, CPU8, unit)
    assert p.layers_per_bucket == 2 and p.buckets[1].blocks == ("layer 3", "layer 2")
    assert p.buckets[1].collective == "all-reduce(data)" and p.buckets[2].issue_after == "backward of layer 0"


def test_refusals_and_descriptions_in_full():
    with pytest.raises(
        ConfigError, match=r"^train\.grad_bucket_bytes=-5 must be 0 \(the default rule\) or positive\.$"
    ):
        plan_comm(M, {"data": 8}, CPU8, -5)
    assert describe_xla_options({}) == (
        "XLA collective options: none set (only GPU train steps of dense models take them)"
    )
    assert describe_xla_options({"a": True, "b": 7}) == "XLA collective options from the gradient plan: --a=True --b=7"

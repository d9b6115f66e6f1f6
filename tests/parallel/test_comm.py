"""The gradient communication plan (jaxdist.parallel.comm) against plans computed by hand."""

from __future__ import annotations

import dataclasses

import pytest

from jaxdist.cli import main
from jaxdist.cluster import load_cluster
from jaxdist.config import Config, ConfigError, apply_preset
from jaxdist.parallel.comm import block_grad_bytes, default_threshold, describe_xla_options, plan_comm, xla_gpu_options

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
        (["model=moe-tiny"], "dense models only"),
        (["train.grad_bucket_bytes=-1"], "grad_bucket_bytes"),
    ],
)
def test_per_block_refuses_what_it_does_not_cover(over, match):
    from jaxdist.config import load_config  # validates what it loads

    with pytest.raises(ConfigError, match=match):
        load_config(None, ["train.grad_sync=per_block", *over])
    # Microbatches as pipeline microbatches are per_block's (jaxdist.parallel.pipeline_sync).
    load_config(None, ["train.grad_sync=per_block", "mesh.pipeline=2", "train.microbatches=2"])

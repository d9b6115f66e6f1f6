"""The HLO collective parser against hand-written programs with known byte counts."""

import pytest

from jaxdist.parallel.hlo import (
    DTYPE_BYTES,
    array_bytes,
    collective_bytes,
    dot_operand_types,
    instruction_bytes,
    parse_collectives,
)

PROGRAM = """
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[64,128])) -> (s32[], f32[64,128]) {
  %p = (s32[], f32[64,128]) parameter(0)
  %x = f32[64,128]{1,0} get-tuple-element(%p), index=1
  %ar = f32[64,128]{1,0} all-reduce(%x), channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true, to_apply=%add
  %ag = f32[16,128]{1,0} all-gather(%y), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[64,128]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[64,128])) -> pred[] {
  %p = (s32[], f32[64,128]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[64,128]) -> f32[8,128] {
  %x = f32[64,128]{1,0} parameter(0)
  %w = (s32[], f32[64,128]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[8,128]{1,0} reduce-scatter(%x), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
  %tup = (f32[10]{0}, bf16[4,4]{1,0}) all-reduce(%a, %b), channel_id=4, replica_groups=mesh['axis_0'=8] {'axis_0'}, to_apply=%add
  %cp = f32[2,2]{1,0} collective-permute(%z), channel_id=5, source_target_pairs={{0,1},{1,0}}
  ROOT %r = f32[8,128]{1,0} copy(%rs)
}
"""


def test_kinds_bytes_groups_and_loop_trips():
    by_kind = {}
    for c in parse_collectives(PROGRAM):
        by_kind.setdefault(c.kind, []).append(c)
    ar_loop = [c for c in by_kind["all-reduce"] if c.count == 3]
    assert len(ar_loop) == 1 and ar_loop[0].bytes == 64 * 128 * 4 and ar_loop[0].group == 4
    (ag,) = by_kind["all-gather"]
    assert (ag.bytes, ag.group, ag.count) == (16 * 128 * 4, 4, 3)  # mesh groups with device_ids
    (rs,) = by_kind["reduce-scatter"]
    assert (rs.bytes, rs.group) == (8 * 128 * 4 * 8, 8)  # whole (un-scattered) buffer
    tup = [c for c in by_kind["all-reduce"] if c.count == 1]
    assert tup[0].bytes == 10 * 4 + 16 * 2 and tup[0].group == 8  # tuple of f32 and bf16
    (cp,) = by_kind["collective-permute"]
    assert (cp.bytes, cp.group) == (16, 2)


def test_totals_per_kind():
    totals = collective_bytes(PROGRAM)
    assert totals["all-reduce"] == 3 * 64 * 128 * 4 + 72
    assert totals["all-gather"] == 3 * 16 * 128 * 4
    assert totals["reduce-scatter"] == 8 * 128 * 4 * 8
    assert totals["collective-permute"] == 16
    assert totals["total"] == sum(v for k, v in totals.items() if k != "total")


def test_instruction_bytes_counts_each_instruction_once():
    # Loop trips are not multiplied in: the all-reduce in the loop body counts once, beside the tuple one.
    assert instruction_bytes(PROGRAM, "all-reduce") == 64 * 128 * 4 + 10 * 4 + 16 * 2
    assert instruction_bytes(PROGRAM, "all-gather") == 16 * 128 * 4
    assert instruction_bytes(PROGRAM, "all-to-all") == 0
    assert instruction_bytes("  ROOT %a = (f32[3]{0}, token[]) all-to-all(%x)\n") == 3 * 4  # no ENTRY needed


def test_array_bytes_uses_the_one_dtype_table():
    assert array_bytes("(bf16[4]{0}, s32[5]{0}, pred[2])") == 4 * 2 + 5 * 4 + 2 * 1
    assert array_bytes("f8e4m3fn[16]{0}") == 16 == 16 * DTYPE_BYTES["f8e4m3fn"]
    assert array_bytes("f32[]") == 4 and array_bytes("token[]") == 0


def test_loop_flops_correction_counts_each_trip_like_the_unrolled_program():
    """XLA's cost analysis counts a while body once; with the correction the scanned program's FLOPs equal
    the same program unrolled (forward only: no backward pass for XLA to prune differently)."""
    import jax
    import jax.numpy as jnp

    from jaxdist.parallel.hlo import loop_flops_correction

    def net(unroll):
        def f(x, ws):
            return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w) * 2 + 1, None), x, ws, unroll=unroll)[0].sum()

        return f

    x, ws = jnp.ones((64, 128)), jnp.ones((6, 128, 128))
    looped = jax.jit(net(False)).lower(x, ws).compile()
    unrolled = jax.jit(net(True)).lower(x, ws).compile()
    counted = looped.cost_analysis()["flops"]
    assert counted < unrolled.cost_analysis()["flops"] / 5  # the loop body counted once
    corrected = counted + loop_flops_correction(looped.as_text())
    assert corrected == pytest.approx(unrolled.cost_analysis()["flops"], rel=0.01)
    assert corrected >= 6 * 2 * 64 * 128 * 128  # at least the six matmuls


def test_dot_operand_types_tell_an_upcast_bf16_program():
    text = """
HloModule m

%fused (p0: bf16[4,8], p1: bf16[8,4]) -> f32[4,4] {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = bf16[8,4]{1,0} parameter(1)
  ROOT %d = f32[4,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[4,8], b: bf16[8,4]) -> f32[4,4] {
  %a = bf16[4,8]{1,0} parameter(0)
  %b = bf16[8,4]{1,0} parameter(1)
  %ca = f32[4,8]{1,0} convert(%a)
  %cb = f32[8,4]{1,0} convert(%b)
  %d1 = f32[4,4]{1,0} dot(%ca, %cb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d2 = f32[4,4]{1,0} dot(%ca, %cb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %f = f32[4,4]{1,0} fusion(%a, %b), kind=kLoop, calls=%fused
}
"""
    assert dot_operand_types(text) == {"bf16": 1, "f32": 2}

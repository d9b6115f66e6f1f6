"""The HLO collective parser against hand-written programs with known byte counts."""

from jaxdist.planner.hlo import collective_bytes, parse_collectives

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
    assert (ag.bytes, ag.group, ag.count) == (16 * 128 * 4, 4, 3)   # mesh groups with device_ids
    (rs,) = by_kind["reduce-scatter"]
    assert (rs.bytes, rs.group) == (8 * 128 * 4 * 8, 8)              # whole (un-scattered) buffer
    tup = [c for c in by_kind["all-reduce"] if c.count == 1]
    assert tup[0].bytes == 10 * 4 + 16 * 2 and tup[0].group == 8     # tuple of f32 and bf16
    (cp,) = by_kind["collective-permute"]
    assert (cp.bytes, cp.group) == (16, 2)


def test_totals_per_kind():
    totals = collective_bytes(PROGRAM)
    assert totals["all-reduce"] == 3 * 64 * 128 * 4 + 72
    assert totals["all-gather"] == 3 * 16 * 128 * 4
    assert totals["reduce-scatter"] == 8 * 128 * 4 * 8
    assert totals["collective-permute"] == 16
    assert totals["total"] == sum(v for k, v in totals.items() if k != "total")

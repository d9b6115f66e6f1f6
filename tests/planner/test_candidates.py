"""Candidate strategies against a brute-force enumeration of the rules, and the search moves."""

import itertools

import pytest

from jaxdist.config import MESH_AXES, load_config
from jaxdist.planner.candidates import REMAT_CHOICES, Strategy, candidates, neighbours, valid
from jaxdist.planner.computation import computation_view


def brute_force(m, nodes, per_node, batch, max_mb=64, seq=64):
    n = nodes * per_node
    divs = [d for d in range(1, n + 1) if n % d == 0]
    out = set()
    for data, fsdp, ctx, tensor, expert, pipe in itertools.product(divs, repeat=6):
        if data * fsdp * ctx * tensor * expert * pipe != n:
            continue
        if per_node % (ctx * tensor * expert * pipe) or (data * fsdp) % nodes:
            continue  # context, tensor, expert, pipeline inside a node; the node count on data * fsdp
        if ctx > 1 and (pipe > 1 or m.moe.experts or seq % (2 * ctx)):
            continue  # the ring: no pipeline, no MoE, 2 * context equal chunks
        if m.n_heads % tensor or m.d_ff % tensor or (m.n_kv_heads % tensor and tensor % m.n_kv_heads):
            continue
        if expert > 1 and (not m.moe.experts or m.moe.experts % expert):
            continue
        if m.n_layers % pipe:
            continue
        moe_stages = pipe > 1 and m.moe.experts
        if moe_stages and (m.n_layers // m.moe.every) % pipe:
            continue  # MoE stages: whole groups per stage
        for mb in range(1, min(batch, max_mb) + 1):
            if batch % mb or (batch // mb) % (data * fsdp * expert):
                continue
            scheds = [("gpipe", 1), ("1f1b", 1)] + [("seq1f1b", c) for c in (2, 4) if seq % c == 0]
            if moe_stages and batch % (data * fsdp * expert * pipe):
                scheds = scheds[1:]  # MoE gpipe stages: the rows over the stages too
            for sched, chunks in scheds if pipe > 1 else [("none", 1)]:
                if sched == "1f1b" and mb < pipe:
                    continue
                for r in REMAT_CHOICES:
                    out.add(Strategy(data, fsdp, tensor, expert, pipe, mb, sched, r.name, chunks, ctx))
    return out


@pytest.mark.parametrize(
    "preset, nodes, per_node, batch",
    [
        ("tiny", 1, 8, 16),
        ("small", 2, 4, 32),
        ("llama-8b", 4, 8, 64),
        ("moe-tiny", 1, 8, 32),
    ],
)
def test_candidates_equal_brute_force(preset, nodes, per_node, batch):
    m = load_config(None, [f"model={preset}"]).model
    view = computation_view(m, 64)
    got = list(candidates(view, nodes * per_node, nodes, per_node, batch))
    assert len(got) == len(set(got))
    assert set(got) == brute_force(m, nodes, per_node, batch)
    assert all(valid(s, view, nodes, per_node, batch) for s in got)


def test_axes_outside_the_allowed_set_stay_at_one():
    view = computation_view(load_config(None, ["model=small"]).model, 64)
    got = list(candidates(view, 8, 1, 8, 32, axes=("data", "fsdp", "tensor")))
    assert got and all(s.pipeline == 1 and s.expert == 1 for s in got)
    assert {s.tensor for s in got} == {1, 2, 4}  # 4 heads: tensor 8 is not allowed


def test_neighbours_are_valid_and_one_move_away():
    m = load_config(None, ["model=llama-8b"]).model
    view = computation_view(m, 1024)
    s = Strategy(data=2, fsdp=8, tensor=4, microbatches=2, remat="full")
    near = list(neighbours(s, view, 8, 8, 64))
    assert near and s not in near
    for c in near:
        assert valid(c, view, 8, 8, 64)
        changed = [a for a in MESH_AXES if getattr(c, a) != getattr(s, a)]
        other = [f for f in ("microbatches", "remat", "schedule") if getattr(c, f) != getattr(s, f)]
        # A factor moved between two axes (schedule may follow the pipeline), or one other field changed.
        assert (len(changed) == 2 and not set(other) - {"schedule"}) or (not changed and len(other) == 1)

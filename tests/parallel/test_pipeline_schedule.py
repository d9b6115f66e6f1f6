"""Pipeline schedules as data, the executor's tables, the chunk partitioner, config checks and the CLI.

Nothing here compiles: schedules are checked against closed forms and a
brute-force replay of the executor's tables with symbolic values.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxdist.cli import main
from jaxdist.config import ConfigError, load_config
from jaxdist.parallel.chunks import ChunkCost, chunk_boundaries, chunk_cost_model, chunk_costs
from jaxdist.parallel.schedule import (
    activation_memory_ratio,
    bubble_formula,
    build_schedule,
    executor_tables,
    peak_in_flight_formula,
    stage_orders,
)

SHAPES = [(p, m, s) for p in (1, 2, 3, 4) for m in (1, 2, 4, 5, 8) for s in (1, 2, 3, 4)]


def cases():
    for p, m, s in SHAPES:
        for kind in ("gpipe", "1f1b", "seq1f1b"):
            if kind != "seq1f1b" and s > 1 or kind == "1f1b" and m < p:
                continue
            yield kind, p, m, s


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "seq1f1b"])
def test_bubble_equals_closed_form(kind):
    for k, p, m, s in cases():
        if k != kind:
            continue
        sch = build_schedule(p, m, s, kind)
        units = s * m
        assert sch.n_ticks == 2 * (units + p - 1), (kind, p, m, s)
        assert sch.bubble_fraction() == pytest.approx((p - 1) / (units + p - 1), abs=1e-12)
        assert sch.bubble_fraction() == pytest.approx(bubble_formula(kind, p, m, s), abs=1e-12)


def test_peak_activations_in_flight_on_first_stage():
    for kind, p, m, s in cases():
        sch = build_schedule(p, m, s, kind)
        assert sch.peak_in_flight(0) == peak_in_flight_formula(kind, p, m, s), (kind, p, m, s)
    # The closed forms of the issue: p microbatches for 1f1b, s+p-1 chunks for seq1f1b (m >= p).
    for p, s in itertools.product((2, 4), (1, 2, 4)):
        one = build_schedule(p, 2 * p, 1, "1f1b")
        seq = build_schedule(p, 2 * p, s, "seq1f1b")
        assert one.peak_in_flight(0) == p and seq.peak_in_flight(0) == s + p - 1
        ratio = seq.activation_microbatches(0) / one.activation_microbatches(0)
        assert ratio == pytest.approx((s + p - 1) / (s * p)) == activation_memory_ratio(p, s)
        # No stage holds more than the first one.
        assert max(seq.peak_in_flight(k) for k in range(p)) == seq.peak_in_flight(0)


def test_every_unit_runs_once_after_its_dependencies():
    for kind, p, m, s in cases():
        sch = build_schedule(p, m, s, kind)
        when = {}
        for t, row in enumerate(sch.grid):
            for k, a in enumerate(row):
                if a is not None:
                    key = (a.op, a.microbatch, a.chunk, k)
                    assert key not in when
                    when[key] = t
        assert len(when) == 2 * p * m * s
        for (op, i, c, k), t in when.items():
            if op == "F":
                assert k == 0 or when[("F", i, c, k - 1)] < t  # activation from the previous stage
                assert c == 0 or when[("F", i, c - 1, k)] < t  # keys/values of earlier chunks
            else:
                assert when[("F", i, c, k)] < t
                assert k == p - 1 or when[("B", i, c, k + 1)] < t  # gradient from the next stage
                assert c == s - 1 or when[("B", i, c + 1, k)] < t  # key/value grads of later chunks


def replay(sch, tab):
    """Run the tables with symbolic values the way the executor does; fail on any wrong read."""
    p, s = sch.stages, sch.chunks
    act_in = [[None] * (tab.act_buffers + 1) for _ in range(p)]
    grad_in = [[None] * (tab.grad_buffers + 1) for _ in range(p)]
    stash = [[None] * tab.slots for _ in range(p)]
    dy = [[None] * tab.slots for _ in range(p)]
    act_msg, grad_msg = [None] * p, [None] * p
    for t in range(tab.n_ticks):
        sent_act, sent_grad = [None] * p, [None] * p
        for k in range(p):
            act_in[k][tab.recv_act[t, k]] = act_msg[k]
            grad_in[k][tab.recv_grad[t, k]] = grad_msg[k]
            br, i, c, slot = tab.branch[t, k], tab.microbatch[t, k], tab.chunk[t, k], tab.slot[t, k]
            if br == 0:
                continue
            fwd = br <= s
            assert c == (br - 1) % s
            for j in range(c):  # earlier chunks' keys/values are still stashed
                assert stash[k][tab.unit_slot[k, i, j]] == (i, j)
            if fwd:
                x = ("embed", i, c) if k == 0 else act_in[k][tab.in_slot[t, k]]
                assert x == (("embed", i, c) if k == 0 else ("act", i, c, k - 1)), (t, k, x)
                assert stash[k][slot] is None, "slot still in use"
                stash[k][slot] = (i, c)
                if k == p - 1:
                    dy[k][slot] = ("dy", i, c)
                sent_act[k] = ("act", i, c, k)
            else:
                g = dy[k][slot] if k == p - 1 else grad_in[k][tab.in_slot[t, k]]
                assert g == (("dy", i, c) if k == p - 1 else ("grad", i, c, k + 1)), (t, k, g)
                assert stash[k][slot] == (i, c)
                stash[k][slot] = None
                sent_grad[k] = ("grad", i, c, k)
        act_msg = [None] + sent_act[:-1]
        grad_msg = sent_grad[1:] + [None]
    assert all(v is None for st in stash for v in st)


def test_executor_tables_deliver_every_input():
    for kind, p, m, s in cases():
        sch = build_schedule(p, m, s, kind)
        tab = executor_tables(sch)
        assert tab.slots == max(sch.peak_in_flight(k) for k in range(p))
        replay(sch, tab)
        # Padded tables (more slots and buffers, idle ticks) run the same schedule.
        replay(sch, tab.padded(tab.slots + 2, tab.act_buffers + 1, tab.grad_buffers + 3, tab.n_ticks + 5))


def test_stage_orders_warm_up():
    orders = stage_orders("seq1f1b", 4, 8, 4)
    # Stage k runs s + p - k - 2 forwards before its first backward, then alternates.
    for k, order in enumerate(orders):
        first_b = next(j for j, a in enumerate(order) if a.op == "B")
        assert first_b == 4 + 4 - k - 2 + 1
        assert [a.op for a in order[first_b - 1 : first_b + 5]] == ["F", "B"] * 3
    assert [(a.microbatch, a.chunk) for a in orders[0] if a.op == "B"][:5] == [(0, 3), (0, 2), (0, 1), (0, 0), (1, 3)]


def test_timeline_text():
    sch = build_schedule(2, 2, 1, "1f1b")
    assert sch.timeline() == ("tick    0              5\nstage 0 F0 F1 .  B0 .  B1\nstage 1 .  F0 B0 F1 B1 .")
    assert "bubble 0.333 (formula 0.333)" in sch.summary()


@pytest.mark.parametrize(
    "args,message",
    [
        (("pipedream", 2, 2, 1), "schedule 'pipedream' is unknown"),
        (("1f1b", 4, 2, 1), "1f1b needs at least as many microbatches as stages (2 < 4)"),
        (("gpipe", 2, 2, 2), "2 sequence chunks need the seq1f1b schedule, not gpipe"),
        (("seq1f1b", 0, 2, 2), "pipeline stages=0 must be a positive integer"),
    ],
)
def test_impossible_schedules(args, message):
    kind, p, m, s = args
    with pytest.raises(ValueError) as e:
        build_schedule(p, m, s, kind)
    assert message in str(e.value)


# --------------------------------------------------------------------------- chunk partitioner


def test_equal_split_and_errors():
    assert chunk_boundaries(128, 4, split="equal") == (0, 32, 64, 96, 128)
    assert chunk_boundaries(128, 1, chunk_cost_model(load_config(None, []).model)) == (0, 128)
    with pytest.raises(ValueError, match="does not split into 3 equal chunks"):
        chunk_boundaries(128, 3, split="equal")
    with pytest.raises(ValueError, match="does not split into 4 chunks"):
        chunk_boundaries(3, 4, ChunkCost(1.0, 1.0))
    with pytest.raises(ValueError, match="split 'tokens' is unknown"):
        chunk_boundaries(128, 4, split="tokens")


def brute_force_min_spread(seq_len, chunks, cost):
    best = None
    for cuts in itertools.combinations(range(1, seq_len), chunks - 1):
        b = (0, *cuts, seq_len)
        c = chunk_costs(b, cost)
        spread = max(c) - min(c)
        best = spread if best is None else min(best, spread)
    return best


def test_cost_split_balances_chunks():
    cost = chunk_cost_model(load_config(None, ["model=llama-8b"]).model)
    for seq_len, s in ((4096, 2), (4096, 4), (8192, 8), (2048, 3)):
        b = chunk_boundaries(seq_len, s, cost)
        c = chunk_costs(b, cost)
        assert max(c) / min(c) <= 1.01, (seq_len, s, b)
        lengths = np.diff(b)
        assert all(np.diff(lengths) <= 0)  # later chunks attend to more keys, so they are shorter
    eq = chunk_costs(chunk_boundaries(8192, 8, split="equal"), cost)
    assert max(eq) / min(eq) > 1.25  # what the equal split would give
    # On a small grid the split is as even as any: compare to brute force.
    small = ChunkCost(per_token=10.0, per_pair=1.0)
    for seq_len, s in ((24, 3), (30, 2), (20, 4)):
        b = chunk_boundaries(seq_len, s, small)
        c = chunk_costs(b, small)
        assert max(c) - min(c) <= brute_force_min_spread(seq_len, s, small) + 1e-9


def test_cost_split_on_a_grid():
    cost = ChunkCost(per_token=0.0, per_pair=1.0)
    b = chunk_boundaries(4096, 4, cost, multiple_of=128)
    assert all(x % 128 == 0 for x in b) and b[0] == 0 and b[-1] == 4096
    # Attention only: chunk j ends near sqrt((j+1)/s)-ish of the sequence, the first chunk is the longest.
    assert b[1] > 1024 and (b[2] - b[1]) > (b[3] - b[2]) > (b[4] - b[3])


# --------------------------------------------------------------------------- config and CLI


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["mesh.pipeline=3"], "model.n_layers=4 is not divisible by mesh.pipeline=3"),
        (["mesh.pipeline=2", "pipeline.chunks=3"], "train.seq_len=128 is not divisible into pipeline.chunks=3"),
        (["mesh.pipeline=2", "pipeline.schedule=1f1b"], "the 1f1b schedule needs train.microbatches >= mesh.pipeline"),
        (["mesh.pipeline=2", "pipeline.schedule=zb"], "pipeline.schedule='zb' is unknown"),
        (["mesh.pipeline=2", "pipeline.chunk_split=x"], "pipeline.chunk_split='x' is unknown"),
        (["mesh.pipeline=2", "model=moe-tiny"], "pipeline stages do not support MoE models yet"),
    ],
)
def test_config_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value)


def test_config_accepts_pipelines():
    cfg = load_config(None, ["mesh.pipeline=2"])  # the embedded default with two stages
    assert cfg.pipeline.schedule == "seq1f1b" and cfg.pipeline.chunks == 2
    load_config(None, ["mesh.pipeline=4", "pipeline.schedule=1f1b", "train.microbatches=4"])
    load_config(None, ["mesh.pipeline=2", "pipeline.schedule=gpipe", "pipeline.chunks=3"])


def test_cli_prints_schedule(capsys):
    assert main(["pipeline", "--stages", "4", "--microbatches", "8", "--chunks", "4"]) == 0
    out = capsys.readouterr().out
    assert "seq1f1b: p=4 m=8 s=4, 70 ticks; bubble 0.086 (formula 0.086)" in out
    assert "peak in flight on stage 0: 7 chunks = 1.75 microbatches" in out
    assert "(s+p-1)/(s*p) = 7/16 = 0.438" in out
    assert out.count("\nstage ") == 4
    assert main(["pipeline", "--stages", "4", "--microbatches", "2", "--kind", "1f1b"]) == 2
    assert "1f1b needs at least as many microbatches as stages" in capsys.readouterr().err

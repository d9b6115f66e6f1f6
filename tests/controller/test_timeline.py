"""Recovery accounting from a controller's files, on a hand-written history."""

from __future__ import annotations

import json

from jaxdist.controller.timeline import generations_trained, recoveries, summary


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_recoveries_from_events_injections_and_trained_steps(tmp_path):
    ctl = tmp_path / "controller"
    # gen 0 trains 1..5, rank 0 killed at t=10 (step 4 was the last committed);
    # gen 1 resumes from 4, trains 5..9, rank 2 stopped at t=30; gen 2 resumes from 9 and finishes.
    _write(
        ctl / "events.jsonl",
        [
            {"time": 1.0, "event": "start", "gen": 0, "members": {"0": "a", "1": "b", "2": "c"}},
            {"time": 3.0, "event": "first_step", "gen": 0, "resume_step": 0},
            {"time": 10.1, "event": "failure", "gen": 0, "kinds": ["exit"], "ranks": [0], "nodes": ["a"]},
            {"time": 11.0, "event": "start", "gen": 1, "members": {"0": "s", "1": "b", "2": "c"}},
            {"time": 14.1, "event": "first_step", "gen": 1, "resume_step": 4},
            {"time": 31.5, "event": "failure", "gen": 1, "kinds": ["silent"], "ranks": [2], "nodes": ["c"]},
            {"time": 32.0, "event": "start", "gen": 2, "members": {"0": "s", "1": "b", "2": "a"}},
            {"time": 36.5, "event": "first_step", "gen": 2, "resume_step": 9},
        ],
    )
    _write(
        ctl / "injections.jsonl",
        [
            {"time": 10.0, "gen": 0, "rank": 0, "signal": "SIGKILL"},
            {"time": 30.0, "gen": 1, "rank": 2, "signal": "SIGSTOP"},
        ],
    )
    _write(
        ctl / "trained.jsonl",
        [{"time": float(s), "gen": 0, "step": s, "loss": 1.0} for s in range(1, 6)]
        + [{"time": 20.0 + s, "gen": 1, "step": s, "loss": 1.0} for s in range(5, 10)]
        + [{"time": 40.0 + s, "gen": 2, "step": s, "loss": 1.0} for s in range(10, 13)],
    )
    gens = generations_trained(tmp_path)
    assert {g: [s for s, _ in rows] for g, rows in gens.items()} == {
        0: [1, 2, 3, 4, 5],
        1: [5, 6, 7, 8, 9],
        2: [10, 11, 12],
    }
    rows = recoveries(tmp_path)
    assert [(r["gen"], r["kind"], r["signal"], r["lost_steps"], r["resume_step"]) for r in rows] == [
        (0, "exit", "SIGKILL", 1, 4),
        (1, "silent", "SIGSTOP", 0, 9),
    ]
    assert abs(rows[0]["detect_s"] - 0.1) < 1e-9 and abs(rows[1]["detect_s"] - 1.5) < 1e-9
    assert abs(rows[0]["to_first_step_s"] - 4.0) < 1e-9 and abs(rows[1]["to_first_step_s"] - 5.0) < 1e-9
    assert rows[0]["swapped"] == {"0": "s"} and rows[1]["swapped"] == {"2": "a"}


def test_summary_median_p90_max():
    s = summary([float(x) for x in range(1, 11)] + [None])
    assert s == {"n": 10, "median": 5.5, "p90": 9.0, "max": 10.0}
    assert summary([])["n"] == 0

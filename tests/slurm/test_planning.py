"""Planning on the free part of the live fixture cluster while other jobs hold GPUs."""

from __future__ import annotations

import itertools
import math
import tomllib

import pytest

from jaxdist.cli import main
from jaxdist.cluster import NODE_LOCAL_AXES
from jaxdist.config import load_config
from jaxdist.planner.plan import PlanError, plan
from jaxdist.planner.shared import plan_free
from jaxdist.slurm.view import cluster_spec, figures, read_partition

from .test_local_cluster import wait_for


@pytest.fixture
def holders(slurm):
    """Other jobs holding 4 GPUs of n1 and all 8 of n3 (cancelled at the end)."""
    jobs = [
        slurm.run(
            [
                "sbatch",
                "--parsable",
                "-J",
                "holder",
                "-N1",
                "-w",
                node,
                f"--gpus-per-node={g}",
                "-o",
                "/dev/null",
                "--wrap",
                "sleep 600",
            ]
        ).strip()
        for node, g in (("n1", 4), ("n3", 8))
    ]
    try:
        # as sets: squeue lists by number, and "10" sorts before "9" as text
        ids = ",".join(jobs)
        running = lambda: set(slurm.run(["squeue", "-h", "-t", "R", "-j", ids, "-o", "%i"]).split()) == set(jobs)  # noqa: E731
        wait_for(running, 120, "holders", why=lambda: slurm.run(["squeue", "-h", "-j", ids, "-o", "%i %T %r"]))
        yield jobs
    finally:
        slurm.run(["scancel", *jobs], check=False)
        wait_for(lambda: not slurm.run(["squeue", "-h", "-j", ",".join(jobs)]).strip(), 60, "holders to end")


def test_the_plan_uses_free_gpus_only_and_is_the_exhaustive_optimum(slurm, holders):
    view = read_partition("gpu")
    assert view.free() == {"n1": 4, "n2": 8, "n3": 0, "n4": 8}
    spec = figures("slurm:gpu@h100x8", view)
    model = load_config(None, ["model=llama-8b"]).model
    fp = plan_free(model, view, spec, batch_size=64, seq_len=4096, standbys=0)

    # reference: every set of nodes with k free GPUs each, every plan on it evaluated (one plan per n x k)
    free, memo, best = view.free(), {}, None
    for k in range(1, 9):
        fit = [n for n, f in free.items() if f >= k]
        for r in range(1, len(fit) + 1):
            for nodes in itertools.combinations(fit, r):
                if (r, k) not in memo:
                    try:
                        p = plan(model, cluster_spec(view, spec, r, k), batch_size=64, seq_len=4096, enumerate_all=True)
                        memo[(r, k)] = p.best.step_time if p.cluster.n_devices == r * k else None
                    except PlanError:
                        memo[(r, k)] = None
                if memo[(r, k)] is not None and (best is None or memo[(r, k)] < best[0]):
                    best = (memo[(r, k)], nodes, k)
    shape, e = fp.choice.best, fp.plan.best
    print(f"\n{view.table()}\n{fp.choice.table(4)}\n{fp.describe()}; exhaustive optimum {best}")
    assert e.step_time == best[0]
    assert all(free[n] >= shape.gpus_per_node for n in shape.nodes) and "n3" not in shape.nodes
    assert fp.plan.cluster.n_devices == shape.training * shape.gpus_per_node
    local = math.prod(e.strategy.mesh[a] for a in NODE_LOCAL_AXES)
    assert e.strategy.tensor > 1 and shape.gpus_per_node % local == 0  # tensor groups inside a node


def test_jaxdist_plan_on_a_partition(slurm, holders, tmp_path, capsys):
    out = tmp_path / "plan.toml"
    args = ["plan", "--cluster", "slurm:gpu@h100x8", "--model", "tiny", "train.batch_size=16", "train.seq_len=32"]
    assert main([*args, "controller.max_nodes=2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "partition gpu: 20 of 32 GPUs free" in printed and "ask Slurm for" in printed, printed
    assert "(+1 standby:" in printed  # controller.standbys=1: one more node with as many GPUs
    written = tomllib.loads(out.read_text())
    assert written["mesh"]["cluster"] == "slurm:gpu@h100x8"
    assert main([*args, "--busy", "0:*"]) == 2
    assert "--busy is for cluster files" in capsys.readouterr().err

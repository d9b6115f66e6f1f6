"""`jaxdist launch` on the live Slurm cluster, through the controller's own recovery: one stub job goes through a
worker's SIGKILL, a node's death, scancel and scontrol requeue, and grows at the requeue (the JAX-free stub
worker of the controller tests: its state is a hash chain over the batches, so a batch skipped or repeated
changes the final hash)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
from pathlib import Path

from jaxdist.controller.generations import last_committed_step
from jaxdist.controller.policy import lineage
from jaxdist.controller.slurm_job import SlurmJob
from jaxdist.controller.timeline import generations_trained

STUB = Path(__file__).parents[1] / "controller" / "stub_worker.py"
_spec = importlib.util.spec_from_file_location("stub_worker", STUB)
stub_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stub_worker)

TIMEOUT = 180  # seconds for any one wait: generous, the machine is shared


def stub_args(name: str, steps: int, *extra: str) -> list[str]:
    return [
        "model=tiny",
        "mesh.cluster=cpu-4x2",
        "train.batch_size=16",
        "train.seq_len=32",
        f"train.steps={steps}",
        "train.runs_dir=runs",
        f"train.name={name}",
        f"controller.worker_command={{python}} {STUB}",
        *extra,
    ]


def stub_env(**extra: str) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]), **extra}


def final_state(job) -> str:
    return json.loads((job.run_dir / "stub" / "final.json").read_text())["state"]


def trained_steps(job) -> list[list[int]]:
    return [[s for s, _ in g] for g in generations_trained(job.run_dir).values()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_one_job_through_a_crash_a_dead_node_scancel_and_a_requeue_that_grows_it(slurm, tmp_path):
    """`jaxdist launch --print ... | sbatch` of a job that trains on 2 to 4 nodes with 1 standby (--nodes=2-5).

    Another job holds n4: Slurm gives 3 nodes, the controller trains on 2 (3 does not suit a batch of 16 on
    2-device nodes) and keeps one as the standby.  At the requeue all 4 nodes are free: it trains on 4."""
    steps = 50
    job = SlurmJob(
        stub_args(
            "faults",
            steps,
            "controller.min_nodes=2",
            "controller.max_nodes=4",
            "controller.standbys=1",
            "controller.start_grace=1",  # the start waits 1 s for more nodes: every allocated node joins
        ),
        cwd=tmp_path,
        env=stub_env(JAXDIST_STUB_STEP_S="0.05"),
    )
    holder = slurm.run(
        [
            "sbatch",
            "--parsable",
            "-J",
            "holder",
            "-N1",
            "-w",
            "n4",
            "--exclusive",
            "-o",
            "/dev/null",
            "--wrap",
            "sleep 600",
        ]
    ).strip()
    try:
        script = job.script()
        assert "#SBATCH --nodes=2-5" in script and "#SBATCH --no-kill" in script and "#SBATCH --requeue" in script
        job.submit(script)
        s = job.wait_until(lambda s: s.get("phase") == "running" and s["last_step"] >= 3, TIMEOUT, "step 3")
        batch_host = job.record().batch_host
        assert len(s["members"]) == 2 and len(s["standbys"]) == 1 and "n4" not in job.record().nodes

        # 1. a worker crashes (SIGKILL): the rank restarts from its node's warm spare (crashed_rank=same_node)
        crash = job.inject(1, signal.SIGKILL)
        s = job.wait_until(lambda s: s["generation"] == 1 and s["phase"] == "running", TIMEOUT, "generation 1")
        step = s["last_step"]
        job.wait_until(lambda s: s["last_step"] >= step + 3, TIMEOUT, "3 steps of generation 1")

        # 2. a member node dies (its slurmd, node agent and worker): the standby takes its rank
        rank, node = next((int(r), n) for r, n in sorted(s["members"].items()) if n != batch_host)
        pids = slurm.kill_node(node)
        dead = job.record_injection(node=node, rank=rank, signal="node_killed", pids=pids)
        s = job.wait_until(lambda s: s["generation"] == 2 and s["phase"] == "running", TIMEOUT, "generation 2")
        slurm.restart_node(node)  # the machine is back (its slurmd; Slurm cleans up the job's step there)
        step = s["last_step"]
        job.wait_until(lambda s: s["last_step"] >= step + 3, TIMEOUT, "3 steps of generation 2")

        # 3. scancel: everything stops, a committed checkpoint stays
        workers = list(job.state()["pids"].values())
        job.cancel()
        assert job.wait_state(("CANCELLED",), TIMEOUT) == "CANCELLED"
        slurm.run(["scancel", holder])
        job.wait_until(lambda s: not slurm.step_processes(), TIMEOUT, "every step process gone", need_state=False)
        assert not any(alive(p) for p in workers)
        kept = last_committed_step(job.run_dir)
        assert 0 < kept < steps, kept

        # 4. scontrol requeue: the job resumes from the checkpoint, on all 4 nodes now free
        job.requeue()
        job.wait_state(("RUNNING",), TIMEOUT)
        assert job.wait(TIMEOUT) == 0, job.summary()
    finally:
        job.close()
        slurm.run(["scancel", holder], check=False)

    assert final_state(job) == stub_worker.expected_final(steps)  # every batch once, in order
    gens = trained_steps(job)
    assert lineage([(g[0] - 1, g[-1]) for g in gens], steps) == list(range(steps))
    failures, starts = job.events_of("failure"), job.events_of("start")
    assert [f["kinds"] for f in failures] == [["exit"], ["silent"]], [f["detail"] for f in failures]
    assert failures[0]["ranks"] == [1] and failures[1]["ranks"] == [rank]
    assert starts[1]["members"] == starts[0]["members"]  # the crashed rank: its own node again
    assert starts[2]["members"][str(rank)] not in starts[1]["members"].values()  # the dead node's rank: the standby
    assert job.events_of("blame")[1]["scope"] == {node: "node"}
    new = job.events_of("new_allocation")
    assert len(new) == 1 and new[0]["gen"] == 2 and starts[3]["cause"] == "elastic start"
    assert sorted(starts[3]["members"].values()) == ["n1", "n2", "n3", "n4"]  # grown from 2 to 4 nodes
    assert job.events_of("first_step")[3]["resume_step"] == kept
    firsts = job.events_of("first_step")
    detect = [f["time"] - i["time"] for f, i in zip(failures, (crash, dead))]
    recover = [fs["time"] - f["time"] for fs, f in zip(firsts[1:3], failures)]
    print(
        f"\nsbatch to first step {firsts[0]['time'] - job.submitted_at:.2f} s; detection {detect[0]:.2f} s "
        f"(SIGKILL), {detect[1]:.2f} s (node); failure to first step {recover[0]:.2f} s, {recover[1]:.2f} s; "
        f"requeue resumed at step {kept}"
    )


def test_min_nodes_equal_to_the_partition_starts_with_its_standby_left_out(slurm, tmp_path):
    """Issue 35 item 7: `controller.min_nodes=4` on the 4-node partition, the default standby: the script asks
    for --nodes=4-5 (it asked for 5: pending for ever with PartitionNodeLimit); Slurm gives 4, all 4 train."""
    steps = 12
    job = SlurmJob(stub_args("four", steps, "controller.min_nodes=4"), cwd=tmp_path, env=stub_env())
    try:
        script = job.script()
        assert "#SBATCH --nodes=4-5" in script.splitlines()
        job.submit(script)
        assert job.wait(TIMEOUT) == 0, job.summary()
    finally:
        job.close()
    assert final_state(job) == stub_worker.expected_final(steps)  # every batch once, in order
    starts = job.events_of("start")
    assert len(starts) == 1 and sorted(starts[0]["members"].values()) == ["n1", "n2", "n3", "n4"]


def test_launch_refuses_a_minimum_the_partition_cannot_meet(slurm, tmp_path):
    """`jaxdist launch` (submitting) checks the partition's node count with sinfo: one sentence, exit 2."""
    cluster = tmp_path / "six.toml"
    cluster.write_text(
        (Path(__file__).parents[2] / "meshes" / "cpu-4x2.toml").read_text().replace("nodes = 4", "nodes = 6")
    )
    job = SlurmJob(stub_args("six", 4, f"mesh.cluster={cluster}", "controller.min_nodes=5"), cwd=tmp_path)
    out = subprocess.run(job.launch_command(), cwd=tmp_path, env=job._env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "has 4 nodes, the job needs at least 5" in out.stderr, out.stderr

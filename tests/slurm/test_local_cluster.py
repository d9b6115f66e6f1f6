"""The local Slurm cluster: a batch job runs on the nodes it asked for, with the fake GPUs it asked for."""

from __future__ import annotations

import time

from jaxdist.slurm.parse import SINFO_FORMAT, parse_jobs, parse_nodes, parse_sinfo

from .conftest import GPUS_PER_NODE, NODES


def wait_for(pred, timeout: float, what: str, poll: float = 0.1, why=None):
    """``pred()``'s first true value within ``timeout`` s; else TimeoutError, with ``why()`` (the state) if given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise TimeoutError(f"waited {timeout} s for {what}" + (f": {why()}" if why else ""))


def test_a_batch_job_runs_and_its_gpus_are_accounted(slurm, tmp_path):
    assert slurm.node_states() == {f"n{i + 1}": "idle" for i in range(NODES)}
    out = tmp_path / "job.out"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "srun --overlap bash -c 'echo $SLURMD_NODENAME $CUDA_VISIBLE_DEVICES' | sort\n"
        f"touch {tmp_path}/started\n"
        f"while [ ! -e {tmp_path}/release ]; do sleep 0.1; done\n"
    )
    job = slurm.run(
        ["sbatch", "--parsable", "-N2", "-w", "n2,n3", "--gpus-per-node=3", "-o", str(out), str(script)]
    ).strip()
    try:
        wait_for(lambda: (tmp_path / "started").exists(), 60, "the batch job to run its step")
        assert out.read_text().split("\n")[:2] == ["n2 0,1,2", "n3 0,1,2"]
        used = slurm.run(["sinfo", "-h", "-N", "-O", "NodeList:8,GresUsed:30"]).split()
        assert dict(zip(used[::2], used[1::2])) == {"n1": "gpu:0", "n2": "gpu:3", "n3": "gpu:3", "n4": "gpu:0"}
        detail = slurm.run(["scontrol", "show", "job", "-d", job])
        assert "Nodes=n[2-3] CPU_IDs=0 Mem=0 GRES=gpu:3(IDX:0-2)" in detail, detail
        total = slurm.run(["sinfo", "-h", "-N", "-O", "Gres:30"]).split()
        assert total == [f"gpu:{GPUS_PER_NODE}"] * NODES
        # the parsers on the live text (captured copies: test_parse.py)
        nodes = {n.name: n for n in parse_nodes(slurm.run(["scontrol", "show", "node", "-d"]))}
        assert {n: (r.addr, r.gpus, r.gpus_used, r.usable) for n, r in nodes.items()} == {
            f"n{i}": ("127.0.0.1", GPUS_PER_NODE, 3 if i in (2, 3) else 0, True) for i in range(1, NODES + 1)
        }
        (record,) = [j for j in parse_jobs(detail) if j.job_id == job]
        assert record.nodes == ("n2", "n3") and record.gpus == {"n2": frozenset({0, 1, 2}), "n3": frozenset({0, 1, 2})}
        rows = parse_sinfo(slurm.run(["sinfo", "-h", "-N", "-O", SINFO_FORMAT]))
        assert [(r.node, r.state, r.gpus_used) for r in rows] == [
            ("n1", "idle", 0),
            ("n2", "mixed", 3),
            ("n3", "mixed", 3),
            ("n4", "idle", 0),
        ]
    finally:
        (tmp_path / "release").touch()
    wait_for(lambda: not slurm.run(["squeue", "-h", "-j", job]).strip(), 60, "the job to end")
    wait_for(lambda: set(slurm.node_states().values()) == {"idle"}, 30, "the nodes idle again")

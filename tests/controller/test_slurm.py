"""The Slurm launcher's pieces that need no cluster: the batch script, node counts, the srun line, the
allocation id and the workers' environment (the live cluster: tests/slurm/)."""

from __future__ import annotations

import shlex
import subprocess

import pytest

from jaxdist.cli import main
from jaxdist.config import ConfigError
from jaxdist.controller.node import worker_environ
from jaxdist.controller.slurm import (
    SlurmLauncher,
    SlurmRequest,
    allocation_id,
    check_partition,
    node_range,
    partition_nodes,
    sbatch_script,
)


def test_node_range():
    assert node_range(4, 4, 1) == "4-5"  # the group; its standby only if Slurm has the node
    assert node_range(4, 4, 0) == "4"
    assert node_range(2, 4, 0) == "2-4"  # may start smaller: Slurm gives what is free, up to 4
    assert node_range(1, 4, 1) == "1-5"
    assert node_range(6, 4, 0) == "4"


def test_printed_script_of_min_nodes_4_asks_for_4_to_5_nodes(tmp_path, capsys, monkeypatch):
    """Issue 35 item 7: min_nodes=4 on a 4-node cluster description with the default standby asked for 5
    nodes, which a 4-node partition never gives (PartitionNodeLimit)."""
    monkeypatch.chdir(tmp_path)
    argv = ["launch", "--print", "mesh.cluster=cpu-4x2", "controller.min_nodes=4", "controller.launcher=slurm"]
    assert main(argv) == 0
    nodes = [l for l in capsys.readouterr().out.splitlines() if l.startswith("#SBATCH --nodes=")]
    assert nodes == ["#SBATCH --nodes=4-5"]


def test_a_partition_smaller_than_the_minimum_is_refused_in_one_sentence():
    sinfo = "n1 gpu*\nn2 gpu*\nn3 gpu*\nn4 gpu*\nn1 debug\nbig1 big\n"
    assert partition_nodes(sinfo) == 4 and partition_nodes(sinfo, "debug") == 1 and partition_nodes(sinfo, "x") is None
    check_partition("4-5", sinfo)  # 4 nodes: the job can start (its standby only if Slurm has one)
    with pytest.raises(ConfigError, match=r"^the default Slurm partition has 4 nodes, the job needs at least 5 "):
        check_partition("5", sinfo)
    with pytest.raises(ConfigError, match=r"^partition 'debug' has 1 node, the job needs at least 2 .*\.$"):
        check_partition("2-3", sinfo, "debug")


def test_batch_script_runs_launch_in_its_allocation(tmp_path):
    request = SlurmRequest("3", 8, ("n2", "n4", "n1"), ("mesh.cluster=/r/x/controller/cluster.toml",), "why\nnot")
    text = sbatch_script(["--config", "/c.toml", "train.steps=9"], request, "/r/x", "/work", job_name="x")
    f = tmp_path / "job.sbatch"
    f.write_text(text)
    assert subprocess.run(["bash", "-n", str(f)]).returncode == 0
    lines = text.splitlines()
    for want in (
        "#SBATCH --nodes=3",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --nodelist=n2,n4,n1",
        "#SBATCH --no-kill",  # a dead node is the controller's to replace
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=/r/x/controller/slurm-%j.out",
        "#SBATCH --chdir=/work",
        "# why",
    ):
        assert want in lines, want
    launch = shlex.split(next(l for l in lines if l.startswith("exec ")))
    assert launch[:6] == ["exec", "python3", "-m", "jaxdist.cli", "launch", "--config"]
    assert launch[-3:] == ["controller.launcher=slurm", "controller.bind=0.0.0.0", "controller.allow_remote=true"]
    assert "train.steps=9" in launch and "mesh.cluster=/r/x/controller/cluster.toml" in launch
    assert "secrets.token_hex(32)" in text  # the token is made inside the job, never written into the script
    assert "--gpus-per-node" not in sbatch_script([], SlurmRequest("2-5"), "/r", "/w")  # CPU devices: no GPU


def test_one_srun_step_per_node(tmp_path):
    argv = SlurmLauncher("10.0.0.1:7470", "tok", tmp_path / "run", tmp_path / "logs", "/py").command("n3", "10.0.0.3")
    assert argv[:4] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=n3"] and "--overlap" in argv
    agent = argv[argv.index("/py") :]
    assert agent[:3] == ["/py", "-m", "jaxdist.controller.node"]
    assert agent[agent.index("--node") + 1] == "n3" and agent[agent.index("--host") + 1] == "10.0.0.3"
    assert "tok" not in argv  # the token travels in the environment


def test_allocation_id_and_worker_environment():
    assert allocation_id({"SLURM_JOB_ID": "17"}) == "17.0"
    assert allocation_id({"SLURM_JOB_ID": "17", "SLURM_RESTART_COUNT": "2"}) == "17.2"
    assert allocation_id({}) == ""
    env = {"SLURM_JOB_ID": "17", "SLURM_LOCALID": "0", "SLURMD_NODENAME": "n2", "CUDA_VISIBLE_DEVICES": "0,1", "A": "b"}
    assert worker_environ(env) == {"SLURMD_NODENAME": "n2", "CUDA_VISIBLE_DEVICES": "0,1", "A": "b"}

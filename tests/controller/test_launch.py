"""Launchers: hosts files, the SSH command, the Slurm script, the Kubernetes manifest, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxdist.cluster import without_device_count
from jaxdist.config import ConfigError
from jaxdist.controller.launch import Launcher, LocalLauncher, SSHLauncher, kubernetes_manifest, read_hosts
from jaxdist.controller.slurm import SlurmLauncher


def test_hosts_file(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# training nodes\nnode-a\nnode-b  # rack 2\n\nnode-c\n")
    assert read_hosts(f) == ["node-a", "node-b", "node-c"]
    f.write_text("a\nb\na\n")
    with pytest.raises(ConfigError, match="lists a host twice: each host runs one node agent"):
        read_hosts(f)
    f.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="lists no host"):
        read_hosts(f)
    with pytest.raises(ConfigError, match="does not exist: set controller.hosts_file"):
        read_hosts(tmp_path / "missing")


def test_ssh_command_tunnels_back_and_keeps_the_token_off_the_command_line():
    ssh = SSHLauncher(["gpu-7"], 7470, "s3cret-token", "/work/job", "/work/job/runs/x", python="/opt/py")
    argv = ssh.command("gpu-7")
    assert argv[:2] == ["ssh", "-o"] and "-R" in argv and argv[argv.index("-R") + 1] == "7470:127.0.0.1:7470"
    assert argv[-2] == "gpu-7"
    remote = argv[-1]
    assert "s3cret-token" not in " ".join(argv)
    assert remote.startswith("cd /work/job && IFS= read -r JAXDIST_JOB_TOKEN && export JAXDIST_JOB_TOKEN && exec ")
    assert "/opt/py -m jaxdist.controller.node --controller 127.0.0.1:7470 --node gpu-7 --host gpu-7" in remote


def test_kubernetes_manifest():
    docs = [
        json.loads(d)
        for d in kubernetes_manifest(["model=tiny"], nodes=5, image="reg/jaxdist:1", gpus_per_node=8).split("\n---\n")
    ]
    assert [d["kind"] for d in docs] == ["Service", "Pod", "Job"]
    job = docs[2]["spec"]
    assert job["completions"] == job["parallelism"] == 5 and job["completionMode"] == "Indexed"
    node = job["template"]["spec"]["containers"][0]
    assert node["resources"] == {"limits": {"nvidia.com/gpu": 8}} and node["image"] == "reg/jaxdist:1"
    assert "--controller jaxdist-controller:7470" in node["command"][-1]
    for c in (node, docs[1]["spec"]["containers"][0]):
        token = next(e for e in c["env"] if e["name"] == "JAXDIST_JOB_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "jaxdist-token", "key": "token"}
    assert "controller.allow_remote=true" in docs[1]["spec"]["containers"][0]["args"]


def _cli(*args, cwd):
    env = {**os.environ, "XLA_FLAGS": without_device_count(os.environ["XLA_FLAGS"])}  # conftest's compile flags
    return subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_prints_slurm_script_and_refuses_print_for_local(tmp_path):
    out = _cli("launch", "--print", "controller.launcher=slurm", "mesh.cluster=cpu-4x2", "model=tiny", cwd=tmp_path)
    assert out.returncode == 0 and "#SBATCH --nodes=1-5" in out.stdout  # 1 to 4 nodes + up to 1 standby
    out = _cli("launch", "--print", "mesh.cluster=cpu-4x2", cwd=tmp_path)
    assert out.returncode == 2 and "--print is for the slurm and kubernetes launchers, not 'local'" in out.stderr
    out = _cli("launch", "controller.launcher=ssh", "controller.hosts_file=nope", cwd=tmp_path)
    assert out.returncode == 2 and "hosts file 'nope' does not exist" in out.stderr


def test_every_launcher_starts_its_agents_with_start_all_and_ends_them_with_stop(tmp_path, monkeypatch):
    """The one launcher interface (controller/launch.py's Launcher): built with everything it needs, start_all()
    starts the node agents and names them, procs holds a live process for each, stop() ends them.  ssh and srun
    are stand-ins here (a script that sleeps), the local launcher's agents are real (their controller is absent)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("ssh", "srun"):
        (bin_dir / name).write_text("#!/bin/sh\nexec sleep 60\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    run, logs = tmp_path / "run", tmp_path / "logs"
    launchers: list[tuple[Launcher, list[str]]] = [
        (LocalLauncher("127.0.0.1:9", "tok", run, logs, count=2), ["local-0", "local-1"]),
        (SSHLauncher(["h1", "h2"], 7470, "tok", tmp_path, run, python=sys.executable, log_dir=logs), ["h1", "h2"]),
        (
            SlurmLauncher(
                "10.0.0.1:7470", "tok", run, logs, sys.executable, nodes=["n1"], addresses={"n1": "10.0.0.9"}
            ),
            ["n1"],
        ),
    ]
    for launcher, names in launchers:
        assert launcher.start_all() == names
        assert sorted(launcher.procs) == sorted(names)
        assert all(p.poll() is None for p in launcher.procs.values()), type(launcher).__name__
        t0 = time.monotonic()
        launcher.stop()
        assert all(p.poll() is not None for p in launcher.procs.values()), type(launcher).__name__
        assert time.monotonic() - t0 < 30
    assert Path(logs).is_dir()

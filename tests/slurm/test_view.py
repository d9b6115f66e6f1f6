"""A partition's free GPUs from captured sinfo / scontrol text (the live cluster: test_planning.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxdist.cluster import load_cluster
from jaxdist.config import ConfigError
from jaxdist.slurm.view import cluster_spec, figures, parse_source, partition_view

CAPTURED = Path(__file__).with_name("captured")


def view_of(prefix: str = ""):
    sinfo, jobs = (CAPTURED / f"{prefix}sinfo.txt").read_text(), (CAPTURED / f"{prefix}jobs.txt").read_text()
    return partition_view("gpu", sinfo, jobs)


def test_untyped_gpus_take_their_indices_from_the_jobs():
    v = view_of()
    # n1: job 1 holds 0-3, job 3 holds 4 (sinfo says 5 in use); n4 is down: nothing free there
    assert {n.name: sorted(n.busy) for n in v.nodes} == {
        "n1": [0, 1, 2, 3, 4],
        "n2": [0],
        "n3": list(range(8)),
        "n4": [],
    }
    assert v.free() == {"n1": 3, "n2": 7, "n3": 0, "n4": 0}
    assert [n.holders for n in v.nodes] == [("job 1 (4)", "job 3 (1)"), ("job 3 (1)",), ("job 2 (8)",), ()]
    # the planner's busy list: global indices node * 8 + local, the down node's all of them
    assert v.busy_devices() == [0, 1, 2, 3, 4, 8, *range(16, 24), *range(24, 32)]
    assert "partition gpu: 10 of 32 GPUs free" in v.table()


def test_typed_gpus_and_a_draining_node():
    v = view_of("typed_")
    assert v.gpu_type == "h100"
    assert v.free() == {"n1": 4, "n2": 6, "n3": 0, "n4": 0}
    assert figures("slurm:gpu", v).name == "h100x8"  # the preset whose device kind names the GPU type
    assert figures("slurm:gpu@h200x8", v).name == "h200x8"


def test_a_count_without_indices_still_counts():
    sinfo = "n1 mixed gpu:8 gpu:3\n"
    v = partition_view("gpu", sinfo, "")  # no job detail seen (e.g. another user's job hidden)
    assert sorted(v.nodes[0].busy) == [0, 1, 2] and v.free() == {"n1": 5}


def test_figures_and_sources():
    assert parse_source("slurm:gpu@meshes/h100x8.toml") == ("gpu", "meshes/h100x8.toml")
    assert parse_source("slurm:debug") == ("debug", "")
    with pytest.raises(ConfigError, match="names no partition"):
        parse_source("slurm:@h100x8")
    with pytest.raises(ConfigError, match="no cluster file describes the GPUs"):
        figures("slurm:gpu", view_of())  # untyped GPUs: the cluster file must be named
    spec = cluster_spec(view_of(), load_cluster("h100x8"), 2, 4)
    assert (spec.name, spec.nodes, spec.devices_per_node, spec.memory_bytes) == (
        "slurm:gpu",
        2,
        4,
        load_cluster("h100x8").memory_bytes,
    )
    with pytest.raises(ConfigError, match="names a Slurm partition"):
        load_cluster("slurm:gpu@h100x8")

"""Slurm's text, parsed: host lists, GRES, and output captured from the fixture cluster (Slurm 22.05).

``captured/nodes.txt``, ``jobs.txt``, ``sinfo.txt``: untyped GPUs (``gpu:8``); job 1 holds 4 GPUs on n1,
job 2 all 8 of n3, job 3 one on n1 and one on n2; n4's slurmd was killed (DOWN+NOT_RESPONDING).
``captured/typed_*``: GPUs of type h100; job 1 holds 4 on n1, job 2 all of n3, job 3 two on n2 and two on
n4, job 4 waits; n4 is being drained.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxdist.slurm.parse import (
    Gres,
    expand_hostlist,
    parse_gres,
    parse_indices,
    parse_jobs,
    parse_nodes,
    parse_sinfo,
    state_usable,
)

CAPTURED = Path(__file__).with_name("captured")


def text(name: str) -> str:
    return (CAPTURED / name).read_text()


@pytest.mark.parametrize(
    "hosts, names",
    [
        ("n1", ["n1"]),
        ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
        ("n[2,4],login", ["n2", "n4", "login"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("", []),
    ],
)
def test_host_lists_expand(hosts, names):
    assert expand_hostlist(hosts) == names


def test_gres_strings():
    assert parse_indices("0-3,5") == {0, 1, 2, 3, 5} and parse_indices("N/A") == frozenset()
    assert parse_gres("gpu:8") == [Gres("gpu", "", 8)]
    assert parse_gres("gpu:h100:4(IDX:0-3)") == [Gres("gpu", "h100", 4, frozenset({0, 1, 2, 3}))]
    assert parse_gres("gpu:a100:2(IDX:0-1),gpu:v100:0(IDX:N/A)") == [
        Gres("gpu", "a100", 2, frozenset({0, 1})),
        Gres("gpu", "v100", 0, frozenset()),
    ]
    assert parse_gres("(null)") == [] and parse_gres("") == []
    # Socket affinity, as Slurm writes Gres= where gres.conf binds GPUs to cores or AutoDetect=nvml found them:
    # a count without device indices (it raised ValueError on 'S:0').
    assert parse_gres("gpu:4(S:0-1)") == [Gres("gpu", "", 4)]
    assert parse_gres("gpu:h100:8(S:0-1),gpu:a100:2(S:1)") == [Gres("gpu", "h100", 8), Gres("gpu", "a100", 2)]


def test_node_states():
    assert [state_usable(s) for s in ("IDLE", "MIXED", "idle", "mixed", "ALLOCATED", "allocated")] == [
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    assert not any(state_usable(s) for s in ("DOWN+NOT_RESPONDING", "MIXED+DRAIN", "draining", "down*", "idle*"))


def test_scontrol_show_node():
    nodes = {n.name: n for n in parse_nodes(text("nodes.txt"))}
    assert list(nodes) == ["n1", "n2", "n3", "n4"]
    assert [(n.gpus, n.gpus_used, n.used_indices) for n in nodes.values()] == [
        (8, 5, None),  # untyped GPUs: only a count on the node
        (8, 1, None),
        (8, 8, None),
        (8, 0, frozenset()),  # none in use: no index to give
    ]
    n1, n4 = nodes["n1"], nodes["n4"]
    assert (n1.state, n1.partitions, n1.addr, n1.hostname, n1.cpus, n1.cpus_alloc) == (
        "MIXED",
        ("gpu",),
        "127.0.0.1",
        "localhost",
        16,
        2,
    )
    assert n1.usable and n4.state == "DOWN+NOT_RESPONDING" and not n4.usable
    typed = {n.name: n for n in parse_nodes(text("typed_nodes.txt"))}
    assert [(n.gpu_type, n.used_indices) for n in typed.values()] == [
        ("h100", frozenset(range(4))),
        ("h100", frozenset(range(2))),
        ("h100", frozenset(range(8))),
        ("h100", frozenset(range(2))),
    ]
    assert typed["n4"].state == "MIXED+DRAIN" and not typed["n4"].usable


def test_scontrol_show_job():
    jobs = {j.job_id: j for j in parse_jobs(text("jobs.txt"))}
    assert {j: (r.name, r.state, r.nodes, r.gpus) for j, r in jobs.items()} == {
        "1": ("wrap", "RUNNING", ("n1",), {"n1": frozenset(range(4))}),
        "2": ("holder", "RUNNING", ("n3",), {"n3": frozenset(range(8))}),
        "3": ("wrap", "RUNNING", ("n1", "n2"), {"n1": frozenset({4}), "n2": frozenset({0})}),
    }
    assert jobs["3"].partition == "gpu" and jobs["3"].user == "root" and jobs["3"].batch_host == "n1"
    typed = {j.job_id: j for j in parse_jobs(text("typed_jobs.txt"))}
    assert typed["3"].gpus == {"n2": frozenset({0, 1}), "n4": frozenset({0, 1})}
    assert typed["4"].state == "PENDING" and typed["4"].nodes == () and typed["4"].gpus == {}


def test_sinfo():
    rows = parse_sinfo(text("sinfo.txt"))
    assert [(r.node, r.state, r.gpus, r.gpus_used, r.used_indices) for r in rows] == [
        ("n1", "mixed", 8, 5, None),
        ("n2", "mixed", 8, 1, None),
        ("n3", "mixed", 8, 8, None),
        ("n4", "down*", 8, 0, frozenset()),
    ]
    typed = parse_sinfo(text("typed_sinfo.txt"))
    assert [(r.node, r.state, r.gpu_type, r.used_indices) for r in typed] == [
        ("n1", "mixed", "h100", frozenset(range(4))),
        ("n2", "mixed", "h100", frozenset(range(2))),
        ("n3", "mixed", "h100", frozenset(range(8))),
        ("n4", "draining", "h100", frozenset(range(2))),
    ]


def test_a_node_with_socket_bound_gpus():
    """``scontrol show node -d`` of a node whose GPUs are bound to sockets (AutoDetect=nvml writes this)."""
    record = (
        "NodeName=g1 Arch=x86_64 CoresPerSocket=32\n   CPUAlloc=64 CPUEfctv=128 CPUTot=128 CPULoad=1.00\n"
        "   Gres=gpu:h100:8(S:0-1)\n   GresUsed=gpu:h100:4(IDX:0-3)\n   NodeAddr=10.0.0.1 NodeHostName=g1\n"
        "   State=MIXED ThreadsPerCore=2\n   Partitions=gpu\n"
    )
    (n,) = parse_nodes(record)
    assert (n.gpus, n.gpus_used, n.used_indices, n.gpu_type, n.usable) == (8, 4, frozenset(range(4)), "h100", True)

"""Cluster view: free devices, allocation files, calibration files, and their errors."""

import re

import pytest

from jaxdist.cluster import load_cluster
from jaxdist.config import ConfigError
from jaxdist.planner.cluster import Calibration, cluster_view, load_allocation, load_calibration


def test_whole_cluster_when_nothing_is_busy():
    spec = load_cluster("h100x64")
    v = cluster_view(spec)
    assert (v.nodes, v.devices_per_node, v.n_devices) == (8, 8, 64)
    assert v.devices == tuple(range(64)) and v.busy == ()
    assert v.peak_flops("bfloat16") == spec.peak_flops_bf16 and v.peak_flops("float32") == spec.peak_flops_fp32


def test_busy_nodes_leave_whole_nodes():
    v = cluster_view(load_cluster("h100x64"), busy=["0:*", "1:*", "2:0-3"])
    # 5 whole nodes free (40 devices) beats 6 nodes x 4 (24).
    assert (v.nodes, v.devices_per_node) == (5, 8)
    assert v.devices == tuple(range(24, 64)) and len(v.busy) == 20


def test_busy_devices_spread_over_nodes_give_the_largest_even_block():
    # Every node loses 2 devices: 8 nodes x 6 = 48 beats any whole-node block.
    busy = [n * 8 + i for n in range(8) for i in (0, 1)]
    v = cluster_view(load_cluster("h100x64"), busy=busy)
    assert (v.nodes, v.devices_per_node) == (8, 6)
    assert set(v.devices).isdisjoint(busy) and len(v.devices) == 48


def test_two_jobs_share_a_cluster_through_an_allocation_file(tmp_path):
    spec = load_cluster("h100x64")
    alloc = tmp_path / "alloc.toml"
    alloc.write_text('[jobs.first]\ndevices = ["0:*", "1:*", "2:*", 24, 25, 26, 27, "3:4-7"]\n')
    assert sorted(load_allocation(alloc, spec)) == list(range(32))
    v = cluster_view(spec, busy=alloc)
    assert (v.nodes, v.devices_per_node) == (4, 8) and min(v.devices) == 32


@pytest.mark.parametrize(
    "busy, fragment",
    [
        ([64], "outside the cluster's 64 devices"),
        (["9:0"], "outside the cluster (8 nodes x 8 devices)"),
        (["a:b"], "is not 'NODE:LOCAL'"),
        ([f"{n}:*" for n in range(8)], "every device of cluster 'h100x64' is busy"),
    ],
)
def test_bad_busy_lists_are_one_sentence_errors(busy, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        cluster_view(load_cluster("h100x64"), busy=busy)


def test_allocation_file_errors(tmp_path):
    spec = load_cluster("h100x8")
    with pytest.raises(ConfigError, match="does not exist"):
        load_allocation(tmp_path / "none.toml", spec)
    (tmp_path / "a.toml").write_text("[other]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"no \[jobs.NAME\] tables"):
        load_allocation(tmp_path / "a.toml", spec)


def test_calibration_overrides_the_cluster_file(tmp_path):
    cal = Calibration(device_kind="cpu", efficiency=0.2, intra_node_bandwidth=3e9, intra_node_latency=2e-5)
    path = tmp_path / "cal.json"
    path.write_text(cal.to_json())
    assert load_calibration(path) == cal
    v = cluster_view(load_cluster("cpu-8"), calibration=cal)
    assert (v.efficiency, v.intra_node_bandwidth, v.intra_node_latency) == (0.2, 3e9, 2e-5)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(ConfigError, match="is malformed"):
        load_calibration(tmp_path / "bad.json")


def test_smaller_views_most_devices_first_and_made_only_when_asked(monkeypatch):
    """The fallback sub-blocks come most devices first (then more per node), and the planner builds none
    when a mesh of every free device suits: building them all first cost nodes^2 x devices per node
    (11 s of a 16 s plan on 2,048 nodes)."""
    import dataclasses
    import importlib
    import itertools

    from jaxdist.config import load_config
    from jaxdist.planner.cluster import smaller_views

    plan_module = importlib.import_module("jaxdist.planner.plan")  # the module (the package exports the function)

    v = cluster_view(load_cluster("h100x64"), busy=["0:*", "1:0-3"])  # 6 whole nodes + one with 4 free
    got = [(s.nodes, s.devices_per_node) for s in smaller_views(v)]
    per = v.devices_per_node
    want = sorted(
        ((n, k) for n in range(v.nodes, 0, -1) for k in range(per, 0, -1) if per % k == 0 and (n, k) != (v.nodes, per)),
        key=lambda nk: (-nk[0] * nk[1], -nk[1]),
    )  # brute force: every sub-block, stably sorted
    assert got == want and len(got) > 10
    assert all(len(s.devices) == s.nodes * s.devices_per_node for s in smaller_views(v))

    made = [0]

    def counted(view):
        for s in smaller_views(view):
            made[0] += 1
            yield s

    monkeypatch.setattr(plan_module, "smaller_views", counted)
    big = dataclasses.replace(load_cluster("h100x8"), nodes=2048, name="h100x16384")
    p = plan_module.plan(load_config(None, ["model=llama-70b"]).model, big, batch_size=4096, seq_len=4096)
    assert p.cluster.n_devices == 16384 and made[0] == 0
    assert list(itertools.islice(counted(cluster_view(big)), 2)) and made[0] == 2

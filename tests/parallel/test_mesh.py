"""Cluster descriptions, the hybrid layout decision and the mesh builder."""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxdist.cluster import MESHES_DIR, ClusterSpec, list_clusters, load_cluster
from jaxdist.config import MESH_AXES, ConfigError, MeshConfig
from jaxdist.controller.ports import free_port
from jaxdist.parallel.mesh import build_mesh, cluster_from_devices, describe_mesh, device_grid, hybrid_shapes

REPO = Path(__file__).parents[2]

GOOD = textwrap.dedent("""\
    name = "mine"
    device_kind = "cpu"
    nodes = 2
    devices_per_node = 4
    memory_bytes = 1_000_000
    peak_flops_bf16 = 1e10
    peak_flops_fp32 = 1e10
    intra_node_bandwidth = 1e9
    inter_node_bandwidth = 1e8
    intra_node_latency = 1e-5
    inter_node_latency = 1e-4
    """)


def _write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


# --------------------------------------------------------------------------- cluster files


def test_every_preset_loads_and_is_consistent():
    names = list_clusters()
    assert {"cpu-8", "cpu-2x4", "h100x8", "h200x8", "h100x64"} <= set(names)
    for name in names:
        spec = load_cluster(name)
        assert spec.name == name, f"meshes/{name}.toml says name={spec.name!r}"
        assert spec.n_devices == spec.nodes * spec.devices_per_node
        assert spec.peak_flops_bf16 >= spec.peak_flops_fp32 > 0
        assert spec.intra_node_bandwidth >= spec.inter_node_bandwidth
        assert spec.intra_node_latency <= spec.inter_node_latency


def test_preset_numbers():
    h100 = load_cluster("h100x64")
    assert (h100.nodes, h100.devices_per_node, h100.n_devices) == (8, 8, 64)
    assert h100.peak_flops_bf16 == 989e12
    assert h100.intra_node_bandwidth == 450e9
    assert h100.inter_node_bandwidth == 400e9 / 8  # 400 Gb/s per GPU
    h200 = load_cluster("h200x8")
    assert h200.peak_flops_bf16 == h100.peak_flops_bf16
    assert h200.memory_bytes > 140e9 > h100.memory_bytes
    assert load_cluster("cpu-8").n_devices == 8
    assert load_cluster("cpu-2x4").nodes == 2


def test_load_by_path(tmp_path):
    spec = load_cluster(str(_write(tmp_path, GOOD)))
    assert spec == ClusterSpec("mine", "cpu", 2, 4, 1_000_000, 1e10, 1e10, 1e9, 1e8, 1e-5, 1e-4)
    assert isinstance(spec.memory_bytes, int) and isinstance(spec.peak_flops_bf16, float)
    assert load_cluster(MESHES_DIR / "cpu-8.toml") == load_cluster("cpu-8")


def test_missing_file_lists_the_presets():
    with pytest.raises(ConfigError, match="cluster description 'h100x9' not found") as e:
        load_cluster("h100x9")
    assert "cpu-8" in str(e.value) and "h100x64" in str(e.value)
    with pytest.raises(ConfigError, match="not found"):
        load_cluster("/nonexistent/dir/x.toml")


def test_unknown_field_suggests_the_right_one(tmp_path):
    p = _write(tmp_path, GOOD.replace("device_kind", "device_knd"))
    with pytest.raises(ConfigError, match="unknown field 'device_knd': did you mean 'device_kind'"):
        load_cluster(str(p))


def test_missing_field(tmp_path):
    text = "\n".join(line for line in GOOD.splitlines() if not line.startswith("memory_bytes"))
    with pytest.raises(ConfigError, match="missing the field memory_bytes"):
        load_cluster(str(_write(tmp_path, text)))


@pytest.mark.parametrize(
    "line,message",
    [
        ("nodes = 0", "field 'nodes' = 0 must be positive"),
        ("inter_node_latency = -1e-4", "field 'inter_node_latency' = -0.0001 must be positive"),
        ('peak_flops_bf16 = "fast"', "field 'peak_flops_bf16' must be a number"),
        ("devices_per_node = 2.5", "field 'devices_per_node' must be a whole number"),
    ],
)
def test_bad_values(tmp_path, line, message):
    key = line.split(" = ")[0]
    text = "\n".join(line if ln.startswith(key + " ") else ln for ln in GOOD.splitlines())
    with pytest.raises(ConfigError, match=message):
        load_cluster(str(_write(tmp_path, text)))


def test_invalid_toml(tmp_path):
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_cluster(str(_write(tmp_path, "name = ")))


def test_cluster_from_live_cpu_devices():
    spec = cluster_from_devices()
    cpu = load_cluster("cpu-8")
    assert (spec.name, spec.device_kind, spec.nodes, spec.devices_per_node) == ("live", "cpu", 1, 8)
    assert spec.peak_flops_bf16 == cpu.peak_flops_bf16  # taken from the preset of the same kind
    assert spec.memory_bytes > 0
    assert cluster_from_devices(jax.devices()[:2]).devices_per_node == 2


# --------------------------------------------------------------------------- hybrid layout


def _sizes(**kw):
    return {a: kw.get(a, 1) for a in MESH_AXES}


def test_hybrid_tensor_stays_in_node():
    ici, dcn = hybrid_shapes(_sizes(fsdp=8, tensor=8), n_nodes=8, per_node=8)
    assert ici == (1, 1, 1, 8, 1, 1) and dcn == (1, 8, 1, 1, 1, 1)


def test_hybrid_nodes_go_to_data_first_then_fsdp():
    assert hybrid_shapes(_sizes(data=8, tensor=8), 8, 8) == ((1, 1, 1, 8, 1, 1), (8, 1, 1, 1, 1, 1))
    assert hybrid_shapes(_sizes(data=2, fsdp=32), 8, 8) == ((1, 8, 1, 1, 1, 1), (2, 4, 1, 1, 1, 1))
    assert hybrid_shapes(_sizes(data=4, fsdp=4, tensor=2, expert=2), 8, 8) == (
        (1, 2, 1, 2, 2, 1),
        (4, 2, 1, 1, 1, 1),
    )
    # Whatever the split, the element-wise product is the mesh shape and the inner shape fills a node.
    for sizes in (_sizes(data=6, fsdp=4, tensor=2), _sizes(data=3, fsdp=16), _sizes(fsdp=24, pipeline=2)):
        ici, dcn = hybrid_shapes(sizes, 12, 4)
        assert tuple(i * d for i, d in zip(ici, dcn)) == tuple(sizes[a] for a in MESH_AXES)
        assert math.prod(ici) == 4 and math.prod(dcn) == 12
        assert dcn[2:] == (1, 1, 1, 1)


def test_hybrid_errors():
    with pytest.raises(ConfigError, match="tensor\\*expert\\*pipeline = 16 does not fit inside one node of 8"):
        hybrid_shapes(_sizes(data=4, tensor=16), 8, 8)
    with pytest.raises(ConfigError, match="tensor\\*expert\\*pipeline = 3 does not fit"):
        hybrid_shapes(_sizes(data=2, tensor=3), 2, 4)
    with pytest.raises(ConfigError, match="data\\*fsdp = 2 cannot span the 4 nodes"):
        hybrid_shapes(_sizes(data=2, tensor=4), 4, 4)


def _fake_devices(nodes, per_node):
    return [
        SimpleNamespace(id=p * per_node + i, process_index=p, platform="cpu", device_kind="cpu")
        for p in range(nodes)
        for i in range(per_node)
    ]


def test_device_grid_keeps_tensor_groups_inside_a_process():
    devices = _fake_devices(8, 8)
    grid = device_grid(_sizes(data=2, fsdp=4, tensor=8), devices)
    assert grid.shape == (2, 4, 1, 8, 1, 1)
    proc = np.vectorize(lambda d: d.process_index)(grid)
    # each tensor group (last-but-two axis) is one process; each data x fsdp slice spans all 8
    assert (proc == proc[:, :, :, :1]).all()
    assert sorted(proc[:, :, 0, 0].ravel()) == list(range(8))
    assert sorted(d.id for d in grid.ravel()) == list(range(64))


# --------------------------------------------------------------------------- build_mesh


def _ids(mesh):
    return sorted(d.id for d in mesh.devices.ravel())


def test_build_mesh_fills_data():
    mesh = build_mesh(MeshConfig(data=-1))
    assert mesh.axis_names == MESH_AXES
    assert dict(mesh.shape) == _sizes(data=8)
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    assert _ids(mesh) == sorted(d.id for d in jax.devices())


@pytest.mark.parametrize(
    "cfg,sizes",
    [
        (MeshConfig(data=2, fsdp=2, tensor=2), _sizes(data=2, fsdp=2, tensor=2)),
        (MeshConfig(data=1, fsdp=8), _sizes(fsdp=8)),
        (MeshConfig(data=2, tensor=4), _sizes(data=2, tensor=4)),
        (MeshConfig(data=-1, tensor=2, pipeline=2), _sizes(data=2, tensor=2, pipeline=2)),
    ],
)
def test_build_mesh_shapes(cfg, sizes):
    mesh = build_mesh(cfg)
    assert dict(mesh.shape) == sizes
    assert mesh.devices.shape == tuple(sizes[a] for a in MESH_AXES)
    assert _ids(mesh) == list(range(8))


def test_build_mesh_tensor_groups_are_neighbours():
    mesh = build_mesh(MeshConfig(data=2, tensor=4))
    groups = [sorted(d.id for d in mesh.devices[i, 0, 0, :, 0, 0]) for i in range(2)]
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_build_mesh_on_a_subset_and_errors():
    mesh = build_mesh(MeshConfig(fsdp=2), jax.devices()[:4])
    assert dict(mesh.shape) == _sizes(data=2, fsdp=2) and _ids(mesh) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="has 6 devices but 8 are available"):
        build_mesh(MeshConfig(data=3, tensor=2))
    with pytest.raises(ConfigError, match="does not divide the 8 devices"):
        build_mesh(MeshConfig(tensor=3))


def test_describe_mesh():
    assert (
        describe_mesh(build_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
        == "data=2 fsdp=2 tensor=2 (8 devices, 1 process)"
    )
    assert describe_mesh(build_mesh(MeshConfig(data=1), jax.devices()[:1])) == "single device (1 device, 1 process)"


# --------------------------------------------------------------------------- two processes

_WORKER = textwrap.dedent("""\
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=2, process_id=int(sys.argv[2]))
    import numpy as np
    from jaxdist.config import ConfigError, MeshConfig
    from jaxdist.parallel.mesh import build_mesh, cluster_from_devices, describe_mesh
    mesh = build_mesh(MeshConfig(fsdp=2, tensor=4))
    proc = np.vectorize(lambda d: d.process_index)(mesh.devices)[0, :, 0, :, 0, 0].tolist()
    spec = cluster_from_devices()
    try:
        build_mesh(MeshConfig(data=1, tensor=8))
        err = "none"
    except ConfigError as e:
        err = str(e)
    print("RESULT", describe_mesh(mesh), proc, spec.nodes, spec.devices_per_node, "|", err, flush=True)
    """)


def test_two_processes_get_the_hybrid_layout(tmp_path):
    script = _write(tmp_path, _WORKER, "worker.py")
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), port, str(i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=60)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT"))
        # fsdp crosses the two processes; each tensor group lies in one process.
        assert line.startswith("RESULT fsdp=2 tensor=4 (8 devices, 2 processes) [[0, 0, 0, 0], [1, 1, 1, 1]] 2 4 |")
        assert "tensor*expert*pipeline = 8 does not fit inside one node of 4 devices" in line

"""The JAX-free cluster module: the one rule from a mesh.cluster value to a file, peak FLOP/s, simulated devices."""

import os
import subprocess
import sys

import pytest

from jaxdist.cluster import (
    MESHES_DIR,
    ClusterSpec,
    cluster_path,
    list_clusters,
    load_cluster,
    prepare_host_devices,
    preset_for_kind,
    simulated_devices,
    without_device_count,
)
from jaxdist.config import ConfigError, load_config


def test_a_bare_name_is_a_preset_and_anything_else_a_path(tmp_path, monkeypatch):
    assert cluster_path("cpu-8") == MESHES_DIR / "cpu-8.toml"
    monkeypatch.chdir(tmp_path)
    assert str(cluster_path("mine.toml")) == "mine.toml"  # the .toml ending makes it a path
    assert str(cluster_path("dir/mine")) == "dir/mine"  # so does a directory
    assert cluster_path("/abs/x.toml").as_posix() == "/abs/x.toml"
    # meshes/NAME.toml written inside the repository and used from elsewhere: the preset NAME.
    assert cluster_path("meshes/h100x8.toml") == MESHES_DIR / "h100x8.toml"
    assert load_cluster("meshes/h100x8.toml") == load_cluster("h100x8")
    # ... unless such a file exists where it is named.
    (tmp_path / "meshes").mkdir()
    own = tmp_path / "meshes" / "h100x8.toml"
    own.write_text((MESHES_DIR / "h100x8.toml").read_text().replace("nodes = 1", "nodes = 3"))
    assert str(cluster_path("meshes/h100x8.toml")) == "meshes/h100x8.toml"
    assert load_cluster("meshes/h100x8.toml").nodes == 3
    with pytest.raises(ConfigError, match="not found"):
        load_cluster("meshes/h100x9.toml")  # no such preset either


def test_peak_flops_by_dtype():
    spec = load_cluster("h100x8")
    assert spec.peak_flops("bfloat16") == spec.peak_flops_bf16 == 989e12
    assert spec.peak_flops("float32") == spec.peak_flops_fp32 < spec.peak_flops_bf16
    odd = ClusterSpec("x", "gpu", 1, 1, 1, 3.0, 2.0, 1.0, 1.0, 1.0, 1.0)
    assert (odd.peak_flops("bfloat16"), odd.peak_flops("float32"), odd.peak_flops("float16")) == (3.0, 2.0, 2.0)


def test_preset_for_kind_is_case_insensitive():
    spec = load_cluster("cpu-8")
    found = preset_for_kind(spec.device_kind.upper())
    assert found is not None and found.device_kind == spec.device_kind and found.name in list_clusters()
    assert preset_for_kind("no such device") is None


def test_simulated_devices_only_for_cpu_clusters(monkeypatch):
    assert simulated_devices(load_config(None, ["mesh.cluster=cpu-8"])) == 8
    assert simulated_devices(load_config(None, ["mesh.cluster=cpu-2x4"])) == 4  # per process
    assert simulated_devices(load_config(None, ["mesh.cluster=h100x8"])) is None
    assert simulated_devices(load_config(None, ["mesh.cluster=nowhere"])) is None  # reported where it is used
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    prepare_host_devices(load_config(None, ["mesh.cluster=cpu-2x4"]))
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    prepare_host_devices(load_config(None, ["mesh.cluster=cpu-8"]))  # a count already chosen is kept
    assert os.environ["XLA_FLAGS"] == "--xla_foo=1 --xla_force_host_platform_device_count=4"
    # a job's processes get the user's flags without the count, which their cluster file sets again
    assert without_device_count(os.environ["XLA_FLAGS"] + " --xla_bar") == "--xla_foo=1 --xla_bar"
    assert without_device_count("") == ""


def test_the_cluster_module_and_the_controller_do_not_import_jax():
    code = (
        "import sys, jaxdist.cluster, jaxdist.controller.controller, jaxdist.controller.policy; "
        "jaxdist.cluster.load_cluster('cpu-8'); assert 'jax' not in sys.modules, 'jax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

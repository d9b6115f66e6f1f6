"""Cached cluster setup: reuse with the same key, rebuild on any change, never a stale entry."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jaxdist.controller.setup_cache import SetupCache, SetupKey, library_versions

VERSIONS = {"jax": "0.10.2", "jaxlib": "0.10.2", "python": "3.11.7"}
MESH = {"data": 4, "fsdp": 2, "tensor": 1, "expert": 1, "pipeline": 1}


def _key(**change) -> SetupKey:
    base = dict(hosts=["h0", "h1", "h2", "h3"], devices_per_host=2, device_kind="cpu", mesh=MESH, versions=VERSIONS)
    base.update(change)
    return SetupKey.make(**base)


def _complete(cache: SetupCache, key: SetupKey, order=(0, 1, 2, 3, 4, 5, 6, 7)):
    e = cache.get_or_create(key, "127.0.0.1:1234")
    assert e.fresh
    assert e.mark_started(list(order))
    return e


def test_same_key_reuses_the_entry(tmp_path):
    cache = SetupCache(tmp_path)
    first = _complete(cache, _key())
    (first.compile_cache / "jit_train_step-abc-cache").write_bytes(b"x" * 10)
    again = SetupCache(tmp_path).get_or_create(_key())
    assert not again.fresh and again.complete
    assert again.path == first.path and again.coordinator == "127.0.0.1:1234"
    assert again.mesh_device_order == list(range(8)) and again.rank_hosts == ["h0", "h1", "h2", "h3"]
    assert again.worker_env(0) == {"JAXDIST_COMPILE_CACHE": str(first.compile_cache)}
    assert (again.compile_cache / "jit_train_step-abc-cache").read_bytes() == b"x" * 10


@pytest.mark.parametrize(
    "change",
    [
        dict(hosts=["h0", "h1", "h2", "h9"]),
        dict(hosts=["h1", "h0", "h2", "h3"]),
        dict(devices_per_host=4),
        dict(device_kind="NVIDIA H100"),
        dict(mesh={**MESH, "data": 2, "fsdp": 4}),
        dict(versions={**VERSIONS, "jaxlib": "0.11.0"}),
    ],
)
def test_any_change_of_the_key_rebuilds(tmp_path, change):
    cache = SetupCache(tmp_path)
    old = _complete(cache, _key())
    new = cache.get_or_create(_key(**change))
    assert new.fresh and not new.complete and new.path != old.path
    assert new.coordinator == "" and new.mesh_device_order is None
    # the old entry is untouched (another job may still use it)
    assert cache.lookup(_key()) is not None


def test_compile_cache_is_shared_across_host_sets_only(tmp_path):
    cache = SetupCache(tmp_path)
    a = cache.get_or_create(_key())
    b = cache.get_or_create(_key(hosts=["h0", "h1", "h2", "standby"]))  # a swapped-in standby
    c = cache.get_or_create(_key(versions={**VERSIONS, "jax": "0.11.0"}))
    assert a.path != b.path and a.compile_cache == b.compile_cache
    assert c.compile_cache != a.compile_cache


def test_stale_entries_are_never_used(tmp_path):
    cache = SetupCache(tmp_path)
    # 1. never completed (its first run died before a step)
    e = cache.get_or_create(_key())
    assert cache.lookup(_key()) is None and cache.stale_removed == [e.path.name]
    assert not e.path.exists()
    # 2. a recorded file changed size (NCCL topology of a GPU key)
    gk = _key(device_kind="NVIDIA H100")
    e = cache.get_or_create(gk)
    for r in range(4):
        for f in e.nccl_files(r):
            f.write_text("<system/>")
    assert e.mark_started(None) and len(e.files) == 8
    assert cache.lookup(gk) is not None
    e.nccl_files(2)[0].write_text("<system version='2'/>")
    assert cache.lookup(gk) is None and not e.path.exists()
    # 3. the stored key does not match the one asked for (e.g. edited, or a digest collision)
    e = _complete(cache, _key())
    data = json.loads((e.path / "entry.json").read_text())
    data["key"]["versions"][0][1] = "0.9.0"
    (e.path / "entry.json").write_text(json.dumps(data))
    assert cache.lookup(_key()) is None
    # rebuilt from scratch afterwards
    assert cache.get_or_create(_key()).fresh


def test_mesh_order_contradiction_and_gpu_env(tmp_path):
    cache = SetupCache(tmp_path)
    e = _complete(cache, _key())
    reused = cache.get_or_create(_key())
    assert reused.mark_started(list(range(8)))
    assert not reused.mark_started([1, 0, 2, 3, 4, 5, 6, 7])  # the caller then invalidates the entry
    gk = _key(device_kind="NVIDIA H200")
    g = cache.get_or_create(gk)
    topo, graph = g.nccl_files(1)
    assert g.worker_env(1) == {
        "JAXDIST_COMPILE_CACHE": str(g.compile_cache),
        "NCCL_TOPO_DUMP_FILE": str(topo),
        "NCCL_GRAPH_DUMP_FILE": str(graph),
    }
    for r in range(4):
        for f in g.nccl_files(r):
            f.write_text("<graphs/>")
    g.mark_started(None)
    again = cache.get_or_create(gk)
    assert again.worker_env(1) == {
        "JAXDIST_COMPILE_CACHE": str(g.compile_cache),
        "NCCL_TOPO_FILE": str(topo),
        "NCCL_GRAPH_FILE": str(graph),
    }
    assert e.worker_env(0).keys() == {"JAXDIST_COMPILE_CACHE"}  # CPU: no NCCL


def test_layouts_and_versions(tmp_path):
    cache = SetupCache(tmp_path)
    _complete(cache, _key())
    _complete(cache, _key(hosts=["x", "y", "z", "w"], devices_per_host=4))
    cache.get_or_create(_key(hosts=["p", "q", "r", "s"]))  # incomplete: not offered
    keys = cache.layouts(devices_per_host=2, device_kind="cpu")
    assert [k.hosts for k in keys] == [("h0", "h1", "h2", "h3")]
    assert dataclasses.replace(keys[0]) == _key()
    v = library_versions()
    assert v["jax"] == __import__("jax").__version__ and v["python"].count(".") == 2

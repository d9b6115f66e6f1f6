"""The fast local tier across nodes: 4 JAX processes x 2 CPU devices, each pretending to be a node.

Each process's node-local directory is ``local/<node>`` (``$JAXDIST_NODE``),
so a process started on a new node name finds nothing there, like a
replacement machine.  The job (``fsdp=4`` over the processes: every process
holds different shards) saves persistently every 2 steps and locally every
step, and every process exits at step 7 before saving it:

* one node replaced (rank 2): its shards come back from the peer holding its
  replica, the job resumes from local step 6 and ends bit-identical to an
  uninterrupted run;
* (a copy of the crashed job) two neighbouring nodes replaced (ranks 2 and 3: rank 2's
  replica lived on rank 3's node): the local step cannot be rebuilt, the job
  resumes from the persistent step 6 and ends bit-identical too;
* (another copy) the group shrunk to 2 of its nodes: local step 6 rebuilt on the new mesh.

The crashed job runs once (the module's ``crashed`` fixture); each case resumes its own copy of it.

With ``data=4`` across the processes every process holds the same pieces, so
a save sends its peer nothing but the step's metadata, and a replaced node's
state is rebuilt from its peer's own file (checked bit for bit).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from procs import Group, cluster_file  # noqa: E402

from jaxdist.checkpoint.local import run_folder  # noqa: E402

TIMEOUT = 240  # seconds for one process group; a healthy one takes ~15-25 s
STEPS = 10


def overrides(tmp: Path, name: str) -> list[str]:
    return [
        "model=tiny",
        f"train.steps={STEPS}",
        "train.seq_len=32",
        "train.batch_size=8",
        "data.max_bytes=200000",
        f"mesh.cluster={cluster_file(tmp, 4, 2)}",
        "mesh.fsdp=4",
        "mesh.tensor=2",
        "train.log_every=5",
        "checkpoint.every=2",
        f"checkpoint.local_dir={tmp}/local/{{node}}",
        f"train.runs_dir={tmp / 'runs'}",
        f"train.name={name}",
    ]


def fit(tmp: Path, name: str, nodes: list[str], tag: str, crash_at: int | None = None) -> list[dict]:
    spec = {"overrides": overrides(tmp, name), "crash_at": crash_at}
    with Group(tmp, 4, 2, ["fit", json.dumps(spec)], tag=tag, nodes=nodes) as g:
        g.wait(TIMEOUT, code=17 if crash_at else 0)
        return [g.results(i)[-1] if g.results(i) else None for i in range(4)]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    """The job of 4 nodes a-d, every process exited at step 7 (local step 6 and persistent step 6 saved)."""
    root = tmp_path_factory.mktemp("crashed")
    fit(root, "job", ["a", "b", "c", "d"], "gen1", crash_at=7)
    return root


def copy_of(crashed: Path, root: Path) -> Path:
    """The crashed job as it stands (run directory and every node's local files), under ``root``: each node's
    folder of the run renamed to the one the run at its new path uses (the folder name hashes the run
    directory's path), so the copy finds its local steps as the crashed job in place would."""
    for part in ("runs", "local"):
        shutil.copytree(crashed / part, root / part)
    old, new = (run_folder("job", r / "runs" / "job") for r in (crashed, root))
    for folder in (root / "local").glob(f"*/{old}"):
        folder.rename(folder.parent / new)
    return root


def test_replaced_node_restores_from_its_peer(tmp_path, crashed):
    ref = fit(tmp_path, "ref", ["a", "b", "c", "d"], "ref")
    assert {r["digest"] for r in ref} == {ref[0]["digest"]} and ref[0]["step"] == STEPS
    assert [r["shift"] for r in ref] == [1] * 4  # rank r's replica on rank r+1's node
    assert all(r["local_steps"] == [9, 10] for r in ref)  # at persistent steps (8, 10) too: keep 2

    job = ["a", "b", "c", "d"]
    local = crashed / "local"
    for node, rank in zip(job, range(4)):  # each node: its own rank's files and its left neighbour's
        files = sorted(p.name for p in local.glob(f"{node}/job-*/6/*.bin"))
        assert files == sorted([f"r{rank}.w{rank}.bin", f"r{(rank - 1) % 4}.w{rank}.bin"]), files
    one, other = copy_of(crashed, tmp_path / "one"), copy_of(crashed, tmp_path / "other")

    # Rank 2 on new node e: rank 3 (node d) holds its replica -> local step 6, then on to the end.
    res = fit(one, "job", ["a", "b", "e", "d"], "gen2")
    assert all(r["resumed_from"] == ["local", 6] for r in res), res
    assert {r["digest"] for r in res} == {ref[0]["digest"]}

    # The copy, ranks 2 and 3 on new nodes e, f: rank 2's shards are gone from everywhere -> persistent
    # step 6, and the job still ends exactly.
    res = fit(other, "job", ["a", "b", "e", "f"], "job2-gen2")
    assert all(r["resumed_from"] == ["persistent", 6] for r in res), res
    assert {r["digest"] for r in res} == {ref[0]["digest"]}


def test_pieces_the_peer_holds_are_not_sent(tmp_path):
    spec = {
        "overrides": [
            "model=tiny",
            "train.seq_len=32",
            "train.batch_size=8",
            "data.max_bytes=200000",
            f"mesh.cluster={cluster_file(tmp_path, 4, 2)}",
            "mesh.data=4",
            "mesh.fsdp=2",
            f"train.runs_dir={tmp_path / 'runs'}",
            "train.name=dp",
        ],
        "ckpt": str(tmp_path / "persistent"),
        "local": str(tmp_path / "local"),
        "steps": 1,
    }
    # worker.py checks that rank 2, its own files deleted, gets back exactly the state it had
    with Group(tmp_path, 4, 2, ["tiers", json.dumps(spec)], tag="dp", nodes=["a", "b", "c", "d"]) as g:
        g.wait(TIMEOUT)
        res = [g.results(i)[0] for i in range(4)]
    for r in res:
        assert r["local_sent"] < 4096 < r["local_payload"], r  # only the metadata crosses to the peer


def test_a_shrunk_group_restores_the_local_step_resharded(tmp_path, crashed):
    """Issue 35 item 4: the job of 4 nodes (fsdp=4 x tensor=2, a local step every step, persistent every 2)
    crashed at step 7; the group comes back on 2 of its nodes, b and d (2 processes x 2 devices, fsdp=2 x
    tensor=2: the mesh a shrink gives). Their node-local files hold every old rank's pieces (b: ranks 1 and 0's
    replica, d: ranks 3 and 2's replica), so local step 6 is rebuilt on the new mesh, and the job ends bit for
    bit where another copy of the same crashed job ends that restores persistent step 6 on two new nodes (steps
    before 7 trained on the 4-node mesh in both: the 2-node mesh sums in another order)."""

    def fit2(root: Path, nodes: list[str], tag: str) -> list[dict]:
        ov = [o for o in overrides(root, "job") if not o.startswith("mesh.")]
        spec = {"overrides": [*ov, f"mesh.cluster={cluster_file(root, 2, 2)}", "mesh.fsdp=2", "mesh.tensor=2"]}
        with Group(root, 2, 2, ["fit", json.dumps(spec)], tag=tag, nodes=nodes) as g:
            g.wait(TIMEOUT)
            return [g.results(i)[-1] for i in range(2)]

    res = fit2(copy_of(crashed, tmp_path / "shrunk"), ["b", "d"], "gen2")
    assert all(r["resumed_from"] == ["local", 6] for r in res), res
    assert all(r["step"] == STEPS for r in res)
    ref = fit2(copy_of(crashed, tmp_path / "other"), ["x", "y"], "copy-gen2")  # new nodes: nothing local
    assert all(r["resumed_from"] == ["persistent", 6] for r in ref), ref
    assert {r["digest"] for r in res} == {ref[0]["digest"]}

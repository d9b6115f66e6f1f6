"""One real Slurm cluster for every Slurm test of the session: 4 nodes x 8 fake GPUs on this machine.

Started in a fresh temporary directory (configuration, state, spool, logs), stopped by PID at the end of
the session, also when a test fails.  Skipped, saying why, where the Slurm packages are missing
(``.ci/run`` installs them) or the tests do not run as root.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from .local_cluster import LocalSlurmCluster, SlurmUnavailable

NODES, GPUS_PER_NODE = 4, 8


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """The running :class:`LocalSlurmCluster`; ``SLURM_CONF`` points every client of the session at it."""
    # A short path: slurmd's and munged's socket paths must stay under the 108 bytes of sun_path.
    root = tempfile.mkdtemp(prefix="jaxdist-slurm-")
    cluster = LocalSlurmCluster(root, nodes=NODES, gpus_per_node=GPUS_PER_NODE)
    try:
        cluster.start()
    except SlurmUnavailable as e:
        shutil.rmtree(root, ignore_errors=True)
        if os.environ.get("JAXDIST_REQUIRE_SLURM") == "1":  # .ci/run installed Slurm: a cluster that won't start fails
            pytest.fail(f"Slurm is installed but the local cluster did not start: {e}")
        pytest.skip(f"no local Slurm cluster: {e}")
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    before = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    print(f"\nlocal Slurm cluster: {NODES} nodes x {GPUS_PER_NODE} GPUs idle {cluster.start_seconds:.2f} s after start")
    try:
        yield cluster
    finally:
        cluster.stop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        shutil.rmtree(root, ignore_errors=True)

"""Fixtures of the controller tests."""

from __future__ import annotations

import pytest

from jaxdist.config import load_config
from jaxdist.controller.controller import Controller


@pytest.fixture
def ctl(tmp_path):
    """The controller of a job on cpu-2x4, built in this process (no JAX, no agents): messages go to its
    ``handle``, what it would send goes nowhere."""
    c = Controller(load_config(None, [f"train.runs_dir={tmp_path}", "train.name=ctl", "mesh.cluster=cpu-2x4"]), [])
    c.endpoint.send = lambda to, msg: None
    yield c
    c.endpoint.close()
    c.run_lock.release()

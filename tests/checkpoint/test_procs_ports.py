"""The multi-process harness survives a coordinator port taken between its choice and its use: the whole group
starts again once on another port (the flake of a fresh-clone CI run on 2026-12-07: gen1.0 exited with -11 after
``Failed to add port to server ... '[::]:39351'``)."""

from __future__ import annotations

import json
import socket

from jaxdist.controller.ports import free_port
from tests.checkpoint import procs


def test_a_group_whose_coordinator_port_is_taken_starts_again_on_another(tmp_path, monkeypatch):
    with socket.socket() as held:  # a listener on loopback that does not share its port (no SO_REUSEPORT)
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        ports = iter([taken])
        monkeypatch.setattr(procs, "free_port", lambda: next(ports, None) or free_port())
        with procs.Group(tmp_path, 2, 1, ["save", json.dumps({"jobs": []})], tag="p") as g:
            g.wait(timeout=180)
    first = (tmp_path / "p.0.port-taken.log").read_text(errors="replace")
    assert procs.PORT_TAKEN in first, first[-2000:]
    assert "INITIALIZED" in g.log(0) and "INITIALIZED" in g.log(1)

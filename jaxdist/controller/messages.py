"""What the controller reads from its peers: the fields each kind of message must and may carry, checked once
at the edge (:func:`message_problem`) so that a peer of another version or with a bug is refused there, never a
crash of the controller behind it."""

from __future__ import annotations

from typing import Any

from jaxdist.controller.protocol import NONE, NUMBER, fields_problem

# What each kind of message must carry, and the types of what it may carry: an authentic message that does not
# match (an agent of another jaxdist version, a bug in one) is refused at the edge, never a crash of the controller.
MESSAGE_FIELDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "node_hb": (
        {"node": str, "procs": list},
        {"host": str, "checks": dict, "probe": str, "free_port": int, "stall": (dict, NONE), "workers": list},
    ),
    "hb": (
        {"node": str, "pid": int, "state": str, "gen": int, "rank": int, "step": int},
        {
            "resume_step": (int, NONE),
            "tokens_per_s": NUMBER,
            "periods": list,
            "loop": (dict, NONE),
            "beat": int,
            "age": NUMBER,
        },
    ),
    "exit": ({"node": str, "pid": int, "rc": int}, {}),
    "probe_result": ({"node": str}, {"rtt": dict}),
}


def message_problem(msg: dict[str, Any]) -> str | None:
    """Why ``msg`` is not a controller message of its kind (one phrase), or None (see MESSAGE_FIELDS)."""
    problem = fields_problem(msg, MESSAGE_FIELDS)
    if problem is None and msg.get("t") == "node_hb":
        for p in msg["procs"]:
            if not isinstance(p, dict) or not isinstance(p.get("pid"), int) or not isinstance(p.get("rc"), (int, NONE)):
                return "a 'node_hb' message with a process entry that is not {pid, rc}"
        for w in msg.get("workers", ()):  # its workers' heartbeats (jaxdist.controller.relay): of its own workers
            if not isinstance(w, dict):
                return "a 'node_hb' message with a worker heartbeat that is not a dict"
            inner = fields_problem({**w, "t": "hb"}, MESSAGE_FIELDS)
            if inner is not None:
                return f"a 'node_hb' message carrying {inner}"
            if w["node"] != msg["node"]:
                return "a 'node_hb' message carrying another node's worker heartbeat"
    return problem

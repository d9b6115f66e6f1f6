"""What the controller does on a health alarm: ask the workers for a device probe, record what it names, and
(``controller.evict_slow``) evict the named node.  The decisions are health.py's; this module acts."""

from __future__ import annotations

import json
import time
from typing import Any

from jaxdist.controller import policy
from jaxdist.controller.health import Finding, name_probe

EVICTED_BY_ALARM = ("compute", "data")  # a rank's own part of the loop: its node is the cause


class HealthActions:
    """A mixin of the Controller (it provides ``state``, ``cc``, ``events``, ``endpoint``, ``dir``,
    ``_member_worker``, ``_ban`` and ``_fail``)."""

    probe_id = 0  # device probes requested so far (ids from 1)
    probe_seen = 0  # the newest probe id whose result arrived
    probe_gen = -1  # the generation of the newest request (a request an ended generation never answered is void)

    def _probe_devices(self, why: str) -> None:
        """Ask every member to run the device probe at its next metric flush (all at the same step)."""
        s = self.state
        workers = [self._member_worker(r) for r in sorted(s.members)]
        pending = self.probe_seen < self.probe_id and self.probe_gen == s.generation
        if len(workers) < 2 or any(w is None for w in workers) or pending:
            return  # a single process has no interconnect to probe; one probe at a time
        self.probe_id, self.probe_gen = self.probe_id + 1, s.generation
        nodes = [s.members[r] for r in sorted(s.members)]
        for w in workers:
            self.endpoint.send(w.identity, {"t": "probe_devices", "id": self.probe_id, "nodes": nodes})
        self.events.add("device_probe_requested", gen=s.generation, id=self.probe_id, why=why)

    def _on_device_probe(self, record: dict[str, Any]) -> None:
        """Rank 0's gathered probe result: name what it shows, record it, act on it."""
        if int(record.get("id", 0)) <= self.probe_seen:
            return  # resent with later heartbeats
        self.probe_seen = int(record["id"])
        verdict = name_probe(record, self.cc.health_z)
        pairs = [{"a": a, "b": b, "seconds": t, "bytes_per_s": bw} for a, b, t, bw in record["pairs"]]
        fields = {
            "gen": self.state.generation,
            "id": self.probe_seen,
            "step": record.get("step"),
            "probe_s": record.get("seconds"),
            "compute_s": record["compute_s"],
            "pairs": pairs,
            "ring_s": record.get("ring_s"),
            "allreduce_s": record.get("allreduce_s"),
            "finding": verdict["kind"],  # "compute" | "link" | None (an event's own field is "kind")
            **{k: verdict[k] for k in ("node", "link", "why", "words")},
        }
        self.events.add("device_probe", **fields)
        with open(self.dir / "health.jsonl", "a") as f:
            f.write(json.dumps({"record": "probe", "t": time.time(), **fields}) + "\n")
        if verdict["node"] is not None:
            self._evict(verdict["node"], f"device probe: {verdict['why']}")

    def _on_alarms(self, alarms: list[Finding]) -> None:
        """Act on a round's alarms: probe the devices on a job-wide slowdown, evict a rank's slow node."""
        job = [x for x in alarms if x.rank is None and x.kind in ("slowdown", "compute")]
        if job:
            self._probe_devices(job[0].why)
        for x in alarms:
            if x.rank is not None and x.node is not None and x.kind in EVICTED_BY_ALARM:
                self._evict(x.node, f"health alarm ({x.kind}): {x.why}")

    def _evict(self, node: str, why: str) -> None:
        """With ``controller.evict_slow``: take ``node`` out (banned) and restart the group with a standby in
        its place through the recovery path; otherwise only report (the event says so)."""
        s = self.state
        rank = next((r for r, n in s.members.items() if n == node), None)
        if not self.cc.evict_slow or rank is None or s.phase != "running" or node in s.banned:
            self.events.add("slow_node", gen=s.generation, node=node, rank=rank, why=why, evicted=False)
            return
        self.events.add("slow_node", gen=s.generation, node=node, rank=rank, why=why, evicted=True)
        self._ban(node, f"evicted: {why}")
        self._fail([policy.Failure("evicted", node, rank, why)], time.monotonic())  # the controller's clock

"""``jaxdist gen``: a generation job's dispatcher and its worker processes.

The dispatcher (this process) loads the sample set, cuts it into tasks
(:mod:`jaxdist.gen.tasks`), listens on a CURVE-authenticated channel
(:mod:`jaxdist.gen.channel`) and starts ``gen.workers`` worker processes
(:mod:`jaxdist.gen.worker`), here or, with ``gen.hosts_file``, on each host
over SSH (``gen.workers`` per host; reverse tunnels carry the worker's
traffic to the dispatcher and the receiver, the token goes on stdin). It hands a pending task to each worker that asks,
records each reported outcome, and when a worker process dies (a crash, a
SIGKILL) takes back the task it held and starts a replacement (at most
``gen.max_restarts`` in all). A task whose lease (``gen.lease_s``) expires is
handed out again too, for workers the dispatcher did not start.

With ``gen.stages`` the job is a chain (:mod:`jaxdist.gen.chain`), each
stage's tasks cut from the previous stage's outputs; its workers per stage
and samples per task are :mod:`jaxdist.gen.job_plan`'s (``gen.workers``
each, or divided by the models' profiles). Tasks go only to the nodes each round's decision tells to
process (:mod:`jaxdist.gen.rounds`: importance x work within
``gen.compute_budget``); a round runs every ``gen.round_s`` and whenever an
idle node asks.

Every second it writes ``<state_dir>/status.json``: tasks pending / running /
delivered / refused, shards and tokens per worker, tokens generated per
second, and the training run's side as its receiver reports it (shards
received and adopted, how many steps the cursor trails the newest shard).
``jaxdist gen status`` prints it (:mod:`jaxdist.gen.status`).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jaxdist.config import ConfigError
from jaxdist.controller.launch import read_hosts
from jaxdist.controller.protocol import NONE, NUMBER
from jaxdist.data.journal import atomic_write
from jaxdist.gen.chain import Chain
from jaxdist.gen.channel import Client, Server, split_address
from jaxdist.gen.config import GenConfig
from jaxdist.gen.job_plan import format_job_plan, job_plan, place_workers
from jaxdist.gen.rounds import NodeReport, RoundDecision, decide_round, format_round
from jaxdist.gen.tasks import load_samples

log = logging.getLogger(__name__)

# The requests the dispatcher reads (jaxdist.gen.worker sends them): anything else authentic is refused at the edge.
_STAGE = {"stage": int}
REQUEST_FIELDS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "want": ({}, _STAGE),
    "done": (
        {"task": int},
        {
            **_STAGE,
            "outcome": str,
            "duplicate": bool,
            "tokens": (int, NONE),
            "seconds": (*NUMBER, NONE),
            "reason": (str, NONE),
            "outputs": list,
        },
    ),
    "retry": ({"task": int}, _STAGE),
}


class Dispatcher:
    def __init__(self, cfg: GenConfig, config_path: str | None = None, overrides: list[str] = ()):
        self.cfg, self.config_path, self.overrides = cfg, config_path, list(overrides)
        self.token = cfg.token()
        self.state = cfg.state_path
        self.state.mkdir(parents=True, exist_ok=True)
        samples = load_samples(cfg.samples)
        n_stages = len(cfg.functions)
        hosts: list[str] = []
        if cfg.hosts_file:
            try:
                hosts = read_hosts(cfg.hosts_file)
            except ConfigError as e:
                raise ConfigError(str(e).replace("controller.hosts_file", "gen.hosts_file")) from None
        self.plan, stages = job_plan(cfg, samples, len(hosts))
        if cfg.profile:
            log.info("the job's plan from %s:\n%s", cfg.profile, format_job_plan(self.plan, stages))
        self.streams, self.streams_why = list(self.plan.streams), list(self.plan.streams_why)
        self.compute = [cfg.compute_per_stream(k) for k in range(n_stages)]
        too_big = [
            k for k in range(n_stages) if cfg.compute_budget and self.streams[k] * self.compute[k] > cfg.compute_budget
        ]
        if too_big:
            k = too_big[0]
            raise ConfigError(
                f"a task of stage {k} ({cfg.functions[k]}) needs {self.streams[k] * self.compute[k]:g} compute, over "
                f"gen.compute_budget={cfg.compute_budget:g}: raise the budget or lower its streams."
            )
        self.chain = Chain(cfg.name, samples, self.streams, self.state, cfg.lease_s)
        self.board = self.chain.boards[0]
        self.server = Server(self.token, "dispatcher", cfg.bind, 0, cfg.bind != "127.0.0.1", REQUEST_FIELDS)
        self.procs: dict[str, subprocess.Popen] = {}
        # each worker's stage and host (None: this machine), as many per stage as the plan gives
        placed = place_workers(self.plan.nodes, hosts)
        self.stage_of = {name: k for name, k, _ in placed}
        self.host_of = {name: host for name, _, host in placed}
        self.worker_names = list(self.stage_of)
        self.idle: dict[str, int] = {}  # sender -> stage: asked for work and holds none
        self.go: set[str] = set()  # senders told to process this round
        self.round: RoundDecision | None = None
        self.rounds, self.max_used = 0, 0.0
        self._last_round = 0.0
        self.per_worker: dict[str, dict[str, float]] = {}
        self.restarts = 0
        self.t0 = time.time()
        self.tokens = 0
        self._receiver: dict[str, Any] = {}
        self._receiver_client = Client(self.token, "g:dispatcher", cfg.deliver_to)
        self._last_status = 0.0

    # ------------------------------------------------------------------ workers

    def _spawn(self, name: str) -> None:
        host = self.host_of[_base(name)]
        stage = ["--stage", str(self.stage_of[_base(name)])]
        log_path = self.state / f"{name}.log"
        with open(log_path, "ab") as out:
            if host is None:  # a process on this machine
                argv = worker_argv(sys.executable, self.server.address, name, self.config_path, self.overrides)
                argv[argv.index("--name") : argv.index("--name")] = stage
                env = {**os.environ, "JAXDIST_JOB_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
                self.procs[name] = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
            else:
                argv = ssh_worker_command(
                    host, self.cfg, self.server.port, name, self.config_path, self.overrides, stage
                )
                p = self.procs[name] = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT
                )
                p.stdin.write((self.token + "\n").encode())  # the token on stdin, never on a command line
                p.stdin.flush()
        self.per_worker.setdefault(name, {"shards": 0, "tokens": 0, "seconds": 0.0})
        self.per_worker[name]["pid"] = self.procs[name].pid
        log.info("worker %s started (%s, pid %d, log %s)", name, host or "here", self.procs[name].pid, log_path)

    def _watch(self) -> None:
        for name, p in list(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del self.procs[name]
            self.idle.pop(f"g:{name}", None)
            self.go.discard(f"g:{name}")
            back = [i for b in self.chain.boards for i in b.release(f"g:{name}")]
            if rc == 0:
                continue
            log.warning("worker %s exited with %d; %d task(s) handed out again", name, rc, len(back))
            if self.chain.done:
                continue
            if rc == 2:  # a config error: every replacement would fail the same way
                raise ConfigError(f"worker {name} stopped on a config error: see {self.state / (name + '.log')}.")
            if self.restarts < self.cfg.max_restarts:
                self.restarts += 1
                self._spawn(f"{_base(name)}.{self.restarts}")

    # ------------------------------------------------------------------ requests

    def handle(self, sender: str, msg: dict[str, Any], payload: bytes | None) -> dict[str, Any]:
        kind = msg.get("t")
        stage = int(msg.get("stage", 0))
        if not 0 <= stage < len(self.chain.boards):
            return {"ok": False, "refused": f"no stage {stage}"}
        board = self.chain.boards[stage]
        if kind == "want":
            if self.chain.done:
                return {"t": "exit"}
            if sender not in self.go:  # a fresh round now, so an idle node never waits a whole round_s
                self.idle[sender] = stage
                self.decide(force=True)
            task = board.take(sender) if sender in self.go else None
            if task is None:  # not told to process this round (or nothing pending): idle until it is
                self.idle[sender] = stage
                return {"t": "wait"}
            self.go.discard(sender)
            self.idle.pop(sender, None)
            return {"t": "task", "task": task.index, "key": task.key, "samples": task.samples}
        if kind == "done":
            i = int(msg["task"])
            if not 0 <= i < len(board.tasks):
                return {"ok": False, "refused": f"no task {i}"}
            if msg.get("outcome") == "failed":  # the function raised: a retry might not; record and move on
                board.finish(i, sender, {"outcome": "refused", "reason": msg.get("reason")})
                self.chain.refresh()
                return {"ok": True}
            keys = ("outcome", "duplicate", "tokens", "seconds", "reason", "outputs")
            board.finish(i, sender, {k: msg.get(k) for k in keys if k != "outputs" or "outputs" in msg})
            self.chain.refresh()
            w = self.per_worker.setdefault(sender.removeprefix("g:"), {"shards": 0, "tokens": 0, "seconds": 0.0})
            if msg.get("outcome") == "delivered":
                w["shards"] += 1
                w["tokens"] += int(msg.get("tokens") or 0)
                self.tokens += int(msg.get("tokens") or 0)
            w["seconds"] += float(msg.get("seconds") or 0.0)
            return {"ok": True}
        if kind == "retry":
            board.running.pop(int(msg["task"]), None)
            return {"ok": True}
        return {"ok": False, "refused": f"unknown request {kind!r}"}

    # ------------------------------------------------------------------ status

    def decide(self, force: bool = False) -> None:
        """A round: the idle nodes' reports and the pending tasks -> the nodes told to process (gen/rounds.py)."""
        now = time.monotonic()
        if not force and now - self._last_round < self.cfg.round_s:
            return
        self._last_round = now
        reports = [NodeReport(sender, stage, True) for sender, stage in self.idle.items()]
        d = decide_round(
            reports,
            self.chain.pending(),
            self.streams,
            self.compute,
            self.chain.running_compute(self.compute),
            self.cfg.compute_budget,
        )
        self.go = set(d.selected)
        self.rounds += 1
        self.max_used = max(self.max_used, d.used)
        if d.selected:
            self.round = d
            log.debug("round %d: %s", self.rounds, format_round(d, self.cfg.functions))

    def status(self) -> dict[str, Any]:
        wall = max(1e-9, time.time() - self.t0)
        d = self.round
        return {
            "name": self.cfg.name,
            "stages": self.cfg.functions,
            "streams": self.streams,
            "streams_why": self.streams_why,
            "nodes": list(self.plan.nodes),
            "nodes_why": list(self.plan.nodes_why),
            "pool": self.plan.pool,
            "planned_items_s": self.plan.items_s,
            "selected": [n.removeprefix("g:") for n in d.selected] if d else [],
            "importance": list(d.importance) if d else [],
            "compute_used": d.used if d else 0.0,
            "compute_now": self.chain.running_compute(self.compute),
            "compute_max": self.max_used,
            "compute_budget": self.cfg.compute_budget,
            "rounds": self.rounds,
            "dispatcher": self.server.address,
            "deliver_to": self.cfg.deliver_to,
            **{k: v for k, v in self.chain.counts().items() if k != "stages"},
            "stages_counts": self.chain.counts()["stages"],
            "workers": self.per_worker,
            "alive": sorted(self.procs),
            "restarts": self.restarts,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / wall,
            "elapsed_s": wall,
            "run": self._receiver,
            "time": time.time(),
        }

    def _write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_status < 1.0:
            return
        self._last_status = now
        r = self._receiver_client.request({"t": "status"}, deadline_s=0.5, try_s=0.5)
        if r is not None:
            self._receiver = {k: v for k, v in r.items() if k not in ("rid", "sender", "sid", "seq", "ts", "ok")}
        atomic_write(self.state / "status.json", json.dumps(self.status(), indent=1).encode())

    # ------------------------------------------------------------------ the job

    def run(self) -> int:
        log.info(
            "generation job %s: %d tasks (%d finished before), %d workers, dispatcher %s, delivering to %s",
            self.cfg.name,
            len(self.board.tasks),
            len(self.board.finished),
            len(self.worker_names),
            self.server.address,
            self.cfg.deliver_to,
        )
        try:
            for name in self.worker_names:
                self._spawn(name)
            while self.procs:
                self.server.serve_once(self.handle, 0.05)
                self.decide()
                self._watch()
                self._write_status()
                if not self.procs and not self.chain.done:
                    left = sum(len(b.tasks) - len(b.finished) for b in self.chain.boards)
                    raise ConfigError(
                        f"every worker died and {self.cfg.max_restarts} restarts are used up with "
                        f"{left} tasks left: see the logs in {self.state}."
                    )
            self._write_status(force=True)
        finally:
            for p in self.procs.values():
                p.kill()
                p.wait(timeout=10)
            self.server.close()
            self._receiver_client.close()
        c = self.chain.boards[-1].counts()
        print(
            f"generation job {self.cfg.name}: {c['delivered']} of {c['tasks']} tasks delivered, {c['refused']} "
            f"refused, {c['reassigned']} handed out again, {self.tokens:,} tokens "
            f"({self.tokens / max(1e-9, time.time() - self.t0):,.0f}/s); status in {self.state / 'status.json'}"
        )
        return 0 if c["refused"] == 0 else 1


def _base(name: str) -> str:
    """A worker's name without the restart count a replacement carries (``w0.2`` -> ``w0``)."""
    head, _, tail = name.rpartition(".")
    return head if head and tail.isdigit() else name


def worker_argv(python: str, dispatcher: str, name: str, config_path: str | None, overrides: list[str]) -> list[str]:
    """The argv of one worker process."""
    argv = [python, "-m", "jaxdist.gen.worker", "--dispatcher", dispatcher, "--name", name]
    return argv + (["--config", config_path] if config_path else []) + list(overrides)


def ssh_worker_command(
    host: str,
    cfg: GenConfig,
    port: int,
    name: str,
    config_path: str | None,
    overrides: list[str],
    stage: list[str] = (),
) -> list[str]:
    """The ssh argv of an SSH worker: reverse tunnels to the dispatcher and the receiver, the token on stdin.

    The worker reaches both through the host's loopback (``-R``), so neither listens beyond this machine;
    the config file is read from the same path on the host (a shared file system, like the run directory).
    """
    r_host, r_port = split_address(cfg.deliver_to)
    config = str(Path(config_path).absolute()) if config_path else None
    argv = worker_argv(cfg.python, f"127.0.0.1:{port}", name, config, [*overrides, f"deliver_to=127.0.0.1:{r_port}"])
    argv[argv.index("--name") : argv.index("--name")] = list(stage)
    remote = (
        f"cd {shlex.quote(os.getcwd())} && IFS= read -r JAXDIST_JOB_TOKEN && export JAXDIST_JOB_TOKEN && "
        f"exec {shlex.join(argv)}"
    )
    tunnels = ["-R", f"{port}:127.0.0.1:{port}", "-R", f"{r_port}:{r_host}:{r_port}"]
    return ["ssh", "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", *tunnels, host, remote]


def run_job(cfg: GenConfig, config_path: str | None = None, overrides: list[str] = ()) -> int:
    return Dispatcher(cfg, config_path, overrides).run()

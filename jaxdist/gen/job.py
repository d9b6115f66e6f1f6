"""``jaxdist gen``: a generation job's dispatcher and its worker processes.

The dispatcher (this process) loads the sample set, cuts it into tasks
(:mod:`jaxdist.gen.tasks`), listens on a CURVE-authenticated channel
(:mod:`jaxdist.gen.channel`) and starts ``gen.workers`` worker processes
(:mod:`jaxdist.gen.worker`). It hands a pending task to each worker that asks,
records each reported outcome, and when a worker process dies (a crash, a
SIGKILL) takes back the task it held and starts a replacement (at most
``gen.max_restarts`` in all). A task whose lease (``gen.lease_s``) expires is
handed out again too, for workers the dispatcher did not start.

Every second it writes ``<state_dir>/status.json``: tasks pending / running /
delivered / refused, shards and tokens per worker, tokens generated per
second, and the training run's side as its receiver reports it (shards
received and adopted, how many steps the cursor trails the newest shard).
``jaxdist gen status`` prints it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from jaxdist.config import ConfigError
from jaxdist.data.journal import atomic_write
from jaxdist.gen.channel import Client, Server
from jaxdist.gen.config import GenConfig
from jaxdist.gen.tasks import TaskBoard, load_samples, make_tasks

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, cfg: GenConfig, config_path: str | None = None, overrides: list[str] = ()):
        self.cfg, self.config_path, self.overrides = cfg, config_path, list(overrides)
        self.token = cfg.token()
        self.state = cfg.state_path
        self.state.mkdir(parents=True, exist_ok=True)
        self.board = TaskBoard(
            make_tasks(cfg.name, load_samples(cfg.samples), cfg.task_size), self.state / "tasks.jsonl", cfg.lease_s
        )
        self.server = Server(self.token, "dispatcher", cfg.bind, 0, allow_remote=cfg.bind != "127.0.0.1")
        self.procs: dict[str, subprocess.Popen] = {}
        self.per_worker: dict[str, dict[str, float]] = {}
        self.restarts = 0
        self.t0 = time.time()
        self.tokens = 0
        self._receiver: dict[str, Any] = {}
        self._receiver_client = Client(self.token, "g:dispatcher", cfg.deliver_to)
        self._last_status = 0.0

    # ------------------------------------------------------------------ workers

    def _spawn(self, name: str) -> None:
        args = [sys.executable, "-m", "jaxdist.gen.worker", "--dispatcher", self.server.address, "--name", name]
        if self.config_path:
            args += ["--config", self.config_path]
        env = {**os.environ, "JAXDIST_JOB_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        log_path = self.state / f"{name}.log"
        with open(log_path, "ab") as out:
            self.procs[name] = subprocess.Popen([*args, *self.overrides], env=env, stdout=out, stderr=subprocess.STDOUT)
        self.per_worker.setdefault(name, {"shards": 0, "tokens": 0, "seconds": 0.0, "pid": self.procs[name].pid})
        log.info("worker %s started (pid %d, log %s)", name, self.procs[name].pid, log_path)

    def _watch(self) -> None:
        for name, p in list(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            del self.procs[name]
            back = self.board.release(f"g:{name}")
            if rc == 0:
                continue
            log.warning("worker %s exited with %d; %d task(s) handed out again", name, rc, len(back))
            if self.board.done:
                continue
            if rc == 2:  # a config error: every replacement would fail the same way
                raise ConfigError(f"worker {name} stopped on a config error: see {self.state / (name + '.log')}.")
            if self.restarts < self.cfg.max_restarts:
                self.restarts += 1
                self._spawn(f"{name.split('.')[0]}.{self.restarts}")

    # ------------------------------------------------------------------ requests

    def handle(self, sender: str, msg: dict[str, Any], payload: bytes | None) -> dict[str, Any]:
        kind = msg.get("t")
        if kind == "want":
            if self.board.done:
                return {"t": "exit"}
            task = self.board.take(sender)
            if task is None:
                return {"t": "wait"}
            return {"t": "task", "task": task.index, "key": task.key, "samples": task.samples}
        if kind == "done":
            i = int(msg["task"])
            if not 0 <= i < len(self.board.tasks):
                return {"ok": False, "refused": f"no task {i}"}
            if msg.get("outcome") == "failed":  # the function raised: a retry might not; record and move on
                self.board.finish(i, sender, {"outcome": "refused", "reason": msg.get("reason")})
                return {"ok": True}
            self.board.finish(
                i,
                sender,
                {k: msg.get(k) for k in ("outcome", "duplicate", "tokens", "seconds", "reason")},
            )
            w = self.per_worker.setdefault(sender.removeprefix("g:"), {"shards": 0, "tokens": 0, "seconds": 0.0})
            if msg.get("outcome") == "delivered":
                w["shards"] += 1
                w["tokens"] += int(msg.get("tokens") or 0)
                self.tokens += int(msg.get("tokens") or 0)
            w["seconds"] += float(msg.get("seconds") or 0.0)
            return {"ok": True}
        if kind == "retry":
            self.board.running.pop(int(msg["task"]), None)
            return {"ok": True}
        return {"ok": False, "refused": f"unknown request {kind!r}"}

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        wall = max(1e-9, time.time() - self.t0)
        return {
            "name": self.cfg.name,
            "dispatcher": self.server.address,
            "deliver_to": self.cfg.deliver_to,
            **self.board.counts(),
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
            self.cfg.workers,
            self.server.address,
            self.cfg.deliver_to,
        )
        try:
            for k in range(self.cfg.workers):
                self._spawn(f"w{k}")
            while self.procs:
                self.server.serve_once(self.handle, 0.1)
                self._watch()
                self._write_status()
                if not self.procs and not self.board.done:
                    raise ConfigError(
                        f"every worker died and {self.cfg.max_restarts} restarts are used up with "
                        f"{len(self.board.tasks) - len(self.board.finished)} tasks left: see the logs in {self.state}."
                    )
            self._write_status(force=True)
        finally:
            for p in self.procs.values():
                p.kill()
                p.wait(timeout=10)
            self.server.close()
            self._receiver_client.close()
        c = self.board.counts()
        print(
            f"generation job {self.cfg.name}: {c['delivered']} of {c['tasks']} tasks delivered, {c['refused']} "
            f"refused, {c['reassigned']} handed out again, {self.tokens:,} tokens "
            f"({self.tokens / max(1e-9, time.time() - self.t0):,.0f}/s); status in {self.state / 'status.json'}"
        )
        return 0 if c["refused"] == 0 else 1


def run_job(cfg: GenConfig, config_path: str | None = None, overrides: list[str] = ()) -> int:
    return Dispatcher(cfg, config_path, overrides).run()


def read_status(cfg: GenConfig) -> dict[str, Any]:
    """The job's last status (``status.json``), with the training run's side asked live from its receiver."""
    path = Path(cfg.state_path) / "status.json"
    try:
        s = json.loads(path.read_text())
    except (OSError, ValueError):
        raise ConfigError(f"no status in {path}: start the job with jaxdist gen --config ... first.") from None
    client = Client(cfg.token(), "g:status", cfg.deliver_to)
    try:
        r = client.request({"t": "status"}, deadline_s=3.0, try_s=1.5)
    finally:
        client.close()
    if r is not None:
        s["run"] = {k: v for k, v in r.items() if k not in ("rid", "sender", "sid", "seq", "ts", "ok")}
    return s


def format_status(s: dict[str, Any]) -> str:
    lines = [
        f"generation job {s['name']}: {s['tasks']} tasks: {s['pending']} pending, {s['running']} running, "
        f"{s['delivered']} delivered, {s['refused']} refused ({s['reassigned']} handed out again)",
        f"  {s['tokens']:,} tokens delivered, {s['tokens_per_s']:,.1f} tokens/s over {s['elapsed_s']:.0f} s; "
        f"workers alive: {', '.join(s['alive']) or 'none'}",
    ]
    for name, w in sorted(s["workers"].items()):
        lines.append(
            f"  {name}: {int(w['shards'])} shards, {int(w['tokens']):,} tokens, {w['seconds']:.1f} s generating"
        )
    r = s.get("run") or {}
    if r:
        lines.append(
            f"  training run: {r['received']} shards received, {r['adopted']} in the batch list, {r['pending']} "
            f"waiting for the trainer; cursor {r['cursor']} of {r['batches']} batches, "
            f"{r['behind_steps']} steps behind the newest shard"
        )
    else:
        lines.append("  training run: its receiver did not answer")
    return "\n".join(lines)

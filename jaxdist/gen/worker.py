"""A generation worker: take a task, run the generation function, deliver the shard, report; repeat.

Started by :func:`jaxdist.gen.job.run_job` (``python -m jaxdist.gen.worker``),
one process per worker. The **generation function** is

* ``"sampler"``: the sampler of ``gen.sampler.run``'s newest (or given)
  checkpoint continues each sample (prompt + continuation is the output; the
  seed is ``gen.sampler.seed + task index``, so a task run again gives the
  same shard);
* ``"module:function"``: ``function(samples: list[str]) -> list[str] | str``,
  imported once (a filter, a preprocessing step, a teacher of your own).

The outputs of a task are joined with newlines into one UTF-8 text shard.
Each task's samples are logged to ``<state_dir>/runlog.<worker>.jsonl`` (one
request record per sample: streams, start, end, bytes in and out) for
``jaxdist gen profile``: a request starts when the worker has its task and
ends when its outputs are delivered (the receiver acknowledged the shard;
before the last stage, as they go to the dispatcher), so a node's profile
counts what it spends on a task besides generating.
A delivery is retried until the receiver answers (``gen.deliver_timeout_s``);
only then is the task reported to the dispatcher, so a worker killed at any
point leaves its task unreported and the dispatcher hands it out again.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import socket
import sys
import time
from collections.abc import Callable

from jaxdist.config import ConfigError
from jaxdist.gen.channel import Client, digest
from jaxdist.gen.config import GenConfig, load_gen_config
from jaxdist.gen.runlog import RunLogWriter

log = logging.getLogger("jaxdist.gen.worker")

GenFn = Callable[[list[str], int], list[str] | str]
MIN_WAIT_S, MAX_WAIT_S = 0.02, 0.3  # a worker told to wait asks again after this, doubling up to the most


def generation_function(cfg: GenConfig, stage: int = 0) -> GenFn:
    """``fn(samples, task_index) -> outputs`` for the stage's function; ConfigError if it cannot be loaded.

    The sampler's function carries ``first_use``: whether its last call compiled a new batch shape."""
    function = cfg.functions[stage]
    if function == "sampler":
        from jaxdist.cluster import prepare_host_devices
        from jaxdist.sample.config import check_request, run_config  # JAX-free: devices are set up first

        s = cfg.sampler
        overrides = s.overrides.split()
        prepare_host_devices(run_config(s.run, overrides))  # the teacher run's cluster: its simulated devices
        check_request(s.max_new_tokens, s.temperature, s.top_k, s.top_p)
        from jaxdist.sample.sampler import Sampler  # JAX

        sampler = Sampler.from_run(s.run, s.step or None, overrides)
        log.info("sampler: %s step %s", s.run, sampler.step)

        def sample(samples: list[str], index: int) -> list[str]:
            programs = len(sampler._programs)
            out = sampler.generate(
                samples,
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                top_k=s.top_k,
                top_p=s.top_p,
                seed=s.seed + index,
            )
            sample.first_use = len(sampler._programs) > programs
            return [g.prompt + g.text for g in out]

        sample.first_use = False
        return sample
    module, _, name = function.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"generation function {function!r} cannot be loaded ({e}): put its module on PYTHONPATH."
        ) from None
    return lambda samples, index: fn(samples)


def _as_text(out: list[str] | str) -> str:
    if isinstance(out, str):
        return out
    if not isinstance(out, (list, tuple)) or not all(isinstance(x, str) for x in out):
        raise TypeError(f"the generation function returned {type(out).__name__}, not a str or a list of str")
    return "\n".join(out)


def _log_requests(
    runlog: RunLogWriter, samples: list[str], payload: bytes, start: float, end: float, first_use: bool
) -> None:
    out = len(payload) // max(1, len(samples))
    for sample in samples:
        runlog.log(len(samples), start, end, len(sample.encode()), out, first_use)


def run_worker(cfg: GenConfig, dispatcher: str, name: str, stage: int = 0) -> int:
    """Serve one stage: take its tasks, run its function; the last stage delivers to the run, an earlier one
    returns its outputs (a list of strings) to the dispatcher, which makes the next stage's tasks of them."""
    token = cfg.token()
    fn = generation_function(cfg, stage)
    last = stage == len(cfg.functions) - 1
    ident = f"g:{name}"
    disp, recv = Client(token, ident, dispatcher), Client(token, ident, cfg.deliver_to)
    # One record per sample of each task (its samples run together: streams = the task's size), for
    # `jaxdist gen profile` (jaxdist/gen/profile.py); counts in bytes, the byte tokenizer's tokens.
    model = cfg.model_of(stage)
    runlog = RunLogWriter(cfg.state_path / f"runlog.{name}.jsonl", model, worker=name, node=socket.gethostname())
    pause = MIN_WAIT_S
    try:
        while True:
            r = disp.request({"t": "want", "stage": stage}, deadline_s=120.0)
            if r is None:
                log.error("worker %s: the dispatcher at %s does not answer; stopping", name, dispatcher)
                return 3
            if r["t"] == "exit":
                return 0
            if r["t"] == "wait":  # asked again soon, then less often while there is nothing for it
                time.sleep(pause)
                pause = min(MAX_WAIT_S, 2 * pause)
                continue
            pause = MIN_WAIT_S
            index, key, samples = int(r["task"]), str(r["key"]), list(r["samples"])
            t0, t_start = time.monotonic(), time.time()
            try:
                out = fn(samples, index)
                payload = _as_text(out).encode()
                if not last and not isinstance(out, (list, tuple)):
                    raise TypeError("a stage before the last must return a list of str (the next stage's samples)")
            except Exception as e:  # the user's function failed on this task: report it, keep working
                log.exception("worker %s: the generation function failed on task %d", name, index)
                disp.request({"t": "done", "stage": stage, "task": index, "outcome": "failed", "reason": repr(e)})
                continue
            gen_s = time.monotonic() - t0
            first_use = bool(getattr(fn, "first_use", False))
            if not last:  # the outputs go back to the dispatcher: the next stage's samples
                outcome = {"t": "done", "stage": stage, "task": index, "outcome": "passed", "seconds": gen_s}
                end = time.time()  # before the report: once it is in, the dispatcher counts the task finished
                disp.request({**outcome, "outputs": list(out)})
                _log_requests(runlog, samples, payload, t_start, end, first_use)
                continue
            ack = recv.request(
                {"t": "deliver", "key": key, "sha256": digest(payload), "n_bytes": len(payload)},
                payload,
                deadline_s=cfg.deliver_timeout_s,
            )
            if ack is None:  # the receiver is down: the task goes back, another try later
                log.warning("worker %s: no acknowledgement for task %d from %s", name, index, cfg.deliver_to)
                disp.request({"t": "retry", "stage": stage, "task": index})
                continue
            _log_requests(runlog, samples, payload, t_start, time.time(), first_use)
            outcome = {
                "t": "done",
                "stage": stage,
                "task": index,
                "outcome": "delivered" if ack["ok"] else "refused",
                "duplicate": bool(ack.get("duplicate")),
                "tokens": int(ack.get("tokens", 0)),
                "seconds": gen_s,
                "reason": ack.get("refused"),
            }
            disp.request(outcome)
    finally:
        disp.close()
        recv.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="python -m jaxdist.gen.worker")
    p.add_argument("--config")
    p.add_argument("--dispatcher", required=True)
    p.add_argument("--stage", type=int, default=0, help="the chain's stage this worker serves (gen.stages)")
    p.add_argument("--name", required=True)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    try:
        return run_worker(load_gen_config(a.config, a.overrides), a.dispatcher, a.name, a.stage)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

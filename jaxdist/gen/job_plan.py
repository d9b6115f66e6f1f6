"""How many workers serve each stage of a generation job, and how many samples each of their tasks holds.

Without ``gen.profile`` every stage gets ``gen.workers`` workers (per host
with ``gen.hosts_file``) and tasks of ``gen.task_size`` samples. With it the
job's pool of nodes (worker processes: ``gen.nodes``, default ``gen.workers``
per stage) is divided among the stages by
:func:`jaxdist.gen.schedule.plan_streams`, the chain's throughput as high as
possible:

* ``gen.task_size = 0``: streams per stage too, the most throughput whose
  task latency stays within ``gen.latency_target_s``;
* ``gen.task_size = s``: every stage at ``s`` streams, only the nodes planned.

Each stage's requests per item of chain output and their sizes come from the
run logs of an earlier run of the job (``gen.job_logs``); without them each
stage counts one request per item, stage 0 its samples' size (and
``gen.sampler.max_new_tokens`` out), a later stage its profile's logged
means. Nodes the plan does not need (more would not raise the throughput) are
not started. :func:`plan_job` decides (pure, printable); :func:`job_plan`
reads the files it needs; :func:`place_workers` names the processes.
"""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxdist.config import ConfigError
from jaxdist.gen.config import GenConfig
from jaxdist.gen.profile import ModelProfile, load_profiles
from jaxdist.gen.runlog import read_run_logs
from jaxdist.gen.schedule import Stage, plan_streams, stages_from_log

MAX_STREAMS = 64  # the stream counts a planned stage chooses from: 1..MAX_STREAMS


@dataclass(frozen=True)
class JobPlan:
    """Per stage: samples per task (streams) and workers (nodes), each with why; ``pool``: the nodes there were."""

    streams: tuple[int, ...]
    streams_why: tuple[str, ...]
    nodes: tuple[int, ...]
    nodes_why: tuple[str, ...]
    pool: int
    items_s: float = 0.0  # the planned chain throughput (items/s), 0 without a profile

    @property
    def spare(self) -> int:
        """Nodes of the pool not started (the plan does not need them)."""
        return self.pool - sum(self.nodes)


def plan_job(
    profiles: Mapping[str, ModelProfile] | None,
    stages: Sequence[Stage],
    pool: int,
    task_size: int,
    workers_per_stage: int,
) -> JobPlan:
    """The job's streams and workers per stage (see the module docstring); ``profiles`` None: no profile."""
    n = len(stages)
    if profiles is None:
        return JobPlan(
            (task_size,) * n, ("gen.task_size",) * n, (workers_per_stage,) * n,
            ("gen.workers per stage",) * n, workers_per_stage * n,
        )  # fmt: skip
    for st in stages:
        if st.model not in profiles:
            raise ConfigError(
                f"the profiles have no profile of '{st.model}' (they have {', '.join(sorted(profiles))}): "
                "profile this model's run logs (jaxdist gen profile)."
            )
    if task_size:
        plan = plan_streams(profiles, stages, pool, [task_size], check_latency=False)
    else:
        plan = plan_streams(profiles, stages, pool, range(1, MAX_STREAMS + 1))
    streams_why = tuple(
        f"gen.task_size{'' if c.meets_target else ' (over gen.latency_target_s)'}" if task_size else c.why_streams
        for c in plan.choices
    )
    return JobPlan(
        tuple(c.streams for c in plan.choices), streams_why, tuple(c.nodes for c in plan.choices),
        tuple(c.why_nodes for c in plan.choices), pool, plan.items_s,
    )  # fmt: skip


def job_stages(cfg: GenConfig, samples: list[str], profiles: Mapping[str, ModelProfile]) -> list[Stage]:
    """The stages of the job for the plan: from ``gen.job_logs`` if given, else as the module docstring says."""
    models = [cfg.model_of(k) for k in range(len(cfg.functions))]
    if len(set(models)) < len(models):
        raise ConfigError(
            f"gen.stages name one model twice ({', '.join(models)}): a planned chain needs one profile per stage."
        )
    targets = dict.fromkeys(models, cfg.latency_target_s)
    if cfg.job_logs:
        paths = sorted({p for pattern in cfg.job_logs for p in (glob.glob(pattern) or [pattern])})
        return stages_from_log(read_run_logs(paths).records, models, targets)
    out = []
    for k, m in enumerate(models):
        if k == 0:
            tokens_in = float(np.mean([len(s.encode()) for s in samples]))
            tokens_out = float(cfg.sampler.max_new_tokens if cfg.functions[0] == "sampler" else tokens_in)
        elif m in profiles:
            tokens_in, tokens_out = profiles[m].mean_tokens_in, profiles[m].mean_tokens_out
        else:
            tokens_in = tokens_out = 0.0  # plan_job names the missing profile
        out.append(Stage(m, 1.0, tokens_in, tokens_out, cfg.latency_target_s))
    return out


def job_plan(cfg: GenConfig, samples: list[str], hosts: int = 0) -> tuple[JobPlan, list[Stage]]:
    """The job's plan from its config (and ``gen.profile``, ``gen.job_logs``); ``hosts``: of ``gen.hosts_file``."""
    n = len(cfg.functions)
    per_stage = cfg.workers * max(1, hosts)
    if not cfg.profile:
        stages = [Stage(cfg.model_of(k), 1.0, 0.0, 0.0, cfg.latency_target_s) for k in range(n)]
        return plan_job(None, stages, 0, cfg.task_size, per_stage), stages
    profiles = load_profiles(cfg.profile)
    stages = job_stages(cfg, samples, profiles)
    pool = cfg.nodes or per_stage * n
    if pool < n:
        raise ConfigError(f"gen.nodes={pool} cannot serve {n} stages: give at least one node per stage.")
    return plan_job(profiles, stages, pool, cfg.task_size, per_stage), stages


def place_workers(nodes: Sequence[int], hosts: Sequence[str] = ()) -> list[tuple[str, int, str | None]]:
    """(name, stage, host) of every worker: stage k's ``nodes[k]`` workers, spread over ``hosts`` in turn (None:
    this machine). Names: ``w<i>`` (``<host>-w<i>`` on a host), with ``s<k>`` in front in a chain."""
    out, turn = [], 0
    for k, count in enumerate(nodes):
        prefix = f"s{k}" if len(nodes) > 1 else ""
        on: dict[str | None, int] = {}
        for _ in range(count):
            host = hosts[turn % len(hosts)] if hosts else None
            turn += 1
            i = on[host] = on.get(host, -1) + 1
            out.append((f"{prefix}{host}-w{i}" if host else f"{prefix}w{i}", k, host))
    return out


def format_job_plan(plan: JobPlan, stages: Sequence[Stage]) -> str:
    """The plan as lines: per stage its requests per item, streams and workers with why; then the throughput."""
    lines = []
    for k, st in enumerate(stages):
        lines.append(
            f"stage {k} {st.model}: {st.requests_per_item:.3g} requests per item of {st.tokens_in:.4g} tokens in, "
            f"{st.tokens_out:.4g} out; {plan.streams[k]} streams ({plan.streams_why[k]}); {plan.nodes[k]} "
            f"workers ({plan.nodes_why[k]})"
        )
    spare = f", {plan.spare} not started (more would not raise it)" if plan.spare else ""
    lines.append(f"chain: {plan.items_s:.4g} items/s planned on {sum(plan.nodes)} of {plan.pool} nodes{spare}")
    return "\n".join(lines)

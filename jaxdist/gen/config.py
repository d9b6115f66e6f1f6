"""The configuration of a generation job: ``gen.toml``'s ``[gen]`` table and ``key=value`` overrides.

Example::

    [gen]
    name = "distill"                 # the job's name: part of every task key
    samples = "prompts.jsonl"        # the sample set (see jaxdist/gen/tasks.py)
    task_size = 8                    # samples per task (one shard per task)
    function = "sampler"             # or "package.module:function"
    workers = 2                      # worker processes on this machine
    deliver_to = "127.0.0.1:5601"    # the training run's receiver (jaxdist gen receive RUN_DIR)
    run = "runs/student"             # the training run (its token; optional with token_file)

    # A chain of cooperating models instead of one function: stage k+1's tasks are made from the
    # outputs stage k's tasks return (in task order); only the last stage delivers to the run.
    # stages = ["sampler", "mypkg.filters:score"]
    # compute_budget = 16            # compute of the tasks running at once, at most (0: no limit)
    # stage_compute = [1.0, 0.25]    # compute one stream of each stage uses (default 1 each)
    # profile = "gen-profile.json"   # the models' profiles: the plan divides the workers among the stages
    # nodes = 6                      # ... this many in all (default: workers x stages)
    # job_logs = ["gen-state/distill/runlog.*.jsonl"]   # an earlier run: requests per stage and their sizes

    [gen.sampler]                    # with function = "sampler"
    run = "runs/teacher"             # the checkpointed run whose model generates
    max_new_tokens = 64
    temperature = 0.8
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxdist.config import ConfigError


@dataclass(frozen=True)
class SamplerSpec:
    run: str = ""
    step: int = 0  # 0: the newest checkpoint
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # task i samples with seed + i: a task run again gives the same shard
    overrides: str = ""  # key=value overrides of the teacher run's config, space-separated (e.g. its mesh)


@dataclass(frozen=True)
class GenConfig:
    name: str = "gen"
    samples: str = ""
    task_size: int = 8  # samples per task = parallel streams of a worker; 0: chosen from gen.profile
    profile: str = ""  # `jaxdist gen profile --out` file: the workers per stage (and with task_size=0 the streams)
    latency_target_s: float = 60.0  # with task_size=0: the most seconds one task may take
    nodes: int = 0  # with gen.profile: the worker processes the plan divides among the stages (0: workers x stages)
    job_logs: list[str] = field(default_factory=list)  # with gen.profile: run logs (globs) of an earlier run of the job
    function: str = "sampler"
    workers: int = 2  # worker processes on this machine, or per host with hosts_file
    hosts_file: str = ""  # one host per line: workers start there over SSH (tunnelled to the dispatcher and receiver)
    python: str = "python3"  # the interpreter on the hosts (SSH workers)
    deliver_to: str = ""
    run: str = ""  # the training run: its gen/token authenticates the workers
    token_file: str = ""  # or the token's file (default: $JAXDIST_JOB_TOKEN, then <run>/gen/token)
    state_dir: str = ""  # default gen-state/<name>
    bind: str = "127.0.0.1"  # where the dispatcher listens (workers on other hosts: their address)
    lease_s: float = 600.0  # a task not finished this long after it was handed out goes to another worker
    max_restarts: int = 4  # worker processes restarted after dying, in all
    deliver_timeout_s: float = 600.0  # how long a worker retries a delivery the receiver does not acknowledge
    stages: list[str] = field(default_factory=list)  # a chain: one function per stage (replaces gen.function)
    compute_budget: float = 0.0  # the most compute the running tasks may use together (0: no limit)
    stage_compute: list[float] = field(default_factory=list)  # compute units per stream of each stage (default 1)
    round_s: float = 0.25  # how often the dispatcher selects the nodes that process next (s)
    sampler: SamplerSpec = field(default_factory=SamplerSpec)

    @property
    def functions(self) -> list[str]:
        """The generation function of each stage (one stage without gen.stages)."""
        return list(self.stages) or [self.function]

    def model_of(self, stage: int) -> str:
        """A stage's name in run logs and profiles: the teacher run, or module:function."""
        fn = self.functions[stage]
        return self.sampler.run if fn == "sampler" else fn

    @property
    def model(self) -> str:
        """The first stage's name in run logs and profiles."""
        return self.model_of(0)

    def compute_per_stream(self, stage: int) -> float:
        return float(self.stage_compute[stage]) if self.stage_compute else 1.0

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir or f"gen-state/{self.name}")

    def check(self) -> GenConfig:
        if not self.samples:
            raise ConfigError("gen.samples is not set: name the file or directory of samples to generate from.")
        if not self.deliver_to:
            raise ConfigError(
                "gen.deliver_to is not set: give the training run's receiver address "
                "(jaxdist gen receive RUN_DIR prints it)."
            )
        if self.task_size < 0 or (self.task_size == 0 and not self.profile):
            raise ConfigError(
                f"gen.task_size must be at least 1 (got {self.task_size}), or 0 with gen.profile set "
                "(streams chosen from the model's profile): set the samples per task."
            )
        if not self.latency_target_s > 0:
            raise ConfigError(f"gen.latency_target_s={self.latency_target_s} must be positive seconds.")
        if self.workers < 1:
            raise ConfigError(f"gen.workers must be at least 1 (got {self.workers}).")
        if self.nodes < 0 or ((self.nodes or self.job_logs) and not self.profile):
            raise ConfigError(
                f"gen.nodes={self.nodes} and gen.job_logs plan the workers per stage: give a number of at least 0, "
                "and gen.profile (the models' profiles) with them."
            )
        if not self.name or any(c in self.name for c in "/:\\") or ".." in self.name:
            raise ConfigError(f"gen.name {self.name!r} must be a plain name (no '/', ':' or '..').")
        for fn in self.functions:
            if fn == "sampler":
                if not self.sampler.run:
                    raise ConfigError("a stage is 'sampler' but gen.sampler.run is not set: name the teacher's run.")
            elif not isinstance(fn, str) or ":" not in fn:
                raise ConfigError(
                    f"generation function {fn!r} is neither 'sampler' nor 'module:function': "
                    "name a Python function, e.g. mypkg.filters:clean."
                )
        if self.stage_compute and (
            len(self.stage_compute) != len(self.functions) or not all(c > 0 for c in self.stage_compute)
        ):
            raise ConfigError(
                f"gen.stage_compute {self.stage_compute} must give one positive number per stage "
                f"({len(self.functions)}): fix the list."
            )
        if not self.compute_budget >= 0 or not self.round_s > 0:
            raise ConfigError(
                f"gen.compute_budget={self.compute_budget} and gen.round_s={self.round_s} must be a number of at "
                "least 0 and positive seconds: fix them."
            )
        if not (self.run or self.token_file or os.environ.get("JAXDIST_JOB_TOKEN")):
            raise ConfigError(
                "no token for the receiver: set gen.run to the training run (its gen/token), "
                "gen.token_file, or $JAXDIST_JOB_TOKEN."
            )
        return self

    def token(self) -> str:
        if os.environ.get("JAXDIST_JOB_TOKEN"):
            return os.environ["JAXDIST_JOB_TOKEN"]
        path = Path(self.token_file) if self.token_file else Path(self.run) / "gen" / "token"
        try:
            return path.read_text().strip()
        except OSError:
            raise ConfigError(
                f"cannot read the token {path}: start the run's receiver first (it writes it) or set gen.token_file."
            ) from None


def _coerce(value: str, like: Any, key: str) -> Any:
    if isinstance(like, list):  # comma-separated; numbers for a list of numbers
        items = [v.strip() for v in value.split(",") if v.strip()]
        if key == "stage_compute":
            try:
                return [float(v) for v in items]
            except ValueError:
                raise ConfigError(f"gen.{key}={value!r} is not a list of numbers: give e.g. 1,0.5.") from None
        return items
    if isinstance(like, bool):
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
    else:
        try:
            return type(like)(value)
        except ValueError:
            pass
    raise ConfigError(f"gen.{key}={value!r} is not a {type(like).__name__}: give one.")


def load_gen_config(path: str | None, overrides: list[str] = ()) -> GenConfig:
    """``[gen]`` of ``path`` (may be None) with ``key=value`` overrides (``sampler.temperature=0.7``)."""
    table: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"the config file '{p}' does not exist (or is a directory): name a TOML file.")
        try:
            table = tomllib.loads(p.read_text()).get("gen", {})
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{p} is not valid TOML ({e}): fix the file.") from None
    sampler = dict(table.pop("sampler", {}))
    for o in overrides:
        key, sep, value = o.partition("=")
        key = key.removeprefix("gen.")
        if not sep:
            raise ConfigError(f"override {o!r} is not key=value: write e.g. workers=2.")
        target, name, like = (
            (sampler, key[len("sampler.") :], SamplerSpec())
            if key.startswith("sampler.")
            else (table, key, GenConfig())
        )
        if name not in {f.name for f in dataclasses.fields(like)} or name == "sampler":
            raise ConfigError(f"unknown key gen.{key}: see jaxdist/gen/config.py for the keys.")
        target[name] = _coerce(value, getattr(like, name), key)
    for t, cls, prefix in ((table, GenConfig, ""), (sampler, SamplerSpec, "sampler.")):
        unknown = set(t) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown key gen.{prefix}{sorted(unknown)[0]}: see jaxdist/gen/config.py for the keys.")
    try:
        return GenConfig(**table, sampler=SamplerSpec(**sampler)).check()
    except TypeError as e:
        raise ConfigError(f"[gen] has a value of the wrong type ({e}): fix it.") from None

"""Generation run logs: one JSON line per request, appended by a worker, read back for profiling and planning.

**Record** (:class:`RunRecord`, one JSON object a line)::

    {"model": "gen-1b", "streams": 4, "start": 1718000000.125, "end": 1718000001.5,
     "tokens_in": 37, "tokens_out": 128, "worker": "w0", "node": "host-a"}

``model``: the name the job gives the model; ``streams``: how many requests the
node was running in parallel (a sampler batch of 4 prompts is 4 streams);
``start`` / ``end``: wall-clock seconds (``time.time()``) of this request;
``tokens_in`` / ``tokens_out``: prompt and generated tokens; ``worker`` /
``node``: who ran it (the profile measures throughput per worker, so logs of
several workers need distinct names); ``first_use`` (optional, default false):
the request ran a batch shape for the first time, so its time includes
compiling that shape's programs; fits leave such requests out.

**Writing.** :class:`RunLogWriter` appends and flushes one line per record; if
the file ends in a torn line (a writer killed mid-line) it starts a fresh line
first, so one kill costs one record, never the next.

**Reading.** :func:`read_run_logs` names each torn or invalid line (a warning,
one sentence) and skips it; a log with no usable record, or a record of a model
outside the expected list, is a :class:`~jaxdist.errors.ConfigError`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jaxdist.data.journal import append_lines
from jaxdist.errors import ConfigError

log = logging.getLogger(__name__)

FIELDS = ("model", "streams", "start", "end", "tokens_in", "tokens_out")


@dataclass(frozen=True)
class RunRecord:
    """One request: ``model`` ran it among ``streams`` parallel streams from ``start`` to ``end`` (seconds)."""

    model: str
    streams: int
    start: float
    end: float
    tokens_in: int
    tokens_out: int
    worker: str = ""
    node: str = ""
    first_use: bool = False  # its time includes compiling a new batch shape: not a steady-state measurement

    @property
    def seconds(self) -> float:
        """The request's latency (s)."""
        return self.end - self.start

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def parse_record(obj: object) -> RunRecord:
    """A record from a decoded JSON line; ValueError (saying which field) if it is not one."""
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in FIELDS if k not in obj]
    if missing:
        raise ValueError(f"no {', '.join(missing)}")
    model = obj["model"]
    if not isinstance(model, str) or not model:
        raise ValueError("model is not a name")
    nums = {}
    for k in FIELDS[1:]:
        v = obj[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{k} is not a number")
        nums[k] = v
    for k in ("streams", "tokens_in", "tokens_out"):
        if nums[k] != int(nums[k]):
            raise ValueError(f"{k} is not a whole number")
    if nums["streams"] < 1:
        raise ValueError("streams is below 1")
    if nums["tokens_in"] < 0 or nums["tokens_out"] < 0:
        raise ValueError("a token count is negative")
    if nums["end"] < nums["start"]:
        raise ValueError("end is before start")
    return RunRecord(
        model,
        int(nums["streams"]),
        float(nums["start"]),
        float(nums["end"]),
        int(nums["tokens_in"]),
        int(nums["tokens_out"]),
        str(obj.get("worker", "")),
        str(obj.get("node", "")),
        bool(obj.get("first_use", False)),
    )


class RunLogWriter:
    """Appends records to one run log (JSONL), one flushed line each.

    A worker makes one per process and calls :meth:`log` once per request, e.g.
    after a sampler batch of ``s`` prompts, ``s`` times with ``streams=s`` and the
    batch's start and end.
    """

    def __init__(self, path: str | Path, model: str, worker: str = "", node: str = "", fsync: bool = False):
        self.path, self.model, self.worker, self.node, self.fsync = Path(path), model, worker, node, fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(
        self, streams: int, start: float, end: float, tokens_in: int, tokens_out: int, first_use: bool = False
    ) -> RunRecord:
        """Append one request of this writer's model (times in seconds, counts in tokens); returns its record."""
        rec = RunRecord(self.model, streams, start, end, tokens_in, tokens_out, self.worker, self.node, first_use)
        self.write([rec])
        return rec

    def write(self, records: Iterable[RunRecord]) -> None:
        """Append records (of any model); a torn last line of the file is closed with a newline first."""
        append_lines(self.path, "".join(r.to_json() + "\n" for r in records).encode(), fsync=self.fsync)


@dataclass
class RunLog:
    """The usable records of some run logs, and the lines skipped (``path:line: why``)."""

    records: list[RunRecord]
    skipped: list[str] = field(default_factory=list)

    def models(self) -> list[str]:
        """The models logged, in order of first appearance."""
        return list(dict.fromkeys(r.model for r in self.records))

    def of(self, model: str) -> list[RunRecord]:
        return [r for r in self.records if r.model == model]


def read_run_logs(paths: Sequence[str | Path], models: Sequence[str] | None = None) -> RunLog:
    """The records of ``paths`` (JSONL run logs); torn or invalid lines are skipped with a warning each.

    ConfigError (one sentence) if a path is missing, no line of a log is usable,
    or, when ``models`` is given, a record names a model outside it.
    """
    if not paths:
        raise ConfigError("no run logs given: name at least one JSONL run log.")
    records: list[RunRecord] = []
    skipped: list[str] = []
    for path in map(Path, paths):
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            raise ConfigError(f"the run log '{path}' cannot be read: name an existing JSONL file.") from None
        ours = []
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                ours.append(parse_record(json.loads(line)))
            except (ValueError, UnicodeDecodeError) as e:
                why = "a torn line (not JSON)" if isinstance(e, json.JSONDecodeError) else f"not a record ({e})"
                skipped.append(f"{path}:{n}: {why}")
                log.warning("%s line %d is %s: skipped.", path, n, why)
        if not ours:
            raise ConfigError(
                f"the run log '{path}' has no usable request record: write one JSON object a line with "
                f"{', '.join(FIELDS)}."
            )
        records += ours
    if models is not None:
        known = set(models)
        for r in records:
            if r.model not in known:
                raise ConfigError(
                    f"the run logs name model '{r.model}', which is not one of {', '.join(sorted(known))}: "
                    f"add it to the model list or drop its records."
                )
    return RunLog(records, skipped)

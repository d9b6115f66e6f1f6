"""A job's health from its workers' efficiency records: robust detection, as pure functions.

Every training process reports one :class:`Period` per ``controller.health_every`` steps (closed at the
loop's metric flushes, so every rank closes its periods at the same steps): how many steps and samples it
trained, the honest training time (the metrics window's clock), and the seconds its host spent in each
part of the loop -- waiting for the next batch (``data_wait_s``), from batch ready to step dispatched
(``dispatch_s``: the host's own part of the step), blocked on the device's results (``blocked_s``: the
device's compute and the collectives), in checkpoint saves (``checkpoint_s``) and evaluation (``eval_s``).
The controller groups the ranks' n-th periods into a *round* and asks :func:`assess`.

Two questions, both with robust statistics (median and MAD: one wild value moves neither):

* **Has the job slowed down?**  The round's seconds per step (the median over ranks) against the job's own
  last ``history`` rounds: abnormal when it exceeds their median by more than ``z`` scaled MADs *and* by
  more than ``min_change`` of the median.  The first condition ignores the noise the job has shown; the
  second ignores changes too small to matter when the history happens to be very steady (MAD near 0).
* **Does one rank stand out?**  For each part of the loop, a rank's seconds per step against the other
  ranks' in the same round: abnormal when it exceeds their median by more than ``z`` scaled MADs, by
  more than ``min_share`` of the job's step time (``min_change`` for saves: the primary host legitimately
  writes more) *and* by a factor of ``min_ratio``.  The MAD of the other ranks in one round is a weak
  measure of noise (with three ranks it is half the gap between the two others, often near 0); the
  factor keeps a busy host's scheduling -- one rank's share of the cores 17% below the others' for two
  rounds, seen in CI with two ranks' CPU-bound programs on a loaded 2-core host -- from naming it.  A cause shared by every rank (an external load on the whole host, a slower phase of
  training) moves the median with it and names no rank.

A finding becomes an alarm (an event, a probe) once the same kind -- for the same rank -- has been
abnormal ``persist`` rounds in a row: one noisy round (a scheduling hiccup of the host) raises nothing.

What each finding means (:class:`Finding` ``kind``):

* ``data``: one rank waits for its batches (its input pipeline is slow);
* ``compute``: one rank's host takes longer to dispatch its part of the step (a slow or overloaded host);
* ``checkpoint``: saves block the loop (one rank's, or the whole job's against its history);
* ``slowdown``: the job is slower and no host-side part explains it: the time went into the device step
  itself (a slow device or a slow link; telling those apart needs timed collectives on the devices).
  A job-wide finding names the part that grew on the median rank: ``data``, ``compute`` or ``checkpoint``
  when every rank's host spends the extra time there (shared storage, an overloaded cluster);
* ``stuck``: see :func:`stuck_ranks`: alive and heartbeating, but its step does not finish while the
  others wait.

A rank's step time cannot single it out in a synchronous job: the collectives make every rank's step as
slow as the slowest, which is why the parts are compared, not the totals.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

MAD_SCALE = 1.4826  # MAD x this estimates the standard deviation of normally distributed values
PARTS = ("data_wait_s", "dispatch_s", "blocked_s", "checkpoint_s", "eval_s")
KIND_OF_PART = {"data_wait_s": "data", "dispatch_s": "compute", "checkpoint_s": "checkpoint"}  # a rank's own


@dataclass(frozen=True)
class Period:
    """One rank's efficiency record: steps ``first_step``..``last_step`` (inclusive), seconds per part."""

    gen: int
    rank: int
    node: str
    index: int  # the rank's n-th period in this generation (0-based): the ranks' same index form a round
    first_step: int
    last_step: int
    t_end: float  # seconds since the epoch
    samples: int  # sequences this rank trained
    train_s: float  # the metrics window's time of these steps (from dispatch to finished on the device)
    data_wait_s: float = 0.0
    dispatch_s: float = 0.0
    blocked_s: float = 0.0
    checkpoint_s: float = 0.0
    eval_s: float = 0.0

    @property
    def steps(self) -> int:
        return self.last_step - self.first_step + 1

    @property
    def step_s(self) -> float:
        """Seconds per step (training time only)."""
        return self.train_s / max(self.steps, 1)

    def per_step(self, part: str) -> float:
        """Seconds per step spent in ``part`` (one of :data:`PARTS`)."""
        return getattr(self, part) / max(self.steps, 1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Period:
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Thresholds:
    """How far from normal is abnormal (see the module docstring)."""

    z: float = 5.0  # scaled MADs above the median
    min_change: float = 0.25  # job: and at least this fraction above its recent median step time
    min_share: float = 0.08  # rank: and at least this fraction of the job's step time per step
    min_ratio: float = 1.5  # rank: and at least this many times the other ranks' median of the same part
    persist: int = 2  # consecutive abnormal rounds before a finding is raised (one noisy round is not)
    history: int = 8  # rounds of the job's own history compared against
    min_history: int = 3  # rounds needed before the job-level test says anything
    warmup_rounds: int = 1  # a generation's first rounds (compiling, loading) are neither judged nor history


@dataclass(frozen=True)
class Finding:
    """Something abnormal in a round: ``kind`` (see the module docstring), the rank and node if one is named."""

    kind: str
    round: int
    rank: int | None
    node: str | None
    value: float  # seconds per step of the measured quantity
    reference: float  # its normal value (the other ranks' median, or the job's recent median)
    why: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def median_mad(values: Sequence[float]) -> tuple[float, float]:
    """The median and the median absolute deviation from it."""
    m = statistics.median(values)
    return m, statistics.median(abs(v - m) for v in values)


def above(value: float, values: Sequence[float], z: float, floor: float) -> tuple[bool, float, float]:
    """Whether ``value`` exceeds the median of ``values`` by more than ``z`` scaled MADs and by more than
    ``floor``; also returns the median and the robust score (``inf`` when the MAD is 0 and it exceeds)."""
    return _judge(value, *median_mad(values), z, floor)


def _judge(value: float, m: float, mad: float, z: float, floor: float) -> tuple[bool, float, float]:
    excess = value - m
    score = excess / (MAD_SCALE * mad) if mad > 0 else (float("inf") if excess > 0 else 0.0)
    return excess > floor and score > z, m, score


def _median_without(ordered: Sequence[float], i: int) -> float:
    """``statistics.median`` of the sorted ``ordered`` without its element at index ``i`` (the same arithmetic)."""
    n = len(ordered) - 1
    at = lambda k: ordered[k] if k < i else ordered[k + 1]  # noqa: E731
    return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


def median_mad_of_others(values: Sequence[float]) -> list[tuple[float, float]]:
    """For each value, :func:`median_mad` of all the other values -- the same numbers, in O(N log N) rather than
    a median of N - 1 values per value (N^2 log N: 1.2 s a round at 1,024 ranks).  Without one value the
    median is one or the mean of two neighbours of the sorted list (at most three distinct medians); for each,
    the deviations are sorted once and the value's own deviation is left out the same way."""
    ordered = sorted(values)
    where = {}  # a value -> an index of it in ordered (any: equal values leave the same others)
    for k, v in enumerate(ordered):
        where.setdefault(v, k)
    deviations: dict[float, list[float]] = {}
    out = []
    for v in values:
        m = _median_without(ordered, where[v])
        devs = deviations.get(m)
        if devs is None:
            devs = deviations[m] = sorted(abs(x - m) for x in values)
        out.append((m, _median_without(devs, bisect.bisect_left(devs, abs(v - m)))))
    return out


def job_step_s(round_periods: Sequence[Period]) -> float:
    """The job's seconds per step in a round: the median over its ranks (they run in lockstep)."""
    return statistics.median(p.step_s for p in round_periods)


def round_summary(round_periods: Sequence[Period]) -> dict[str, float]:
    """The round's medians over ranks: ``step_s`` and each part of :data:`PARTS`, in seconds per step."""
    out = {"step_s": job_step_s(round_periods)}
    for part in PARTS:
        out[part] = statistics.median(p.per_step(part) for p in round_periods)
    return out


JOB_KIND_OF_PART = {"data_wait_s": "data", "dispatch_s": "compute", "checkpoint_s": "checkpoint"}


def assess(
    round_index: int,
    periods: Sequence[Period],
    history: Sequence[dict[str, float]],
    t: Thresholds = Thresholds(),
) -> list[Finding]:
    """Findings of one round: ``periods`` (one per rank); ``history``: the :func:`round_summary` of the
    job's previous normal rounds, oldest first (only the last ``t.history`` count)."""
    if not periods:
        return []
    out: list[Finding] = []
    now = round_summary(periods)
    job = now["step_s"]
    if len(periods) >= 3:  # with two ranks, one standing out from the other cannot be told from the reverse
        for part, kind in KIND_OF_PART.items():  # blocked_s: shared by all ranks in lockstep, not a rank's own
            values = [p.per_step(part) for p in periods]
            # A save legitimately differs by rank (the primary host writes more): it must block for longer.
            floor = (t.min_change if part == "checkpoint_s" else t.min_share) * job
            for p, value, (m, mad) in zip(periods, values, median_mad_of_others(values)):  # each against the others
                hit, ref, score = _judge(value, m, mad, t.z, floor)
                if hit and value > t.min_ratio * ref:
                    out.append(
                        Finding(
                            kind,
                            round_index,
                            p.rank,
                            p.node,
                            p.per_step(part),
                            ref,
                            f"rank {p.rank} on {p.node} spends {p.per_step(part):.3f} s per step in "
                            f"{part[:-2].replace('_', ' ')}, the other ranks {ref:.3f} s (score {score:.1f})",
                        )
                    )
    recent = list(history)[-t.history :]
    if len(recent) >= t.min_history and not out:  # a rank named above explains a slower job
        steps = [h["step_s"] for h in recent]
        hit, ref, score = above(job, steps, t.z, t.min_change * statistics.median(steps))
        if hit:
            # Which part of the loop took the extra time, on the median rank: a host-side part shared by every
            # rank (shared storage, an overloaded cluster), or the device step itself (blocked_s).
            grew = {part: now[part] - statistics.median(h[part] for h in recent) for part in PARTS}
            part = max(grew, key=grew.get)
            kind = JOB_KIND_OF_PART.get(part, "slowdown")
            what = (
                "the device step itself is slower (a slow device or link: no host-side part explains it)"
                if kind == "slowdown"
                else f"every rank spends {grew[part]:.3f} s more per step in {part[:-2].replace('_', ' ')}"
            )
            out.append(
                Finding(
                    kind,
                    round_index,
                    None,
                    None,
                    job,
                    ref,
                    f"the job takes {job:.3f} s per step, its recent median {ref:.3f} s (score {score:.1f}): {what}",
                    {"grew": grew},
                )
            )
    return out


@dataclass
class HealthHistory:
    """The controller's record of one generation's periods, grouped into rounds as they complete."""

    gen: int
    ranks: int
    periods: dict[int, list[Period]] = field(default_factory=dict)  # rank -> its periods in order
    rounds_done: int = 0
    job_history: list[dict[str, float]] = field(default_factory=list)  # round_summary of the normal rounds
    streaks: dict[tuple[str, int | None], int] = field(default_factory=dict)  # (kind, rank) -> abnormal rounds
    reported: dict[int, int] = field(default_factory=dict)  # round -> ranks that sent it (a round is complete in O(1))

    def is_next(self, record: Any) -> bool:
        """Whether ``record`` (a Period's dict, as a heartbeat carries it) is the next of its rank: the records a
        heartbeat resends are skipped without being read into Periods."""
        if not isinstance(record, dict):
            return False
        rank = record.get("rank")
        return (
            record.get("gen") == self.gen
            and isinstance(rank, int)
            and 0 <= rank < self.ranks
            and record.get("index") == len(self.periods.get(rank, ()))
        )

    def add(self, p: Period) -> bool:
        """Record ``p`` (a duplicate or another generation's is ignored); True if it is new."""
        if p.gen != self.gen or not 0 <= p.rank < self.ranks:
            return False
        mine = self.periods.setdefault(p.rank, [])
        if p.index != len(mine):
            return False
        mine.append(p)
        self.reported[p.index] = self.reported.get(p.index, 0) + 1
        return True

    def complete_rounds(
        self, t: Thresholds = Thresholds()
    ) -> Iterable[tuple[int, list[Period], list[Finding], list[Finding]]]:
        """Each round every rank has now reported (in order; each round once), with its findings and the
        alarms among them: a finding whose (kind, rank) has now been abnormal ``t.persist`` rounds in a row
        (raised once per spell: it is raised again only after a normal round).

        A round with a finding does not join the job's history, nor does one already ``min_change`` slower
        than its recent median: a slow spell is compared against the normal rounds before it, not against
        itself.  The first ``t.warmup_rounds`` rounds hold the
        generation's compiles and restores (one rank may compile while the others load their programs
        from the cache): they are recorded but not judged.
        """
        # Asked after every period the controller receives: counted, not a walk over the ranks (that was N^2 a
        # round at N ranks).
        while self.reported.get(self.rounds_done, 0) >= self.ranks:
            r = self.rounds_done
            self.reported.pop(r)
            periods = [self.periods[k][r] for k in sorted(self.periods)]
            found = assess(r, periods, self.job_history, t) if r >= t.warmup_rounds else []
            summary = round_summary(periods)
            if not found and r >= t.warmup_rounds and not self._drifting(summary["step_s"], t):
                self.job_history.append(summary)
            self.rounds_done += 1
            now = {(f.kind, f.rank): f for f in found}
            self.streaks = {k: self.streaks.get(k, 0) + 1 for k in now}
            yield r, periods, found, [f for k, f in now.items() if self.streaks[k] == t.persist]

    def _drifting(self, step_s: float, t: Thresholds) -> bool:
        """A round slower than the recent median by more than ``t.min_change`` but not (yet) abnormal -- the
        first, partly slow round of a spell -- stays out of the history too: joining it would raise the
        reference and hide the rest of the spell."""
        recent = [h["step_s"] for h in self.job_history[-t.history :]]
        return len(recent) >= t.min_history and step_s > (1 + t.min_change) * statistics.median(recent)

    def typical_step_s(self) -> float | None:
        """The median seconds per step of the normal rounds so far (None before any)."""
        return statistics.median(h["step_s"] for h in self.job_history) if self.job_history else None


@dataclass(frozen=True)
class LoopPosition:
    """Where a rank's training loop is (from its heartbeats): in ``phase`` for ``age_s`` seconds, having
    dispatched steps up to ``dispatched``."""

    rank: int
    node: str
    phase: str  # "data" | "agree" | "dispatch" | "blocked" | "checkpoint" | "eval" | "callbacks" | "idle"
    dispatched: int
    age_s: float


STUCK_PHASES = ("data", "callbacks")  # a rank held here (its host's own work) keeps the others waiting
# Waiting for the other ranks: in the step ("blocked"), agreeing on the batch list ("agree"), or in "dispatch": a
# host whose dispatch takes long waits for its own device (a full queue, or inputs still being computed), which
# waits for the others -- measured: at a hang inside rank 0's device program, rank 1 sat in "dispatch".
WAITING_PHASES = ("blocked", "agree", "dispatch")
STUCK_STEPS = 3.0  # step times (plus the heartbeat timeout) a rank may hold the others up in a host-side phase:
# a healthy host spends a fraction of one step there (its data, its dispatch, its callbacks), whatever
# train.log_every is; the heartbeat timeout covers the heartbeat's own delay and a loaded host's pauses
GROUP_STUCK_FACTOR = 10.0  # a whole group blocked is judged this many metric windows late: a slow step looks the same


def stuck_ranks(
    stalled_s: float,
    positions: Sequence[LoopPosition],
    step_s: float,
    heartbeat_timeout: float,
    window_s: float | None = None,
) -> tuple[list[int], str] | None:
    """The ranks holding up a group that has made no step for ``stalled_s`` seconds although every rank
    still heartbeats, and why; None when nothing is stuck (yet).

    ``step_s``: the job's typical seconds per step.  A rank is stuck when the group has made no step for
    ``STUCK_STEPS x step_s + heartbeat_timeout`` while at least one other rank waits (phase ``blocked`` or
    ``agree``) and it has been in its own host-side phase (waiting for data, dispatching, running
    callbacks) for as long: a healthy host is there for a fraction of a step.  A rank in a save or an
    evaluation is not named (those can take long; the progress timeout still covers them).

    ``window_s`` (default ``step_s``): the seconds of one metrics window (``train.log_every`` steps): a host
    legitimately waits that long for its device at a flush, so a group whose every rank waits is judged
    only after ``GROUP_STUCK_FACTOR`` windows.  Then the hang is inside the device program (a collective or
    a host callback that never returns): every host waits for its device, and no host can tell which
    rank's device holds the step (the dispatched steps do not tell either: a host waiting in dispatch lags
    behind one waiting at the flush for the same hang).  The whole group is returned, and the reason says so.
    """
    if not positions or step_s <= 0:
        return None
    limit = STUCK_STEPS * step_s + heartbeat_timeout
    if stalled_s <= limit:
        return None
    blocked = [p for p in positions if p.phase in WAITING_PHASES]
    if not blocked:
        return None  # every host is busy with its own work: nobody waits for anybody
    held = [p for p in positions if p.phase in STUCK_PHASES and p.age_s > limit]
    if held:
        named = sorted(p.rank for p in held)
        what = ", ".join(f"rank {p.rank} on {p.node} ({p.phase} for {p.age_s:.1f} s)" for p in held)
        return named, f"{what} while {len(blocked)} rank(s) wait in the step; no step for {stalled_s:.1f} s"
    group_limit = GROUP_STUCK_FACTOR * (window_s or step_s) + heartbeat_timeout
    # How long every rank has waited: the youngest wait, not the time since the last step, which also counts
    # the group's saves and evaluations before it (after a fault-free run's first save every rank has waited
    # a fraction of a second while the last step is seconds old).
    waited = min(stalled_s, min(p.age_s for p in positions))
    if len(blocked) == len(positions) and waited > group_limit:
        return sorted(p.rank for p in positions), (
            f"every rank has waited for {waited:.1f} s (over {group_limit:.1f} s; dispatched up to step "
            f"{max(p.dispatched for p in positions)}): a hang inside the device program (a collective or a host "
            "callback that never returns); every host waits for its device, so no host can tell which rank's "
            "device holds it"
        )
    return None


PROBE_MIN_EXCESS = (
    0.5  # a node's compute or a pair's transfer stands out only by more than this fraction of the others'
)


def name_probe(record: dict[str, Any], z: float = 5.0, min_excess: float = PROBE_MIN_EXCESS) -> dict[str, Any]:
    """What a device probe's ``record`` (jaxdist.train.device_probe.DeviceProbe.run) names, as printable data.

    A node's compute seconds (a matmul on its own devices, no collective) stand out when they exceed the
    other nodes' median by more than ``z`` scaled MADs and by more than ``min_excess`` of that median: the
    node is slow (``kind="compute"``).  A pair's transfer seconds are judged the same way against
    the other pairs (when both a node and pairs stand out, the larger excess in seconds wins: it explains more
    of the slower step); the slow pairs are a slow link: they name the worst
    of them (``kind="link"``, ``link=[a, b]``), unless one node's pairs are all slow: its own network
    (``kind="link"``, ``node``).  Returns ``kind`` (``"compute"``, ``"link"`` or None), ``node``,
    ``link``, ``why``, and ``words``: one word per node for the status table.
    """
    compute = {k: float(v) for k, v in record["compute_s"].items()}
    nodes = list(record.get("nodes") or compute)
    words = dict.fromkeys(nodes, "ok")
    out: dict[str, Any] = {
        "kind": None,
        "node": None,
        "link": None,
        "why": "no node or link stands out",
        "words": words,
    }
    slow_nodes = []
    if len(compute) >= 3:
        for n, s in compute.items():
            others = [v for k, v in compute.items() if k != n]
            hit, ref, _ = above(s, others, z, min_excess * statistics.median(others))
            if hit:
                slow_nodes.append((n, s, ref))
    pairs = [(str(a), str(b), float(s)) for a, b, s, *_ in record["pairs"]]
    slow = []
    if len(pairs) >= 3:
        for i, (a, b, s) in enumerate(pairs):
            others = [p[2] for j, p in enumerate(pairs) if j != i]
            hit, ref, _ = above(s, others, z, min_excess * statistics.median(others))
            if hit:
                slow.append((a, b, s, ref))
    # Both stand out: the one with the larger excess seconds explains the slower step (a busy host's compute
    # test varies by a millisecond or two; a degraded link adds far more).
    worst_pair = max((p[2] - p[3] for p in slow), default=0.0)
    worst_node = max((x[1] - x[2] for x in slow_nodes), default=0.0)
    if slow_nodes and worst_node >= worst_pair:
        n, s, ref = max(slow_nodes, key=lambda x: x[1] - x[2])
        for m, *_ in slow_nodes:
            words[m] = "slow compute"
        out.update(kind="compute", node=n, why=f"{n} computes in {s * 1e3:.2f} ms, the other nodes {ref * 1e3:.2f} ms")
        return out
    if not slow:
        return out
    # A node whose every pair is slow: its own network.  Otherwise the worst pair is the link (another pair
    # that barely passes the test on a busy host must not turn one slow link into a "slow node").
    count = {n: sum(n in p[:2] for p in slow) for n in nodes}
    full = [n for n, c in count.items() if c >= 2 and c == len(nodes) - 1]
    if len(full) == 1:
        n = full[0]
        words[n] = "slow network"
        out.update(kind="link", node=n, why=f"every pair of {n} ({count[n]}) is slow: its network is slow")
        return out
    a, b, s, ref = max(slow, key=lambda p: p[2] / p[3] if p[3] > 0 else float("inf"))
    words[a], words[b] = f"slow link to {b}", f"slow link to {a}"
    others = [f"{x}-{y}" for x, y, *_ in slow if (x, y) != (a, b)]
    also = f" (also above the others: {', '.join(others)})" if others else ""
    out.update(
        kind="link", link=[a, b], why=f"{a}-{b} takes {s * 1e3:.2f} ms, the other pairs {ref * 1e3:.2f} ms{also}"
    )
    return out

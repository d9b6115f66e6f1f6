"""The controller's decisions, as pure functions of what it knows (no sockets, no clocks, no JAX).

* :func:`valid_group_sizes`, :func:`choose_group_size`: how many nodes may train
  (elastic start: the largest count the mesh and batch allow, up to max_nodes);
* :func:`find_failures`: which workers are dead, silent or stuck (:func:`disconnect_grace`: how long a dropped
  connection waits);
* :func:`plan_replacement`: which node takes each rank of the next generation;
* :func:`grown_plan`: more ranks for it when more nodes are ready than the group has (up to the size it started with);
* :func:`process_failure_verdict`: after a process crash on a healthy node, keep the rank there, move it, ban the
  node, or stop the job (a rank that fails wherever it runs);
* :func:`slow_nodes`: which node's links are slow (slow steps: :mod:`jaxdist.controller.health`);
* :func:`lineage`: which batches the final parameters were trained on.
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jaxdist.cluster import NODE_LOCAL_AXES
from jaxdist.config import Config, ConfigError, validate


def group_size_error(cfg: Config, n_nodes: int, devices_per_node: int) -> str | None:
    """Why ``n_nodes`` nodes of ``devices_per_node`` devices cannot run ``cfg`` (one sentence), or None."""
    try:
        validate(cfg, n_nodes * devices_per_node)
        sizes = cfg.mesh.resolved(n_nodes * devices_per_node)
    except ConfigError as e:
        return str(e)
    local = math.prod(sizes[a] for a in NODE_LOCAL_AXES)
    if devices_per_node % local:
        named = "*".join(a for a in NODE_LOCAL_AXES if a != "context" or sizes["context"] > 1)
        return f"{named} = {local} does not fit in a node of {devices_per_node} devices"
    if (sizes["data"] * sizes["fsdp"]) % n_nodes:
        return f"data*fsdp = {sizes['data'] * sizes['fsdp']} cannot be split over {n_nodes} nodes"
    return None


def valid_group_sizes(cfg: Config, devices_per_node: int, upto: int) -> list[int]:
    """Node counts 1..upto on which the config's mesh, batch and hybrid layout work."""
    cfg = copy.deepcopy(cfg)
    return [n for n in range(1, upto + 1) if group_size_error(cfg, n, devices_per_node) is None]


def group_size_problem(
    cfg: Config, min_nodes: int, max_nodes: int, devices_per_node: int, valid: Iterable[int]
) -> str | None:
    """Why no node count from ``min_nodes`` to ``max_nodes`` can train ``cfg`` (one sentence), or None if one can.

    ``valid``: :func:`valid_group_sizes` up to ``max_nodes`` (the cluster's node count unless controller.max_nodes).
    """
    if any(n >= min_nodes for n in valid):
        return None
    if min_nodes > max_nodes:
        return (
            f"controller.min_nodes={min_nodes} asks for more than the {max_nodes} nodes the job may use "
            f"(mesh.cluster={cfg.mesh.cluster}, or controller.max_nodes): lower controller.min_nodes."
        )
    why = group_size_error(cfg, max_nodes, devices_per_node)  # not None: max_nodes >= min_nodes is not valid
    return (
        f"no node count from controller.min_nodes={min_nodes} to {max_nodes} fits the mesh and batch ({why}): "
        "change the mesh, the batch or the node counts."
    )


def choose_group_size(ready: int, min_nodes: int, max_nodes: int, valid: Iterable[int]) -> int | None:
    """The largest valid node count in [min_nodes, min(ready, max_nodes)], or None (wait for more nodes)."""
    fits = [n for n in valid if min_nodes <= n <= min(ready, max_nodes)]
    return max(fits) if fits else None


# --------------------------------------------------------------------------- health


@dataclass
class WorkerView:
    """What the controller knows of one member of the running generation.

    ``last_heartbeat`` and ``exited_at`` are seconds on the controller's clock;
    ``exit_code`` is the process's return code (negative: killed by that signal).
    """

    rank: int
    node: str
    last_heartbeat: float
    step: int = 0
    state: str = "joining"
    exit_code: int | None = None
    exited_at: float | None = None
    connected: bool | None = None  # its connection answers ZeroMQ heartbeats (None: unknown)
    disconnected_at: float | None = None


@dataclass(frozen=True)
class Failure:
    """A reason to end a generation: ``kind`` exit | silent | stalled | start_timeout; ``node`` None blames no node."""

    kind: str
    node: str | None
    rank: int | None
    detail: str


STARTUP_STATES = ("warming", "warm", "joining", "restoring")
SIGTERM = 15
# How long a worker's exit by SIGTERM waits before it is a failure.  scancel or a preemption signals every
# process of the job at once; the worker's exit, reported by its node agent, can reach the controller before the
# controller's own SIGTERM handler has stopped its loop (seen in tests/slurm/test_launch.py on a loaded machine).
# A SIGTERM of one worker alone is rare, and its recovery starts this much later.
TERM_GRACE_S = 2.0
SIGABRT = 6


def find_failures(
    now: float,
    workers: Sequence[WorkerView],
    *,
    started_at: float,
    progress_at: float | None,
    heartbeat_timeout: float,
    progress_timeout: float,
    start_timeout: float,
    heartbeat_grace: float | None = None,
    disconnect_grace: float = 0.25,
    term_grace: float = TERM_GRACE_S,
) -> list[Failure]:
    """Failures of a generation at time ``now`` (seconds).

    Blamed: a worker that exited with a non-zero code; one whose connection
    dropped ``disconnect_grace`` ago (time for its node to report an exit) --
    a stopped or frozen process stops answering ZeroMQ's heartbeats; and one
    whose own heartbeats stopped for ``heartbeat_timeout``, or for
    ``heartbeat_grace`` while it is starting or its connection is known to be
    alive (its main thread may just hold the GIL).  A group whose step has not
    advanced for ``progress_timeout`` since ``progress_at`` (its last new
    step), or that has not made a first step ``start_timeout`` after
    ``started_at``, fails without blaming a node.  A worker that reported
    "done" or exited with 0 has finished training: no failure.  An exit by
    SIGTERM is blamed only ``term_grace`` after it: a whole job being stopped
    (scancel, preemption) sends it to the controller too, whose own stop must
    not be recorded as its workers' failure (:data:`TERM_GRACE_S`).

    An exit by SIGABRT is a consequence, not blamed, when another member
    exited otherwise or lost its connection: JAX's distributed service aborts
    every process ("another task died") within milliseconds of losing one, and
    those aborts may be reported before the judgment, or even before the exit
    that caused them -- so an abort alone waits ``disconnect_grace`` for its
    cause before it is blamed.
    """
    out = []
    grace = heartbeat_timeout if heartbeat_grace is None else heartbeat_grace
    caused = any(
        w.exit_code not in (None, 0, -SIGABRT) or (w.exit_code is None and w.disconnected_at is not None)
        for w in workers
        if w.state != "done"
    )
    for w in workers:
        if w.state == "done" or w.exit_code == 0:
            continue
        silent_s = now - w.last_heartbeat
        if w.exit_code is not None:
            if w.exit_code == -SIGTERM and w.exited_at is not None and now - w.exited_at < term_grace:
                continue  # the job may be stopping as a whole: the controller's own SIGTERM comes within the grace
            if w.exit_code == -SIGABRT and (
                caused or (w.exited_at is not None and now - w.exited_at <= disconnect_grace)
            ):
                continue  # aborted because a peer went (or may have: its exit report can come a moment later)
            how = f"killed by signal {-w.exit_code}" if w.exit_code < 0 else f"exit code {w.exit_code}"
            out.append(Failure("exit", w.node, w.rank, f"rank {w.rank} on {w.node}: {how}"))
        elif w.disconnected_at is not None:
            if now - w.disconnected_at > disconnect_grace:  # else: wait for an exit report
                out.append(
                    Failure(
                        "silent",
                        w.node,
                        w.rank,
                        f"rank {w.rank} on {w.node}: its connection stopped answering heartbeats "
                        f"(last message {silent_s:.1f} s ago)",
                    )
                )
        elif silent_s > (grace if (w.state in STARTUP_STATES or w.connected) else heartbeat_timeout):
            out.append(
                Failure("silent", w.node, w.rank, f"rank {w.rank} on {w.node}: no heartbeat for {silent_s:.1f} s")
            )
    if out:
        return out
    if any(w.exit_code == 0 or w.state == "done" for w in workers):
        return []  # finishing: the others follow in a moment
    if progress_at is None:
        if now - started_at > start_timeout:
            out.append(Failure("start_timeout", None, None, f"no first step {now - started_at:.0f} s after the start"))
    elif now - progress_at > progress_timeout:
        out.append(Failure("stalled", None, None, f"no step progress for {now - progress_at:.0f} s"))
    return out


# A dropped connection waits heartbeat_timeout instead of one heartbeat interval while at least this many
# members, and this share of them, dropped within heartbeat_timeout (disconnect_grace).
MASS_DROP_MIN = 4
MASS_DROP_SHARE = 0.05


def disconnect_grace(now: float, workers: Sequence[WorkerView], interval: float, timeout: float) -> float:
    """How long a member's dropped connection waits before it is a failure (find_failures' ``disconnect_grace``).

    One heartbeat ``interval`` (time for its node to report an exit), or ``timeout`` while connections dropped
    in bulk: at least :data:`MASS_DROP_MIN` members and :data:`MASS_DROP_SHARE` of them within ``timeout``.  A
    stall of the controller's host or of the network stops the ZeroMQ pings of many connections at once (at 1,024
    simulated nodes 2-4 s stalls of the shared VM dropped 109 and 264 nodes' connections together, and 3 to 6 in
    others, which this does not cover), and ZeroMQ reconnects them when it passes; a member heard again meanwhile
    has not failed.  A real loss of that many is found ``timeout - interval`` later; a single dropped member as
    before.
    """
    dropped = sum(
        1
        for w in workers
        if w.exit_code is None and w.disconnected_at is not None and now - w.disconnected_at <= timeout
    )
    return timeout if in_bulk(dropped, len(workers)) else interval


def in_bulk(count: int, group: int) -> bool:
    """Whether ``count`` of a group of ``group`` members going at once is a bulk (:data:`MASS_DROP_MIN` and
    :data:`MASS_DROP_SHARE`): more likely a stall of the controller's host or of the network than that many
    nodes lost."""
    return count >= max(MASS_DROP_MIN, MASS_DROP_SHARE * group)


def plan_replacement(
    members: dict[int, str], failed: set[str], candidates: Sequence[str], banned: set[str]
) -> dict[int, str] | None:
    """Rank -> node of the next generation, or None when too few nodes are left.

    Healthy members keep their ranks.  Each failed member's rank goes to the
    next candidate (warm standbys first, as the caller orders them), skipping
    banned nodes and nodes already in the group; a failed node that is not
    banned may take back its own rank when no standby is left (its agent
    starts a fresh process).
    """
    keep = {r: n for r, n in members.items() if n not in failed}
    used = set(keep.values())
    pool = [n for n in candidates if n not in banned and n not in used and n not in failed]
    pool += [n for n in sorted(failed) if n not in banned]
    plan = dict(keep)
    for r in sorted(set(members) - set(keep)):
        if not pool:
            return None
        plan[r] = pool.pop(0)
        used.add(plan[r])
    return plan


def grown_plan(
    plan: dict[int, str], ready: Sequence[str], min_nodes: int, max_nodes: int, valid: Iterable[int]
) -> dict[int, str]:
    """``plan`` with more ranks when ``ready`` nodes outside it (warm standbys, in order) allow a larger group the
    mesh and batch accept, up to ``max_nodes`` (the caller passes the size the job started with: a group that
    shrank takes its size back, none grows past it); else ``plan``.

    The planned ranks keep their nodes; the new ranks follow them."""
    extra = [n for n in ready if n not in plan.values()]
    n = choose_group_size(len(plan) + len(extra), min_nodes, max_nodes, valid)
    if n is None or n <= len(plan):
        return plan
    return {**plan, **{len(plan) + i: node for i, node in enumerate(extra[: n - len(plan)])}}


@dataclass(frozen=True)
class Verdict:
    """What follows a process failure on a healthy node: ``action`` stay | move | ban | give_up, and why."""

    action: str
    why: str = ""


def process_failure_verdict(log: Sequence[tuple[int, str]], limit: int) -> Verdict:
    """The decision after the last process failure of ``log`` ((rank, node) per failure, oldest first).

    ``limit`` is controller.max_process_failures. A node reaches the limit with failures of one rank only:
    that rank is moved to another node (once), the node is not charged with a ban -- a rank's program can
    fail wherever it runs. A rank that then fails on another node too, reaching the limit in all, fails
    wherever it runs: the job stops (give_up) rather than banning healthy nodes one after another; so does a
    rank that failed 2 x limit times with no other node to take it. A node that reaches the limit with
    failures of two or more ranks is the node's fault: ban.
    """
    rank, node = log[-1]
    on_node = [r for r, n in log if n == node]
    of_rank = [n for r, n in log if r == rank]
    if len(on_node) >= limit and len(set(on_node)) > 1:
        return Verdict("ban", f"its processes failed {len(on_node)} times, as ranks {sorted(set(on_node))}")
    if len(of_rank) >= limit and len(set(of_rank)) > 1:
        where = ", ".join(f"{of_rank.count(n)} on {n}" for n in dict.fromkeys(of_rank))
        return Verdict(
            "give_up",
            f"the process of rank {rank} failed {len(of_rank)} times on healthy nodes ({where}): it fails "
            "wherever it runs, so the program or its data at that rank is at fault, not a node (see the worker logs)",
        )
    if len(of_rank) >= 2 * limit:
        return Verdict(
            "give_up",
            f"the process of rank {rank} failed {len(of_rank)} times on {node} and no other node could take it "
            "(see the worker logs)",
        )
    if len(on_node) >= limit:
        return Verdict("move", f"rank {rank} failed {len(on_node)} times on {node}: it moves to another node once")
    return Verdict("stay")


# --------------------------------------------------------------------------- slowness


PROBE_PEERS = 8  # the other nodes one node pings (its link check): the cost grows as N x this, not N^2


def probe_peers(names: Sequence[str], name: str, k: int = PROBE_PEERS) -> list[str]:
    """The nodes ``name`` pings: itself (its probe address as the others see it) and the ``k`` nodes before it in
    ``names`` (cyclically).  Over a ring of live nodes every node pings ``k`` and is pinged by ``k``, so each
    node's round-trip times cover 2k links, enough for :func:`slow_nodes` to tell a slow node (in all of its
    pairs) from its neighbours (in one or two of theirs); a node joining pings the ``k`` that joined last."""
    if name not in names:
        return [name]
    i = list(names).index(name)
    before = [names[(i - j) % len(names)] for j in range(1, min(k, len(names) - 1) + 1)]
    return [name, *before]


def slow_nodes(rtt: dict[tuple[str, str], float], factor: float = 3.0) -> list[str]:
    """Nodes whose median round-trip time (s) to the others exceeds ``factor`` x the median over all nodes.

    ``rtt[(a, b)]`` is the time of a probe from a to b and back; a slow link
    or host shows in every pair it belongs to, a healthy node in few.
    """
    per_node: dict[str, list[float]] = {}
    for (a, b), t in rtt.items():
        per_node.setdefault(a, []).append(t)
        per_node.setdefault(b, []).append(t)
    if len(per_node) < 3:
        return []  # with two nodes a slow pair cannot be attributed to one of them
    medians = {n: statistics.median(ts) for n, ts in per_node.items()}
    overall = statistics.median(medians.values())
    return sorted(n for n, m in medians.items() if m > factor * overall)


# --------------------------------------------------------------------------- accounting


def lineage(generations: Sequence[tuple[int, int]], final_step: int) -> list[int]:
    """Batch indices (0-based: step s trains batch s-1) behind the final parameters.

    ``generations`` lists (resume step, last completed step) per generation in
    order.  Generation g contributes the batches from its resume step up to the
    step the next one resumed from (the rest was recomputed); the last one up
    to ``final_step``.  An uninterrupted, loss-free history gives
    ``list(range(final_step))``; a repeated or skipped batch shows as a
    duplicate or a gap.
    """
    out: list[int] = []
    for i, (resume, last) in enumerate(generations):
        end = generations[i + 1][0] if i + 1 < len(generations) else final_step
        end = min(end, last) if i + 1 < len(generations) else end
        out.extend(range(resume, end))
    return out


def lost_steps(last_step: int, resume_step: int) -> int:
    """Steps of compute thrown away by a restart: completed before the failure, then redone."""
    return max(0, last_step - resume_step)


def ban_ends(now: float, cooldown: float, bans: int) -> float | None:
    """When (``now``'s clock) a node banned for the ``bans``-th time may return: ``cooldown`` doubled at each
    ban after the first; None when ``cooldown`` is 0 (a ban is for good)."""
    return now + cooldown * 2 ** (bans - 1) if cooldown > 0 else None


def bans_over(banned: Sequence[str], until: dict[str, float], now: float) -> list[str]:
    """The banned nodes whose cool-down has ended by ``now`` (in ban order); a node without an end stays out."""
    return [n for n in banned if n in until and until[n] <= now]


def covering_group(members: dict[int, str], usable: Sequence[str], n: int) -> list[str]:
    """``n`` of the ``usable`` nodes (in their order) for a smaller group, chosen so that their node-local
    directories hold every old rank's local-tier files between them when any ``n`` can (then the newest local
    step is resharded onto the new group instead of going back to the persistent one).

    With one process per node, old rank r's files are on its own node and, as a replica, on rank r+1's node
    (jaxdist.checkpoint.local: the shift is 1): a set covers every rank when no two neighbours on the ring of
    old ranks are both left out -- a vertex cover of the ring, its smallest found exactly by dynamic
    programming. The rest of the group is filled in the usable nodes' order; when ``n`` is too few to cover,
    the first ``n`` usable nodes.
    """
    old = [members[r] for r in sorted(members)]
    count, ok = len(old), set(usable)
    cover = _ring_cover([node in ok for node in old]) if count >= 2 and n < len(usable) else None
    if cover is None or len(cover) > n:
        return list(usable)[:n]
    chosen = {old[r] for r in cover}
    rest = [node for node in usable if node not in chosen][: n - len(chosen)]
    return [node for node in usable if node in chosen or node in rest]


def _ring_cover(allowed: list[bool]) -> list[int] | None:
    """The smallest set of allowed positions on a ring such that of every two neighbours one is in it, or None."""
    count, best = len(allowed), None
    for first in (True, False):  # position 0 in the set or not; the ring closes on it
        if first and not allowed[0]:
            continue
        inf = count + 1
        # cost[state] of positions 0..i with position i in (1) or out (0); back pointers per position
        cost = {1: 1, 0: inf} if first else {1: inf, 0: 0}
        back: list[dict[int, int]] = []
        for i in range(1, count):
            new, ptr = {}, {}
            for state in (1, 0):
                if state == 1 and not allowed[i]:
                    new[state], ptr[state] = inf, 0
                    continue
                prevs = (1, 0) if state == 1 else (1,)  # an out position needs its left neighbour in
                p = min(prevs, key=lambda k: cost[k])
                new[state], ptr[state] = cost[p] + state, p
            cost = new
            back.append(ptr)
        ends = (1, 0) if first else (1,)  # the last position and position 0 are neighbours too
        last = min(ends, key=lambda k: cost[k])
        if cost[last] >= inf:
            continue
        states, state = [last], last
        for ptr in reversed(back):
            state = ptr[state]
            states.append(state)
        states.reverse()
        states[0] = 1 if first else 0
        chosen = [i for i, st in enumerate(states) if st]
        if best is None or len(chosen) < len(best):
            best = chosen
    return best

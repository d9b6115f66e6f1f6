"""Candidate strategies: mesh factorisations x microbatches x pipeline schedules x remat choices.

A :class:`Strategy` is one evaluation point of the search.  :func:`candidates`
enumerates every strategy that the model, the batch and the cluster allow:

* ``data * fsdp * context * tensor * expert * pipeline`` = the free devices;
* ``context * tensor * expert * pipeline`` divides the devices of one node (these
  axes stay on the fast links), and ``data * fsdp`` is a multiple of the node count;
* ``context > 1`` only for a dense model without pipeline stages whose sequence
  splits into ``2 * context`` chunks (the ring's load-balanced order);
* heads and MLP width divisible by ``tensor`` (KV heads divisible by it, or it
  by them), experts by ``expert`` (dense models: ``expert = 1``), layers by
  ``pipeline``;
* the global batch divisible by ``microbatches``, and each microbatch by the
  batch axes ``data * fsdp * expert`` (attention splits tokens over ``expert`` too).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from jaxdist.config import MESH_AXES, Config
from jaxdist.models.names import CHECKPOINT_NAMES
from jaxdist.planner.computation import ComputationView

# Pipeline schedules the cost model knows: bubble (p-1)/(m+p-1) for gpipe and
# 1f1b, (p-1)/(s*m+p-1) for seq1f1b with s chunks per sequence; in flight on
# stage 0: m microbatches (gpipe), min(p, m) (1f1b), min(s+p-1, s*m) chunks of
# 1/s of a sequence (seq1f1b).  These are the closed forms of
# jaxdist.parallel.schedule (bubble_formula, peak_in_flight_formula; a test
# keeps them equal).
SCHEDULES = ("gpipe", "1f1b", "seq1f1b")
CHUNK_CHOICES = (2, 4)  # sequence chunks the planner tries for seq1f1b


@dataclass(frozen=True)
class RematChoice:
    """A remat choice: what each block keeps for the backward pass, and what that costs to recompute.

    ``train_remat`` is the ``train.remat`` value that applies it.  ``saved``
    lists the checkpoint names (``CHECKPOINT_NAMES``) kept per block besides
    the block input, which the layer scan always keeps; ``None`` means
    everything the backward pass needs (no remat).  ``recompute`` is the share
    of one block's forward FLOPs done again in the backward pass: a fraction in
    [0, 1], or ``"attention_scores"`` for the scores matmul only.  The remat
    selector (issue #3) can hand the planner its own choices in this form.
    """

    name: str
    train_remat: str
    saved: tuple[str, ...] | None
    recompute: float | str


REMAT_NONE = RematChoice("none", "none", None, 0.0)
# Every tagged intermediate (checkpoint_name) is kept; attention scores, softmax,
# rotary and SiLU are recomputed.
REMAT_NAMES = RematChoice("names", "save:" + ",".join(CHECKPOINT_NAMES), tuple(CHECKPOINT_NAMES), "attention_scores")
REMAT_FULL = RematChoice("full", "full", (), 1.0)
REMAT_CHOICES = (REMAT_NONE, REMAT_NAMES, REMAT_FULL)


_REGISTERED: dict[str, RematChoice] = {c.name: c for c in REMAT_CHOICES}


def register_remat_choice(choice: RematChoice) -> RematChoice:
    """Make ``choice`` known by name to the cost model (e.g. one the remat selector built); returns it."""
    known = _REGISTERED.get(choice.name)
    if known is not None and known != choice:
        raise ValueError(f"a different remat choice is already called '{choice.name}': give this one another name")
    _REGISTERED[choice.name] = choice
    return choice


def remat_choice(name: str) -> RematChoice:
    """The registered RematChoice called ``name`` (none, names, full, ...), or the one whose ``train.remat`` it is."""
    for c in _REGISTERED.values():
        if name in (c.name, c.train_remat):
            return c
    raise ValueError(f"unknown remat choice '{name}': use one of {', '.join(_REGISTERED)}")


@dataclass(frozen=True, order=True)
class Strategy:
    """One way to run a step: mesh axis sizes, microbatches, pipeline schedule, remat choice."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    expert: int = 1
    pipeline: int = 1
    microbatches: int = 1
    schedule: str = "none"
    remat: str = "none"
    chunks: int = 1  # seq1f1b: chunks per sequence; 1 for every other schedule
    context: int = 1  # sequence split over the ring (planner/ring.py); last, so ordering without it is unchanged
    # Devices per expert's hidden width (mesh.expert_tensor); 0: all of tensor.  The search leaves it at 0; a
    # config's own value (strategy_of) moves the rest of tensor into expert parallelism (parallel/moe.py).
    expert_tensor: int = 0

    @functools.cached_property
    def mesh(self) -> dict[str, int]:
        """Axis sizes in MESH_AXES order (made once per strategy: the planner reads it in every cost term; do not
        change the dict)."""
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def n_devices(self) -> int:
        """Devices the mesh spans."""
        return math.prod(self.mesh.values())

    def describe(self) -> str:
        """Short text, e.g. ``fsdp=8 tensor=8 | mb 4 | remat full``."""
        axes = " ".join(f"{a}={s}" for a, s in self.mesh.items() if s != 1) or "single device"
        sched = f" {self.schedule}" if self.pipeline > 1 else ""
        if self.schedule == "seq1f1b":
            sched += f" x{self.chunks}"
        if self.expert_tensor:
            axes += f" expert_tensor={self.expert_tensor}"
        return f"{axes} | mb {self.microbatches}{sched} | remat {self.remat}"


def _ordered_factorisations(n: int, k: int) -> Iterator[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for d in range(1, n + 1):
        if n % d == 0:
            for rest in _ordered_factorisations(n // d, k - 1):
                yield (d, *rest)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_allowed(view: ComputationView, sizes: dict[str, int], nodes: int, per_node: int) -> str | None:
    """None if the model and cluster allow these axis sizes, else the reason (one phrase)."""
    m = view.model
    t, e, p, c = sizes["tensor"], sizes["expert"], sizes["pipeline"], sizes.get("context", 1)
    if c > 1:  # the refusals of jaxdist.config.schema._context_on_model, as constraints of the search
        if p > 1:
            return f"context={c} does not run with pipeline stages (pipeline={p})"
        if view.n_experts:  # it runs (jaxdist.parallel.moe), but the memory model does not cover it yet
            return f"context={c} with an MoE model is not in the planner's memory model yet"
        if view.seq_len % (2 * c):
            return f"the sequence of {view.seq_len} tokens does not split into 2*context={2 * c} equal chunks"
    if per_node % (c * t * e * p):
        return f"context*tensor*expert*pipeline={c * t * e * p} does not divide the {per_node} devices of a node"
    if (sizes["data"] * sizes["fsdp"]) % nodes:
        return f"data*fsdp={sizes['data'] * sizes['fsdp']} is not a multiple of the {nodes} nodes"
    if m.n_heads % t or m.d_ff % t:
        return f"tensor={t} does not divide the heads ({m.n_heads}) and MLP width ({m.d_ff})"
    if m.n_kv_heads % t and t % m.n_kv_heads:
        return f"tensor={t} and the {m.n_kv_heads} KV heads do not divide one another"
    if e > 1 and (view.n_experts == 0 or view.n_experts % e):
        return f"expert={e} needs a multiple of it as the expert count (the model has {view.n_experts})"
    if m.n_layers % p:
        return f"pipeline={p} does not divide the {m.n_layers} layers"
    if p > 1 and view.n_experts:  # whole groups of blocks per stage
        if (m.n_layers // m.moe.every) % p:
            return (
                f"pipeline={p} does not divide the {m.n_layers // m.moe.every} groups of moe.every={m.moe.every} blocks"
            )
        # Where the planned dispatch runs inside the stages (jaxdist.parallel.moe.stage_row_axes); with capacity
        # dispatch XLA partitions the experts, gathering a stage's tokens, outside the cost model.
        if m.moe.dispatch != "dropless":
            return f"MoE pipeline stages with {m.moe.dispatch} dispatch leave the experts to XLA"
    return None


def candidates(
    view: ComputationView,
    n_devices: int,
    nodes: int,
    per_node: int,
    batch_size: int,
    remat: Sequence[RematChoice] = REMAT_CHOICES,
    axes: Sequence[str] = MESH_AXES,
    max_microbatches: int = 64,
) -> Iterator[Strategy]:
    """Every strategy allowed on ``n_devices`` (= nodes x per_node) for global batch ``batch_size`` sequences.

    Axes outside ``axes`` stay at size 1 (e.g. leave out ``pipeline`` where
    the trainer cannot run it yet).  Microbatch counts are the divisors of the
    batch up to ``max_microbatches`` that leave each microbatch divisible by
    ``data * fsdp * expert``.
    """
    assert nodes * per_node == n_devices
    for shape in _ordered_factorisations(n_devices, len(MESH_AXES)):
        sizes = dict(zip(MESH_AXES, shape))
        if any(s > 1 and a not in axes for a, s in sizes.items()):
            continue
        if mesh_allowed(view, sizes, nodes, per_node) is not None:
            continue
        batch_ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
        schedules = _schedules(view) if sizes["pipeline"] > 1 else [("none", 1)]
        if view.n_experts and batch_size % (batch_ways * sizes["pipeline"]):
            # an MoE model's gpipe stages run the embedding and head on the rows split over the stages too
            schedules = [x for x in schedules if x[0] != "gpipe"]
        for m in _divisors(batch_size):
            if m > max_microbatches or (batch_size // m) % batch_ways:
                continue
            for sched, chunks in schedules:
                if sched == "1f1b" and m < sizes["pipeline"]:
                    continue  # the trainer's 1f1b needs a microbatch per stage
                for r in remat:
                    yield Strategy(**sizes, microbatches=m, schedule=sched, remat=r.name, chunks=chunks)


def _schedules(view: ComputationView) -> list[tuple[str, int]]:
    """(schedule, chunks) pairs for a pipelined mesh: seq1f1b with each chunk count that divides the sequence."""
    out = [(x, 1) for x in SCHEDULES if x != "seq1f1b"]
    return out + [("seq1f1b", c) for c in CHUNK_CHOICES if view.seq_len % c == 0]


def with_pipeline(s: Strategy, view: ComputationView, **sizes: int) -> list[Strategy]:
    """``s`` with new axis sizes and the schedules worth trying there: none without a pipeline; for a new
    pipeline depth, the current schedule if it still applies, else 1f1b (a microbatch per stage) and
    seq1f1b with the most chunks.  Other schedules are one more move away (:func:`neighbours`)."""
    new = replace(s, **sizes)
    if new.pipeline == 1:
        return [replace(new, schedule="none", chunks=1)]
    if s.pipeline > 1 and (s.schedule != "1f1b" or new.microbatches >= new.pipeline):
        return [new]
    out = [replace(new, schedule="1f1b", chunks=1)] if new.microbatches >= new.pipeline else []
    chunks = [c for x, c in _schedules(view) if x == "seq1f1b"]
    if chunks:
        out.append(replace(new, schedule="seq1f1b", chunks=chunks[-1]))
    return out


def neighbours(
    s: Strategy,
    view: ComputationView,
    nodes: int,
    per_node: int,
    batch_size: int,
    remat: Sequence[RematChoice] = REMAT_CHOICES,
    axes: Sequence[str] = MESH_AXES,
    max_microbatches: int = 64,
) -> Iterator[Strategy]:
    """Strategies one move away from ``s``: a prime factor moved between two axes, microbatches
    doubled or halved (or set to the pipeline depth), another schedule, another remat choice.
    Only allowed strategies are returned."""
    sizes = s.mesh
    out: list[Strategy] = []
    for src in axes:
        if sizes[src] == 1:
            continue
        for q in _prime_factors(sizes[src]):
            for dst in axes:
                if dst == src:
                    continue
                new = dict(sizes)
                new[src] //= q
                new[dst] *= q
                out.extend(with_pipeline(s, view, **new))
    m = s.microbatches
    for m2 in {m * 2, m // 2, m * 3, max(1, m // 3), s.pipeline, 2 * s.pipeline}:
        if m2 >= 1:
            out.append(replace(s, microbatches=m2))
    if s.pipeline > 1:
        out.extend(replace(s, schedule=x, chunks=c) for x, c in _schedules(view) if (x, c) != (s.schedule, s.chunks))
    out.extend(replace(s, remat=r.name) for r in remat if r.name != s.remat)
    seen = set()
    for c in out:
        if c in seen or c == s:
            continue
        seen.add(c)
        if valid(c, view, nodes, per_node, batch_size, max_microbatches):
            yield c


def valid(
    s: Strategy, view: ComputationView, nodes: int, per_node: int, batch_size: int, max_microbatches: int = 64
) -> bool:
    """Whether ``s`` is one of the strategies :func:`candidates` enumerates (remat and axes aside)."""
    if s.n_devices != nodes * per_node or mesh_allowed(view, s.mesh, nodes, per_node) is not None:
        return False
    m = s.microbatches
    if m < 1 or m > max_microbatches or batch_size % m or (batch_size // m) % (s.data * s.fsdp * s.expert):
        return False
    if (s.schedule == "none") != (s.pipeline == 1) or (s.schedule == "1f1b" and m < s.pipeline):
        return False
    if view.n_experts and s.schedule == "gpipe" and batch_size % (_ways(s) * s.pipeline):
        return False  # an MoE model's gpipe stages: the embedding and head on the rows split over them too
    if s.schedule == "seq1f1b":
        return s.chunks in CHUNK_CHOICES and view.seq_len % s.chunks == 0
    return s.chunks == 1


def _ways(s: Strategy) -> int:
    return s.data * s.fsdp * s.expert


def _prime_factors(n: int) -> list[int]:
    out, q = [], 2
    while q * q <= n:
        if n % q == 0:
            out.append(q)
            while n % q == 0:
                n //= q
        q += 1
    if n > 1:
        out.append(n)
    return out


def strategy_of(cfg: Config, n_devices: int) -> Strategy:
    """The planner's Strategy for a config's mesh, microbatches and remat (``train.remat`` must be a planner choice)."""
    sizes = cfg.mesh.resolved(cfg.mesh.devices_used(n_devices))
    remat = remat_choice(cfg.train.remat).name  # ValueError if the planner does not know it
    if sizes["pipeline"] == 1:
        schedule, chunks = "none", 1
    else:
        schedule = cfg.pipeline.schedule
        chunks = cfg.pipeline.chunks if schedule == "seq1f1b" else 1
        if chunks == 1 and schedule == "seq1f1b":
            schedule = "1f1b"  # seq1f1b with one chunk is 1f1b
    etp = cfg.mesh.expert_tensor if cfg.model.moe.experts and cfg.mesh.expert_tensor != sizes["tensor"] else 0
    return Strategy(
        **sizes, microbatches=cfg.train.microbatches, schedule=schedule, remat=remat, chunks=chunks, expert_tensor=etp
    )

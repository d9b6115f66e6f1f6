"""Planning on the free part of a shared Slurm partition: which shape to ask for, and the plan on it.

    view = read_partition("gpu")                                   # jaxdist.slurm.view
    fp = plan_free(cfg.model, view, load_cluster("h100x8"), batch_size=256, seq_len=4096)
    print(fp.choice.table())        # the shapes tried: nodes x GPUs, where, predicted step time, what is left
    print(fp.plan.table())          # the plans on the chosen shape

Every shape the free GPUs allow (``n`` nodes with ``k`` free GPUs each, see
:func:`jaxdist.slurm.shape.choose_shape`) is planned as a cluster of ``n`` x
``k`` devices with the cluster file's figures; the planner keeps tensor,
expert, context and pipeline groups inside a node.  The shape with the
fastest predicted step wins; between equally fast ones, the one that leaves
the other jobs the most usable GPUs.  A shape of at most :data:`EXHAUSTIVE_UP_TO`
devices is planned by evaluating every candidate (the planner's local search
can miss the optimum by a few percent, e.g. tensor=2 for llama-8b on 2 x 8);
a larger one by the search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxdist.cluster import ClusterSpec
from jaxdist.config import MESH_AXES, ConfigError, ModelConfig
from jaxdist.planner.candidates import remat_choice
from jaxdist.planner.plan import Plan, PlanError, plan
from jaxdist.slurm.shape import ShapeChoice, choose_shape
from jaxdist.slurm.view import PartitionView, cluster_spec

EXHAUSTIVE_UP_TO = 64  # devices of a shape planned exhaustively (about 0.5 s for 16 H100s and llama-8b)


@dataclass(frozen=True)
class FreePlan:
    """The partition as seen, the shapes tried (``choice.best`` is asked for) and the plan on the chosen one."""

    view: PartitionView
    choice: ShapeChoice
    plan: Plan

    def overrides(self) -> list[str]:
        """The plan as config overrides for the job (``mesh.data=-1``: the same mesh on the shape, and a valid
        one on another node count the controller may form)."""
        s = self.plan.best.strategy
        out = ["mesh.auto=false", "mesh.data=-1"]
        out += [f"mesh.{a}={getattr(s, a)}" for a in MESH_AXES if a != "data"]
        out += [f"train.microbatches={s.microbatches}", f"train.remat={remat_choice(s.remat).train_remat}"]
        if s.pipeline > 1:
            out += [f"pipeline.schedule={s.schedule}", f"pipeline.chunks={max(1, s.chunks)}"]
        return out

    def describe(self) -> str:
        """One line: the request and the plan's predicted step."""
        s, e = self.choice.best, self.plan.best
        return f"ask Slurm for {s.describe()}: {e.strategy.describe()}, predicted {e.step_time:.4g} s/step"


def plan_free(
    model: ModelConfig,
    view: PartitionView,
    figures: ClusterSpec,
    *,
    batch_size: int,
    seq_len: int | None = None,
    standbys: int = 0,
    max_nodes: int = 0,
    min_nodes: int = 1,
    **plan_kwargs: Any,
) -> FreePlan:
    """Plan ``model`` on the free GPUs of ``view`` (figures per device from ``figures``).

    ``standbys``: nodes asked for beyond the training ones, with as many free GPUs; the training nodes are
    ``min_nodes`` to ``max_nodes`` (0: any); ``plan_kwargs`` go to :func:`jaxdist.planner.plan.plan` (calibration, axes,
    enumerate_all, memory_fraction, ...).  Raises ConfigError when no shape of the free GPUs fits the model.
    """
    plans: dict[tuple[int, int], Plan] = {}
    refusals: dict[int, PlanError] = {}

    def step_time(n: int, k: int) -> float | None:
        kwargs = {"enumerate_all": n * k <= EXHAUSTIVE_UP_TO, **plan_kwargs}
        try:
            p = plan(model, cluster_spec(view, figures, n, k), batch_size=batch_size, seq_len=seq_len, **kwargs)
        except PlanError as e:
            refusals[n * k] = e
            return None  # the model does not fit, or no mesh of n x k suits the batch
        if p.cluster.n_devices != n * k:
            return None  # planned on fewer devices: that smaller shape is tried on its own
        plans[(n, k)] = p
        return p.best.step_time

    totals = {n.name: n.gpus for n in view.nodes}
    try:
        choice = choose_shape(
            view.free(), totals, step_time, standbys=standbys, max_nodes=max_nodes, min_nodes=min_nodes
        )
    except ConfigError as e:
        if refusals:  # say why the largest shape of the free GPUs cannot train it
            raise PlanError(f"{e} On the largest shape: {refusals[max(refusals)]}") from None
        raise
    return FreePlan(view, choice, plans[(choice.best.training, choice.best.gpus_per_node)])

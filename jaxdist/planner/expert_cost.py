"""The planner's terms for an MoE model's experts (jaxdist.planner.cost uses them): the rows an expert device
takes in one block's dispatch, the mesh as the experts' rows see it, and whether its executor pipeline stages
hold the planned dispatch (and with it the stage's weights gathered whole along fsdp)."""

from __future__ import annotations

from dataclasses import dataclass

from jaxdist.models.moe import expert_capacity
from jaxdist.planner.candidates import Strategy
from jaxdist.planner.computation import ComputationView


@dataclass(frozen=True)
class ExpertRows:
    """One MoE block's dispatch on one device, per microbatch.

    ``tokens``: the block's tokens on the device (those of its attention, split further over the part of
    ``tensor`` that ``expert_tensor`` gives to expert parallelism).  ``rows``: the rows its local experts
    take, the size of every routed buffer (jaxdist/parallel/moe.py): dropless without expert parallelism,
    tokens x top-k; dropless with it, the padded receive buffer ``ep`` x tokens x min(top-k, local experts),
    sized for any routing (the ragged exchange of GPUs lands in the same layout); capacity,
    every expert's slots, experts x ceil(factor x tokens x top-k / experts).  ``local_experts``: experts
    held here; ``ep``, ``etp``: the expert-parallel size (expert x tensor / etp) and each expert's tensor size.
    """

    tokens: int
    rows: int
    local_experts: int
    ep: int
    etp: int


def expert_rows(view: ComputationView, s: Strategy, tokens: int) -> ExpertRows:
    """The :class:`ExpertRows` of ``s`` for a device with ``tokens`` tokens per microbatch in its attention."""
    moe = view.model.moe
    etp = s.expert_tensor or s.tensor
    ep = s.expert * (s.tensor // etp)
    n = max(1, tokens // (s.tensor // etp))
    local = max(1, moe.experts // ep)
    if moe.dispatch == "capacity":
        rows = moe.experts * expert_capacity(n, moe.top_k, moe.experts, moe.capacity_factor)
    elif ep == 1:
        rows = n * moe.top_k
    else:
        rows = ep * n * min(moe.top_k, local)
    return ExpertRows(n, rows, local, ep, etp)


def expert_view_sizes(sizes: tuple, etp: int) -> tuple:
    """Mesh sizes as the experts' rows see them: each expert's width split ``etp`` ways (``expert_mlp``)."""
    return tuple((a, etp if a == "tensor" else n) for a, n in sizes)


def stage_sync(view: ComputationView, s: Strategy) -> bool:
    """Whether an MoE model's executor stages run manual over their rows' axes with the planned dispatch inside
    (jaxdist.parallel.moe.stage_row_axes): dropless dispatch, each expert on all of tensor, tokens split over
    data, fsdp or expert."""
    whole_tensor = s.expert_tensor in (0, s.tensor)
    return view.model.moe.dispatch == "dropless" and whole_tensor and s.data * s.fsdp * s.expert > 1

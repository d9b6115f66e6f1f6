"""Checkpoints of train states: balanced parallel writing, async save, commit markers and
checksums, restore onto any mesh or process count (see manager.py)."""

from jaxdist.checkpoint.integrity import CheckpointDamaged
from jaxdist.checkpoint.manager import RunCheckpointer, SaveStats, abstract_like, plan_from_layout
from jaxdist.checkpoint.plan import ArrayLayout, Piece, Shard, WritePlan, plan_writes

__all__ = [
    "RunCheckpointer",
    "SaveStats",
    "CheckpointDamaged",
    "abstract_like",
    "plan_from_layout",
    "ArrayLayout",
    "Piece",
    "Shard",
    "WritePlan",
    "plan_writes",
]

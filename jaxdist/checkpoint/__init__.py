"""Orbax checkpoints of train states: async save, restore onto any mesh."""

from jaxdist.checkpoint.manager import RunCheckpointer, abstract_like

__all__ = ["RunCheckpointer", "abstract_like"]

"""Whether a checkpoint can be resumed by this config's state without changing it: shapes and dtypes.

A restore onto other shapes fails deep in the storage library, and one onto
another dtype (float32 master weights read as bfloat16) silently casts: both
are refused here first, in one sentence, from the shapes and dtypes the commit
marker records (jaxdist.checkpoint.manager.describe_layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxdist.checkpoint import integrity
from jaxdist.checkpoint.writer import named_leaves


def layout_change(step_dir: Path, abstract_state: Any) -> str | None:
    """What restoring ``step_dir`` onto ``abstract_state`` would change (the first array whose shape or dtype
    differs, and the setting that does it), or None (same, or a marker without a layout: not judged here)."""
    marker = integrity.read_commit(step_dir)
    arrays = (marker or {}).get("layout", {}).get("arrays") if isinstance(marker, dict) else None
    if not isinstance(arrays, list):
        return None
    stored = {a["name"]: (tuple(a["shape"]), str(a["dtype"])) for a in arrays if isinstance(a, dict) and "name" in a}
    for name, leaf in named_leaves(abstract_state):
        if name not in stored or not hasattr(leaf, "shape"):
            continue
        shape, dtype = stored[name]
        if tuple(leaf.shape) != shape:
            return (
                f"{name} is {list(shape)} in the checkpoint but {list(leaf.shape)} in this config: the model's "
                "shape (model.*) differs from the run's"
            )
        if str(leaf.dtype) != dtype:
            setting = "model.param_dtype" if name.startswith(("params.", "opt_state.")) else "the config"
            return (
                f"{name} is {dtype} in the checkpoint but {leaf.dtype} in this config: {setting} differs from the "
                "run's, and resuming would cast the saved state"
            )
    return None

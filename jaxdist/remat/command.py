"""``jaxdist remat``: profile a model's block on a cluster's mesh, plan within a budget, compare policies.

    jaxdist remat --model llama-8b --mesh meshes/h100x8.toml --budget 20GiB train.seq_len=8192 train.batch_size=8

prints the block's plan (what is saved, what is recomputed, totals) and,
beside it, the predicted activation memory and recompute time of jax's
built-in policies and of the common named recipes.  Without ``--budget`` the
budget is what the device memory leaves after parameters, gradients,
optimizer state and working space (the breakdown is printed).  Times are
XLA FLOPs / the device's peak from the cluster file unless ``--measure``
times each operator on the present backend.
"""

from __future__ import annotations

import re
import sys

from jaxdist.cluster import load_cluster
from jaxdist.config import Config, ConfigError, unused_devices_note
from jaxdist.models.arithmetic import param_count
from jaxdist.remat.plan import compare_policies, format_bytes, format_comparison, plan_remat
from jaxdist.remat.policy import auto_budget, memory_breakdown, profile_for_config

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``"20GiB"`` -> 21474836480, ``"512MB"`` -> 512000000, ``"1e9"`` -> 1000000000 (bytes)."""
    m = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"budget '{text}' is not a size: write it like 20GiB, 512MiB, 80GB or 1e10 (bytes).")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value < 1:
        raise ConfigError(
            f"budget '{text}' is not a positive size: it is the bytes per device the saved activations of all "
            "blocks may take, e.g. 20GiB (leave --budget out to derive it from the device memory)."
        )
    return int(value)


def run_remat(
    cfg: Config, budget: str | None = None, measure: bool = False, operators: bool = False, repeats: int = 5, out=None
) -> int:
    """Print the plan and the comparison for ``cfg`` (model, mesh sizes, cluster, batch, seq_len)."""
    # Imported here, not at the top: they import JAX, which `jaxdist --help` must not.

    out = out or sys.stdout
    given = None if budget is None else parse_bytes(budget)  # a bad --budget is refused before the profile
    cluster = load_cluster(cfg.mesh.cluster)
    sizes = cfg.mesh.resolved(cfg.mesh.devices_used(cluster.n_devices))
    note = unused_devices_note(cfg.mesh, cluster.n_devices)
    if note:
        print(f"note: {note}", file=out)
    peak = cluster.peak_flops(cfg.model.dtype)
    profile = profile_for_config(cfg, sizes, peak, measure=measure)
    t = cfg.train
    shape = " ".join(f"{a}={s}" for a, s in sizes.items() if s > 1) or "one device"
    n = param_count(cfg.model)
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    print(
        f"model {cfg.model.preset} ({size} params, {cfg.model.dtype}), "
        f"{profile.n_layers} scanned blocks; cluster {cluster.name} ({cluster.device_kind}, "
        f"{format_bytes(cluster.memory_bytes)} per device); mesh {shape}; microbatch "
        f"{t.batch_size // t.microbatches} x {t.seq_len} tokens (global)",
        file=out,
    )
    print(
        f"block: {len(profile.operators)} forward operators, input {format_bytes(profile.input_bytes)} per device; "
        f"times: {profile.timing}",
        file=out,
    )
    if given is not None:
        budget_bytes = given
    elif t.remat_budget_bytes:
        budget_bytes = t.remat_budget_bytes
    else:
        b = memory_breakdown(cfg, sizes, cluster.memory_bytes, profile)
        print("budget from device memory: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in b.items()), file=out)
        budget_bytes = auto_budget(cfg, sizes, cluster.memory_bytes, profile)
    plan = plan_remat(profile, budget_bytes, slack_share=t.remat_slack)
    print("", file=out)
    print(plan.table(by_group=not operators), file=out)
    print("", file=out)
    print(format_comparison(compare_policies(profile, plan)), file=out)
    settings = "".join(
        [
            "" if budget is None else f" train.remat_budget_bytes={budget_bytes}",
            f" train.remat_slack={t.remat_slack:g}" if t.remat_slack else "",
        ]
    )
    same = plan.names_equivalent
    names = f"the same as train.remat={same}" if same else "no list of checkpoint names saves the same values"
    if t.remat_verify:  # the closed loop below decides: this plan is one of its candidates, not its answer
        print(
            f"\nthe selector's plan for {format_bytes(budget_bytes)} of saved activations ({names}) is "
            f"{plan.gap_to_optimum()}; train.remat=auto{settings} does not apply it as such: it compiles the "
            "best candidates against train.memory_budget_bytes (below) and applies the one chosen there "
            "(train.remat_verify=false would apply this plan)",
            file=out,
        )
    else:
        print(f"\ntrain.remat=auto{settings} applies this plan ({names}); it is {plan.gap_to_optimum()}", file=out)
    return 0

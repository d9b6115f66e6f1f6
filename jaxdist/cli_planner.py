"""``jaxdist plan`` and ``jaxdist calibrate`` (registered by jaxdist/cli.py; nothing heavy imported here).

    jaxdist plan --model llama-70b --cluster meshes/h100x64.toml [--busy alloc.toml] [--out plan.toml]
    jaxdist plan --model llama-8b --cluster slurm:gpu@h100x8       # the free GPUs of a Slurm partition
                 [--top 8] [--exhaustive] [--calibration FILE] [--config FILE] [KEY=VALUE ...]
    jaxdist calibrate [--cluster cpu-8] [--model small] [--out FILE]

``plan`` plans for ``train.batch_size`` sequences of ``train.seq_len`` tokens
when ``train.seq_len`` is given (override or config file), else of the
model's ``max_seq_len``.  It prints the best plans, explains the chosen one
and writes it as a config that ``jaxdist train --config`` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tomllib
from pathlib import Path

from jaxdist.cluster import load_cluster, prepare_host_devices
from jaxdist.config import MESH_AXES, ConfigError, load_config
from jaxdist.models.arithmetic import param_count
from jaxdist.run_owner import check_overwrite


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Add the ``plan`` and ``calibrate`` subcommands to the jaxdist parser."""
    p = sub.add_parser("plan", help="choose mesh, microbatches and remat for a model on a cluster")
    p.add_argument("--config", help="TOML config file (model, batch, cluster)")
    p.add_argument("--model", help="model preset (same as model=NAME)")
    p.add_argument(
        "--cluster",
        help="cluster: a name in meshes/, a TOML path (same as mesh.cluster=...), live, or slurm:PARTITION[@CLUSTER] "
        "(the partition's free GPUs, figures from the cluster file CLUSTER; controller.standbys, min_nodes and max_nodes apply)",
    )
    p.add_argument("--busy", help="devices other jobs hold: an allocation TOML file, or a list like 0:*,1:0-3,17")
    p.add_argument("--calibration", help="calibration JSON from `jaxdist calibrate` (default: the saved one, if any)")
    p.add_argument("--out", default="plan.toml", help="where to write the chosen plan's config (default plan.toml)")
    p.add_argument("--force", action="store_true", help="replace an --out file that is not an earlier plan")
    p.add_argument("--top", type=int, default=8, help="plans to show (default 8)")
    p.add_argument("--exhaustive", action="store_true", help="evaluate every candidate instead of searching")
    p.add_argument("--axes", help="mesh axes the plan may use, e.g. data,fsdp,tensor (default: what train runs)")
    p.add_argument(
        "--verify",
        action="store_true",
        help="compile the chosen plan's train step ahead of time and keep the best whose compiled peak fits "
        "train.memory_budget_bytes (needs the plan's devices; CPU clusters are simulated)",
    )
    p.add_argument(
        "--entry",
        help="module:function returning your own model and loss (train.entry): planned by compiling every mesh "
        "its parameter names allow on the cluster's devices (jaxdist.train.custom_plan)",
    )
    p.set_defaults(fn=cmd_plan)

    c = sub.add_parser("calibrate", help="measure the present devices' efficiency and links for the planner")
    c.add_argument("--cluster", default="cpu-8", help="cluster file whose peak FLOP/s the efficiency refers to")
    c.add_argument("--model", default="small", help="reference model preset timed on a data-parallel mesh")
    c.add_argument("--out", help="calibration JSON to write (default: the planner's per-device-kind file)")
    c.add_argument("--force", action="store_true", help="replace an --out file that is not an earlier calibration")
    c.set_defaults(fn=cmd_calibrate)


def _explicit_seq_len(args) -> bool:
    if any(o.split("=", 1)[0].lstrip("-") == "train.seq_len" for o in args.overrides):
        return True
    if args.config:
        try:
            return "seq_len" in tomllib.loads(Path(args.config).read_text()).get("train", {})
        except (OSError, tomllib.TOMLDecodeError):
            return False  # load_config reports it
    return False


def cmd_plan(args) -> int:
    """``jaxdist plan``: print the best plans and write the chosen one as a train config."""
    extra = ([f"model={args.model}"] if args.model else []) + ([f"mesh.cluster={args.cluster}"] if args.cluster else [])
    check_overwrite(args.out, lambda text: text.startswith("# jaxdist plan:"), args.force, (args.config, args.busy))
    entry = [f"train.entry={args.entry}"] if args.entry else []
    cfg = load_config(args.config, extra + list(args.overrides) + entry)
    if cfg.train.entry:  # your own model: no closed form; its compiled programs decide (jaxdist.train.custom_plan)
        return _plan_own_model(args, cfg)
    seq_len = cfg.train.seq_len if _explicit_seq_len(args) else cfg.model.max_seq_len
    cfg = cfg.replace(**{"train.seq_len": seq_len})
    if args.verify:
        prepare_host_devices(cfg)  # before JAX starts: the cluster's simulated CPU devices to compile for

    from jaxdist.planner.cluster import load_calibration  # the planner imports JAX: not at registration
    from jaxdist.planner.plan import plan
    from jaxdist.slurm.view import is_slurm_source

    slurm = is_slurm_source(cfg.mesh.cluster)
    if slurm and args.busy:
        raise ConfigError("--busy is for cluster files: with a slurm: cluster, Slurm says which GPUs other jobs hold.")
    busy = None
    if args.busy:
        busy = args.busy if Path(args.busy).suffix == ".toml" else [x for x in args.busy.split(",") if x]
    axes = None
    if args.axes:
        axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ConfigError(f"--axes names unknown axes {', '.join(bad)}: use some of {', '.join(MESH_AXES)}.")
    calibration = load_calibration(args.calibration) if args.calibration else None
    fraction = 0.9  # the planner's usable share; train.memory_budget_bytes, when set, is the usable bytes
    if slurm:
        p = _plan_on_partition(cfg, seq_len, calibration, axes, args.exhaustive)
    else:
        if cfg.train.memory_budget_bytes and cfg.mesh.cluster != "live":
            fraction = cfg.train.memory_budget_bytes / load_cluster(cfg.mesh.cluster).memory_bytes
        p = plan(
            cfg.model,
            cfg.mesh.cluster,
            batch_size=cfg.train.batch_size,
            seq_len=seq_len,
            busy=busy,
            calibration=calibration,
            axes=axes,
            enumerate_all=args.exhaustive,
            memory_fraction=fraction,
        )
    m = cfg.model
    n_params = param_count(m)
    cal = (
        f"calibrated: efficiency {p.cluster.efficiency:.1%}"
        if p.cluster.calibration
        else f"uncalibrated: efficiency {p.cluster.efficiency:.0%} (run `jaxdist calibrate` on the devices)"
    )
    size = f"{n_params / 1e9:.3g}B" if n_params >= 1e9 else f"{n_params / 1e6:.3g}M"
    print(
        f"model {m.preset}: {size} parameters, {m.dtype} compute; batch {cfg.train.batch_size} x "
        f"{seq_len} = {cfg.train.batch_size * seq_len} tokens per step"
    )
    print(f"cluster {p.cluster.describe()}; {cal}")
    searched = f"{p.evaluations} of {p.space} plans (exhaustive)" if p.space else f"{p.evaluations} plans searched"
    print(f"{searched} in {p.seconds:.2f} s\n")
    print(p.table(args.top))
    print()
    if args.verify:
        p = _verified(p, cfg)
    print(p.explain())
    out = Path(args.out)
    out.write_text(p.to_toml(cfg))
    print(f"\nwrote {out}: run it with `jaxdist train --config {out}`")
    return 0


def _plan_own_model(args, cfg) -> int:
    """``jaxdist plan --entry M:F``: every mesh your model's names allow, compiled on the cluster's devices (a CPU
    cluster file's are simulated here), the fastest that fits written as a train config."""
    if any((args.busy, args.axes, args.calibration, args.exhaustive, args.verify)):
        raise ConfigError(
            "--busy, --axes, --calibration, --exhaustive and --verify are for jaxdist's own model: with --entry "
            "every mesh of the cluster's devices is compiled; leave them out."
        )
    spec = load_cluster(cfg.mesh.cluster)
    n = spec.nodes * spec.devices_per_node
    flags = os.environ.get("XLA_FLAGS", "")
    if spec.device_kind.lower() == "cpu" and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    # JAX, the user's module and the compiler: after XLA_FLAGS
    import jax

    from jaxdist.train.custom import ENTRY_KEYS, entry_keywords, user_model
    from jaxdist.train.custom_plan import plan_user_mesh

    devices = jax.devices()
    if devices[0].device_kind.lower() != spec.device_kind.lower() or len(devices) < n:
        raise ConfigError(
            f"--entry compiles your model for mesh.cluster={cfg.mesh.cluster}'s {n} x {spec.device_kind} devices but "
            f"this process sees {len(devices)} x {devices[0].device_kind}: run it where those devices are, or plan on "
            "a CPU cluster file (cpu-8)."
        )
    own = entry_keywords(cfg)
    user = user_model(*(own.get(k) for k in ENTRY_KEYS))
    p = plan_user_mesh(cfg.set(**{"mesh.auto": True}), devices[:n], user, nodes=spec.nodes)
    print(f"your model ({cfg.train.entry}): {p.probe.param_bytes / 2**20:.3g} MiB of parameters; batch "
          f"{cfg.train.batch_size}; cluster {cfg.mesh.cluster} ({spec.nodes} x {spec.devices_per_node} "
          f"{spec.device_kind})\n")  # fmt: skip
    print(p.table() + "\n")
    print(f"chosen: {p.describe()}")
    out = Path(args.out)
    head = f"# jaxdist plan: {cfg.train.entry} on {cfg.mesh.cluster}\n# {p.describe()}\n\n"
    out.write_text(head + p.to_config(cfg).to_toml())
    print(f"\nwrote {out}: run it with `jaxdist train --config {out}`")
    return 0


def _plan_on_partition(cfg, seq_len, calibration, axes, exhaustive):
    """The plan on the free GPUs of ``cfg.mesh.cluster`` = slurm:PARTITION[@CLUSTER]; prints the partition and
    the shapes tried (jaxdist.planner.shared)."""
    # the planner imports JAX, the partition view reads Slurm: only for slurm: clusters
    from jaxdist.planner.shared import plan_free
    from jaxdist.slurm.view import figures, parse_source, read_partition

    view = read_partition(parse_source(cfg.mesh.cluster)[0])
    spec = figures(cfg.mesh.cluster, view)
    kwargs = dict(calibration=calibration, axes=axes)
    if cfg.train.memory_budget_bytes:
        kwargs["memory_fraction"] = cfg.train.memory_budget_bytes / spec.memory_bytes
    if exhaustive:
        kwargs["enumerate_all"] = True
    fp = plan_free(
        cfg.model,
        view,
        spec,
        batch_size=cfg.train.batch_size,
        seq_len=seq_len,
        standbys=cfg.controller.standbys,
        max_nodes=cfg.controller.max_nodes,
        min_nodes=cfg.controller.min_nodes,
        **kwargs,
    )
    print(view.table() + "\n")
    print(f"shapes of the free GPUs ({spec.name}'s figures per device), best first:")
    print(fp.choice.table() + "\n")
    print(fp.describe() + "\n")
    return dataclasses.replace(fp.plan, cluster_source=cfg.mesh.cluster)


def _verified(p, cfg):
    """``p`` with the plan ``--verify`` found first: the best whose compiled train step fits the budget (the
    table of compiles printed); ConfigError when the plan's devices are not here or none fits."""
    # JAX and the compiler: only for --verify
    import jax

    from jaxdist.cluster import memory_budget
    from jaxdist.planner.verify import verify_plan
    from jaxdist.train.aot import compiled_peak

    devices = jax.devices()
    n, kind = p.cluster.n_devices, p.cluster.spec.device_kind
    if devices[0].device_kind != kind or len(devices) < n:
        raise ConfigError(
            f"--verify compiles for the plan's {n} x {kind} devices but this process sees {len(devices)} x "
            f"{devices[0].device_kind}: run `jaxdist plan --verify` where those devices are, or leave --verify out."
        )
    budget = memory_budget(cfg.train.memory_budget_bytes, p.cluster.spec.memory_bytes)

    def compile_peak(e):
        one = dataclasses.replace(p, ranked=(e,)).to_config(cfg)
        got = compiled_peak(one, devices[:n])
        return got.peak_bytes, got.seconds

    v = verify_plan(p.ranked, budget, compile_peak)
    print(v.table() + "\n")
    return dataclasses.replace(p, ranked=(v.chosen,) + tuple(e for e in p.ranked if e is not v.chosen))


def cmd_calibrate(args) -> int:
    """``jaxdist calibrate``: measure efficiency and links on the devices present and save them."""
    cfg = load_config(None, [f"mesh.cluster={args.cluster}"] + list(args.overrides))
    if args.out:
        check_overwrite(args.out, lambda text: "efficiency" in json.loads(text), args.force)
    prepare_host_devices(cfg)
    # JAX after XLA_FLAGS (prepare_host_devices)
    import jax

    from jaxdist.measure.calibrate import calibrate
    from jaxdist.planner.calibrate import write_calibration

    devices = jax.devices()
    kind = load_cluster(args.cluster).device_kind
    if devices[0].device_kind.lower() != kind.lower():  # a calibration is read back for its device kind
        raise ConfigError(
            f"the devices here are {devices[0].device_kind}, but --cluster {args.cluster} describes {kind}: "
            f"calibrate on {kind} devices, or name a cluster of these devices (e.g. --cluster cpu-8)."
        )
    print(f"calibrating on {len(devices)} x {devices[0].device_kind} against {args.cluster} ...", file=sys.stderr)
    cal = calibrate(devices, cluster=args.cluster, model=args.model)
    path = write_calibration(cal, args.out)
    print(
        f"efficiency {cal.efficiency:.3f} of peak; all-reduce latency {cal.intra_node_latency * 1e6:.1f} us, "
        f"bandwidth {cal.intra_node_bandwidth / 1e9:.2f} GB/s per device"
    )
    print(f"wrote {path}")
    return 0

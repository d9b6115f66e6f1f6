"""Framework overhead: the Trainer's jitted step against a hand-written jax.jit step.

One Trainer (default: the ``small`` preset on a data=2, fsdp=2, tensor=2 mesh
of 8 simulated CPU devices) and three steps on the same batches, with the same
parameter, optimizer-state and batch shardings (taken from the Trainer) and
the same buffer donation:

- ``trainer``: ``trainer.train_step(state, batch)``, exactly as ``fit`` calls it;
- ``hand``: what a user would write without jaxdist (``jaxdist.models.apply``,
  a plain cross-entropy, ``jax.value_and_grad``, optax gradient clipping +
  AdamW with the same schedule, no metrics beyond the loss), bound to the
  Trainer's parallelism (``trainer.parallelism.bind``): the like-for-like baseline;
- ``plain``: the same hand-written step without activation constraints (the
  compiler propagates shardings from the inputs alone).

Then the whole loop: two more Trainers run ``fit`` in turns of 5 steps, one
with the controller agent's heartbeat callback attached (a real WorkerAgent,
rank 0, recording every flushed step), and their logged step times (the
device finished) are compared (target: with / without <= 1.03).

The steps are timed in rotation (no variant always runs first) after a
warmup, each waited on with ``block_until_ready``.  The table shows median
step times and their ratios (target: trainer / hand <= 1.03), compile times
(trace + lower + compile, seconds) and the per-device memory XLA plans for each
compiled program (``compiled.memory_analysis()``).

    python benchmarks/overhead.py                       # small, data=2,fsdp=2,tensor=2, 30 steps
    python benchmarks/overhead.py --preset tiny --mesh data=8 --steps 50
    python benchmarks/overhead.py train.remat=full      # any further config override
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

from jaxdist.config import MESH_AXES, MODEL_PRESETS, load_config  # jax-free: safe before XLA_FLAGS is set
from jaxdist.models.arithmetic import param_count

MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="small", help="model preset (default: small)")
    p.add_argument(
        "--mesh",
        default="data=2,fsdp=2,tensor=2",
        help="mesh axis sizes, comma-separated AXIS=SIZE (default: data=2,fsdp=2,tensor=2)",
    )
    p.add_argument(
        "--devices", type=int, default=0, help="simulated CPU devices (default: the product of the mesh sizes)"
    )
    p.add_argument("--steps", type=int, default=30, help="timed steps of each kind (default: 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each kind first (default: 3)")
    p.add_argument("--batch", type=int, default=32, help="global batch in sequences (default: 32)")
    p.add_argument(
        "--seq", type=int, default=0, help="tokens per sequence (default: 128, or the preset's max_seq_len if shorter)"
    )
    p.add_argument("overrides", nargs="*", help="further config overrides, e.g. train.remat=full")
    args = p.parse_args(argv)
    args.mesh_sizes = _parse_mesh(p, args.mesh)
    if args.preset not in MODEL_PRESETS:
        p.error(f"--preset {args.preset} is unknown: choose one of {', '.join(MODEL_PRESETS)}")
    args.seq = args.seq or min(128, MODEL_PRESETS[args.preset]["max_seq_len"])
    if args.steps <= 0 or args.warmup < 0:
        p.error("--steps must be positive and --warmup not negative")
    return args


def _parse_mesh(p: argparse.ArgumentParser, text: str) -> dict[str, int]:
    sizes = {}
    for part in filter(None, text.split(",")):
        axis, _, size = part.partition("=")
        if axis not in MESH_AXES or not size.isdigit() or int(size) < 1:
            p.error(f"--mesh entry '{part}' is not AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}")
        sizes[axis] = int(size)
    return sizes


def simulate_cpu_devices(n: int) -> None:
    """Ask XLA for ``n`` host devices; must run before jax is imported."""
    assert "jax" not in sys.modules, "set XLA_FLAGS before importing jax"
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def make_baseline(trainer):
    """(step function, jit shardings, initial (params, opt_state)) written with jax and optax only.

    Uses the trainer's parameter and batch shardings; the optimizer state's
    moments follow the parameters, its counters are replicated.  The step
    function is not jitted here so that each variant gets its own trace.
    """
    import jax
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxdist.models import apply

    t = trainer.config.train
    warmup = max(0, min(t.warmup_steps, t.steps - 1))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, t.learning_rate, warmup, max(t.steps, warmup + 1), t.learning_rate * t.min_lr_ratio
    )
    opt = optax.chain(
        optax.clip_by_global_norm(t.grad_clip), optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay)
    )
    graphdef = trainer.graphdef

    def loss_fn(params, tokens):
        logits = apply(graphdef, params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(carry, tokens):
        params, opt_state = carry
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    replicated = NamedSharding(trainer.mesh, P())
    p_sh = trainer.param_shardings
    abstract_opt = jax.eval_shape(opt.init, trainer.state["params"])
    o_sh = optax.tree_utils.tree_map_params(
        opt, lambda _, s: s, abstract_opt, p_sh, transform_non_params=lambda _: replicated
    )
    carry_sh = (p_sh, o_sh)
    jit_kw = dict(
        in_shardings=(carry_sh, trainer.batch_sharding), out_shardings=(carry_sh, replicated), donate_argnums=(0,)
    )

    def init():  # own copies of the trainer's initial parameters: every variant donates its state
        copy = jax.jit(lambda p: (jax.tree.map(lambda x: x.copy(), p), opt.init(p)), out_shardings=carry_sh)
        return copy(trainer.state["params"])

    return step, jit_kw, init


def compile_stats(jitted, args: tuple) -> dict[str, float]:
    """Seconds to trace, lower and compile ``jitted`` for ``args``, and its per-device memory plan (bytes)."""
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    temp, arg, out, alias = (
        m.temp_size_in_bytes,
        m.argument_size_in_bytes,
        m.output_size_in_bytes,
        m.alias_size_in_bytes,
    )
    return {"compile_s": seconds, "temp": temp, "arg": arg, "out": out, "alias": alias, "peak": temp + arg + out}


# (key, label) of the timed variants, in table order.
VARIANTS = (
    ("trainer", "jaxdist Trainer step"),
    ("hand", "hand-written jit, same constraints"),
    ("plain", "hand-written jit, no constraints"),
)


def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Time the three steps; returns {variant: stats} (seconds, bytes) and "_info"."""
    import jax

    from jaxdist.parallel.mesh import describe_mesh
    from jaxdist.train.trainer import Trainer

    sizes = {a: 1 for a in MESH_AXES}
    sizes.update(args.mesh_sizes)
    runs = tempfile.mkdtemp(prefix="jaxdist-overhead-")
    overrides = [
        f"model={args.preset}",
        *(f"mesh.{a}={s}" for a, s in sizes.items()),
        f"train.batch_size={args.batch}",
        f"train.seq_len={args.seq}",
        f"train.steps={args.warmup + args.steps + 1}",
        f"train.runs_dir={runs}",
        "train.progress=false",
        "train.tensorboard=false",
        "checkpoint.enabled=false",
        "data.max_bytes=2000000",
        *args.overrides,
    ]
    cfg = load_config(None, overrides)
    trainer = Trainer(cfg)
    trainer_state = trainer.init_state()
    step, jit_kw, init = make_baseline(trainer)
    # The Trainer's step traces with its parallelism bound (the activations the model constrains are
    # pinned, MoE experts dispatched); "hand" is bound the same way, "plain" is not.
    fns = {
        "trainer": trainer._train_step,  # compile_stats compiles it afresh, like the others
        "hand": jax.jit(trainer.parallelism.bind(step), **jit_kw),
        "plain": jax.jit(step, **jit_kw),
    }
    carries = {"trainer": trainer_state, "hand": init(), "plain": init()}
    batches = [trainer.batch(i) for i in range(4)]
    jax.block_until_ready((carries, batches))

    stats = {k: compile_stats(fns[k], (carries[k], batches[0])) for k, _ in VARIANTS}

    def one_step(key: str, i: int) -> None:
        batch = batches[i % len(batches)]
        if key == "trainer":
            carries[key], out = trainer.train_step(carries[key], batch)  # the compiled step fit() calls
        else:
            carries[key], out = fns[key](carries[key], batch)
        jax.block_until_ready((carries[key], out))

    keys = [k for k, _ in VARIANTS]
    times = {k: [] for k in keys}
    for i in range(args.warmup + args.steps):
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:  # rotate: no variant always goes first
            t0 = time.perf_counter()
            one_step(key, i)
            if i >= args.warmup:
                times[key].append(time.perf_counter() - t0)
    trainer.close()
    shutil.rmtree(runs, ignore_errors=True)  # only metrics.jsonl and config.json
    stats.update(fit_loop(cfg, args))

    for key, ts in times.items():
        stats[key].update(median_s=statistics.median(ts), iqr_s=_iqr(ts))
    stats["_info"] = {
        "describe": f"{describe_mesh(trainer.mesh)}, model {cfg.model.preset} "
        f"({param_count(cfg.model) / 1e6:.2f}M params, {cfg.model.dtype}), "
        f"batch {cfg.train.batch_size}x{cfg.train.seq_len}, "
        f"{args.steps} timed steps each after {args.warmup} warmup, "
        f"jax {jax.__version__} on {jax.devices()[0].platform}"
    }
    return stats


FIT_VARIANTS = (("fit", "Trainer.fit loop"), ("fit_agent", "Trainer.fit + controller agent heartbeat"))


def fit_loop(cfg, args: argparse.Namespace, chunk: int = 5) -> dict[str, dict[str, float]]:
    """Seconds per step of ``Trainer.fit`` (callbacks included) with and without the controller agent's
    heartbeat callback attached: two Trainers, ``chunk`` steps of fit() each in turn, the logged step
    times (the device finished, evaluation excluded) summed per chunk; medians per step."""
    from jaxdist.controller.agent import WorkerAgent
    from jaxdist.train.trainer import Trainer

    runs = tempfile.mkdtemp(prefix="jaxdist-overhead-fit-")
    steps = args.warmup * chunk + args.steps
    base = cfg.replace(
        **{
            "train.steps": steps + chunk,
            "train.runs_dir": runs,
            "train.eval_batches": 1,
            "train.eval_every": 0,
            "train.log_every": 10,
        }
    )
    trainers = {k: Trainer(base.replace(**{"train.name": k})) for k, _ in FIT_VARIANTS}
    # A real worker agent (rank 0: it records every flushed step), heartbeating to a port nobody listens on.
    agent = WorkerAgent("127.0.0.1:9", "overhead-benchmark-token", "bench", interval=0.25)
    agent.update(rank=0, gen=0)
    agent.attach(trainers["fit_agent"])
    per_step = {k: [] for k in trainers}
    done = 0
    while done < steps:
        for k, t in list(trainers.items()) if (done // chunk) % 2 == 0 else list(trainers.items())[::-1]:
            records = t.fit(steps=chunk)
            if done >= args.warmup * chunk:
                per_step[k].append(sum(r["step_time"] for r in records) / len(records))
        done += chunk
    agent.close()
    for t in trainers.values():
        t.close()
    shutil.rmtree(runs, ignore_errors=True)
    return {k: {"median_s": statistics.median(v), "iqr_s": _iqr(v)} for k, v in per_step.items()}


def _iqr(xs: list[float]) -> float:
    if len(xs) < 4:
        return 0.0
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def format_table(stats: dict) -> str:
    """The result table as text (times in ms, compile in s, memory in MiB per device)."""
    cols = [
        ("median ms", "median_s", 1e3, "{:.2f}"),
        ("IQR ms", "iqr_s", 1e3, "{:.2f}"),
        ("compile s", "compile_s", 1, "{:.2f}"),
        ("temp MiB", "temp", 1 / MIB, "{:.2f}"),
        ("args MiB", "arg", 1 / MIB, "{:.2f}"),
        ("out MiB", "out", 1 / MIB, "{:.2f}"),
        ("alias MiB", "alias", 1 / MIB, "{:.2f}"),
        ("peak MiB", "peak", 1 / MIB, "{:.2f}"),
    ]
    rows = [["step"] + [c[0] for c in cols]]
    for key, label in VARIANTS:
        rows.append([label] + [fmt.format(stats[key][k] * scale) for _, k, scale, fmt in cols])
    for num, den, label in (
        ("trainer", "hand", "ratio Trainer / same constraints"),
        ("trainer", "plain", "ratio Trainer / no constraints"),
    ):
        rows.append([label] + [f"{stats[num][k] / stats[den][k]:.3f}" if stats[den][k] else "-" for _, k, _, _ in cols])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [stats["_info"]["describe"], "", line(rows[0]), line(["-" * w for w in widths])]
    out += [line(r) for r in rows[1:]]
    ratio = stats["trainer"]["median_s"] / stats["hand"]["median_s"]
    fit_ratio = stats["fit_agent"]["median_s"] / stats["fit"]["median_s"]
    out += ["", "the whole loop (log_every=10; logged step times, which wait for the device):"]
    out += [
        f"  {label:<42} median {1e3 * stats[k]['median_s']:.2f} ms/step, IQR {1e3 * stats[k]['iqr_s']:.2f}"
        for k, label in FIT_VARIANTS
    ]
    out += [
        f"  ratio with heartbeat / without = {fit_ratio:.3f} (target <= 1.03: "
        f"{'met' if fit_ratio <= 1.03 else 'NOT met'})"
    ]
    out += [
        "",
        f"overhead: Trainer step / hand-written step with the same constraints = {ratio:.3f} "
        f"(target <= 1.03: {'met' if ratio <= 1.03 else 'NOT met'})",
        "memory per device as XLA plans it; peak = temp + args + out "
        "(alias: output bytes that reuse donated argument buffers)",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = args.mesh_sizes
    n = args.devices or math.prod(sizes.values())
    sizes.setdefault("data", n // math.prod(sizes.values()))  # fill the devices, like mesh.data=-1
    simulate_cpu_devices(n)
    stats = run(args)
    print(format_table(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())

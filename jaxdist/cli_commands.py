"""The ``jaxdist`` commands (:mod:`jaxdist.cli` parses the command line and calls them): each takes the
parsed arguments and returns the exit code."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from pathlib import Path

from jaxdist.cluster import prepare_host_devices
from jaxdist.config import Config, ConfigError, load_config, reference_markdown
from jaxdist.controller.health_view import status as health_status
from jaxdist.data import add_data, load_source
from jaxdist.data.audit import describe, verify

# The commands import JAX-heavy modules inside their functions: `jaxdist --help`, `jaxdist config`,
# `jaxdist data` and the controller never load JAX, and `jaxdist train` sets XLA_FLAGS before it does.
# The controller's modules (pyzmq, an optional package) are imported by the commands that use them too.


def cmd_config(args) -> int:
    if args.reference:
        print(reference_markdown())
        return 0
    cfg = load_config(args.config, args.overrides)
    print(cfg.to_toml())
    return 0


def _warm_up(cfg: Config) -> None:
    """What a standby does before it has a rank: import JAX and the trainer, read the data (with train.entry:
    import the user's module; its data is read when the entry is called)."""
    import jaxdist.train.trainer  # noqa: F401  (JAX, flax, optax, orbax: seconds)

    if cfg.train.entry:
        try:
            importlib.import_module(cfg.train.entry.partition(":")[0])
        except ImportError:
            pass  # the worker given a rank says so in one sentence (jaxdist.train.custom.entry_keywords), exit 2
    else:
        load_source(cfg.data)


def cmd_train(args) -> int:
    cfg = load_config(args.config, _with_entry(args))
    prepare_host_devices(cfg)
    # Started by a node agent: heartbeat from now on, warm up, then wait for a rank (sets JAX_* env).
    agent = None
    if os.environ.get("JAXDIST_CONTROLLER"):
        from jaxdist.controller.agent import agent_from_env  # pyzmq (optional): only a worker under a controller

        agent = agent_from_env()
    if agent is not None:
        from jaxdist.train.compile_cache import configure_compile_cache  # JAX-free until JAX is loaded

        agent.wait_for_rank(warm=lambda: _warm_up(cfg), configure_cache=configure_compile_cache)
    from jaxdist.train.distributed import initialize_from_env  # JAX, after XLA_FLAGS

    initialize_from_env()
    # JAX and what loads it, after the process group is set up (a JAX-free CLI until here)
    import jax

    from jaxdist.resolve import resolve
    from jaxdist.train.custom import entry_keywords
    from jaxdist.train.start_report import start_report
    from jaxdist.train.trainer import Trainer

    # train.entry: your own model from module:function (jaxdist.train.custom); else jaxdist's, resolved here
    own = entry_keywords(cfg)
    with Trainer(cfg, jax.devices(), **own) if own else Trainer(resolve(cfg, jax.devices())) as trainer:
        if agent is not None:
            agent.attach(trainer)
            if jax.process_count() > 1:  # the controller's device probe, run by every process at the same step
                from jaxdist.train.device_probe import probe_for_agent  # only under the controller

                trainer.add_callback(probe_for_agent(trainer, agent))
        if jax.process_index() == 0:
            print("\n".join(start_report(trainer)), file=sys.stderr)
        trainer.init_state()
        start = int(jax.device_get(trainer.state["step"]))
        if start and jax.process_index() == 0:
            print(f"resuming at step {start}", file=sys.stderr)
        notice = trainer.bf16_notice()
        if notice and jax.process_index() == 0:
            print(f"jaxdist: note: {notice}", file=sys.stderr)
        history = trainer.fit()
        # fit() evaluated at its last step (every process: evaluate() is a collective)
        evaluated = f"eval loss {trainer.last_eval[1]:.3f}" if history and trainer.last_eval else "no evaluation"
        if jax.process_index() == 0 and history:
            first, last = history[0], history[-1]
            print(
                f"steps {first['step']}..{last['step']}: loss {first['loss']:.3f} -> {last['loss']:.3f}, "
                f"{evaluated}, {last['tokens_per_s']:.0f} tokens/s; "
                f"outputs in {trainer.run_dir}",
                file=sys.stderr,
            )
            if cfg.train.profile_steps:
                a, b = cfg.train.profile_steps
                print(
                    f"profile of steps {a}..{b} in {trainer.run_dir / 'profile'} "
                    f"(tensorboard --logdir {trainer.run_dir / 'profile'}, or the .xplane.pb / .trace.json.gz "
                    "files in Perfetto)",
                    file=sys.stderr,
                )
    if agent is not None:
        agent.finished()
    return 0


def cmd_ckpt(args) -> int:
    from jaxdist.checkpoint import report  # orbax and JAX

    if args.overrides:
        raise ConfigError(
            f"`jaxdist ckpt {args.action}` takes no overrides, got {' '.join(args.overrides)}: "
            "pass only the run directory and --step/--strategy."
        )
    try:
        ckdir = report.checkpoint_dir(args.run_dir)
        if args.action == "list":
            print(report.list_text(ckdir))
        elif args.action == "inspect":
            print(report.inspect_text(ckdir, args.step))
        elif args.action == "plan":
            print(report.plan_text(ckdir, args.step, args.strategy, args.top))
        else:
            ok, text = report.verify_text(ckdir, args.step)
            print(text)
            return 0 if ok else 1
    except FileNotFoundError as e:
        print(f"jaxdist: {e}", file=sys.stderr)
        return 2
    return 0


def cmd_data(args) -> int:
    if args.overrides:
        raise ConfigError(f"jaxdist data does not take '{args.overrides[0]}': see `jaxdist data --help`.")
    if args.action == "prepare":
        return cmd_prepare(args)
    run = Path(args.run_dir)
    if not run.is_dir():
        raise ConfigError(f"run directory '{run}' does not exist: pass the run's folder, e.g. runs/<train.name>.")
    if args.action != "add" and args.paths:
        raise ConfigError(f"jaxdist data {args.action} takes only RUN_DIR, not '{args.paths[0]}'.")
    if args.action == "show":
        print(describe(run, args.version, args.head))
        return 0
    if args.action == "verify":
        if not (run / "config.json").is_file() and not (run / "batchlist").is_dir():
            raise ConfigError(
                f"'{run}' is not a run directory (no config.json, no batchlist/): pass runs/<train.name>."
            )
        ok, lines = verify(run, full=args.full)
        print("\n".join(lines))
        print("batch list: ok" if ok else "batch list: PROBLEMS FOUND (see above)")
        return 0 if ok else 1
    if not args.paths:
        raise ConfigError("jaxdist data add needs at least one PATH: a text file, a directory or a token file.")
    r = add_data(run, args.paths, seed=args.seed, kind=args.kind, token_dtype=args.token_dtype)
    print(
        f"queued {len(r['sources'])} source(s), {r['batches']:,} batches, seed {r['seed']} as {r['request']}: "
        "a running trainer mixes them in at its next step, a stopped one when it starts"
    )
    return 0


def cmd_prepare(args) -> int:
    from jaxdist.data.prepare import piece_bytes_of, prepare  # JAX-free; tokenizers and pyarrow are loaded when used

    if len(args.paths) != 1:
        raise ConfigError("jaxdist data prepare takes SRC OUT: the corpus and the output directory.")
    out = Path(args.paths[0])
    piece_bytes = piece_bytes_of(args.piece_mb)
    if args.all_targets and not args.chat:
        raise ConfigError("--all-targets is for chat data: add --chat, or leave --all-targets out.")
    chat = "all" if args.all_targets else "assistant" if args.chat else ""
    m = prepare(
        args.run_dir, out, args.tokenizer, args.workers, args.text_field, piece_bytes, force=args.force, chat=chat
    )
    what = "conversations" if chat else "documents"
    print(
        f"{m['n_tokens']:,} tokens ({m['token_dtype']}) of {m['n_documents']:,} {what} from "
        f"{len(m['sources'])} file(s) in {out / 'tokens.bin'}; train with data.source=tokens "
        f"data.path={out / 'tokens.bin'} data.tokenizer={args.tokenizer}" + (" data.packing=documents" if chat else "")
    )
    return 0


def cmd_sample(args) -> int:
    from jaxdist.sample.config import check_request, check_texts, clamp_new_tokens, run_config  # no JAX

    prepare_host_devices(run_config(args.run_dir, args.overrides))  # the run's cluster: its simulated devices
    check_request(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    prompts = args.prompt or [""]
    check_texts(prompts, args.stop or ())
    from jaxdist.sample.sampler import Sampler, TextStream, describe  # JAX

    sampler = Sampler.from_run(args.run_dir, args.step, args.overrides)
    print(describe(sampler), file=sys.stderr)
    longest = max(len(ids) for ids in sampler.prompt_ids(prompts, args.chat))
    max_new_tokens, notice = clamp_new_tokens(args.max_new_tokens, longest, sampler.model.max_seq_len)
    if notice:
        print(f"jaxdist: {notice}", file=sys.stderr)
    # One prompt: its text printed as it comes; several: each printed whole at the end.
    # --chat: each prompt is a user message, and what is printed is the assistant's answer.
    stream = TextStream(sampler.tokenizer, sys.stdout, args.stop) if len(prompts) == 1 else None
    if stream is not None and not args.chat:
        print(prompts[0], end="", flush=True)
    results = sampler.generate(
        prompts,
        max_new_tokens,
        args.temperature,
        args.top_k,
        args.top_p,
        args.seed,
        args.stop,
        on_token=stream,
        chat=args.chat,
    )
    for i, g in enumerate(results):
        if stream is not None:
            stream.finish(g.text)
        else:
            shown = "" if args.chat else g.prompt
            print(f"--- prompt {i} ({g.finish})\n{shown}{g.text}", flush=True)
    return 0


def cmd_remat(args) -> int:
    overrides = list(args.overrides)
    if args.model:
        overrides.insert(0, f"model={args.model}")
    if args.mesh:
        overrides.append(f"mesh.cluster={args.mesh}")
    cfg = load_config(args.config, overrides)
    prepare_host_devices(cfg)  # the closed loop compiles on the cluster's (simulated CPU) devices
    from jaxdist.remat.command import parse_bytes, run_remat  # imports JAX

    rc = run_remat(cfg, args.budget, measure=args.measure, operators=args.ops)
    if rc == 0 and cfg.train.remat_verify:
        if args.budget is not None:
            cfg = cfg.replace(**{"train.remat_budget_bytes": parse_bytes(args.budget)})
        _verify_remat(cfg)
    return rc


def _verify_remat(cfg) -> None:
    """Print train.remat=auto closed against the compiler (predicted vs compiled peak), or why it cannot be."""
    # JAX and the compiler: only for --verify
    import jax

    from jaxdist.cluster import load_cluster, memory_budget
    from jaxdist.remat.plan import format_bytes
    from jaxdist.resolve import verified_remat

    cluster = load_cluster(cfg.mesh.cluster)
    devices = jax.devices()
    used = cfg.mesh.devices_used(cluster.n_devices)
    budget = memory_budget(cfg.train.memory_budget_bytes, cluster.memory_bytes)
    print(f"\nagainst the compiler: train.memory_budget_bytes {format_bytes(budget)} per device (compiled peak)")
    if devices[0].device_kind != cluster.device_kind or len(devices) < used:
        print(
            f"not compiled: the mesh needs {used} x {cluster.device_kind} and this process sees {len(devices)} x "
            f"{devices[0].device_kind}; run `jaxdist remat` (or train) where those devices are to close the loop "
            "(train.remat_verify=false skips it)."
        )
        return
    choice = verified_remat(cfg.replace(**{"train.remat": "auto"}), devices[:used])
    print(choice.table())
    print(choice.describe())
    print(choice.applied())


def cmd_pipeline(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from jaxdist.parallel.chunks import chunk_boundaries, chunk_cost_model, chunk_costs  # JAX
    from jaxdist.parallel.schedule import activation_memory_ratio, build_schedule

    kind = args.kind or ("seq1f1b" if args.chunks > 1 else "1f1b")
    try:
        sch = build_schedule(args.stages, args.microbatches, args.chunks, kind)
        bounds = chunk_boundaries(cfg.train.seq_len, args.chunks, chunk_cost_model(cfg.model), args.split)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    p, s = args.stages, args.chunks
    print(sch.summary())
    print(sch.timeline())
    if kind == "seq1f1b":
        print(
            f"activation memory vs 1f1b on stage 0: (s+p-1)/(s*p) = {s + p - 1}/{s * p} = "
            f"{activation_memory_ratio(p, s):.3f}"
        )
        costs = chunk_costs(bounds, chunk_cost_model(cfg.model))
        print(
            f"chunks of train.seq_len={cfg.train.seq_len} for model {cfg.model.preset} ({args.split} split): "
            f"boundaries {list(bounds)}, forward GFLOPs per block [{', '.join(f'{c / 1e9:.4g}' for c in costs)}] "
            f"(max/min {max(costs) / min(costs):.3f})"
        )
    return 0


def cmd_comm(args) -> int:
    cfg = load_config(args.config, args.overrides)
    from jaxdist.cluster import load_cluster
    from jaxdist.parallel.comm import plan_for_config  # no JAX

    print(plan_for_config(cfg, load_cluster(cfg.mesh.cluster)).table())
    return 0


def _with_entry(args) -> list[str]:
    """The overrides, with ``--entry module:function`` as ``train.entry`` (your own model, jaxdist.train.custom)."""
    entry = getattr(args, "entry", None)
    return list(args.overrides) + ([f"train.entry={entry}"] if entry else [])


def cmd_launch(args) -> int:
    from jaxdist.controller.commands import launch  # pyzmq (optional): only the controller's commands need it

    return launch(args.config, _with_entry(args), print_only=args.print, image=args.image, shape_planner=_plan_shape)


def _plan_shape(cfg, view, figures):
    """mesh=auto on a slurm: cluster: the shapes of the partition's free GPUs by predicted step time, and the
    chosen plan as overrides (the planner imports JAX: only here)."""
    from jaxdist.planner.shared import plan_free  # imports JAX: only for mesh=auto on a slurm: cluster

    cc = cfg.controller
    fp = plan_free(
        cfg.model,
        view,
        figures,
        batch_size=cfg.train.batch_size,
        seq_len=cfg.train.seq_len,
        standbys=cc.standbys,
        max_nodes=cc.max_nodes,
        min_nodes=cc.min_nodes,
    )
    return fp.choice, fp.overrides()


def cmd_controller(args) -> int:
    from jaxdist.controller.commands import controller  # pyzmq (optional): only the controller's commands need it

    return controller(args.config, args.overrides)


def cmd_status(args) -> int:
    return health_status(args.run_dir, args.heatmap)


def cmd_gen(args) -> int:
    from jaxdist.gen.config import load_gen_config  # JAX-free: the dispatcher never loads JAX

    words = list(args.words) + list(args.overrides)
    action = words.pop(0) if words and words[0] in ("run", "status", "receive", "profile") else "run"
    if action == "profile":
        from jaxdist.gen.profile import main as profile_main  # JAX-free

        return profile_main(words)
    logging.getLogger("jaxdist").setLevel(logging.INFO)
    if action == "receive":
        from jaxdist.gen.delivery import Receiver  # pyzmq: only for receiving

        if not words:
            raise ConfigError("jaxdist gen receive needs the training run's directory: jaxdist gen receive RUN_DIR.")
        rec = Receiver(words[0], args.bind, args.port, allow_remote=args.bind != "127.0.0.1")
        print(f"receiving shards for {words[0]} on {rec.address}", flush=True)
        try:
            rec.serve(None if args.for_seconds is None else time.monotonic() + args.for_seconds)
        except KeyboardInterrupt:
            pass
        finally:
            rec.close()
        return 0
    cfg = load_gen_config(args.config, words)
    # the generation job's modules: only for jaxdist gen
    from jaxdist.gen.job import run_job
    from jaxdist.gen.status import format_status, read_status

    if action == "status":
        print(format_status(read_status(cfg)))
        return 0
    return run_job(cfg, args.config, words)


def cmd_convert(args) -> int:
    from jaxdist.convert_config import check_destination, import_config, stored_config  # JAX-free: devices later

    check_destination(args.direction, args.src, args.dst, args.force)
    tokenizer = None
    if args.direction == "hf-to-jaxdist":
        cfg, tokenizer = import_config(args.src, args.dst, args.overrides)
    else:
        cfg = stored_config(args.src, args.overrides)
    prepare_host_devices(cfg)
    from jaxdist.train.distributed import initialize_from_env  # JAX, after XLA_FLAGS

    initialize_from_env()
    # JAX and the converters, after the process group is set up
    import jax

    from jaxdist.convert import hf_to_run, run_to_hf

    if args.direction == "hf-to-jaxdist":
        nbytes = hf_to_run(cfg, tokenizer)
        done = f"{nbytes / 1e6:.1f} MB of parameters as step 0 of {cfg.run_dir} (jaxdist train resumes from it)"
        done += f", tokenizer {tokenizer.name}" if tokenizer is not None else ", no tokenizer file (bytes)"
    else:
        files = run_to_hf(cfg, args.dst, args.step, args.dtype)
        done = f"{len(files)} files in {args.dst}"
    if jax.process_index() == 0:
        print(f"wrote {done}", file=sys.stderr)
    return 0

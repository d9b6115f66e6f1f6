"""``jaxdist`` command line.

    jaxdist train [--config FILE] [--entry M:F] [KEY=VALUE ...]   train (resumes a run that has checkpoints;
                                                     --entry: your own model, jaxdist.train.custom)
    jaxdist config [--config FILE] [KEY=VALUE ...]   print the resolved config as TOML
    jaxdist config --reference                       print the configuration reference (Markdown)
    jaxdist ckpt list|inspect|verify|plan RUN_DIR    checkpoints of a run: steps, contents, checksums, write plan
    jaxdist data show|verify RUN_DIR                 a run's batch list: versions, sources, cursor; checks
    jaxdist data add RUN_DIR PATH...                 mix new data into a run (running or stopped)
    jaxdist data prepare SRC OUT --tokenizer T [--workers N] [--text-field text] [--chat [--all-targets]]
                                                     tokenize JSONL / Parquet / text into OUT/tokens.bin
    jaxdist sample RUN_DIR --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P]
                   [--seed S] [--step STEP] [--stop STRING] [--chat] [KEY=VALUE ...]
                                                     continue prompts with a run's checkpoint (streamed)
    jaxdist remat [--model M] [--mesh CLUSTER] [--budget 20GiB] [KEY=VALUE ...]
                                                     the remat plan for a block and the named policies beside it
    jaxdist launch [--config FILE] [--print] [--entry M:F] [KEY=VALUE ...]   controller + node agents (controller.launcher:
                                                     local, ssh, slurm, kubernetes); keeps the job alive
    jaxdist controller [--config FILE] [KEY=VALUE ...]   only the controller (node agents started elsewhere)
    jaxdist plan [--model M | --entry M:F] [--cluster C] [--busy F] [--out plan.toml] [KEY=VALUE ...]
                                                     best mesh / microbatches / remat; writes a train config
                                                     (--entry M:F: your own model, every mesh compiled)
    jaxdist calibrate [--cluster C] [--out FILE]     measure the devices' efficiency and links for the planner
    jaxdist gen [run] --config gen.toml [KEY=VALUE ...]   generation workers: tasks from a sample set, shards
                                                     delivered to a training run (jaxdist/gen/job.py)
    jaxdist gen status --config gen.toml             tasks, shards per worker, tokens/s, the run's lag
    jaxdist gen receive RUN_DIR [--port P]           the training run's side: receive and add shards
    jaxdist gen profile LOGS... [--out FILE]         models' performance parameters from workers' run logs
    jaxdist pipeline --stages P --microbatches M [--chunks S] [--kind K] [KEY=VALUE ...]
                                                     a pipeline schedule's timeline, bubble, activations in
                                                     flight, and the chunk boundaries for model / train.seq_len

Overrides are dotted keys: ``train.steps=200 mesh.tensor=2 model=tiny``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jaxdist.cli_commands import (
    cmd_ckpt,
    cmd_comm,
    cmd_config,
    cmd_controller,
    cmd_convert,
    cmd_data,
    cmd_gen,
    cmd_launch,
    cmd_pipeline,
    cmd_remat,
    cmd_sample,
    cmd_status,
    cmd_train,
)
from jaxdist.cli_planner import add_parsers as add_planner_parsers  # plan, calibrate (JAX-free to register)
from jaxdist.config import PIPELINE_SCHEDULES, ConfigError
from jaxdist.optional import missing_package


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdist", description="Train large models on device meshes.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (resumes from the run's checkpoints)")
    t.add_argument("--config", help="TOML config file")
    t.add_argument("--entry", help="module:function returning your own model and loss (train.entry)")
    t.set_defaults(fn=cmd_train)

    c = sub.add_parser("config", help="print the resolved config, or the reference")
    c.add_argument("--config", help="TOML config file")
    c.add_argument("--reference", action="store_true", help="print the configuration reference")
    c.set_defaults(fn=cmd_config)

    la = sub.add_parser("launch", help="multi-host launch: controller + node agents, kept alive on failures")
    la.add_argument("--config", help="TOML config file")
    la.add_argument("--print", action="store_true", help="slurm / kubernetes: print the batch script or manifest")
    la.add_argument("--image", default="jaxdist:latest", help="kubernetes: container image of the pods")
    la.add_argument("--entry", help="module:function returning your own model and loss (train.entry)")
    la.set_defaults(fn=cmd_launch)

    co = sub.add_parser("controller", help="run only the controller of a job (node agents join it)")
    co.add_argument("--config", help="TOML config file")
    co.set_defaults(fn=cmd_controller)

    st = sub.add_parser("status", help="a launched job's health per node: table and heat map (no JAX)")
    st.add_argument("run_dir", help="run directory (<runs_dir>/<name>)")
    st.add_argument("--heatmap", help="where to write the heat map PNG (default <run>/controller/health.png)")
    st.set_defaults(fn=cmd_status)

    k = sub.add_parser("ckpt", help="list, inspect, verify a run's checkpoints or print their write plan")
    k.add_argument("action", choices=("list", "inspect", "verify", "plan"))
    k.add_argument("run_dir", help="run directory (or its checkpoints/ folder)")
    k.add_argument("--step", type=int, help="one step (default: newest committed; verify: all)")
    k.add_argument(
        "--strategy",
        default="balanced",
        choices=("balanced", "replica0"),
        help="plan: the balanced plan or the naive one (replica 0 writes each shard)",
    )
    k.add_argument("--top", type=int, default=0, help="plan: show only the N biggest arrays")
    k.set_defaults(fn=cmd_ckpt)

    cv = sub.add_parser(
        "convert", help="Hugging Face checkpoints in and out: hf-to-jaxdist HF RUN | jaxdist-to-hf RUN HF"
    )
    cv.add_argument("direction", choices=("hf-to-jaxdist", "jaxdist-to-hf"))
    cv.add_argument("src", help="hf-to-jaxdist: the Hugging Face directory; jaxdist-to-hf: the run directory")
    cv.add_argument("dst", help="hf-to-jaxdist: the new run directory; jaxdist-to-hf: the output directory")
    cv.add_argument("--step", type=int, help="jaxdist-to-hf: the checkpoint step (default: newest)")
    cv.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="jaxdist-to-hf: tensor dtype")
    cv.add_argument(
        "--force", action="store_true", help="write into a non-empty output directory (never into the input)"
    )
    cv.set_defaults(fn=cmd_convert)

    d = sub.add_parser(
        "data", help="show, verify or add to a run's batch list (its exact data order); prepare a corpus"
    )
    d.add_argument("action", choices=("show", "add", "verify", "prepare"))
    d.add_argument("run_dir", help="run directory (runs/<train.name>); prepare: SRC, the corpus")
    d.add_argument(
        "paths",
        nargs="*",
        help="add: text files, directories of text files or token files (.bin); prepare: OUT, the output directory",
    )
    d.add_argument("--tokenizer", default="bytes", help="prepare: bytes, a tokenizer.json or a SentencePiece .model")
    d.add_argument("--workers", type=int, default=1, help="prepare: tokenizing processes (default: 1)")
    d.add_argument("--text-field", default="text", help="prepare: JSONL field / Parquet column of the text")
    d.add_argument("--piece-mb", type=float, default=8.0, help="prepare: input MiB per piece of work (default: 8)")
    d.add_argument(
        "--chat",
        action="store_true",
        help="prepare: JSONL conversations rendered with the tokenizer's chat template; the assistant's tokens are "
        "the targets (targets.bin); train with data.packing=documents",
    )
    d.add_argument("--all-targets", action="store_true", help="prepare --chat: every token is a target")
    d.add_argument("--seed", type=int, help="add: shuffle seed (default: random, recorded in the journal)")
    d.add_argument(
        "--kind",
        default="auto",
        choices=("auto", "text", "tokens"),
        help="add: how to read a file (auto: .bin/.tok/.tokens are token files, others text)",
    )
    d.add_argument("--token-dtype", choices=("uint16", "uint32"), help="add: dtype of token files (default: the run's)")
    d.add_argument("--version", type=int, help="show: this version (default: newest)")
    d.add_argument("--head", type=int, default=5, help="show: how many upcoming batch ids to list")
    d.add_argument("--full", action="store_true", help="verify: also re-hash every added source (reads all of it)")
    d.add_argument("--force", action="store_true", help="prepare: write into an output directory holding other files")
    d.set_defaults(fn=cmd_data)

    sa = sub.add_parser("sample", help="continue prompts with a run's checkpoint, on the run's mesh axes")
    sa.add_argument("run_dir", help="run directory (runs/<train.name>)")
    sa.add_argument("--prompt", action="append", help="prompt text (repeat for a batch; default: one empty prompt)")
    sa.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate per prompt (default: 100)")
    sa.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); higher = more random")
    sa.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest tokens (0 = all)")
    sa.add_argument("--top-p", type=float, default=1.0, help="sample among the likeliest tokens of mass P (1 = all)")
    sa.add_argument("--seed", type=int, default=0, help="seed of the sampling key")
    sa.add_argument("--step", type=int, help="checkpoint step (default: the newest good one)")
    sa.add_argument("--stop", action="append", help="end a prompt's text at this string (repeatable)")
    sa.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message, rendered with the chat template beside the run's tokenizer; prints "
        "the assistant's answer",
    )
    sa.set_defaults(fn=cmd_sample)

    r = sub.add_parser("remat", help="plan remat for a model on a cluster: what to save, what to recompute")
    r.add_argument("--config", help="TOML config file")
    r.add_argument("--model", help="model preset (same as model=NAME)")
    r.add_argument("--mesh", help="cluster: a name in meshes/ or a TOML path (same as mesh.cluster=...)")
    r.add_argument(
        "--budget", help="saved activations per device, all blocks, e.g. 20GiB (default: from device memory)"
    )
    r.add_argument("--measure", action="store_true", help="time operators on this machine instead of FLOPs / peak")
    r.add_argument("--ops", action="store_true", help="list every saved or recomputed operator, not groups")
    r.set_defaults(fn=cmd_remat)

    pl = sub.add_parser("pipeline", help="print a pipeline schedule: timeline, bubble, activations in flight")
    pl.add_argument("--config", help="TOML config file (model and train.seq_len for the chunk boundaries)")
    pl.add_argument("--stages", type=int, required=True, help="pipeline stages p")
    pl.add_argument("--microbatches", type=int, required=True, help="microbatches m per step")
    pl.add_argument("--chunks", type=int, default=1, help="sequence chunks s per microbatch (seq1f1b)")
    pl.add_argument("--kind", choices=PIPELINE_SCHEDULES, help="schedule (default: seq1f1b with chunks, else 1f1b)")
    pl.add_argument("--split", default="cost", choices=("cost", "equal"), help="chunk boundaries: equal cost or tokens")
    pl.set_defaults(fn=cmd_pipeline)

    cm = sub.add_parser("comm", help="print the gradient communication plan: buckets, collectives, issue points")
    cm.add_argument("what", choices=("plan",), help="plan: the table of gradient collectives of one step")
    cm.add_argument(
        "--config", help="TOML config file (model, mesh, train.grad_bucket_bytes); KEY=VALUE overrides follow"
    )
    cm.set_defaults(fn=cmd_comm)

    g = sub.add_parser("gen", help="generation workers feeding a training run: run, status, receive RUN_DIR")
    g.add_argument(
        "words", nargs="*", help="[run|status|receive RUN_DIR|profile LOGS...] then KEY=VALUE overrides of [gen]"
    )
    g.add_argument("--config", help="TOML file with a [gen] table")
    g.add_argument("--port", type=int, default=0, help="receive: port to listen on (default: a free one)")
    g.add_argument("--bind", default="127.0.0.1", help="receive: address to listen on")
    g.add_argument(
        "--for-seconds", type=float, help="receive: stop after this many seconds (default: run until killed)"
    )
    g.set_defaults(fn=cmd_gen)

    add_planner_parsers(sub)
    return p


# Options whose value may look negative (argparse reads `--budget -5MiB` as two options): joined to their value so
# that the value reaches its own check, which says what is wrong with it.
SIGNED_VALUE_OPTIONS = ("--budget",)


def _join_signed_values(argv: list[str]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in SIGNED_VALUE_OPTIONS and arg[:1] == "-" and (arg[1:2].isdigit() or arg[1:2] == "."):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    # Everything argparse does not know is a KEY=VALUE (or --KEY VALUE) override.
    argv = _join_signed_values(list(sys.argv[1:] if argv is None else argv))
    args, args.overrides = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"jaxdist: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # an optional package this command needs (jaxdist.optional.PACKAGES)
        sentence = missing_package(e)
        if sentence is None:
            raise
        print(f"jaxdist: {sentence}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was committed stays (a run resumes from its newest checkpoint)
        what = " ".join(w for w in (args.command, getattr(args, "action", None)) if isinstance(w, str))
        print(f"jaxdist: {what} interrupted (Ctrl-C); what it had finished is kept.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (``jaxdist config --reference | head``): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's exit flush must not raise again
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""Mutation testing of one core module with mutmut 3 (issue 42): the module's fast tests against its mutants.

    python tools/mutation.py --module sample.decode              # run (or resume) and rewrite the report
    python tools/mutation.py --module sample.decode --fresh      # forget earlier verdicts: every mutant again
    python tools/mutation.py --module sample.decode --report-only
    python tools/mutation.py --list                           # the modules and the tests each one runs

mutmut (3.8.1, ``pip install mutmut==3.8.1``) copies the package into a ``mutants/`` folder with every function of
the mutated files rewritten as a trampoline to its original or one of its mutants, runs the selected tests once to
learn which test reaches which function, then for each mutant runs only the tests that reach its function
(``pytest -x``, in a process forked for it).  A mutant is *killed* when a test fails, *survived* when they all
pass, *timeout* when they run 15x longer than on the original, *no tests* when none of the selected tests reaches
its function.

**The restriction to one module.**  mutmut 3 reads ``[tool.mutmut]`` from ``./pyproject.toml`` and keeps its
state (the mutated copy, which test reaches which function, every verdict) in ``./mutants/``; it has no
command-line option for the files to mutate or the tests to run.  Rather than edit the project's
``pyproject.toml``, this script gives each module its own working directory, ``mutants/<module>/`` (git-ignored):
symlinks to ``jaxdist/``, ``tests/`` and ``meshes/`` and a ``pyproject.toml`` that is the project's (pytest's
settings included) plus a generated ``[tool.mutmut]``:

* ``source_paths = ["jaxdist"]``: the whole package is copied, so the tests import every other module unchanged;
* ``only_mutate``: the module's file(s), from :data:`MODULES`;
* ``pytest_add_cli_args_test_selection``: the module's FAST tests, from :data:`MODULES` (seconds to a minute:
  never the whole suite);
* ``process_isolation = "forkserver"``: mutmut's main process never imports JAX; every mutant runs in a process
  forked from a server that has only collected the tests (JAX imported, no backend started, nothing compiled),
  so no compiled program of the original code is inherited and XLA's threads are never forked;
* ``pytest_add_cli_args``: ``-p mutation_jax_plugin`` (``tools/mutation_jax_plugin.py``, linked in): JAX's trace
  caches are cleared before each test, or a jitted function would be seen (and its mutants run) by the first test
  that traces it only.

mutmut runs in that directory (its ``mutants/`` is then ``mutants/<module>/mutants/``), so each module keeps its
own verdicts and a second module's run does not invalidate the first's.  With ``PYTHONPATH`` cleared, the tests
import the mutated copy, never the editable install.

**Verdicts kept between runs.**  A run resumes in two passes: first every mutant without a verdict (mutmut
resets those of a function whose source changed, and a new function's are new), then every mutant whose earlier
verdict was not killed (survived, no tests, timeout) again, by name, against the tests as they are now (new tests
are found and traced first).  Mutants already killed in unchanged functions stay killed.  mutmut traces which
tests reach which function only for tests it has not seen: after adding assertions to an existing test (not a
new test), move ``mutants/<module>/mutants/mutmut-stats.json`` aside so that it traces every test again.  When the
module's generated configuration changes (its table entry, this script's settings) mutmut forgets every verdict
and all mutants run.  After changing or deleting tests, run with ``--fresh``.

**The report**, ``tools/mutation_report.md``, is rewritten from ``tools/mutation_runs.json`` (one record per run
and module: the counts, and the mutants not killed with their one-line diffs) and
``tools/mutation_equivalent.toml`` (per module, mutant name -> why it cannot change behaviour).  A survivor listed
there counts as *equivalent*, not survived; a listed mutant that a test kills is reported as a stale entry.
Score = (killed + timeout) / (mutants - equivalent).

mutmut runs with at most ``--max-children`` workers (default 2) under ``--timeout`` seconds of wall clock.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "mutants"
REPORT = REPO / "tools" / "mutation_report.md"
RUNS = REPO / "tools" / "mutation_runs.json"
EQUIVALENT = REPO / "tools" / "mutation_equivalent.toml"
MUTMUT_VERSION = "3.8.1"

# module -> (files to mutate, the fast tests that cover them: files or node ids, each run in seconds to a minute).
MODULES: dict[str, tuple[list[str], list[str]]] = {
    # The token choice against exact probabilities.  The sampler's decoding tests (the cache, the ring) compile the
    # model's prefill and decoding programs: minutes per mutant on a loaded 2-core host, so prefill, decode_step and
    # the slot arithmetic show as "no tests" here; sample.sampler runs them.
    "sample.decode": (
        ["jaxdist/sample/decode.py"],
        [
            "tests/sample/test_decode_distribution.py",
            "tests/sample/test_sampler.py",
            "-k",
            "test_decode_distribution or left_pad or ring_slots or next_token_ends or ring_wraps or past_max_seq_len"
            " or seeds_repeat or stop_string or top_k_1_and_tiny or continuation"
            " or (cached_greedy and not moe and not data2)",
        ],
    ),
    # The sampler's host side (the batch, the loop, stop strings and EOS, the programs' shardings, from_run, chat
    # prompts, the vocabulary note, the API's argument checks) against the training forward pass and transformers'
    # tokenizer and chat template.
    # Without the MoE and the subprocess CLI cases: every mutant compiles the sampler's programs again (tens of
    # seconds each on this host), so the cheapest tests that reach each function.
    "sample.sampler": (
        ["jaxdist/sample/sampler.py"],
        [
            "tests/sample/test_sampler.py",
            "tests/hf/test_tokenizer_travels.py",
            "tests/test_api_edge.py",
            "-k",
            "not cli_samples and not moe-tiny"
            " and (test_sampler.py or test_api_edge.py or from_run or vocabulary or chat_prompts)",
        ],
    ),
    # The step against optax, the written-out cross-entropy and each packed document alone; the MoE objective.
    "train.step": (
        ["jaxdist/train/step.py"],
        [
            "tests/train/test_step.py",
            "tests/models/test_moe.py::test_train_step_objective_and_metrics_over_microbatches",
        ],
    ),
    # The selector against brute force and the MILP optimum, its bounds and slack.
    "remat.select": (["jaxdist/remat/select.py"], ["tests/remat/test_select.py"]),
    # The schedules against their closed-form bubbles, peaks and dependencies; the chunk split against brute force.
    "parallel.schedule": (
        ["jaxdist/parallel/schedule.py", "jaxdist/parallel/chunks.py"],
        ["tests/parallel/test_pipeline_schedule.py"],
    ),
    # The gradient communication plan (buckets, thresholds, XLA options) worked out by hand.
    "parallel.comm": (["jaxdist/parallel/comm.py"], ["tests/parallel/test_comm.py"]),
    # The search against exhaustive enumeration, the plans of known models and clusters.
    "planner.search": (["jaxdist/planner/search.py"], ["tests/planner/test_search.py"]),
    # The cost model: parameter bytes against the real shardings, the collectives, bubbles and times worked out by
    # hand, the context axis's terms.  Not the tests that compile a step or run the search (seconds each per
    # mutant, ~1,000 mutants): planner.search and tests/planner/test_measured.py check those paths.
    "planner.cost": (
        ["jaxdist/planner/cost.py"],
        [
            "tests/planner/test_cost.py",
            "tests/planner/test_cost_by_hand.py",
            "tests/planner/test_context.py",
            "tests/planner/test_candidates.py",
            "tests/planner/test_fit.py",
            "-k",
            "not compiled_step and not cli_plan",
        ],
    ),
    "data.batchlist": (["jaxdist/data/batchlist.py"], ["tests/data/test_batchlist.py"]),
    "data.audit": (["jaxdist/data/audit.py"], ["tests/data/test_batchlist.py", "tests/data/test_audit.py"]),
    "checkpoint.integrity": (["jaxdist/checkpoint/integrity.py"], ["tests/checkpoint/test_integrity.py"]),
    "controller.policy": (["jaxdist/controller/policy.py"], ["tests/controller/test_policy.py"]),
    # Hugging Face conversion: tensor names, shapes and layouts both ways, against transformers itself (logits,
    # greedy tokens, export loaded by transformers), the round trip and the refusals of bad files.
    "hf.convert": (
        ["jaxdist/hf/tensors.py", "jaxdist/hf/load.py", "jaxdist/hf/export.py"],
        [
            "tests/hf/conformance",
            "tests/hf/test_roundtrip.py",
            "tests/hf/test_errors.py",
            "tests/hf/test_bad_directories.py",
        ],
    ),
}

NOT_KILLED = ("survived", "no tests", "timeout", "suspicious", "segfault", "not checked", "skipped")


def status_of(exit_code: int | None) -> str:
    from mutmut.stats import status_by_exit_code  # the tool's own table of exit codes

    return status_by_exit_code[exit_code]


def prepare(module: str, fresh: bool) -> bool:
    """``mutants/<module>/``: links to the sources and tests, and the project's pyproject.toml plus [tool.mutmut];
    True when that configuration is new or changed (mutmut then forgets every verdict: all mutants must run)."""
    files, tests = MODULES[module]
    work = WORK / module
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for name in ("jaxdist", "tests", "meshes", "tools/mutation_jax_plugin.py"):
        link = work / Path(name).name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(REPO / name, work))
    text = (REPO / "pyproject.toml").read_text()
    assert "[tool.mutmut]" not in text, "pyproject.toml has its own [tool.mutmut]: this script writes one per module"
    section = {
        "source_paths": ["jaxdist"],
        "only_mutate": files,
        "pytest_add_cli_args_test_selection": tests,
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-p", "mutation_jax_plugin"],
        "also_copy": ["meshes", "mutation_jax_plugin.py"],
        "process_isolation": "forkserver",
        "use_git_change_detection": False,
        "on_dependency_change": "ignore",
    }
    lines = ["", "[tool.mutmut]  # written by tools/mutation.py for " + module]
    lines += [f"{k} = {json.dumps(v)}" for k, v in section.items()]
    config = text + "\n".join(lines) + "\n"
    path = work / "pyproject.toml"
    changed = not path.exists() or path.read_text() != config
    if changed:
        path.write_text(config)
    return changed


def verdicts(module: str) -> dict[str, str]:
    """mutant name -> status, from mutmut's meta files of the module's working directory."""
    out: dict[str, str] = {}
    for f in MODULES[module][0]:
        meta = WORK / module / "mutants" / (f + ".meta")
        if meta.exists():
            for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                out[name] = status_of(code)
    return out


def function_hashes(module: str) -> dict[str, str]:
    """qualified mutated function (``jaxdist.x.y.x_fn``) -> mutmut's hash of its source, from the meta files."""
    out: dict[str, str] = {}
    for f in MODULES[module][0]:
        meta = WORK / module / "mutants" / (f + ".meta")
        if meta.exists():
            prefix = f.removesuffix(".py").replace("/", ".")
            for fn, h in json.loads(meta.read_text()).get("hash_by_function_name", {}).items():
                out[f"{prefix}.{fn}"] = h
    return out


def diffs(module: str, names: list[str]) -> dict[str, str]:
    """mutant name -> its change in one line (``old`` -> ``new``), read by mutmut in the module's directory."""
    if not names:
        return {}
    code = (
        "import json, sys\n"
        "from mutmut.mutation.diff_apply import get_diff_for_mutant, find_mutant\n"
        "out = {}\n"
        "for n in json.loads(sys.stdin.read()):\n"
        "    out[n] = get_diff_for_mutant(n, path=find_mutant(n).path)\n"
        "print(json.dumps(out))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(names),
        cwd=WORK / module,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    if r.returncode != 0:
        print(r.stderr[-2000:], file=sys.stderr)
        return {n: "(diff unavailable)" for n in names}
    return {n: one_line(d) for n, d in json.loads(r.stdout.splitlines()[-1]).items()}


def one_line(diff: str) -> str:
    """A unified diff as ``- old`` / ``+ new`` lines joined into one line (whitespace squeezed)."""
    minus = [" ".join(x[1:].split()) for x in diff.splitlines() if x.startswith("-") and not x.startswith("---")]
    plus = [" ".join(x[1:].split()) for x in diff.splitlines() if x.startswith("+") and not x.startswith("+++")]
    return f"`{' / '.join(minus)}` -> `{' / '.join(plus)}`"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the tests must import mutants/<module>/mutants/jaxdist, nothing else
    return env


def run(module: str, max_children: int, timeout: int, everything: bool) -> int:
    """Run mutmut in the module's directory.  A resume runs twice: first with no names, so that mutmut tests every
    mutant without a verdict (those of functions whose source changed since, which it resets, and new ones); then
    the mutants of unchanged functions that had a verdict other than killed, by name, against the tests as they
    are now (the first pass ran the changed functions' mutants already)."""
    before = {} if everything else verdicts(module)
    hashes = function_hashes(module)
    rc = _mutmut(module, [], timeout, max_children)
    if not before or rc != 0:
        return rc
    after, now = verdicts(module), function_hashes(module)

    def tested_in_the_first_pass(name: str) -> bool:  # its function changed: mutmut reset and ran its mutants
        fn = name.rsplit("__mutmut_", 1)[0]
        return hashes.get(fn) != now.get(fn)

    retest = sorted(
        n
        for n, s in after.items()
        if s != "killed" and before.get(n, "not checked") != "not checked" and not tested_in_the_first_pass(n)
    )
    if not retest:
        print(f"{module}: every mutant with an earlier verdict is killed (use --fresh to run them all again)")
        return rc
    return _mutmut(module, retest, timeout, max_children)


def _mutmut(module: str, names: list[str], timeout: int, max_children: int) -> int:
    cmd = ["mutmut", "run", "--max-children", str(max_children), *names]
    log = WORK / module / "mutmut.log"
    which = f"{len(names)} mutants by name" if names else "every mutant without a verdict"
    print(f"{module}: {' '.join(cmd[:4])} ({which}) in {WORK / module}; log {log}")
    with open(log, "a") as out:
        out.write(f"\n==== {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M:%S} UTC: {' '.join(cmd)}\n")
        out.flush()
        try:
            r = subprocess.run(
                cmd, cwd=WORK / module, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=_env()
            )
            rc = r.returncode
        except subprocess.TimeoutExpired:
            print(f"{module}: mutmut ran past --timeout {timeout} s; verdicts so far are kept", file=sys.stderr)
            rc = 124
    return rc


def record(module: str, note: str) -> dict:
    """Count the module's verdicts into a new record of tools/mutation_runs.json; return it."""
    v = verdicts(module)
    if not v:
        raise SystemExit(f"{module}: no verdicts in {WORK / module} (run it first)")
    equivalent = load_equivalent().get(module, {})
    counts = {s: 0 for s in ("killed", "timeout", "survived", "equivalent", "no tests", "other")}
    for name, s in v.items():
        if s in ("survived", "no tests") and name in equivalent:
            counts["equivalent"] += 1
        elif s in counts:
            counts[s] += 1
        else:
            counts["other"] += 1
    not_killed = sorted(n for n, s in v.items() if s in NOT_KILLED)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    rec = {
        "module": module,
        "date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "commit": commit.stdout.strip(),
        "note": note,
        "mutants": len(v),
        **counts,
        "not_killed": {n: {"status": v[n]} for n in not_killed},
    }
    d = diffs(module, not_killed)
    for n in not_killed:
        rec["not_killed"][n]["diff"] = d.get(n, "")
    runs = json.loads(RUNS.read_text()) if RUNS.exists() else []
    runs.append(rec)
    RUNS.write_text(json.dumps(runs, indent=1) + "\n")
    return rec


def load_equivalent() -> dict[str, dict[str, str]]:
    return tomllib.loads(EQUIVALENT.read_text()) if EQUIVALENT.exists() else {}


def recount(rec: dict, equivalent: dict[str, str]) -> dict:
    """``rec`` with survived / no tests / equivalent counted against today's list of equivalent mutants (a run
    recorded before a mutant was judged equivalent shows it as such too, so the rows compare)."""
    out = dict(rec)
    eq = [n for n, x in rec["not_killed"].items() if n in equivalent and x["status"] in ("survived", "no tests")]
    out["equivalent"] = len(eq)
    for status in ("survived", "no tests"):
        out[status] = sum(1 for n, x in rec["not_killed"].items() if x["status"] == status and n not in eq)
    return out


def score(rec: dict) -> str:
    live = rec["mutants"] - rec["equivalent"]
    return f"{100 * (rec['killed'] + rec['timeout']) / live:.1f} %" if live else "-"


def write_report() -> None:
    runs = json.loads(RUNS.read_text()) if RUNS.exists() else []
    equivalent = load_equivalent()
    out = [
        "# Mutation testing of the core (issue 42)",
        "",
        "Written by `tools/mutation.py` (mutmut 3.8.1; how to run it: docs/development.md, *Mutation testing*).  Per module, every",
        "recorded run (the first is the figure before this issue's tests, the last the figure now), then the",
        "mutants not killed at the last run, then the equivalent ones (they cannot change behaviour) and why.",
        "Score = (killed + timeout) / (mutants - equivalent); the target is 85 %.  Every row counts equivalents by",
        "today's `tools/mutation_equivalent.toml`.",
        "",
    ]
    for module in MODULES:
        recs = [r for r in runs if r["module"] == module]
        if not recs:
            continue
        files, tests = MODULES[module]
        out += [
            f"## {module}",
            "",
            f"Mutated: {', '.join(f'`{f}`' for f in files)}.  Tests (pytest arguments, `tools/mutation.py`'s table): "
            f"`{' '.join(tests)}`.",
            "",
        ]
        out += [
            "| date | commit | run | mutants | killed | timeout | survived | no tests | equivalent | other | score |"
        ]
        out += ["| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        eq = equivalent.get(module, {})
        for r in (recount(r, eq) for r in recs):
            out.append(
                f"| {r['date']} | {r['commit']} | {r['note']} | {r['mutants']} | {r['killed']} | {r['timeout']} | "
                f"{r['survived']} | {r['no tests']} | {r['equivalent']} | {r['other']} | {score(r)} |"
            )
        last = recs[-1]
        left = {
            n: x for n, x in last["not_killed"].items() if n not in eq or x["status"] not in ("survived", "no tests")
        }
        out += ["", f"Not killed at the last run ({len(left)}):", ""]
        out += [f"- `{n.split('.')[-1]}` ({x['status']}): {x['diff']}" for n, x in left.items()] or ["- none"]
        out += ["", f"Equivalent ({len(eq)}):", ""]
        for n, why in eq.items():
            x = last["not_killed"].get(n)
            if x is None:
                out.append(f"- `{n.split('.')[-1]}`: STALE ENTRY (killed, or no longer a mutant): {why}")
            else:
                out.append(f"- `{n.split('.')[-1]}` {x['diff']}: {why}")
        if not eq:
            out.append("- none")
        out.append("")
    REPORT.write_text("\n".join(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--module", choices=sorted(MODULES), help="the module to mutate (see --list)")
    ap.add_argument("--fresh", action="store_true", help="forget earlier verdicts and mutate afresh")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from the recorded runs")
    ap.add_argument("--max-children", type=int, default=2, help="mutants tested at once (default 2)")
    ap.add_argument("--timeout", type=int, default=3600, help="wall-clock limit of the mutmut run, seconds")
    ap.add_argument("--note", default="", help="what this run is, for the report (say: before, after)")
    ap.add_argument("--list", action="store_true", help="print the modules, their files and tests")
    args = ap.parse_args(argv)
    if args.list:
        for m, (files, tests) in MODULES.items():
            print(f"{m}: {' '.join(files)}\n    " + "\n    ".join(tests))
        return 0
    if args.report_only:
        write_report()
        return 0
    if args.module is None:
        ap.error("give --module (or --list, --report-only)")
    if args.max_children < 1 or args.timeout < 1:
        ap.error("--max-children and --timeout must be positive")
    from importlib.metadata import version

    if version("mutmut") != MUTMUT_VERSION:
        print(f"warning: mutmut {version('mutmut')} installed; this script was written for {MUTMUT_VERSION}")
    changed = prepare(args.module, args.fresh)
    rc = run(args.module, args.max_children, args.timeout, changed)
    rec = recount(
        record(args.module, args.note or ("fresh" if args.fresh else "resumed")), load_equivalent().get(args.module, {})
    )
    write_report()
    print(
        f"{args.module}: {rec['mutants']} mutants, {rec['killed']} killed, {rec['timeout']} timeout, "
        f"{rec['survived']} survived, {rec['no tests']} no tests, {rec['equivalent']} equivalent, "
        f"{rec['other']} other; score {score(rec)} (mutmut exit {rc}); report {REPORT.relative_to(REPO)}"
    )
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

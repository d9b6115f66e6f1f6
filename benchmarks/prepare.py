"""Tokens/s of ``jaxdist data prepare`` on 1 and 2 worker processes against the ``tokenizers`` library's own
``encode_batch`` on one process, on the same corpus in the same run.

The corpus is a JSONL file of the standard library's .py files (the embedded default corpus, sorted by
path, the first ``--mb`` MiB of them), written to a temporary directory.  The tokenizer is a byte-level
BPE of ``--vocab`` tokens trained here with the ``tokenizers`` library on the first 2 MiB of the corpus
(or ``--tokenizer tokenizer.json``).  Rows:

- ``prepare --workers N``: wall seconds of :func:`jaxdist.data.prepare.prepare` into a fresh directory:
  hashing the source, reading and parsing the JSONL, tokenizing, writing pieces, concatenating into
  tokens.bin and the manifest (everything the command does; worker start-up included);
- ``encode_batch``: ``Tokenizer.encode_batch`` of the texts already in memory (no JSON, no files),
  with the library's own thread pool (its default), then with ``TOKENIZERS_PARALLELISM=false`` (one thread).

Each row is the best of ``--repeat`` runs; ratios are against ``encode_batch`` with its thread pool.

    python benchmarks/prepare.py                 # 8 MiB, vocab 8192
    python benchmarks/prepare.py --mb 32 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import tempfile
import time
from pathlib import Path

from jaxdist.data.prepare import prepare
from jaxdist.data.sources import scan_files

MIB = 2**20


def stdlib_docs(mb: float) -> list[str]:
    """The stdlib's .py files in path order, up to ``mb`` MiB of UTF-8."""
    root = sysconfig.get_paths()["stdlib"]
    out, size = [], 0
    for rel, n, _ in scan_files(root, suffix=".py", skip_dirs=frozenset({"site-packages", "__pycache__"})):
        if size + n > mb * MIB:
            break
        try:
            out.append(Path(root, rel).read_text(encoding="utf-8"))
        except UnicodeDecodeError:  # a few test files are deliberately not UTF-8
            continue
        size += n
    return out


def train_bpe(docs: list[str], vocab: int, path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    sample, size = [], 0
    for d in docs:
        if size > 2 * MIB:
            break
        sample.append(d)
        size += len(d)
    tok.train_from_iterator(sample, trainer)
    tok.save(str(path))
    return path


def best(fn, repeat: int) -> tuple[float, int]:
    """(best seconds, tokens) of ``repeat`` calls of ``fn`` (which returns its token count)."""
    times, n = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        n = fn()
        times.append(time.perf_counter() - start)
    return min(times), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=8.0, help="corpus size (MiB of stdlib sources)")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary trained here (tokens)")
    ap.add_argument("--tokenizer", help="a tokenizer.json to use instead of training one")
    ap.add_argument("--repeat", type=int, default=2, help="runs per row (the best is shown)")
    ap.add_argument("--piece-mb", type=float, default=1.0, help="prepare's MiB per piece of work")
    args = ap.parse_args()

    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        docs = stdlib_docs(args.mb)
        corpus = tmp / "corpus.jsonl"
        with open(corpus, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        tok_path = Path(args.tokenizer) if args.tokenizer else train_bpe(docs, args.vocab, tmp / "tokenizer.json")
        lib = Tokenizer.from_file(str(tok_path))
        text_mib = sum(len(d.encode()) for d in docs) / MIB
        print(
            f"corpus: {len(docs)} documents, {text_mib:.1f} MiB of text ({corpus.stat().st_size / MIB:.1f} MiB JSONL); "
            f"tokenizer: {tok_path.name}, {lib.get_vocab_size()} tokens; {os.cpu_count()} CPUs"
        )
        rows = []
        for workers in (1, 2):
            runs = iter(range(10**6))

            def run(workers=workers, runs=runs) -> int:
                out = tmp / f"out{workers}-{next(runs)}"
                m = prepare(corpus, out, str(tok_path), workers, piece_bytes=int(args.piece_mb * MIB), progress=False)
                return m["n_tokens"] - m["n_documents"]  # the EOS separators are not the library's work

            rows.append((f"jaxdist data prepare --workers {workers}", *best(run, args.repeat)))

        def encode() -> int:
            return sum(len(e.ids) for e in lib.encode_batch(docs, add_special_tokens=False))

        rows.append(("tokenizers encode_batch (thread pool)", *best(encode, args.repeat)))
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by the library at each call
        rows.append(("tokenizers encode_batch (1 thread)", *best(encode, args.repeat)))

    ref = rows[2][2] / rows[2][1]
    print(f"\n| {'what':<40} | {'tokens':>10} | {'seconds':>8} | {'tokens/s':>10} | {'vs encode_batch':>15} |")
    print(f"| {'-' * 40} | {'-' * 10}:| {'-' * 8}:| {'-' * 10}:| {'-' * 15}:|")
    for name, seconds, n in rows:
        print(f"| {name:<40} | {n:>10,} | {seconds:>8.2f} | {n / seconds:>10,.0f} | {n / seconds / ref:>15.2f} |")
    assert len({n for _, _, n in rows}) == 1, "every row must tokenize the same corpus into the same tokens"


if __name__ == "__main__":
    main()

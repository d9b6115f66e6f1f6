"""Corpora for the tokenizer and prepare tests: stdlib sources as texts, JSONL files of them."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_PACKAGES = ("json", "email")  # what the tokenizers are trained on (about 0.4 MB)


def stdlib_texts(packages: tuple[str, ...], limit: int = 10**9) -> list[str]:
    """The .py files of stdlib ``packages`` (sorted), as text, at most ``limit`` of them."""
    files = sorted(f for p in packages for f in (STDLIB / p).glob("*.py"))[:limit]
    return [f.read_text(encoding="utf-8") for f in files]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    """One JSON object per line, the text under ``field`` (and an id beside it)."""
    with open(path, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, field: t}) + "\n")
    return path

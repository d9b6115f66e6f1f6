"""The documentation: its runnable commands run, every guide is in the site's nav, README.md stays short.

A fenced ```bash block directly under the line ``<!-- runnable -->`` in README.md or docs/*.md is runnable:
it runs with ``bash -euo pipefail`` in a new empty directory, with 8 simulated CPU devices, the repository
first on PYTHONPATH, and ``jaxdist`` and ``python`` meaning this interpreter, bounded by a timeout that kills
it and its children.  Such a block makes its own inputs and stays cheap: the whole file takes about 75 s on
the 2-core machine (keep it under 90 s).  The site itself is built by ``mkdocs build --strict`` (.ci/run),
which fails on a broken link or anchor inside docs/; README.md's links into docs/ are checked here.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

from jaxdist.cluster import without_device_count

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
MARKER = "<!-- runnable -->"
README_MAX_LINES = 200
BLOCK_TIMEOUT = 300  # seconds; the slowest block (two runs of the tiny model) takes 25-40 s on the 2-core machine


@dataclass(frozen=True)
class Block:
    """One runnable block: the page, the 1-based line of its opening fence, its commands."""

    path: Path
    line: int
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO).as_posix()}:{self.line}"


def parse_runnable(path: Path) -> tuple[list[Block], list[str]]:
    """The runnable blocks of one page, and the problems of markers not followed by a closed ```bash block."""
    lines = path.read_text().split("\n")
    blocks, problems = [], []
    name = path.relative_to(REPO).as_posix()
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        fence = lines[i + 1] if i + 1 < len(lines) else ""
        if fence.strip() != "```bash":
            problems.append(f"{name}:{i + 1}: {MARKER} is not directly followed by a ```bash fence ({fence!r})")
            continue
        end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            problems.append(f"{name}:{i + 2}: the runnable block is never closed")
            continue
        blocks.append(Block(path, i + 2, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks, problems


BLOCKS = [block for page in PAGES for block in parse_runnable(page)[0]]


def _env(bin_dir: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID") and not k.startswith("SLURM_")
    }
    env["XLA_FLAGS"] = f"{without_device_count(os.environ['XLA_FLAGS'])} --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(bin_dir), env.get("PATH", "")))
    # The session's persistent compilation cache (tests/conftest.py): the blocks that train the tiny model compile
    # the same programs, so all but the first load them.  A cached program is the same executable.
    if "JAXDIST_TEST_COMPILE_CACHE" in os.environ:
        env["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAXDIST_TEST_COMPILE_CACHE"]
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.3"
    return env


def _shims(bin_dir: Path) -> None:
    """``jaxdist`` and ``python`` on PATH as this interpreter, whether or not the console script is installed."""
    bin_dir.mkdir()
    for name, command in (("jaxdist", f'"{sys.executable}" -m jaxdist.cli'), ("python", f'"{sys.executable}"')):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        shim.chmod(0o755)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_runnable_block_exits_0(block: Block, tmp_path: Path) -> None:
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    _shims(bin_dir)
    work.mkdir()
    script = tmp_path / "block.sh"
    script.write_text(block.code)
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", str(script)],
        cwd=work,
        env=_env(bin_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout kills the commands it started too
    )
    try:
        out, _ = proc.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{block.id}: still running after {BLOCK_TIMEOUT} s\n--- block\n{block.code}--- output\n{out}")
    assert proc.returncode == 0, f"{block.id}: exit {proc.returncode}\n--- block\n{block.code}--- output\n{out}"


def test_runnable_markers_mark_bash_blocks() -> None:
    problems = [problem for page in PAGES for problem in parse_runnable(page)[1]]
    assert not problems, "\n".join(problems)


def test_the_readme_and_the_guides_have_runnable_blocks() -> None:
    # A renamed marker would otherwise turn every check of the commands off without a failure.
    assert any(block.path.name == "README.md" for block in BLOCKS), "README.md has no runnable block"
    assert len(BLOCKS) >= 5, f"only {len(BLOCKS)} runnable blocks in README.md and docs/"


def _nav_files(mkdocs_yml: str) -> list[str]:
    """The .md files listed under ``nav:`` (entries ``- Title: file.md`` or ``- file.md``)."""
    files, in_nav = [], False
    for line in mkdocs_yml.splitlines():
        if re.match(r"nav:\s*$", line):
            in_nav = True
        elif in_nav and line.strip() and not line[0].isspace():
            in_nav = False
        elif in_nav:
            m = re.search(r"(?:^\s*-\s*|:\s*)([\w./-]+\.md)\s*$", line)
            if m:
                files.append(m.group(1))
    return files


def test_every_guide_is_in_the_nav() -> None:
    nav = _nav_files((REPO / "mkdocs.yml").read_text())
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(set(nav) - set(pages)) == [], "mkdocs.yml's nav lists pages that docs/ does not have"
    assert sorted(set(pages) - set(nav)) == [], "docs/ has pages that mkdocs.yml's nav does not list"


def test_readme_is_at_most_200_lines() -> None:
    n = len((REPO / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move the detail to docs/"


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading: its text, ASCII, lower case, words joined by -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    anchors, in_code = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


def test_readme_links_into_docs_hold() -> None:
    readme = (REPO / "README.md").read_text()
    broken = []
    for target, anchor in re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme):
        page = REPO / target
        if not page.is_file():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in _anchors(page):
            broken.append(f"{target}#{anchor}: no such heading")
    assert not broken, "README.md links to:\n" + "\n".join(broken)


def test_slug_matches_mkdocs() -> None:
    assert _slug("Gradient communication: when each block's gradients are reduced") == (
        "gradient-communication-when-each-blocks-gradients-are-reduced"
    )
    assert _slug("A job's health per node: `jaxdist status`") == "a-jobs-health-per-node-jaxdist-status"

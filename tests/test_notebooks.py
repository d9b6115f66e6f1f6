"""Every notebook in notebooks/ runs top to bottom without an error, on small settings.

The notebooks read their sizes from the environment so this test can shrink
them: ``JAXDIST_NB_STEPS`` (training steps), ``JAXDIST_NB_RUNS`` (a directory
for run outputs; the notebooks never write into the repository) and
``JAXDIST_NB_SMALL=1`` (for any other knob a notebook wants to shrink).  The
kernel is the ``python3`` kernelspec of ipykernel; jupyter_client starts it
with this interpreter (``sys.executable``), so it sees the same installed jaxdist.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient import NotebookClient

from jaxdist.cluster import without_device_count

NOTEBOOKS_DIR = Path(__file__).parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
KERNEL = "python3"
CELL_TIMEOUT_S = 300
SMALL_STEPS = 6


def test_notebooks_exist():
    assert any(p.name == "quickstart.ipynb" for p in NOTEBOOKS), f"no quickstart.ipynb in {NOTEBOOKS_DIR}"


def test_python3_kernel_is_available():
    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
    except NoSuchKernel:
        pytest.fail(
            "no 'python3' Jupyter kernel: install the test extras (pip install -e '.[test]'), "
            "or run `python -m ipykernel install --user`."
        )
    assert spec.language == "python"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_saved_clean(path: Path):
    """Notebooks are committed without outputs, so diffs show only what a person wrote."""
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count is not None)
    ]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"
    assert nb.metadata.get("kernelspec", {}).get("name") == KERNEL


# finetune.ipynb runs in full in tests/test_finetune.py (it needs torch and transformers, and checks what it learns)
RUN = [p for p in NOTEBOOKS if p.stem != "finetune"]


@pytest.mark.parametrize("path", RUN, ids=[p.stem for p in RUN])
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The kernel inherits this process's environment.
    monkeypatch.setenv("JAXDIST_NB_STEPS", str(SMALL_STEPS))
    monkeypatch.setenv("JAXDIST_NB_RUNS", str(tmp_path))
    monkeypatch.setenv("JAXDIST_NB_SMALL", "1")
    # The notebook sets the device count itself before importing jax; conftest's compile flags stay.
    monkeypatch.setenv("XLA_FLAGS", without_device_count(os.environ["XLA_FLAGS"]))

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    client.execute()  # raises CellExecutionError, with the failing cell and traceback, on any error

    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert ran and all(c.execution_count is not None for c in ran), "not every code cell ran"

"""No import cycle among jaxdist's modules, counting imports inside functions and under TYPE_CHECKING
(import-linter's contracts skip the latter): tools/import_cycles.py, run as a developer would."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_module_imports_another_that_imports_it_back_and_every_local_import_says_why():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "import_cycles.py")], capture_output=True, text=True, timeout=120
    )
    assert "import cycles (every import counted): 0" in out.stdout and out.returncode == 0, out.stdout[:2000]
    assert " 0 without a reason comment" in out.stdout, out.stdout[-3000:]  # ARCHITECTURE.md's promise


def test_a_cycle_inside_a_function_is_found(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_cycles
    finally:
        sys.path.remove(str(ROOT / "tools"))
    pkg = tmp_path / "jaxdist"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from jaxdist.b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text(
        "def g():\n    from jaxdist.a import f  # the cycle, hidden in a function\n    return f\n"
    )
    monkeypatch.setattr(import_cycles, "ROOT", tmp_path)
    monkeypatch.setattr(import_cycles, "PKG", pkg)
    graph, local = import_cycles.imports(import_cycles.modules())
    assert import_cycles.cycles(graph) == [["jaxdist.a", "jaxdist.b"]]
    assert [(m, n, why) for m, _, n, why in local] == [("jaxdist.b", "jaxdist.a", "the cycle, hidden in a function")]

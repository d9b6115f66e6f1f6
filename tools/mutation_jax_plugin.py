"""pytest plugin loaded by tools/mutation.py's mutmut runs: JAX's trace caches are cleared before every test.

mutmut learns which tests reach a function from the calls its trampoline sees.  A jitted function's Python body
runs only when JAX traces it; a later test calling the same jitted function with the same shapes reuses the
trace, so the trampoline would see only the first test, and a mutant would be run against that test alone (a
temperature mutant survived that way, tested at temperature 1 only).  Cleared caches make every test trace again:
each test that uses a function is counted, and each runs the mutant.  Compiled programs still come from the
persistent compilation cache when the traced program is the same (tests/conftest.py).
"""

import jax
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    jax.clear_caches()

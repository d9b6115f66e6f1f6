import atexit
import os
import shutil
import tempfile

import pytest

# 8 CPU devices for every test (and every process a test starts: they inherit the environment).  The test
# programs are tiny, so compiling them costs more than running them: XLA's CPU backend skips LLVM's
# optimisation passes (level 0, no expensive passes), as the remat loop's and the pipeline tests' own compiles
# do.  It changes how fast the generated code runs, not what it computes; every bit-for-bit comparison is
# between programs compiled alike.  Benchmarks and users compile at XLA's defaults.
os.environ["XLA_FLAGS"] = (
    "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_llvm_disable_expensive_passes=true"
)
# XLA's newer CPU fusion emitters spend about twice the compile time of the older ones on these programs
# (benchmarks/README, "The test suite's time").  The older
# emitters compile the same HLO but may reduce in another order, so a module whose claim is the same bits from
# two *different* programs (another mesh or device order, the ordered sum, a probability that sums to top_p
# exactly) says ``pytestmark = pytest.mark.default_emitters`` and compiles at XLA's default, as users do
# (``_default_emitters`` below).  Only where this jaxlib knows the flag (an unknown flag in XLA_FLAGS aborts every
# process that starts XLA): asked once, in a child, and the answer inherited by every process after.
OLD_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "JAXDIST_TEST_OLD_EMITTERS" not in os.environ:
    import subprocess
    import sys

    _probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"],
        env={**os.environ, "XLA_FLAGS": OLD_EMITTERS, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        timeout=300,
    )
    os.environ["JAXDIST_TEST_OLD_EMITTERS"] = "1" if _probe.returncode == 0 else "0"
if os.environ["JAXDIST_TEST_OLD_EMITTERS"] == "1":
    os.environ["XLA_FLAGS"] += " " + OLD_EMITTERS
# One persistent compilation cache per test session.  Many tests compile the same programs (the tiny model's
# train step on the same mesh, built by a new Trainer each time), and each group of the multi-process
# checkpoint tests (tests/checkpoint/worker.py reads $JAXDIST_TEST_COMPILE_CACHE) compiles what the previous
# group did: later ones load the executable instead.  A cached program is the same executable, so every
# bit-for-bit assertion holds.  The controller's jobs keep their own per-job caches (they count hits and
# misses): the setting below is jax.config in this process only, not the environment their workers inherit.
if "JAXDIST_TEST_COMPILE_CACHE" not in os.environ:
    os.environ["JAXDIST_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="jaxdist-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXDIST_TEST_COMPILE_CACHE"], True)

# The planner's calibrations and the learned working space of the memory loops: one empty directory per test
# session (never the user's ~/.cache), so no test depends on what an earlier run learned.
if "JAXDIST_CALIBRATION_DIR" not in os.environ:
    os.environ["JAXDIST_CALIBRATION_DIR"] = tempfile.mkdtemp(prefix="jaxdist-test-calibration-")
    atexit.register(shutil.rmtree, os.environ["JAXDIST_CALIBRATION_DIR"], True)

import jax  # noqa: E402  (imported here, after XLA_FLAGS: every test sees 8 CPU devices)

jax.config.update("jax_compilation_cache_dir", os.environ["JAXDIST_TEST_COMPILE_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.3)  # tiny programs: not worth a file

# The modules that take longest (seconds on the 2-core machine, two processes, 2026-12-06), started first when the
# suite runs on several processes (pytest-xdist, ``-n 2 --dist loadfile --no-loadscope-reorder``: a module is one
# unit; without the last flag xdist reorders modules by test count, which starts these last): a long module that
# starts last is the run's tail.  One process at a time keeps the collection order.
LONGEST_FIRST = (
    "checkpoint/test_local_multiprocess.py",  # ~135
    "controller/test_fault_injection.py",  # ~130
    "test_notebooks.py",  # ~100
    "slurm/test_train.py",  # ~90
    "controller/test_health_jobs.py",  # ~85
    "controller/test_stub_jobs.py",  # ~80
    "test_finetune.py",  # ~60
    "test_docs.py",  # ~45
    "gen/test_gen_cluster.py",  # ~35
    "train/test_custom_plan.py",  # ~33
    "parallel/test_pipeline.py",  # ~33
)


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    tests = os.path.dirname(__file__)

    def rank(item) -> int:
        path = os.path.relpath(str(item.path), tests).replace(os.sep, "/")
        return LONGEST_FIRST.index(path) if path in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a module, and of the other modules, is kept


def pytest_configure(config):
    # here, not in pyproject.toml: tools/mutation.py's per-module configuration copies pyproject.toml, and mutmut
    # forgets every verdict when it changes
    config.addinivalue_line(
        "markers", "default_emitters: the module compiles with XLA's default CPU fusion emitters (tests/conftest.py)"
    )


@pytest.fixture(autouse=True, scope="module")
def _default_emitters(request):
    """In a module marked ``default_emitters``: every program compiles with XLA's default CPU fusion emitters (a
    per-compile override of the session's older ones), and the processes the module starts inherit XLA_FLAGS
    without the older ones; JAX's in-memory caches are dropped before and after, so that no executable crosses
    over (the persistent cache's key holds the override)."""
    if request.node.get_closest_marker("default_emitters") is None or OLD_EMITTERS not in os.environ["XLA_FLAGS"]:
        yield
        return
    from jax._src import compiler  # JAX has no public switch for every compile; a renamed function fails here

    original = compiler.get_compile_options

    def with_default_emitters(*args, env_options_overrides=None, **kwargs):
        overrides = {"xla_cpu_use_fusion_emitters": True, **(env_options_overrides or {})}
        return original(*args, env_options_overrides=overrides, **kwargs)

    jax.clear_caches()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiler, "get_compile_options", with_default_emitters)
        mp.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"].replace(" " + OLD_EMITTERS, ""))
        yield
    jax.clear_caches()

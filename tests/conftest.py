import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
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

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
# One persistent compilation cache for the multi-process test groups of this session (tests/checkpoint/worker.py):
# a group of 4 processes compiles the same programs as the previous group, so later groups load them instead.
# A cached program is the same executable, so every bit-for-bit assertion holds; the controller's tests keep
# their own per-job caches (they count hits and misses).
if "JAXDIST_TEST_COMPILE_CACHE" not in os.environ:
    os.environ["JAXDIST_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="jaxdist-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JAXDIST_TEST_COMPILE_CACHE"], True)

import jax  # noqa: E402, F401  (imported here, after XLA_FLAGS: every test sees 8 CPU devices)

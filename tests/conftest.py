import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402, F401  (imported here, after XLA_FLAGS: every test sees 8 CPU devices)

#!/usr/bin/env bash
# The GPU check on a lent GPU machine as it is: its own JAX (with CUDA), flax, optax and orbax, and no network.
# Run from anywhere in a checkout:  bash benchmarks/gpu_check.sh [config overrides for every row ...]
# It installs jaxdist without its dependencies (nothing is downloaded), says what the machine is, and runs
# benchmarks/gpu_check.py (one table, under 8 minutes on an H200).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
# --no-build-isolation: the build uses the machine's setuptools instead of downloading one.
if ! "$python" -m pip install --quiet --no-deps --no-build-isolation -e .; then
    echo "gpu_check.sh: pip could not install jaxdist; running it from this checkout (PYTHONPATH) instead" >&2
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
"$python" -c "import jax, jaxdist; print('jax', jax.__version__, jax.devices())"
exec "$python" benchmarks/gpu_check.py "$@"

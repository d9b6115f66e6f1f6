"""Joining a multi-process job (one process per host) before any JAX computation.

The usual variables select it:

* ``JAX_COORDINATOR_ADDRESS`` (host:port of process 0), ``JAX_NUM_PROCESSES``,
  ``JAX_PROCESS_ID``: set by ``jaxdist launch`` or by hand;
* under Slurm (``SLURM_NTASKS`` > 1) JAX detects the three values itself.

On CPU the cross-process collectives use gloo.  ``JAXDIST_HEARTBEAT_TIMEOUT``
(seconds) shortens how long peers wait for a dead process and
``JAXDIST_SHUTDOWN_TIMEOUT`` (seconds) how long a finished process waits for the
others at exit (tests set both low).  ``JAX_COORDINATOR_BIND_ADDRESS``
(host:port) is where process 0's coordination service listens (default: every
interface; ``jaxdist launch`` keeps it on loopback when the job is on one machine).
"""

from __future__ import annotations

import os

import jax


def wants_distributed(env: dict[str, str] | None = None) -> bool:
    """True when the environment describes a job of more than one process."""
    env = os.environ if env is None else env
    if int(env.get("JAX_NUM_PROCESSES", "1") or 1) > 1:
        return True
    return int(env.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in env


def initialize_from_env() -> bool:
    """Call ``jax.distributed.initialize`` if the environment asks for it; True if it did."""
    if not wants_distributed():
        return False
    if jax.distributed.is_initialized():
        return True
    if os.environ.get("JAX_PLATFORMS", "") in ("cpu", ""):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if "JAXDIST_HEARTBEAT_TIMEOUT" in os.environ:
        kwargs["heartbeat_timeout_seconds"] = int(os.environ["JAXDIST_HEARTBEAT_TIMEOUT"])
    if "JAXDIST_SHUTDOWN_TIMEOUT" in os.environ:
        kwargs["shutdown_timeout_seconds"] = int(os.environ["JAXDIST_SHUTDOWN_TIMEOUT"])
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):  # else process 0's service listens on every interface
        kwargs["coordinator_bind_address"] = os.environ["JAX_COORDINATOR_BIND_ADDRESS"]
    if "JAX_COORDINATOR_ADDRESS" in os.environ:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
            **kwargs,
        )
    else:  # Slurm: JAX reads SLURM_* itself.
        jax.distributed.initialize(**kwargs)
    return True

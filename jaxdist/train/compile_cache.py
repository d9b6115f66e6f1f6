"""The persistent compilation cache of a worker: where it is, and that every CPU process writes its entries.

A standby loads the group's programs from this cache instead of compiling
them (jaxdist/controller/agent.py hands the directory over; this module does
what needs JAX).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)


def configure_compile_cache(path: str, count_event: Callable[..., None] | None = None) -> None:
    """Point JAX's persistent compilation cache at ``path``, caching every program (even fast ones).

    Through the environment when JAX is not imported yet (it reads these at
    import), through ``jax.config`` when it is; ``count_event`` (a
    jax.monitoring event listener) then sees its hits and misses.
    """
    settings = {
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    os.environ.update({k.upper(): str(v) for k, v in settings.items()})
    if "jax" not in sys.modules:
        return
    import jax  # only once JAX is loaded: a worker that has not imported it yet stays JAX-free here

    for k, v in settings.items():
        jax.config.update(k, v)
    _write_cache_on_every_cpu_process()
    if count_event is not None:
        jax.monitoring.register_event_listener(count_event)


def _write_cache_on_every_cpu_process() -> None:
    """Let every process of a CPU job write its own persistent-cache entries.

    JAX writes entries from process 0 only, assuming every process computes the
    same key (true on GPU, where the key leaves the device assignment out).  On
    CPU the key hashes each process's own view of the topology, so the other
    processes would never find an entry and would compile on every start --
    and the group steps at the pace of its slowest member.  Their keys differ,
    so their writes cannot collide.  Wraps a private JAX function; if it is not
    there (another JAX version), nothing changes.
    """
    try:
        # private JAX modules: another JAX version may lack them (then nothing changes)
        from jax._src import compilation_cache, compiler, distributed
    except ImportError:
        return
    original = getattr(compiler, "_cache_write", None)
    if original is None or getattr(original, "jaxdist_wrapped", False):
        return

    def write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        if distributed.global_state.process_id == 0 or backend.platform != "cpu" or host_callbacks:
            return original(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        if compile_time_secs < jax_min_compile_time():
            return None
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as e:  # a cache write must never fail the compile
            log.warning("could not write the persistent compilation cache entry of %s: %s", module_name, e)
        return None

    write.jaxdist_wrapped = True  # type: ignore[attr-defined]
    compiler._cache_write = write


def jax_min_compile_time() -> float:
    import jax  # called from the wrapped cache write: JAX is loaded by then

    return float(jax.config.jax_persistent_cache_min_compile_time_secs)

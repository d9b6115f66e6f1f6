"""One background writer thread, shared by both checkpoint tiers (persistent and node-local).

A save copies the arrays to the host in the caller's thread and hands the slow
part (files, checksums, commit marker) to :class:`BackgroundWriter`, which runs
one job at a time.  The next save waits for the running job instead of queuing
behind it; an exception raised by a job is kept and re-raised in the caller's
thread by the next :meth:`~BackgroundWriter.submit` or
:meth:`~BackgroundWriter.wait`, so a failed save is never silently lost.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any


class BackgroundWriter:
    """Runs one job at a time on a daemon thread and reports its failure on the caller's thread.

    ``what`` names the jobs in the error raised for a failed one, e.g. ``"a
    checkpoint save in /runs/x/checkpoints"`` gives ``RuntimeError("a checkpoint
    save in /runs/x/checkpoints failed: <the job's exception>")``.
    ``busy_waits`` counts the waits that found a job still running and were
    given ``on_busy`` (saves that came due before the previous one finished).

    The thread is started by the first :meth:`submit` and kept, waiting for the next job, until
    :meth:`close`: a save hands its job over with a queue put.  A thread started per save cost the caller
    more than anything else jaxdist adds to a save's blocked time (``Thread.start`` waits until the new thread
    runs, and orbax's own background thread holds the GIL then; benchmarks/README.md).
    """

    def __init__(self, what: str):
        self.what = what
        self.busy_waits = 0
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        """Whether a job is still running (or waiting to start)."""
        return not self._idle.is_set()

    def submit(self, fn: Callable[..., Any], *args: Any, name: str = "jaxdist-writer") -> None:
        """Wait for the previous job (re-raising its failure), then run ``fn(*args)`` on the writer thread,
        named ``name`` while it runs."""
        self.wait()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self._thread.start()
        self._idle.clear()
        self._jobs.put((fn, args, name))

    def run(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in this thread now (a synchronous save), failing the way a background job does."""
        self.wait()
        self._run(fn, args)
        self._raise_error()

    def wait(self, on_busy: Callable[[], None] | None = None) -> float:
        """Block until the running job (if any) is done; seconds waited.

        ``on_busy`` is called (and ``busy_waits`` counted) before waiting when
        a job is still running.  Raises RuntimeError, chained to the job's
        exception, if the job failed.
        """
        t0 = time.perf_counter()
        if not self._idle.is_set():
            if on_busy is not None:
                self.busy_waits += 1
                on_busy()
            self._idle.wait()
        self._raise_error()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Wait for the running job (re-raising its failure), then end the thread; a later submit starts one."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread.join()
                self._thread = None

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, name = job
            threading.current_thread().name = name
            self._run(fn, args)
            self._idle.set()

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as e:  # kept for the caller's thread: the next submit or wait raises it
            self._error = e

    def _raise_error(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"{self.what} failed: {e}") from e

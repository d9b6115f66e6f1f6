"""One background writer thread, shared by both checkpoint tiers (persistent and node-local).

A save copies the arrays to the host in the caller's thread and hands the slow
part (files, checksums, commit marker) to :class:`BackgroundWriter`, which runs
one job at a time.  The next save waits for the running job instead of queuing
behind it; an exception raised by a job is kept and re-raised in the caller's
thread by the next :meth:`~BackgroundWriter.submit` or
:meth:`~BackgroundWriter.wait`, so a failed save is never silently lost.
"""

from __future__ import annotations

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
    """

    def __init__(self, what: str):
        self.what = what
        self.busy_waits = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def running(self) -> bool:
        """Whether a job is still running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, fn: Callable[..., Any], *args: Any, name: str = "jaxdist-writer") -> None:
        """Wait for the previous job (re-raising its failure), then start ``fn(*args)`` on thread ``name``."""
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(fn, args), name=name, daemon=True)
        self._thread.start()

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
        if self._thread is not None:
            if self._thread.is_alive() and on_busy is not None:
                self.busy_waits += 1
                on_busy()
            self._thread.join()
            self._thread = None
        self._raise_error()
        return time.perf_counter() - t0

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as e:  # kept for the caller's thread: the next submit or wait raises it
            self._error = e

    def _raise_error(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"{self.what} failed: {e}") from e

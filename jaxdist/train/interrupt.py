"""Ctrl-C in the training loop takes effect between steps.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when
SIGINT arrives: inside orbax starting a background save, inside JAX's dispatch,
inside a thread's start.  Code there that was not written for it can be left
half-done (orbax's async save waiting forever for a thread it was starting) or
can swallow the exception, and then the run neither stops nor resumes cleanly.
:func:`between_steps` replaces Python's handler while the loop runs: the first
Ctrl-C is noted, said in one line, and raised by the loop at the next step
boundary, where nothing is half-done; a second Ctrl-C raises at once (Python's
own handler is back by then).  A handler the user installed, or SIGINT ignored,
is left as it is, as is every thread but the main one (only it can set a
handler).  ``Trainer.close`` uses it too: a Ctrl-C while it waits for the last
checkpoint lets that save commit first.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def between_steps(doing: str = "stopping after this step") -> Iterator[Callable[[], None]]:
    """Yield ``check()``: it raises ``KeyboardInterrupt`` once Ctrl-C was pressed; call it between steps (or
    after the work the block must not leave half done).  ``doing``: what the one line says happens first."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield lambda: None
        return
    pressed = threading.Event()

    def note(signum, frame) -> None:
        pressed.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C: at once
        print(f"jaxdist: Ctrl-C: {doing} (press it again to stop now).", file=sys.stderr, flush=True)

    def check() -> None:
        if pressed.is_set():
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield check
    finally:
        if signal.getsignal(signal.SIGINT) is note:
            signal.signal(signal.SIGINT, signal.default_int_handler)

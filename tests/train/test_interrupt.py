"""Ctrl-C during fit stops the loop between steps, never inside what a step does (a save, a callback).

A suite run caught ``jaxdist train`` ignoring Ctrl-C and training on: SIGINT landed while orbax was starting
the thread of an asynchronous save (the main thread in ``Thread.start``), and the run neither stopped nor
resumed cleanly.  These tests send SIGINT from inside a step, at a point the old code was interrupted at
(in a callback before the step's save), so they fail there: its KeyboardInterrupt left the step's save
undone.
"""

from __future__ import annotations

import gc
import os
import signal

import pytest

from jaxdist.checkpoint import RunCheckpointer
from jaxdist.train.interrupt import between_steps
from jaxdist.train.trainer import Trainer

from .test_resume import small_config


@pytest.fixture(autouse=True)
def python_handles_ctrl_c():
    """Python's own SIGINT handler, as in a terminal: a suite started in the background by a shell without job
    control runs with SIGINT ignored, and jaxdist leaves an ignored SIGINT alone."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_the_first_ctrl_c_is_raised_at_the_check_and_a_second_at_once():
    with between_steps() as check:
        os.kill(os.getpid(), signal.SIGINT)  # noted, not raised here
        with pytest.raises(KeyboardInterrupt):
            check()
        # A handler that runs inside a garbage-collection callback (JAX registers one) has its KeyboardInterrupt
        # swallowed there as unraisable: no collection may start while the second signal waits to be handled.
        gc.disable()
        try:
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)  # the second: Python's own handler again
                for _ in range(10**6):  # the handler runs between bytecodes of this thread
                    pass
        finally:
            gc.enable()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_handler_the_user_installed_is_left_alone():
    seen = []
    old = signal.signal(signal.SIGINT, lambda *a: seen.append(1))
    try:
        with between_steps() as check:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10**5):
                pass
            check()  # nothing was noted: the user's handler had it
        assert seen == [1]
    finally:
        signal.signal(signal.SIGINT, old)


def test_ctrl_c_in_a_step_finishes_the_steps_save_and_stops_before_the_next(tmp_path):
    """SIGINT from a callback of step 10, before the save due at step 10 (checkpoint.every=5): fit raises
    KeyboardInterrupt after the step, with step 10 committed and step 11 never trained."""
    cfg = small_config(tmp_path, "ctrl-c", 20)
    with pytest.raises(KeyboardInterrupt):
        with Trainer(cfg) as t:
            t.add_hook(lambda tr, step, m: step == 10 and os.kill(os.getpid(), signal.SIGINT), every=1)
            t.fit()
    assert int(t.state["step"]) == 10
    assert RunCheckpointer(tmp_path / "ctrl-c" / "checkpoints").all_steps() == [5, 10]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_while_close_waits_for_the_last_save_lets_it_commit_then_stops(tmp_path):
    """SIGINT as Trainer.close starts waiting for the save of the last step (6, checkpoint.every=3, written in the
    background): the save commits, then KeyboardInterrupt; the run's lock is given back.  Raised at once, as the old
    close let it be, it left step 6 uncommitted (checkpoints [3])."""
    cfg = small_config(tmp_path, "ctrl-c-close", 6, ["checkpoint.every=3"])
    t = Trainer(cfg)
    t.fit()
    wait = t.checkpointer.close

    def interrupted_close():
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10**5):  # the handler runs between bytecodes of this thread
            pass
        wait()

    t.checkpointer.close = interrupted_close
    with pytest.raises(KeyboardInterrupt):
        t.close()
    assert RunCheckpointer(tmp_path / "ctrl-c-close" / "checkpoints").all_steps() == [3, 6]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    Trainer(small_config(tmp_path, "ctrl-c-close", 6, ["checkpoint.every=3"])).close()  # the lock was given back

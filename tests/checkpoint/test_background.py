"""The checkpoint writer thread (jaxdist/checkpoint/background.py): one kept thread, failures on the caller's."""

from __future__ import annotations

import threading

import pytest

from jaxdist.checkpoint.background import BackgroundWriter


def test_saves_hand_their_jobs_to_one_kept_thread_and_close_ends_it(monkeypatch):
    """A thread is started once, not per save: ``Thread.start`` waits until the new thread runs, which was most
    of what jaxdist added to a save's blocked time while orbax's own thread held the GIL (benchmarks/README.md)."""
    started, w = [], BackgroundWriter("a test save")
    real_start = threading.Thread.start

    def start(thread):  # the writer's own threads only: another library's may start beside them
        if getattr(thread, "_target", None) == w._loop:
            started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    ran = []
    for step in range(5):
        w.submit(
            lambda s=step: ran.append((s, threading.get_ident(), threading.current_thread().name)), name=f"job-{step}"
        )
    w.wait()
    assert [s for s, _, _ in ran] == list(range(5))
    assert len({ident for _, ident, _ in ran}) == 1 and threading.get_ident() not in {i for _, i, _ in ran}
    assert [n for _, _, n in ran] == [f"job-{s}" for s in range(5)]  # each job runs under its own name
    assert started == ["job-0"]
    thread = w._thread
    w.close()
    assert not thread.is_alive() and w._thread is None
    w.submit(lambda: ran.append("after close"))  # a later save starts a thread again
    w.close()
    assert ran[-1] == "after close" and started == ["job-0", "jaxdist-writer"]


def test_a_failed_job_is_raised_on_the_callers_thread_and_the_writer_goes_on():
    w = BackgroundWriter("a checkpoint save in /x")

    def fail():
        raise OSError("disk full")

    w.submit(fail)
    with pytest.raises(RuntimeError, match=r"^a checkpoint save in /x failed: disk full$") as e:
        w.wait()
    assert isinstance(e.value.__cause__, OSError)
    w.wait()  # reported once
    w.submit(fail)
    with pytest.raises(RuntimeError, match="disk full"):  # the next submit reports it before it starts its job
        w.submit(lambda: None)
    ran = []
    w.submit(lambda: ran.append(1))
    w.submit(fail)
    with pytest.raises(RuntimeError, match="disk full"):  # close reports it too, and still ends the thread
        w.close()
    assert ran == [1] and w._thread is None


def test_a_wait_that_finds_a_job_running_is_counted_and_told():
    w, gate, told = BackgroundWriter("a test save"), threading.Event(), []
    w.submit(gate.wait, 30)
    assert w.running
    threading.Timer(0.2, gate.set).start()
    w.wait(on_busy=lambda: told.append(w.running))
    assert told == [True] and w.busy_waits == 1 and not w.running
    w.wait(on_busy=lambda: told.append("idle"))  # nothing running: not told, not counted
    assert told == [True] and w.busy_waits == 1
    w.run(lambda: told.append("sync"))  # a synchronous save runs in the caller's thread
    assert told[-1] == "sync"
    w.close()

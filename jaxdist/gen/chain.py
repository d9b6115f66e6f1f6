"""A chain's tasks: stage 0's from the sample set, stage k+1's from the outputs stage k's tasks returned.

Stage ``k`` (``gen.stages[k]``) runs tasks of ``streams[k]`` samples. A task
of an intermediate stage returns its outputs (a list of strings: fewer than
its samples for a filter) to the dispatcher, which records them with the
task's outcome in ``<state_dir>/tasks.s<k>.jsonl`` (stage 0:
``tasks.jsonl``). Stage k+1's tasks are cut from those outputs **in task
order** (the outputs of stage k's tasks 0, 1, 2, ... as far as all are
finished), ``streams[k+1]`` at a time, the rest once stage k can produce no
more; so the cut, and each task's key
``<job>:s<k+1>:<digest of its samples>:<size>:<index>``, is the same in every
run of the job, and a restarted job recognises what an earlier run finished.
Only the last stage delivers to the training run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxdist.gen.tasks import TaskBoard, make_tasks, sample_digest


class Chain:
    """The task boards of the stages, fed forward as tasks finish (:meth:`refresh`)."""

    def __init__(self, job: str, samples: list[str], streams: list[int], state: Path, lease_s: float):
        self.job, self.streams = job, list(streams)
        n = len(streams)
        self.boards = [TaskBoard(make_tasks(job, samples, streams[0]), state / "tasks.jsonl", lease_s)]
        self.boards += [TaskBoard([], state / f"tasks.s{k}.jsonl", lease_s) for k in range(1, n)]
        self.fed = [0] * n  # stage k's tasks (a finished prefix) whose outputs went forward
        self.buffer: list[list[str]] = [[] for _ in range(n)]  # outputs of stage k not yet in a stage k+1 task
        self.closed = [False] * n  # stage k has all its tasks and they are finished
        self.refresh()

    def refresh(self) -> None:
        """Cut the next stages' tasks from the outputs finished since the last call."""
        for k, board in enumerate(self.boards):
            upstream_closed = k == 0 or (self.closed[k - 1] and not self.buffer[k - 1])
            if k + 1 < len(self.boards):
                while self.fed[k] < len(board.tasks) and self.fed[k] in board.finished:
                    self.buffer[k] += list(board.finished[self.fed[k]].get("outputs") or [])
                    self.fed[k] += 1
            self.closed[k] = upstream_closed and board.done
            if k + 1 < len(self.boards):
                size, nxt = self.streams[k + 1], self.boards[k + 1]
                while len(self.buffer[k]) >= size or (self.closed[k] and self.buffer[k]):
                    part, self.buffer[k] = self.buffer[k][:size], self.buffer[k][size:]
                    nxt.add(part, f"{self.job}:s{k + 1}:{sample_digest(part)}:{size}:{len(nxt.tasks)}")

    @property
    def done(self) -> bool:
        """Every stage has finished every task it will have."""
        return self.closed[-1]

    def pending(self) -> list[int]:
        """Pending tasks per stage (leases expired first)."""
        for b in self.boards:
            b.expire()
        return [len(b.pending) for b in self.boards]

    def running_compute(self, compute_per_stream: list[float]) -> float:
        """The compute of the tasks running now (budget units): samples x the stage's compute per stream."""
        return sum(
            len(b.tasks[i].samples) * compute_per_stream[k] for k, b in enumerate(self.boards) for i in b.running
        )

    def counts(self) -> dict[str, Any]:
        """The task counts summed over the stages, and per stage under ``stages``."""
        per = [b.counts() for b in self.boards]
        total = {key: sum(c[key] for c in per) for key in per[0]}
        return {**total, "stages": per}

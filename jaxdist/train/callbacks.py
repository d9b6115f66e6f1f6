"""The training loop's periodic actions: one protocol, the metrics window, and the built-in callbacks.

``Trainer.fit`` is: next batch, step, run what is due.  Everything periodic --
logging metrics, the progress bar, evaluation, checkpoints of both tiers, user
hooks, the controller agent's heartbeat -- is a :class:`Callback` that owns its
interval::

    class Callback(Protocol):
        syncs: bool                                 # needs the device finished and the metrics on the host
        def due(self, step: int, last: bool) -> bool
        def __call__(self, ctx: StepContext) -> None

Before the callbacks of a step run, the loop flushes the metrics window if any
of them ``syncs``; a callback that does not sync (the progress bar, the
heartbeat) costs no device-to-host transfer, so attaching one that runs every
step does not slow the step down.

Timing is honest: a window of steps ends when its last step has *finished on
the device* (the host waits for the window's metrics first, then reads the
clock), and the next window starts when the callbacks that ran after that wait
(evaluation, checkpoints, hooks) are done.  So the logged ``step_time`` of a
run adds up to its training wall time minus the evaluation and checkpoint
time, which their own records carry (``eval.seconds``, ``checkpoint.blocked_s``).

Non-finite steps are found at the same syncs, not at every step: the jitted
step applies no update when its loss or gradient norm is not finite (only the
step count advances), and a flush that finds such a step logs it as skipped or,
past ``train.skip_nonfinite``, raises :class:`NonFiniteStep`.  Every save
syncs first, so no checkpoint ever holds a state from after a non-finite
step that was not allowed: the newest checkpoint is the last good one.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jax

from jaxdist import optional
from jaxdist.errors import ConfigError
from jaxdist.train.efficiency import LoopClock

log = logging.getLogger(__name__)


class Callback(Protocol):
    """A periodic action of the training loop (see the module docstring)."""

    syncs: bool

    def due(self, step: int, last: bool) -> bool:
        """Whether to run after step ``step`` (1-based count of steps done); ``last``: the final step of fit."""

    def __call__(self, ctx: StepContext) -> None:
        """Do the action; ``ctx`` gives the trainer, the step and the metrics."""


class NonFiniteStep(ConfigError):
    """A step had a non-finite loss or gradient norm, and more than ``train.skip_nonfinite`` did."""

    def __init__(self, step: int, loss: float, grad_norm: float, allowed: int, newest_checkpoint: int | None = None):
        where = (
            "no checkpoint was saved"
            if newest_checkpoint is None
            else f"the newest checkpoint is step {newest_checkpoint}"
        )
        super().__init__(
            f"step {step} has loss {loss} and gradient norm {grad_norm}, a non-finite step beyond the "
            f"train.skip_nonfinite={allowed} allowed: training stopped and saved no state from after it ({where}); "
            "lower train.learning_rate or check the data, or raise train.skip_nonfinite to skip such steps."
        )
        self.step, self.loss, self.grad_norm, self.allowed = step, loss, grad_norm, allowed


class MetricsWindow:
    """The steps dispatched since the last flush, their device metrics, and the clock of the window.

    ``flush()`` waits for the window's metrics (so for its last step to finish),
    then reads the clock: each step of the window is logged with the window's
    mean ``step_time`` (seconds), ``tokens_per_s``, ``mfu`` (model FLOPs from
    :mod:`jaxdist.models.arithmetic` over peak) and ``hfu`` (the compiled
    program's FLOPs, recomputation included, over peak), and ``window`` (its
    length in steps).

    A step whose ``loss`` or ``grad_norm`` is not finite (the jitted step did
    not apply its update) is logged with ``skipped: true`` and appended to
    ``skipped``; the flush that finds more than ``skip_nonfinite`` of them
    raises :class:`NonFiniteStep` after writing the window's records.
    """

    def __init__(
        self,
        writer: Any,
        tokens_per_step: int,
        model_flops_per_step: float | None,
        hardware_flops_per_step: float | None,
        peak_flops: float,
        skip_nonfinite: int = 0,
        skipped: list[int] | None = None,
        clock: LoopClock | None = None,
    ):
        self.writer = writer
        self.tokens_per_step = tokens_per_step
        self.model_flops_per_step = model_flops_per_step
        self.hardware_flops_per_step = hardware_flops_per_step
        self.peak_flops = peak_flops
        self.skip_nonfinite = skip_nonfinite
        self.skipped = [] if skipped is None else skipped  # non-finite steps skipped so far (shared across fits)
        self.pending: list[tuple[int, dict, tuple[str, int] | None]] = []  # (step, device metrics, batch)
        self.latest: dict[str, float] | None = None  # the newest record on the host
        self.flushed: list[dict[str, float]] = []  # records of the flush at the current step
        self.history: list[dict[str, float]] = []
        self.clock = LoopClock() if clock is None else clock  # where the host's time goes (efficiency records)
        self.t0 = time.perf_counter()

    def restart(self) -> None:
        """Start the next window now (after evaluation, checkpoints and hooks: not step time)."""
        assert not self.pending, "restart only an empty window"
        self.t0 = time.perf_counter()

    def add(self, step: int, metrics: dict, batch: tuple[str, int] | None = None) -> None:
        """Step ``step`` was dispatched; ``batch``: (batch id, batch-list version) it trained."""
        self.pending.append((step, metrics, batch))

    def completed_step(self) -> int | None:
        """The newest step known finished on the device, without waiting (None before any)."""
        for step, m, _ in reversed(self.pending):
            if all(v.is_ready() for v in jax.tree.leaves(m)):
                return step
        return None if self.latest is None else int(self.latest["step"])

    def flush(self) -> list[dict[str, float]]:
        """Wait for the window's steps, write their records, start a new window; returns the records."""
        if not self.pending:
            return []
        host = jax.device_get([m for _, m, _ in self.pending])  # waits for the last step of the window
        now = time.perf_counter()
        n = len(self.pending)
        self.clock.add_window(n, now - self.t0)
        dt = (now - self.t0) / n
        records = []
        for (step, _, batch), m in zip(self.pending, host):
            digest = m.get("batch_digest")  # an integer id of the tokens, logged beside the batch id
            r = {k: float(v) for k, v in m.items() if k != "batch_digest"}
            r.update(
                step_time=dt,
                window=n,
                tokens_per_s=self.tokens_per_step / dt,
            )
            if self.model_flops_per_step is not None:  # None: a user's model that gave no FLOP count
                r["mfu"] = self.model_flops_per_step / dt / self.peak_flops
            if self.hardware_flops_per_step is not None:
                r["hfu"] = self.hardware_flops_per_step / dt / self.peak_flops
            if "targets" in r:  # data.packing=documents: the predictions the loss counted, apart from computed ones
                r["target_tokens_per_s"] = r["targets"] / dt
                r["target_share"] = r["targets"] / self.tokens_per_step
            finite = math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
            # The log names the batch each step trained (hooks and history keep floats only).
            logged = r if batch is None else {**r, "batch_id": batch[0], "batch_version": batch[1]}
            if digest is not None:
                logged = {**logged, "batch_digest": int(digest)}
            self.writer.write("train", step, logged if finite else {**logged, "skipped": True})
            records.append({"step": step, **r})
        self.pending = []
        self.t0 = now
        self.latest = records[-1]
        self.flushed = records
        self.history.extend(records)
        for r in records:
            if math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]):
                continue
            if len(self.skipped) >= self.skip_nonfinite:
                raise NonFiniteStep(int(r["step"]), r["loss"], r["grad_norm"], self.skip_nonfinite)
            self.skipped.append(int(r["step"]))
            log.warning(
                "step %d has loss %s and gradient norm %s: skipped, its update not applied (%d of "
                "train.skip_nonfinite=%d)",
                r["step"],
                r["loss"],
                r["grad_norm"],
                len(self.skipped),
                self.skip_nonfinite,
            )
        return records


@dataclass
class StepContext:
    """What a callback sees after a step: the trainer, the step count, and the metrics window."""

    trainer: Any
    step: int  # steps done, counting from 0 at the start of the run
    start: int  # the step fit() started from
    end: int  # the step fit() stops at
    window: MetricsWindow

    @property
    def last(self) -> bool:
        return self.step == self.end

    def metrics(self) -> dict[str, float]:
        """This step's record as floats (with "step"); waits for the device if it is not flushed yet."""
        self.window.flush()
        return self.window.latest

    def latest(self) -> dict[str, float] | None:
        """The newest record already on the host (maybe of an earlier step), without waiting."""
        return self.window.latest

    def completed_step(self) -> int | None:
        """The newest step finished on the device, without waiting."""
        return self.window.completed_step()


def every(n: int, at_end: bool = False) -> Callable[[int, bool], bool]:
    """A ``due`` rule: every ``n``-th step (``n`` <= 0: never), and the last one too with ``at_end``."""
    return lambda step, last: (n > 0 and step % n == 0) or (at_end and last)


@dataclass
class LogMetrics:
    """Flush the metrics window every ``every`` steps and at the end (the flush itself is the loop's)."""

    every: int
    syncs: bool = True

    def due(self, step: int, last: bool) -> bool:
        return every(self.every, at_end=True)(step, last)

    def __call__(self, ctx: StepContext) -> None:
        pass  # the loop flushed the window before running a syncing callback


@dataclass
class ProgressBar:
    """A tqdm bar: advances every step, shows loss / tokens/s / step time when a window is flushed."""

    bar: Any  # a tqdm.auto.tqdm
    syncs: bool = False

    @classmethod
    def start(cls, total: int, initial: int, desc: str) -> ProgressBar | None:
        """A bar from step ``initial`` to ``total``, or None (one warning) where tqdm is not installed."""
        tqdm = optional.load("tqdm.auto", "no progress bar", "train.progress=false")
        if tqdm is None:
            return None
        return cls(tqdm.tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True))

    def due(self, step: int, last: bool) -> bool:
        return True

    def __call__(self, ctx: StepContext) -> None:
        self.bar.update(1)
        if ctx.window.flushed and ctx.window.flushed[-1]["step"] == ctx.step:
            last = ctx.window.flushed[-1]
            self.bar.set_postfix(
                loss=f"{last['loss']:.3f}",
                tok_s=f"{last['tokens_per_s']:.0f}",
                step_ms=f"{1e3 * last['step_time']:.0f}",
            )

    def close(self) -> None:
        self.bar.close()


Hook = Callable[[Any, int, dict[str, float]], None]


@dataclass
class HookCallback:
    """``fn(trainer, step, metrics)`` every ``every`` steps, metrics as host floats (a sync at those steps)."""

    fn: Hook
    every: int
    syncs: bool = True

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0

    def __call__(self, ctx: StepContext) -> None:
        self.fn(ctx.trainer, ctx.step, ctx.metrics())


@dataclass
class Evaluate:
    """Held-out loss every ``every`` steps (0: only at the end) and at the end; an ``eval`` record with seconds."""

    every: int
    syncs: bool = True
    part = "eval"  # where the loop clock books its time

    def due(self, step: int, last: bool) -> bool:
        return every(self.every, at_end=True)(step, last)

    def __call__(self, ctx: StepContext) -> None:
        t0 = time.perf_counter()
        loss = ctx.trainer.evaluate()
        ctx.trainer.last_eval = (ctx.step, loss)
        ctx.trainer.metrics.write("eval", ctx.step, {"loss": loss, "seconds": time.perf_counter() - t0})


@dataclass
class SaveCheckpoint:
    """A persistent checkpoint every ``every`` steps and at the end."""

    every: int
    syncs: bool = True
    part = "checkpoint"  # where the loop clock books its time

    def due(self, step: int, last: bool) -> bool:
        return every(self.every, at_end=True)(step, last)

    def __call__(self, ctx: StepContext) -> None:
        ctx.trainer.save(ctx.step)


@dataclass
class SaveLocal:
    """A save to the node-local tier every ``every`` steps, at persistent steps too.

    So the local tier is never older than the persistent one: a failure just after a persistent save still
    recovers from local disk (and runs no program the job has not compiled), not from shared storage.
    """

    every: int
    syncs: bool = True
    part = "checkpoint"  # where the loop clock books its time

    def due(self, step: int, last: bool) -> bool:
        return step % self.every == 0

    def __call__(self, ctx: StepContext) -> None:
        ctx.trainer.save_local(ctx.step)


@dataclass
class Profile:
    """A JAX profiler trace of steps ``first``..``last`` (``train.profile_steps``) under ``log_dir``.

    The trace starts once the step before ``first`` has finished on the device and stops once ``last`` has,
    so it holds exactly those steps' device work (and the host's dispatch of them).  Every process writes its
    own host's file (``plugins/profile/<time>/<host>.xplane.pb``: TensorBoard's profile plugin, Perfetto).
    """

    first: int
    last: int
    log_dir: Path
    syncs: bool = True
    tracing: bool = False

    @classmethod
    def open(cls, steps: tuple[int, ...], start: int, end: int, log_dir: Path) -> Profile | None:
        """The callback for this fit (None if no profiled step falls in ``start+1..end``); starts the trace now
        when the first profiled step is this fit's first."""
        if not steps or steps[1] <= start or steps[0] > end:
            return None
        profile = cls(max(steps[0], start + 1), min(steps[1], end), Path(log_dir))
        if profile.first == start + 1:
            profile.begin()
        return profile

    def begin(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        jax.profiler.start_trace(str(self.log_dir))
        self.tracing = True

    def due(self, step: int, last: bool) -> bool:
        return step == self.first - 1 or step == self.last

    def __call__(self, ctx: StepContext) -> None:
        if ctx.step == self.first - 1 and not self.tracing:
            self.begin()
        elif ctx.step == self.last:
            self.close()

    def close(self) -> None:
        """Stop the trace (the loop waited for the device first); also when fit ends early."""
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
            log.info("profile of steps %d..%d written under %s", self.first, self.last, self.log_dir)


def run_due(callbacks: list[Callback], ctx: StepContext) -> None:
    """Run the callbacks due after ``ctx.step``: flush the window first if one of them syncs.

    After syncing callbacks the next window starts when they are done, so their time is not step time.
    """
    due = [cb for cb in callbacks if cb.due(ctx.step, ctx.last)]
    if not due:
        return
    syncing = any(cb.syncs for cb in due)
    clock = ctx.window.clock
    if syncing:
        clock.enter("blocked")
        ctx.window.flush()
    for cb in due:
        clock.enter(getattr(cb, "part", "callbacks"))
        cb(ctx)
    clock.enter("callbacks")
    if syncing:
        ctx.window.restart()

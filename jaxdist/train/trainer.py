"""The Trainer: mesh, sharded model, data, jitted step, metrics, checkpoints, hooks.

    with Trainer(config) as trainer:
        trainer.add_hook(lambda t, step, m: print(step, m["loss"]), every=10)
        history = trainer.fit()

A Trainer resumes from the newest checkpoint in its run directory (unless
``checkpoint.resume=false``), so the same command continues a stopped run and
produces the parameters of an uninterrupted one.  With
``checkpoint.local_dir`` it also saves every ``checkpoint.local_every`` steps
to the fast node-local tier (jaxdist/checkpoint/local.py) and resumes from
there when that step is at least as new as the persistent one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np

from jaxdist.checkpoint import RunCheckpointer
from jaxdist.checkpoint.compat import layout_change
from jaxdist.checkpoint.local import AUTO as LOCAL_AUTO, run_tier
from jaxdist.config import Config, ConfigError
from jaxdist.data import RunBatchList, eval_sampler, format_id, global_batch_array, load_source
from jaxdist.data.documents import pack
from jaxdist.data.items import ItemSource
from jaxdist.data.loader import ItemSampler
from jaxdist.data.sources import check_vocab
from jaxdist.errors import expect
from jaxdist.hf.load import load_params
from jaxdist.models.arithmetic import param_count, train_flops_per_token
from jaxdist.parallel.consistency import check_same_collectives, coordination_store
from jaxdist.parallel.mesh import describe_mesh
from jaxdist.run_owner import (
    OWN_MODEL_FILE,
    RunLock,
    check_not_own_model,
    history_present,
    history_since,
    set_aside_history,
    under_job,
)
from jaxdist.train.callbacks import (
    Callback,
    Evaluate,
    Hook,
    HookCallback,
    LogMetrics,
    MetricsWindow,
    NonFiniteStep,
    Profile,
    ProgressBar,
    SaveCheckpoint,
    SaveLocal,
    StepContext,
    run_due,
)
from jaxdist.train.custom import param_count as user_param_count, user_model, vocab_size as user_vocab_size
from jaxdist.train.custom_plan import settle_user
from jaxdist.train.efficiency import LoopClock
from jaxdist.train.faults import fault_hooks
from jaxdist.train.interrupt import between_steps
from jaxdist.train.metrics import MetricsWriter
from jaxdist.train.optimizer import resumed_schedule_steps
from jaxdist.train.program import Program
from jaxdist.train.resolved import Resolved
from jaxdist.train.step import init_state
from jaxdist.train.tracking import open_tracker

log = logging.getLogger(__name__)


class Trainer(Program):
    """Runs one training job described by a :class:`~jaxdist.train.resolved.Resolved` (what
    :func:`jaxdist.resolve.resolve` returns) or a :class:`~jaxdist.config.Config` that leaves nothing to choose.

    ``devices`` (a Config's only) defaults to all of ``jax.devices()``; in a multi-process job
    these are the global devices and each process feeds only its own.

    ``model``, ``loss``, ``optimizer`` and ``flops_per_example`` train your own Flax NNX module instead of
    jaxdist's transformer (:mod:`jaxdist.train.custom`: ``model(rngs) -> nnx.Module``, ``loss(output, batch)
    -> scalar | (scalar, metrics)``, an optax ``GradientTransformation``); ``model`` and ``loss`` go together.
    ``data`` (and ``eval_data``): a random-access dataset of dicts of arrays to train on instead of the config's
    data, through the batch list (:mod:`jaxdist.data.items`; ``collate`` makes a batch's rows).  More datasets
    join it while it trains with :meth:`add_data`; resuming such a run, ``added_data`` lists them again.
    """

    def __init__(
        self,
        config: Config | Resolved,
        devices: list | None = None,
        *,
        model=None,
        loss=None,
        optimizer=None,
        flops_per_example: float | None = None,
        data=None,
        eval_data=None,
        collate=None,
        added_data=None,
    ):
        expect(
            config,
            (Config, Resolved),
            "Trainer's config",
            "a jaxdist Config (jaxdist.config.load_config(path, overrides)) or jaxdist.resolve.resolve's result",
        )
        expect(devices, (list, tuple, type(None)), "Trainer's devices", "a list of JAX devices or None (all)")
        # A Config built without resolve(): the same checks, here (a smaller mesh runs on the first devices).
        user = user_model(model, loss, optimizer, flops_per_example, data, eval_data, collate, added_data)
        super().__init__(settle_user(config, devices, user))
        self.is_main = jax.process_index() == 0
        self.run_dir = self.config.run_dir
        # One writer per run: process 0 holds the run's lock (a launched job's controller holds it for its workers).
        self._lock = RunLock(self.run_dir, "jaxdist train") if self.is_main and not under_job() else None
        if self._lock is not None:
            self._lock.acquire()
        try:
            self._build_run()
        except BaseException:
            self.close_lock()
            raise

    def _build_run(self) -> None:
        """Everything past the program, with the run's lock held: a fresh start's history set aside, data,
        checkpoints and metrics."""
        c = self.config
        if c.checkpoint.resume:  # the checkpoints must be of this model: jaxdist's transformer or the user's
            self._check_same_kind_of_model()
        self.set_aside: Path | None = None  # where checkpoint.resume=false moved the run's earlier history
        if self.is_main and not c.checkpoint.resume and not under_job():
            self.set_aside = set_aside_history(self.run_dir)
            if self.set_aside is not None:
                log.warning(
                    "checkpoint.resume=false: the run's earlier history (%s) is set aside in %s; this run starts "
                    "from step 0",
                    ", ".join(p.name for p in sorted(self.set_aside.iterdir())),
                    self.set_aside,
                )
        self._build_data()  # the source, the batch list at its cursor, the eval batches

        self.tokens_per_step = c.train.batch_size * c.train.seq_len
        if self.user is None:
            self.flops_per_step = train_flops_per_token(c.model, c.train.seq_len) * self.tokens_per_step
        else:  # the user's count, else none: MFU needs the model's own FLOPs (hfu comes from the compiled step)
            per_example = self.user.flops_per_example
            self.flops_per_step = None if per_example is None else per_example * c.train.batch_size
        self.peak_flops = self.cluster.peak_flops(c.model.dtype) * len(self.devices)  # FLOP/s of all devices

        self.callbacks: list[Callback] = []  # user hooks and callbacks, run after the metrics and the bar
        self.last_eval: tuple[int, float] | None = None  # (step, eval loss) of the latest evaluation in fit
        self.state: dict | None = None
        self.collectives_hash: str | None = None  # the step's collectives, checked equal in every process by fit
        self.resumed_from: tuple[str, int] | None = None  # ("local" | "persistent", step) once init_state restored
        self.skipped_steps: list[int] = []  # steps skipped for a non-finite loss or gradient norm (skip_nonfinite)
        self._build_checkpoints()  # the persistent tier and the node-local one
        if self.local is not None and not c.checkpoint.resume:  # a fresh start: no older run's local steps
            self.local.clear()
        tracker = open_tracker(c.train.tracker, self.run_dir, c.train.name, c.to_dict()) if self.is_main else None
        self.metrics = MetricsWriter(
            self.run_dir, enabled=self.is_main, tensorboard=c.train.tensorboard, tracker=tracker
        )
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(c.to_dict(), indent=2))
            if self.user is not None:  # commands that build jaxdist's transformer from config.json refuse this run
                (self.run_dir / OWN_MODEL_FILE).write_text(json.dumps(self.user.record(c), indent=2))

    @classmethod
    def for_compiling(
        cls, config: Config | Resolved, devices: list | None = None, *, model=None, loss=None, optimizer=None
    ) -> Program:
        """The compile-time half only (:class:`~jaxdist.train.program.Program`: mesh, model, optimizer and jitted
        programs; no data, run directory, checkpoints or metrics, nothing to close), as the Trainer builds it."""
        return Program(settle_user(config, devices, user_model(model, loss, optimizer, None)))

    def _build_data(self) -> None:
        """The data source, the run's batch list (exact order across restarts) and the eval sampler."""
        c = self.config
        user = self.user
        if user is not None and user.data is not None:  # a Python dataset: one batch-list window per item
            self.data = SimpleNamespace(name=user.data.name, train=user.data, eval=user.eval_data)
            self.packing = None
            self.batches = RunBatchList(
                self.run_dir,
                user.data,
                user.data.name,
                c.data.seed,
                c.train.batch_size,
                c.train.seq_len,
                is_main=self.is_main,
                process_count=jax.process_count(),
                added_items=user.added_data,
            )
            self.eval_sampler = None if user.eval_data is None else ItemSampler(user.eval_data, c.train.batch_size)
            if self.eval_sampler is None and c.train.eval_batches and self.is_main:
                log.info(
                    "no eval_data given: the run evaluates nothing (train.eval_batches=%d unused)", c.train.eval_batches
                )
            return
        self.data = load_source(c.data)
        # The ids the model can read: the config's vocabulary, or the length of a user model's dimension named vocab.
        vocab = c.model.vocab_size if self.user is None else user_vocab_size(self.abstract_params, self.param_names)
        for split, tokens in (("train", self.data.train), ("held-out", self.data.eval)):  # one pass over the ids
            if vocab is not None:
                check_vocab(tokens, vocab, f"the {split} split of {self.data.name}")
        # data.packing=documents: rows packed from whole documents (jaxdist.data.documents), train and eval alike
        self.packing = eval_packing = None
        if self.data.train_starts is not None:
            d = self.data
            self.packing = pack(d.train_starts, len(d.train), c.train.seq_len, d.train_targets)
            eval_packing = pack(d.eval_starts, len(d.eval), c.train.seq_len, d.eval_targets)
        # Training batches come in batch-list order (exact across restarts, resizes and additions).
        self.batches = RunBatchList(
            self.run_dir,
            self.data.train,
            self.data.name,
            c.data.seed,
            c.train.batch_size,
            c.train.seq_len,
            is_main=self.is_main,
            process_count=jax.process_count(),
            packing=self.packing,
        )
        self.eval_sampler = eval_sampler(self.data.eval, c.train.seq_len, c.train.batch_size, eval_packing)

    def _check_same_kind_of_model(self) -> None:
        """ConfigError (one sentence) when the run's checkpoints are of the other kind of model: a run of the
        user's own model resumed without ``model=``, or jaxdist's transformer's checkpoints resumed with one."""
        if self.user is None:
            check_not_own_model(
                self.run_dir,
                "a Trainer without model= (and jaxdist train without --entry)",
                "pass the same model, loss and optimizer (Trainer(config, model=...) or --entry), or use another "
                "train.name",
            )
        elif "checkpoints" in history_present(self.run_dir) and not (self.run_dir / OWN_MODEL_FILE).is_file():
            raise ConfigError(
                f"'{self.run_dir}' holds a run of jaxdist's transformer, not of your own model: use another "
                "train.name, or checkpoint.resume=false to set that history aside."
            )

    def _build_checkpoints(self) -> None:
        """The persistent checkpointer and the node-local tier (None when off)."""
        c = self.config
        self.checkpointer = (
            RunCheckpointer(self.run_dir / "checkpoints", c.checkpoint.keep, c.checkpoint.asynchronous)
            if c.checkpoint.enabled
            else None
        )
        ck = c.checkpoint  # not_before: a launched job that started over skips the earlier history's files
        where = ck.local_dir if ck.enabled else ""
        self.local = run_tier(where, ck.local_keep, self.run_dir, c.train.name, self.abstract_state, history_since())

    # ------------------------------------------------------------------ sharding

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    def init_state(self) -> dict:
        """Restore the newest checkpoint of the run if allowed and present, else initialise."""
        ck = self.checkpointer
        resume = ck is not None and self.config.checkpoint.resume
        if resume and self.local is not None:  # the local tier, if its step is at least as new
            latest = ck.latest_step()
            restored = self.local.restore(self.abstract_state(), newer_than=-1 if latest is None else latest - 1)
            if restored is not None:
                self.state, meta = restored
                self._check_resume(meta)
                self.resumed_from = ("local", int(meta["step"]))
                log.info("resumed from step %d in the local tier %s", int(meta["step"]), self.local.directory)
                return self.state
        if resume and ck.latest_step() is None and ck.damaged_steps():
            # A restore set them all aside: starting over here would silently drop the run.
            raise ConfigError(
                f"every checkpoint in {ck.directory} is damaged (set aside as <step>.damaged, steps "
                f"{', '.join(map(str, ck.damaged_steps()))}); set checkpoint.resume=false to start over."
            )
        if resume and ck.latest_step() is not None:
            step = ck.latest_step()
            change = layout_change(ck.directory / str(step), self.abstract_state())
            if change is not None:
                raise ConfigError(
                    f"cannot resume {ck.directory}/{step}: {change}; resume with the run's settings, or start a "
                    "new run (another train.name, or checkpoint.resume=false to set this history aside)."
                )
            try:  # the newest checkpoint whose checksums hold; damaged ones are skipped with a warning
                state, meta = ck.restore(self.abstract_state())
            except (ValueError, KeyError) as e:
                raise ConfigError(
                    f"the checkpoint at {ck.directory}/{step} does not match this model or optimizer ({e}); "
                    "use a new train.name or set checkpoint.resume=false."
                ) from None
            except FileNotFoundError:
                raise ConfigError(
                    f"every checkpoint in {ck.directory} is damaged (set aside as <step>.damaged); "
                    "set checkpoint.resume=false to start over."
                ) from None
            step = int(meta["step"])
            self._check_resume(meta)
            self.resumed_from = ("persistent", step)
            if self.local is not None:  # local steps past it were not usable and belong to an abandoned future
                self.local.discard_after(step)
            log.info("resumed from step %d in %s", step, ck.directory)
            self.state = state
        else:
            if self.local is not None:  # a run that starts over must never restore an older run's local steps
                self.local.clear()
            m = self.config.model
            if m.init_from:  # fine-tuning: the Hugging Face weights, read straight into their shards
                params = load_params(m.init_from, m, self.abstract_state()["params"])
                start = jax.jit(
                    lambda p: init_state(p, self.optimizer, self.config.train.seed), out_shardings=self.state_shardings
                )
                self.state = start(params)
            else:
                self.state = self._init_fn()
        return self.state

    def _check_resume(self, meta: dict) -> None:
        # The batch list checked the config when it opened; here: the checkpoint's version and cursor.
        self.batches.resume(meta.get("data", {}), int(meta["step"]))
        self._settle_schedule(meta)

    def _settle_schedule(self, meta: dict) -> None:
        """Continue the learning-rate schedule the checkpoint recorded (jaxdist.train.optimizer.resumed_schedule_steps).

        The optimizer state is the same for any length, so only the train step is rebuilt (compiled on first use).
        """
        steps, notice = resumed_schedule_steps(self.config.train, meta, self.schedule_steps)
        if notice and self.is_main:
            log.warning("%s", notice)
        if steps != self.schedule_steps:
            self.set_schedule_steps(steps)

    def _checkpoint_meta(self, step: int) -> dict:
        """What a checkpoint of ``step`` records beside the state: the data position, the schedule, the config."""
        return {
            "step": step,
            "data": self._data_meta(step),
            "schedule_steps": self.schedule_steps,
            "config": self.config.to_dict(),
        }

    def _data_meta(self, position: int) -> dict:
        return self.batches.checkpoint_meta(position)  # batch-list version + cursor

    # ------------------------------------------------------------------ loop

    def add_hook(self, fn: Hook, every: int = 1) -> None:
        """Call ``fn(trainer, step, metrics)`` after every ``every``-th step (metrics as host floats).

        The metrics are those of that step, so the loop waits for the device at
        those steps; a callback that needs no host values (see :meth:`add_callback`) does not.
        """
        if every <= 0:
            raise ValueError("hook interval must be positive")
        self.callbacks.append(HookCallback(fn, every))

    def add_data(self, dataset, *, name: str | None = None, seed: int | None = None) -> dict | None:
        """Add the random-access ``dataset`` (rows made by the Trainer's ``collate``) to a run on a Python dataset:
        at the next step boundary its items are shuffled (with ``seed``; default a random one, recorded) into the
        batches not yet trained, each trained once, as ``jaxdist data add`` does with files for a run on token data.

        Call it on every process of the job at the same step (a hook), and pass the added datasets again as
        ``added_data=[...]`` when the run resumes.  Returns process 0's request (``{"request", "seed", "sources",
        "batches"}``), None on the others.  ConfigError (one sentence) for a run on token data, items of another
        shape, fewer items than one batch, or items the run already has."""
        if self.user is None or self.user.data is None:
            raise ConfigError(
                "this run trains on the configured token data, not on a Python dataset's items: add files to it "
                "with jaxdist.data.add_data (jaxdist data add)."
            )
        return self.batches.add_items(ItemSource(dataset, self.user.data.collate, name), seed)

    def add_callback(self, callback: Callback) -> None:
        """Run ``callback`` in the loop when it is due (jaxdist.train.callbacks.Callback: ``syncs``, ``due``, call)."""
        self.callbacks.append(callback)

    def batch(self, step: int) -> jax.Array:
        """The global batch of training step ``step`` as one sharded array [B, T+1]."""
        return global_batch_array(self.batches.reader, step, self.batch_sharding)

    def evaluate(self, params: dict | None = None) -> float:
        """Mean held-out loss (nats/token) over ``train.eval_batches`` fixed batches."""
        if not self.config.train.eval_batches:
            raise ConfigError("train.eval_batches=0 leaves no held-out batches to evaluate: set it to 1 or more.")
        if self.eval_sampler is None:
            raise ConfigError("the Trainer was given data= without eval_data=: pass held-out items to evaluate.")
        params = self.state["params"] if params is None else params
        losses = []
        for i in range(self.config.train.eval_batches):
            losses.append(self._eval_step(params, global_batch_array(self.eval_sampler, i, self.batch_sharding)))
        return float(np.mean(jax.device_get(losses)))

    def fit(self, steps: int | None = None) -> list[dict[str, float]]:
        """Train until ``train.steps`` (or ``steps`` more); returns the train records written."""
        c = self.config
        if self.state is None:
            self.init_state()
        start = int(jax.device_get(self.state["step"]))
        end = c.train.steps if steps is None else min(c.train.steps, start + steps)
        if start >= end:
            return []
        # Where the host spends the loop's time (the controller agent's efficiency records and stuck-rank view).
        self.loop_clock = LoopClock(c.train.batch_size // jax.process_count(), start + 1)
        if jax.process_count() > 1 and self.collectives_hash is None:  # same collectives everywhere, or no start
            kv_set, kv_get = coordination_store()
            self.collectives_hash = check_same_collectives(
                self.compiled_train_step().as_text(), jax.process_index(), jax.process_count(), kv_set, kv_get
            )
        self.faults = fault_hooks(self.run_dir)  # None unless $JAXDIST_FAULT_HOOKS=1 (test-only)
        if self.faults is not None:
            self.loop_clock.hook = self.faults.on_phase
        window = MetricsWindow(
            self.metrics,
            self.tokens_per_step,
            self.flops_per_step,
            self.hardware_flops_per_step(),
            self.peak_flops,
            c.train.skip_nonfinite,
            self.skipped_steps,
            self.loop_clock,
        )
        bar = ProgressBar.start(c.train.steps, start, c.train.name) if c.train.progress and self.is_main else None
        saving = SaveCheckpoint(c.checkpoint.every) if self.checkpointer is not None else None
        callbacks = (
            [LogMetrics(c.train.log_every)]
            + ([bar] if bar else [])
            + self.callbacks
            # eval_batches=0, or a Python dataset without eval_data: no evaluation
            + ([Evaluate(c.train.eval_every)] if c.train.eval_batches and self.eval_sampler is not None else [])
            + ([SaveLocal(c.checkpoint.local_every)] if self.local is not None else [])  # before the persistent
            + ([saving] if saving else [])
        )
        # Several processes agree on additions where metrics sync the host anyway (every log_every steps).
        prefetch = self.batches.loader(
            start, self.batch_sharding, depth=2, poll_every=1 if jax.process_count() == 1 else c.train.log_every
        )
        profile = Profile.open(c.train.profile_steps, start, end, self.run_dir / "profile")
        if profile is not None:
            callbacks.insert(0, profile)  # stops before the step's saves and evaluation: only training traced
        window.restart()
        with between_steps() as ctrl_c:  # Ctrl-C stops the loop here, never inside a save or a dispatch
            try:
                for i in range(start, end):
                    ctrl_c()
                    # The processes' agreement on the batch list is a collective: waiting there for a slower peer
                    # is not this rank's own wait for data (that would hide which rank's input is slow).
                    self.loop_clock.enter("agree")
                    prefetch.agree(i)
                    self.loop_clock.enter("data")
                    batch_id, batch = prefetch.get(i)  # data added since the last step joins here
                    self.loop_clock.enter("dispatch")
                    self.state, m = self.train_step(self.state, batch)
                    self.loop_clock.enter("callbacks", i + 1)
                    window.add(i + 1, m, (format_id(batch_id), self.batches.version))
                    run_due(callbacks, StepContext(self, i + 1, start, end, window))
                ctrl_c()  # pressed during the last step: still a stop, not a finished command
            except NonFiniteStep as e:  # found at a sync; every save syncs first, so none holds a later state
                raise NonFiniteStep(e.step, e.loss, e.grad_norm, e.allowed, self._newest_checkpoint()) from None
            finally:
                if profile is not None:
                    profile.close()
                prefetch.close()
                if bar is not None:
                    bar.close()
                self.metrics.flush()
        return window.history

    def save(self, step: int | None = None) -> None:
        """Checkpoint the current state (asynchronously)."""
        step = int(jax.device_get(self.state["step"])) if step is None else step
        if self.local is not None and self.local.stats and self.local.stats[-1].step == step:
            self.local.wait()  # this step's local files land before its persistent commit: local is never older
        if self.checkpointer.save(step, self.state, self._checkpoint_meta(step)):
            s = self.checkpointer.stats[-1]  # seconds the loop was blocked by the save / by the previous one
            self.metrics.write("checkpoint", step, {"blocked_s": s.blocked_s, "waited_s": s.waited_s})

    def _newest_checkpoint(self) -> int | None:
        """The newest step saved to either tier (committed, or started by this process), or None."""
        steps = [s.step for tier in (self.checkpointer, self.local) if tier is not None for s in tier.stats]
        if self.checkpointer is not None and self.checkpointer.latest_step() is not None:
            steps.append(self.checkpointer.latest_step())
        return max(steps, default=None)

    def save_local(self, step: int) -> None:
        """Save the current state to the fast node-local tier (collective; files written in the background)."""
        self.local.save(step, self.state, self._checkpoint_meta(step))
        s = self.local.stats[-1]
        self.metrics.write(
            "checkpoint_local",
            step,
            {
                "blocked_s": s.blocked_s,
                "replicate_s": s.replicate_s,
                "payload_bytes": s.payload_bytes,
                "sent_bytes": s.sent_bytes,
            },
        )

    def close(self) -> None:
        """Wait for pending checkpoint writes, close files and give the run's lock back.

        A first Ctrl-C meanwhile lets the saves commit and is raised after (a second stops at once)."""
        with between_steps("finishing the checkpoint being written") as ctrl_c:
            try:
                if self.local is not None:
                    self.local.close()
                if self.checkpointer is not None:
                    self.checkpointer.close()
                    auto = self.local is not None and self.config.checkpoint.local_dir == LOCAL_AUTO
                    if auto and self.checkpointer.latest_step() == self.config.train.steps:  # temporary steps of a
                        self.local.clear(remove_dir=True)  # finished run: the last persistent checkpoint holds the end
                self.metrics.close()
            finally:
                self.close_lock()
            ctrl_c()

    def close_lock(self) -> None:
        """Give the run's lock back (another process may then write the run)."""
        if getattr(self, "_lock", None) is not None:
            self._lock.release()

    def describe(self) -> str:
        """One paragraph: mesh, model size, batch, where the run lives."""
        c = self.config
        if self.user is None:
            model = f"{c.model.preset} ({param_count(c.model) / 1e6:.2f}M params, {c.model.dtype})"
        else:
            model = f"yours ({user_param_count(self.abstract_params) / 1e6:.2f}M params)"
        return (
            f"mesh {describe_mesh(self.mesh)}; model {model}; "
            f"batch {c.train.batch_size}x{c.train.seq_len} tokens; data {self.data.name}{self.packing_note()}; "
            f"run {self.run_dir}"
        )

    def packing_note(self) -> str:
        """With data.packing=documents: its rows and packing efficiency (the share of real tokens), else ''."""
        p = self.packing
        if p is None:
            return ""
        return (
            f", packed by documents: {len(self.data.train_starts):,} documents in {p.rows:,} rows, "
            f"{p.efficiency:.1%} real tokens"
        )

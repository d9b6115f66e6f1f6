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

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxdist.checkpoint import RunCheckpointer
from jaxdist.checkpoint.local import LocalTier, resolve_dir
from jaxdist.config import Config, ConfigError
from jaxdist.config_checks import validate
from jaxdist.data import RunBatchList, eval_sampler, format_id, global_batch_array, load_source
from jaxdist.models import create_abstract, init_params
from jaxdist.parallel.mesh import build_mesh, describe_mesh, load_cluster
from jaxdist.parallel.moe import expert_layout, expert_parallelism
from jaxdist.parallel.rules import DEFAULT_RULES, activation_sharding, logical_to_spec
from jaxdist.remat.policy import remat_policy, resolve_remat_policy  # noqa: F401  (remat_policy: kept importable here)
from jaxdist.train.metrics import MetricsWriter
from jaxdist.train.optimizer import make_optimizer
from jaxdist.train.step import init_state, make_eval_step, make_train_step, model_flops_per_token

log = logging.getLogger(__name__)

Hook = Callable[["Trainer", int, dict[str, float]], None]


@dataclasses.dataclass
class _HookEntry:
    fn: Hook
    every: int


class Trainer:
    """Runs one training job described by a :class:`~jaxdist.config.Config`.

    ``devices`` defaults to all of ``jax.devices()``; in a multi-process job
    these are the global devices and each process feeds only its own.
    """

    def __init__(self, config: Config, devices: list | None = None):
        self.devices = list(devices if devices is not None else jax.devices())
        if config.mesh.auto:  # mesh=auto: jaxdist.planner picks mesh sizes, microbatches and remat here
            from jaxdist.planner.plan import resolve_auto
            config = resolve_auto(config, self.devices)
            log.info("planned mesh: %s", " ".join(f"{a}={n}" for a, n in config.mesh.sizes().items()))
        self.config = config
        validate(config, len(self.devices))
        c = config
        self.cluster = load_cluster(c.mesh.cluster)
        self.mesh = build_mesh(c.mesh, self.devices)
        self.rules = DEFAULT_RULES
        # MoE: expert weights live on the expert view of the devices (mesh.expert_tensor).
        self.expert_layout = expert_layout(self.mesh, c.mesh.expert_tensor, self.rules)
        self.is_main = jax.process_index() == 0
        self.run_dir = c.run_dir

        # train.remat -> policy; "auto" profiles the block on this mesh and plans within the memory budget.
        self.remat_policy, self.remat_plan = resolve_remat_policy(c, dict(self.mesh.shape), self.cluster)
        self.graphdef, abstract_params, names = create_abstract(c.model, c.train.seed, self.remat_policy)
        self.param_shardings = jax.tree.map(
            lambda n, a: self.expert_layout.sharding(n, a.shape, self.rules, self.mesh), names, abstract_params,
            is_leaf=lambda x: isinstance(x, tuple))
        self.optimizer, self.schedule = make_optimizer(c.train)
        self.state_shardings = self._state_shardings(abstract_params)
        self.batch_sharding = self.sharding(("batch", "seq"))
        self.replicated = NamedSharding(self.mesh, P())

        seed = c.train.seed
        self._init_fn = jax.jit(lambda: init_state(init_params(c.model, seed), self.optimizer, seed),
                                out_shardings=self.state_shardings)
        self._train_step = jax.jit(
            make_train_step(self.graphdef, self.optimizer, self.schedule, c.train.microbatches, c.train.grad_clip,
                            grads_fn=self._pipeline_grads_fn()),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, self.replicated), donate_argnums=(0,))
        self._eval_step = jax.jit(make_eval_step(self.graphdef),
                                  in_shardings=(self.state_shardings["params"], self.batch_sharding),
                                  out_shardings=self.replicated)

        self.data = load_source(c.data)
        # Training batches come in batch-list order (exact across restarts, resizes and additions).
        self.batches = RunBatchList(self.run_dir, self.data.train, self.data.name, c.data.seed, c.train.batch_size,
                                    c.train.seq_len, is_main=self.is_main, process_count=jax.process_count())
        self._batch_log: dict[int, tuple[str, int]] = {}  # step -> (batch id, batch-list version), until logged
        self.eval_sampler = eval_sampler(self.data.eval, c.train.seq_len, c.train.batch_size)

        self.tokens_per_step = c.train.batch_size * c.train.seq_len
        self.flops_per_step = model_flops_per_token(c.model, c.train.seq_len) * self.tokens_per_step
        peak = self.cluster.peak_flops_bf16 if c.model.dtype == "bfloat16" else self.cluster.peak_flops_fp32
        self.peak_flops = peak * len(self.devices)

        self.hooks: list[_HookEntry] = []
        self.last_eval: tuple[int, float] | None = None  # (step, eval loss) of the latest evaluation in fit
        self.state: dict | None = None
        self.resumed_from: tuple[str, int] | None = None  # ("local" | "persistent", step) once init_state restored
        self.checkpointer = (RunCheckpointer(self.run_dir / "checkpoints", c.checkpoint.keep,
                                             c.checkpoint.asynchronous) if c.checkpoint.enabled else None)
        self.local = None
        if c.checkpoint.enabled and c.checkpoint.local_dir:  # per run: a hash of the run directory keeps runs apart
            tag = hashlib.sha256(str(self.run_dir.absolute()).encode()).hexdigest()[:8]
            self.local = LocalTier(resolve_dir(c.checkpoint.local_dir, f"{c.train.name}-{tag}"), c.checkpoint.local_keep)
        self.metrics = MetricsWriter(self.run_dir, enabled=self.is_main, tensorboard=c.train.tensorboard)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.json").write_text(json.dumps(c.to_dict(), indent=2))

    # ------------------------------------------------------------------ sharding

    def sharding(self, logical: tuple[str | None, ...], shape: tuple[int, ...] | None = None) -> NamedSharding:
        """NamedSharding on this mesh for an array with these logical axis names."""
        return NamedSharding(self.mesh, logical_to_spec(logical, self.rules, self.mesh, shape))

    def _state_shardings(self, abstract_params: dict) -> dict:
        import optax

        abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
        opt_shardings = optax.tree_utils.tree_map_params(
            self.optimizer, lambda _, s: s, abstract_opt, self.param_shardings,
            transform_non_params=lambda _: NamedSharding(self.mesh, P()))
        rep = NamedSharding(self.mesh, P())
        return {"step": rep, "params": self.param_shardings, "opt_state": opt_shardings, "rng": rep}

    def _pipeline_grads_fn(self):
        """With mesh.pipeline > 1, the pipeline executor's (loss, metrics, grads); else None (the model's own)."""
        if self.config.mesh.pipeline == 1:
            return None
        from jaxdist.parallel.pipeline import pipeline_grads_fn

        return pipeline_grads_fn(self.config, self.mesh, self.rules)

    @contextlib.contextmanager
    def _tracing(self):
        # constrain() in the model reads the mesh and rules while jit traces.
        with activation_sharding(self.mesh, self.rules), expert_parallelism(self.expert_layout):
            yield

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ state

    def abstract_state(self) -> dict:
        """The train state's shapes, dtypes and target shardings (nothing allocated)."""
        shapes = jax.eval_shape(self._init_fn)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

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
        if resume and ck.latest_step() is not None:
            step = ck.latest_step()
            try:  # the newest checkpoint whose checksums hold; damaged ones are skipped with a warning
                state, meta = ck.restore(self.abstract_state())
            except (ValueError, KeyError) as e:
                raise ConfigError(
                    f"the checkpoint at {ck.directory}/{step} does not match this model or optimizer ({e}); "
                    "use a new train.name or set checkpoint.resume=false.") from None
            except FileNotFoundError:
                raise ConfigError(f"every checkpoint in {ck.directory} is damaged (set aside as <step>.damaged); "
                                  "set checkpoint.resume=false to start over.") from None
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
            with self._tracing():
                self.state = self._init_fn()
        return self.state

    def _check_resume(self, meta: dict) -> None:
        # The batch list checked the config when it opened; here: the checkpoint's version and cursor.
        self.batches.resume(meta.get("data", {}), int(meta["step"]))

    def _data_meta(self, position: int) -> dict:
        return self.batches.checkpoint_meta(position)  # batch-list version + cursor

    # ------------------------------------------------------------------ loop

    def add_hook(self, fn: Hook, every: int = 1) -> None:
        """Call ``fn(trainer, step, metrics)`` after every ``every``-th step (metrics as floats)."""
        if every <= 0:
            raise ValueError("hook interval must be positive")
        self.hooks.append(_HookEntry(fn, every))

    def train_step(self, state: dict, batch: jax.Array) -> tuple[dict, dict]:
        """One jitted optimizer step (donates ``state``)."""
        with self._tracing():
            return self._train_step(state, batch)

    def compile_train_step(self):
        """The train step compiled ahead of time for this run's shapes (``jax.stages.Compiled``).

        Its ``memory_analysis()`` and ``cost_analysis()`` give bytes and FLOPs per device.
        """
        batch = jax.ShapeDtypeStruct((self.config.train.batch_size, self.config.train.seq_len + 1),
                                     jax.numpy.int32, sharding=self.batch_sharding)
        with self._tracing():
            return self._train_step.lower(self.abstract_state(), batch).compile()

    def batch(self, step: int) -> jax.Array:
        """The global batch of training step ``step`` as one sharded array [B, T+1]."""
        return global_batch_array(self.batches.reader, step, self.batch_sharding)

    def evaluate(self, params: dict | None = None) -> float:
        """Mean held-out loss (nats/token) over ``train.eval_batches`` fixed batches."""
        params = self.state["params"] if params is None else params
        losses = []
        with self._tracing():
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
        history: list[dict[str, float]] = []
        if start >= end:
            return history
        bar = None
        if c.train.progress and self.is_main:
            from tqdm.auto import tqdm
            bar = tqdm(total=c.train.steps, initial=start, desc=c.train.name, unit="step", dynamic_ncols=True)
        # Several processes agree on additions where metrics sync the host anyway (every log_every steps).
        prefetch = self.batches.loader(start, self.batch_sharding, depth=2,
                                       poll_every=1 if jax.process_count() == 1 else c.train.log_every)
        pending: list[tuple[int, dict]] = []
        t_last = time.perf_counter()
        try:
            for i in range(start, end):
                batch_id, batch = prefetch.get(i)  # data added since the last step joins here
                self._batch_log[i + 1] = (format_id(batch_id), self.batches.version)
                self.state, m = self.train_step(self.state, batch)
                pending.append((i + 1, m))
                done = i + 1
                if bar is not None:
                    bar.update(1)
                hooks_now = [h for h in self.hooks if done % h.every == 0]
                saving = self.checkpointer is not None and done % c.checkpoint.every == 0
                local_due = self.local is not None and done % c.checkpoint.local_every == 0
                # Log before a save, so no checkpointed step is missing from the log after a kill.
                if done % c.train.log_every == 0 or done == end or hooks_now or saving or local_due:
                    records = self._flush(pending, time.perf_counter() - t_last)
                    history.extend(records)
                    t_last = time.perf_counter()
                    pending = []
                    last = records[-1]
                    if bar is not None:
                        bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}",
                                        step_ms=f"{1e3 * last['step_time']:.0f}")
                    for h in hooks_now:
                        h.fn(self, done, last)
                if c.train.eval_every and done % c.train.eval_every == 0 or done == end:
                    self.last_eval = (done, self.evaluate())
                    self.metrics.write("eval", done, {"loss": self.last_eval[1]})
                if self.checkpointer is not None and (done % c.checkpoint.every == 0 or done == end):
                    self.save(done)
                    t_last = time.perf_counter()
                elif local_due:
                    self.save_local(done)
                    t_last = time.perf_counter()
        finally:
            prefetch.close()
            if bar is not None:
                bar.close()
            self.metrics.flush()
        return history

    def _flush(self, pending: list[tuple[int, dict]], elapsed: float) -> list[dict[str, float]]:
        host = jax.device_get([m for _, m in pending])
        dt = elapsed / len(pending)
        records = []
        for (step, _), m in zip(pending, host):
            r = {k: float(v) for k, v in m.items()}
            r.update(step_time=dt, tokens_per_s=self.tokens_per_step / dt,
                     mfu=self.flops_per_step / dt / self.peak_flops)
            bid, version = self._batch_log.pop(step, (None, None))
            # The log names the batch each step trained (hooks and history keep floats only).
            self.metrics.write("train", step, r if bid is None else {**r, "batch_id": bid, "batch_version": version})
            records.append({"step": step, **r})
        return records

    def save(self, step: int | None = None) -> None:
        """Checkpoint the current state (asynchronously)."""
        step = int(jax.device_get(self.state["step"])) if step is None else step
        if self.checkpointer.save(step, self.state, {"step": step, "data": self._data_meta(step),
                                                     "config": self.config.to_dict()}):
            s = self.checkpointer.stats[-1]  # seconds the loop was blocked by the save / by the previous one
            self.metrics.write("checkpoint", step, {"blocked_s": s.blocked_s, "waited_s": s.waited_s})

    def save_local(self, step: int) -> None:
        """Save the current state to the fast node-local tier (collective; files written in the background)."""
        self.local.save(step, self.state, {"step": step, "data": self._data_meta(step),
                                           "config": self.config.to_dict()})
        s = self.local.stats[-1]
        self.metrics.write("checkpoint_local", step, {"blocked_s": s.blocked_s, "replicate_s": s.replicate_s,
                                                      "payload_bytes": s.payload_bytes, "sent_bytes": s.sent_bytes})

    def close(self) -> None:
        """Wait for pending checkpoint writes and close files."""
        if self.local is not None:
            self.local.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.metrics.close()

    def describe(self) -> str:
        """One paragraph: mesh, model size, batch, where the run lives."""
        c = self.config
        return (f"mesh {describe_mesh(self.mesh)}; model {c.model.preset} "
                f"({c.model.num_params() / 1e6:.2f}M params, {c.model.dtype}); "
                f"batch {c.train.batch_size}x{c.train.seq_len} tokens; data {self.data.name}; run {self.run_dir}")

"""Your own model, loss and optimizer in the Trainer: the meshes, checkpoints, batch list and controller of
jaxdist around a Flax NNX module defined outside it.

    def build(rngs):                      # any nnx.Module whose parameters carry logical axis names
        return MyNet(vocab, rngs=rngs)    # (nnx.with_partitioning / nnx.Param(..., sharding_names=...))

    def loss(output, batch):              # what the module returned for the batch, and the batch
        ce = optax.softmax_cross_entropy_with_integer_labels(output, batch[:, 1:])
        return ce.mean(), {"accuracy": (output.argmax(-1) == batch[:, 1:]).mean()}

    with Trainer(config, model=build, loss=loss, optimizer=optax.adamw(3e-4)) as t:
        t.fit()

The module is called on the whole batch (``module(batch)``: with the built-in sources a token array
[B, T+1]; it reads what it needs) and ``loss(output, batch)`` returns the scalar to minimise, or
``(scalar, metrics)`` with scalar metrics.  The scalar is a mean; when the batch's items count differently
(tokens that are padding, for example), ``metrics["weight"]`` says how many it is a mean over, and the
microbatches of a step are combined weighted by it, so the step's loss is the mean over the whole batch.
Over the data axes nothing is needed: the step is one program over the global batch and XLA places the
collectives (``train.grad_sync=end``).

Where the parameters go: each dimension's logical name maps to mesh axes by the same rules as the built-in
model (:data:`jaxdist.parallel.rules.DEFAULT_RULES`: ``embed`` over fsdp; ``mlp``, ``heads``, ``vocab``
over tensor; ...), so a mesh axis with no name mapped to it splits nothing and is refused.  Where an
activation lives is said the same way, ``jaxdist.models.hooks.constrain(x, ("batch", "seq", "embed"))``
(without it XLA guesses, and may gather a whole activation on every device).

Recomputation: the module marks each block with ``jaxdist.models.hooks.remat_block`` (``x =
remat_block(block)(x)``), and ``train.remat`` applies to every marked block (``jax.checkpoint`` with its
policy); ``save:NAME`` keeps the activations tagged ``jax.ad_checkpoint.checkpoint_name(x, NAME)``, checked
against the tags the forward pass has.  Run the blocks with a scan (``nnx.scan`` over blocks stacked by
``nnx.vmap``): measured on XLA:CPU, a Python loop of checkpointed blocks does not lower the step's peak (the
compiler schedules the recomputation early), a scan does.  ``train.remat=auto`` compiles the candidates
(:mod:`jaxdist.train.custom_remat`).

Pipeline stages: a module that runs its stack of blocks with :func:`jaxdist.models.blocks.run_blocks` (``x =
run_blocks(self.blocks, x)``, each block marked for remat) can be split over ``mesh.pipeline`` stages with
``pipeline.schedule=gpipe`` (:mod:`jaxdist.parallel.pipeline_blocks`); ``train.microbatches`` are then the
pipeline's microbatches, and outside the stack the batch's rows are split over the stages too.

The optimizer is any ``optax.GradientTransformation`` (default: the AdamW of the ``[train]`` settings); its
state is checkpointed and resumed with the parameters.  ``train.grad_clip`` still clips the global norm
first.  A user's optimizer has no schedule jaxdist knows, so its steps log no ``lr``.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxdist.config import Config, ConfigError
from jaxdist.config.schema import validate, validate_devices
from jaxdist.data.items import ItemSource
from jaxdist.models import hooks
from jaxdist.parallel.pipeline_blocks import check_rows_over_stages, stack_length
from jaxdist.parallel.rules import DEFAULT_RULES, logical_to_spec


@dataclass(frozen=True)
class UserModel:
    """A model jaxdist did not define: ``build(rngs) -> nnx.Module``, ``loss(output, batch) -> scalar | (scalar,
    metrics)``, an optax ``optimizer`` (None: the ``[train]`` AdamW) and, for MFU, the training FLOPs of one
    example (forward and backward; None: MFU is not reported, the hardware FLOPs from the compiled step are)."""

    build: Callable[[nnx.Rngs], nnx.Module]
    loss: Callable[[Any, Any], Any]
    optimizer: optax.GradientTransformation | None = None
    flops_per_example: float | None = None
    data: ItemSource | None = None  # a Python dataset's items as training batches (None: the config's data)
    eval_data: ItemSource | None = None  # its held-out items (None: no evaluation)
    added_data: tuple[ItemSource, ...] = ()  # on resume: the datasets Trainer.add_data added to the run

    def record(self, config: Config) -> dict[str, Any]:
        """What the run directory's ``own_model.json`` says of this model: where its code is."""
        return {
            "build": f"{getattr(self.build, '__module__', '?')}:{getattr(self.build, '__qualname__', '?')}",
            "entry": config.train.entry or None,
        }

    def __post_init__(self):
        if not callable(self.build):
            raise ConfigError(
                f"model={self.build!r} is not callable: pass a function of nnx.Rngs that builds the module."
            )
        if not callable(self.loss):
            raise ConfigError(f"loss={self.loss!r} is not callable: pass a function (output, batch) -> scalar.")
        opt = self.optimizer
        if opt is not None and not (callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))):
            raise ConfigError(
                f"optimizer={type(opt).__name__} is not an optax.GradientTransformation: pass one (optax.adamw(...), "
                "optax.chain(...)) or None for the [train] AdamW."
            )


def user_model(
    model, loss, optimizer, flops_per_example, data=None, eval_data=None, collate=None, added_data=None
) -> UserModel | None:
    """The Trainer's keywords as a :class:`UserModel`, or None (jaxdist's own transformer) when none is given.
    ``data`` / ``eval_data``: random-access datasets (jaxdist.data.items), rows made by ``collate``;
    ``added_data``: a sequence of the datasets added to the run (resuming it)."""
    given = (optimizer, flops_per_example, data, eval_data, collate, added_data)
    if model is None and loss is None and all(x is None for x in given):
        return None
    if model is None or loss is None:
        raise ConfigError(
            "model= and loss= go together (your module and the loss of its output): pass both, or neither for "
            "jaxdist's own transformer."
        )
    if eval_data is not None and data is None:
        raise ConfigError("eval_data= goes with data= (a Python dataset to train on): pass both, or neither.")
    if added_data is not None and data is None:
        raise ConfigError("added_data= goes with data= (the Python dataset the run started on): pass both.")
    if added_data is not None and not isinstance(added_data, (list, tuple)):
        raise ConfigError(
            f"added_data={type(added_data).__name__} is not a list: pass the datasets added to the run as a list."
        )
    items = [None if d is None else ItemSource(d, collate, name) for d, name in ((data, None), (eval_data, "eval"))]
    added = tuple(ItemSource(d, collate) for d in added_data or ())
    return UserModel(model, loss, optimizer, flops_per_example, *items, added)


# ------------------------------------------------------------------ the module's parameters


def abstract_module(user: UserModel, seed: int):
    """(graphdef, abstract params as a pure dict of ShapeDtypeStruct, logical names per param); nothing allocated.

    ConfigError (one sentence) for a module that is not an nnx.Module, holds state other than nnx.Param (batch
    statistics, stored RNG streams: the step would differentiate them), or names none of its parameters."""
    with nnx.use_eager_sharding(False):
        module = nnx.eval_shape(lambda: user.build(nnx.Rngs(seed)))
    if not isinstance(module, nnx.Module):
        raise ConfigError(
            f"model(rngs) returned {type(module).__name__}, not a flax.nnx.Module: return the module it builds."
        )
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    others = sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=lambda v: isinstance(v, nnx.Variable))})
    if others:
        raise ConfigError(
            f"the model holds {', '.join(others)} variables besides its nnx.Param: jaxdist trains parameters only, "
            "so build it without them (no BatchNorm statistics, no Rngs kept in the module)."
        )
    names = jax.tree.map(
        lambda v: tuple(v.get_metadata().get("out_sharding") or ()),
        params,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )
    abstract = params.to_pure_dict()
    names = _pure(names)
    if not any(jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))):
        raise ConfigError(
            "the model's parameters carry no logical axis names, so no mesh axis can split them: name their "
            "dimensions (nnx.with_partitioning(init, ('embed', 'mlp')) or nnx.Param(..., sharding_names=...)) with "
            f"the names of jaxdist.parallel.rules.DEFAULT_RULES ({', '.join(n for n, _ in DEFAULT_RULES)})."
        )
    # A parameter without names (a bias left as nnx made it) is replicated: None for each of its dimensions.
    names = jax.tree.map(
        lambda n, a: n or (None,) * len(a.shape), names, abstract, is_leaf=lambda x: isinstance(x, tuple)
    )
    return graphdef, abstract, names


def _pure(state) -> dict:
    return {k: _pure(v) if hasattr(v, "items") else v for k, v in state.items()}


def init_params(user: UserModel, seed: int) -> dict:
    """Freshly initialised parameters as a pure dict of arrays (call under jit to shard them)."""
    with nnx.use_eager_sharding(False):
        module = user.build(nnx.Rngs(seed))
    return nnx.split(module, nnx.Param, ...)[1].to_pure_dict()


def vocab_size(abstract: dict, names: dict) -> int | None:
    """The length of a dimension the model names ``vocab`` (its embedding), or None: the tokens it can read."""
    found = [
        a.shape[n.index("vocab")]
        for n, a in zip(
            jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)), jax.tree.leaves(abstract), strict=True
        )
        if "vocab" in n and len(n) == len(a.shape)
    ]
    return min(found) if found else None


# ------------------------------------------------------------------ the mesh it can use


def check_user_config(cfg: Config, n_devices: int | None, names: dict | None = None, abstract: dict | None = None):
    """The config's checks that do not concern jaxdist's own transformer, and what a user's model cannot do
    (ConfigError, one sentence): a mesh axis none of its parameter names maps to, a pipeline schedule other than
    gpipe or with a context axis, and the settings that need the built-in model's blocks."""
    sizes = cfg.mesh.checked_sizes()
    stages = sizes["pipeline"]
    if stages > 1 and cfg.pipeline.schedule != "gpipe":  # before the sections' checks of the other schedules
        raise ConfigError(
            f"pipeline.schedule={cfg.pipeline.schedule} needs the loss inside the last stage, and your own model's "
            f"loss runs after its stack of blocks, on the whole batch: set pipeline.schedule=gpipe for "
            f"mesh.pipeline={stages}."
        )
    validate(cfg, own_model=True)  # the sections; jaxdist's transformer's own rules are not this model's
    if stages > 1 and sizes["context"] > 1:
        raise ConfigError(
            f"mesh.context={sizes['context']} does not run with pipeline stages yet (mesh.pipeline={stages}): set "
            "mesh.pipeline=1 or mesh.context=1."
        )
    fixed = (
        ("train.grad_sync", cfg.train.grad_sync, "end"),
        ("data.packing", cfg.data.packing, "stream"),
        ("model.init_from", cfg.model.init_from, ""),
    )
    for key, value, plain in fixed:
        if value != plain:
            raise ConfigError(
                f"{key}={value} works with jaxdist's own transformer only (its blocks, its document masks, its Hugging "
                f"Face layout): set {key}={plain or 'an empty string'} for your own model."
            )
    if names is not None and abstract is not None:
        _check_axes_split_something(sizes, names, abstract)
    if n_devices is not None:
        validate_devices(cfg, n_devices)


def _check_axes_split_something(sizes: dict[str, int], names: dict, abstract: dict) -> None:
    leaves = jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    shapes = [a.shape for a in jax.tree.leaves(abstract)]
    used: set[str] = set()
    for n, shape in zip(leaves, shapes, strict=True):
        if not any(n):
            continue
        if len(n) != len(shape):
            raise ConfigError(
                f"a parameter of shape {tuple(shape)} carries {len(n)} logical names {n}: give one name (or None) per "
                "dimension."
            )
        try:
            spec = logical_to_spec(n, DEFAULT_RULES)
        except ValueError as e:
            raise ConfigError(f"{e}: use the names of jaxdist.parallel.rules.DEFAULT_RULES.") from None
        for entry in spec:
            used.update((entry,) if isinstance(entry, str) else entry or ())
    if sizes["pipeline"] > 1 and "pipeline" not in used:
        raise ConfigError(
            f"mesh.pipeline={sizes['pipeline']} splits a stack of blocks whose parameters lead with the axis "
            "'layers', and your model has none: stack its blocks with nnx.vmap(..., transform_metadata="
            "{nnx.PARTITION_NAME: 'layers'}) and run them with jaxdist.models.blocks.run_blocks, or set "
            "mesh.pipeline=1."
        )
    for axis in ("fsdp", "tensor", "expert"):
        if sizes[axis] > 1 and axis not in used:
            takers = ", ".join(n for n, axes in DEFAULT_RULES if axis in axes and n != "batch")
            raise ConfigError(
                f"mesh.{axis}={sizes[axis]} splits no parameter of your model: none of its dimensions is named "
                f"{takers}; name one (nnx.with_partitioning) or set mesh.{axis}=1."
            )


# ------------------------------------------------------------------ the step


def _loss_parts(out: Any) -> tuple[jax.Array, dict]:
    value, metrics = (out[0], dict(out[1])) if isinstance(out, tuple) and len(out) == 2 else (out, {})
    value = jnp.asarray(value)
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.floating):
        raise ConfigError(
            f"loss(output, batch) returned {value.dtype.name}{list(value.shape)}, not a float scalar: reduce it "
            "(a mean over the batch) and return the scalar, or (scalar, {name: scalar metric})."
        )
    for k, v in metrics.items():
        if jnp.shape(v) != ():
            raise ConfigError(
                f"loss(output, batch)'s metric {k!r} has shape {list(jnp.shape(v))}: metrics are scalars (reduce it)."
            )
    return value.astype(jnp.float32), {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def objective(
    user: UserModel, graphdef, remat: Any = None, wrap: Callable | None = None, stacks: hooks.LayerScan | None = None
) -> Callable:
    """``fn(params, batch) -> (loss, metrics)``: the module's forward pass, each block it marks with
    :func:`jaxdist.models.hooks.remat_block` under ``remat`` (a jax.checkpoint policy, "full" or None; ``wrap``:
    another function of the block instead), its stacks of blocks (:func:`jaxdist.models.blocks.run_blocks`) run
    by ``stacks`` (None: a scan; with pipeline stages: jaxdist.parallel.pipeline_blocks), and the user's loss."""
    if wrap is not None:
        pass
    elif remat is None:
        wrap = None
    elif remat == "full":
        wrap = jax.checkpoint
    else:
        wrap = functools.partial(jax.checkpoint, policy=remat)

    def fn(params, batch):
        with hooks.rematerializing(wrap), hooks.scanning_layers(stacks):
            out = nnx.merge(graphdef, params)(batch)
        return _loss_parts(user.loss(out, batch))

    return fn


@dataclass(frozen=True)
class Traced:
    """What tracing the loss once shows of the model: the checkpoint names it tags, in order, and how many
    blocks it marks with :func:`jaxdist.models.hooks.remat_block`."""

    names: tuple[str, ...]
    blocks: int
    axes: tuple[str, ...] = ()  # the logical names its activations are constrained by (constrain), in order
    stacks: tuple[int, ...] = ()  # the blocks of each stack it runs with jaxdist.models.blocks.run_blocks


def check_loss(user: UserModel, graphdef, remat: Any, abstract_params: dict, batch: Any) -> Traced:
    """Trace the loss once on shapes (nothing runs): its refusals (:func:`_loss_parts`) come before a compile."""
    blocks = [0]
    axes: dict[str, None] = {}

    def count(f):
        blocks[0] += 1
        return f

    def seen(x, logical):
        axes.update(dict.fromkeys(a for a in logical if a))
        return x

    stacks: list[int] = []

    def stacked(body, x, state):
        stacks.append(stack_length(state))
        return jax.lax.scan(body, x, state)

    names = tuple(
        dict.fromkeys(_names_in(jax.make_jaxpr(objective(user, graphdef, remat))(abstract_params, batch).jaxpr))
    )
    with hooks.constraining(seen):
        jax.eval_shape(objective(user, graphdef, wrap=count, stacks=stacked), abstract_params, batch)
    return Traced(names, blocks[0], tuple(axes), tuple(stacks))


def check_pipeline(cfg: Config, traced: Traced, sizes: dict[str, int]) -> None:
    """ConfigError (one sentence) for pipeline stages (``sizes``: the mesh's axes) on a model that runs no stack
    of blocks through :func:`jaxdist.models.blocks.run_blocks` (the stages would hold its blocks and run none of
    them), a stack the stages do not divide, or a batch whose rows the data axes and the stages do not divide
    (outside its stack the model runs on every stage's rows)."""
    p = sizes.get("pipeline", 1)
    if p == 1:
        return
    check_rows_over_stages(cfg.train.batch_size, sizes, "your model's layers outside its stack")
    if not traced.stacks:
        raise ConfigError(
            f"mesh.pipeline={p} runs the stacks of blocks your model gives to jaxdist.models.blocks.run_blocks, and "
            "it gives none: call x = run_blocks(self.blocks, x) instead of its own loop or scan, or set "
            "mesh.pipeline=1."
        )
    for n in traced.stacks:
        if n % p:
            raise ConfigError(
                f"your model's stack of {n} blocks does not split into mesh.pipeline={p} stages: use a number of "
                f"stages that divides {n}."
            )


def check_context(cfg: Config, traced: Traced) -> None:
    """ConfigError (one sentence) for ``mesh.context > 1`` on a model that does not say its sequence axis: the
    context axis splits the activations constrained with ``"seq"`` (XLA then moves what the model's mixing of
    positions needs); without one it would split nothing."""
    n = cfg.mesh.checked_sizes()["context"]
    if n > 1 and "seq" not in traced.axes:
        raise ConfigError(
            f"mesh.context={n} splits the sequence axis your model names, and it names none: constrain its "
            "activations with jaxdist.models.hooks.constrain(x, ('batch', 'seq', 'embed')), or set mesh.context=1."
        )


def _names_in(jaxpr) -> list[str]:
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            out.append(eqn.params["name"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's, or a Jaxpr
                if hasattr(inner, "eqns"):
                    out += _names_in(inner)
    return out


def check_remat(remat: Any, traced: Traced) -> None:
    """ConfigError (one sentence) when ``train.remat`` cannot act on the model: a policy but no block marked to
    recompute, or ``save:`` naming a tag the model does not use (jax would save nothing for it, silently, which
    is full recomputation under another name)."""
    kind, names = getattr(remat, "kind", "none"), traced.names
    if kind not in ("none", "auto") and traced.blocks == 0:
        raise ConfigError(
            f"train.remat={remat} recomputes blocks, but your model marks none: wrap each block's call in "
            "jaxdist.models.hooks.remat_block (x = remat_block(self.block)(x)), or set train.remat=none."
        )
    if kind != "names":
        return
    unknown = [n for n in remat.names if n not in names]
    if unknown:
        tags = ", ".join(names) if names else "none (tag activations with jax.ad_checkpoint.checkpoint_name)"
        raise ConfigError(
            f"train.remat='{remat}' names {', '.join(repr(n) for n in unknown)}, which your model does not tag: "
            f"use save: with some of its tags, {tags}."
        )


def grads_fn(fn: Callable, microbatches: int) -> Callable:
    """``(params, batch) -> (loss, metrics, grads)`` over ``microbatches`` equal slices of the batch (rows k,
    k+m, ...: every device keeps working on rows it holds), combined weighted by ``metrics["weight"]`` where the
    loss gives one (the step's metrics then carry the batch's total weight), else equally."""
    vg = jax.value_and_grad(fn, has_aux=True)

    def one(params, batch):
        (loss, metrics), grads = vg(params, batch)
        return loss, metrics, grads

    if microbatches == 1:
        return one

    def run(params, batch):
        m = microbatches
        mb = jax.tree.map(lambda x: x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1), batch)

        def body(carry, b):
            loss_sum, metric_sum, grad_sum, weight_sum = carry
            loss, metrics, grads = one(params, b)
            w = jax.lax.stop_gradient(metrics.pop("weight", jnp.float32(1.0)))
            return (
                loss_sum + w * loss,
                jax.tree.map(lambda s, v: s + w * v, metric_sum, metrics),
                jax.tree.map(lambda s, g: s + w.astype(g.dtype) * g, grad_sum, grads),
                weight_sum + w,
            ), None

        first = jax.tree.map(lambda x: x[0], mb)
        shapes = jax.eval_shape(lambda p, b: fn(p, b)[1], params, first)
        metric_zeros = {k: jnp.zeros((), jnp.float32) for k in shapes if k != "weight"}
        zeros = (jnp.zeros((), jnp.float32), metric_zeros, jax.tree.map(jnp.zeros_like, params), jnp.float32(0))
        (loss_sum, metric_sum, grad_sum, weight), _ = jax.lax.scan(body, zeros, mb)
        metrics = {k: v / weight for k, v in metric_sum.items()}
        if "weight" in shapes:
            metrics["weight"] = weight
        return loss_sum / weight, metrics, jax.tree.map(lambda g: g / weight.astype(g.dtype), grad_sum)

    return run


def param_count(abstract: dict) -> int:
    """Parameters of the model (from its shapes)."""
    return sum(math.prod(a.shape) for a in jax.tree.leaves(abstract))


# ------------------------------------------------------------------ train.entry: the same from a worker

ENTRY_KEYS = ("model", "loss", "optimizer", "flops_per_example", "data", "eval_data", "collate", "added_data")


def entry_keywords(cfg: Config) -> dict[str, Any]:
    """The Trainer's keywords from ``train.entry`` (``module:function``, called with the config); {} when it is
    empty.  ConfigError (one sentence) for a module that cannot be imported, a function it lacks, or a result
    that is not a dict of the Trainer's keywords with model and loss."""
    if not cfg.train.entry:
        return {}
    module, _, name = cfg.train.entry.partition(":")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"train.entry={cfg.train.entry}: module {module!r} cannot be imported ({e}): put it on the workers' "
            "PYTHONPATH (or in the directory the job starts in) or fix the name."
        ) from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ConfigError(
            f"train.entry={cfg.train.entry}: {module} has no function {name!r}: name the function that returns "
            "your model and loss."
        )
    out = fn(cfg)
    if not isinstance(out, dict) or not {"model", "loss"} <= set(out) or set(out) - set(ENTRY_KEYS):
        got = sorted(out) if isinstance(out, dict) else type(out).__name__
        raise ConfigError(
            f"train.entry={cfg.train.entry} returned {got}: return a dict with model and loss, and any of "
            f"{', '.join(ENTRY_KEYS[2:])}."
        )
    return out

"""The program one pipeline stage runs (inside ``shard_map``): see :mod:`jaxdist.parallel.pipeline`.

:func:`run_stage` traces a ``lax.scan`` over the schedule's ticks.  Per tick a
stage receives the previous tick's messages (``ppermute``), runs one branch of a
``lax.switch`` (idle, forward of chunk c, backward of chunk c), and the last
stage runs the loss head, the first the embedding's backward.  The state that
travels through the ticks (the loop carry) holds the stash slots, receive
buffers, key/value stash and gradient accumulators; each block writes and reads
its own slice in place.  The embedding, the blocks, the output head and the
per-token loss are the model's own (jaxdist.models.transformer); only their
order over the ticks and the stages is decided here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from jaxdist.config import ModelConfig, Remat
from jaxdist.models.moe import (
    ROUTER_SUMS,
    group_member,
    losses_from_sums,
    moe_layer_count,
    moe_param_specs,
    split_group,
    sums_cotangent,
)
from jaxdist.models.packed import unpack
from jaxdist.models.transformer import (
    CHECKPOINT_NAMES,
    array_dtype,
    block_forward_cached,
    embed_tokens,
    head,
    head_params,
    rotary_tables,
    token_cross_entropy,
)
from jaxdist.packed_row import ID_MASK
from jaxdist.parallel.rules import Rules, activation_sharding

AXIS = "pipeline"


def stage_remat_policy(remat: str | Remat, chunks: int = 1) -> Callable:
    """The jax.checkpoint policy that decides what a unit stashes between its forward and backward.

    Takes ``train.remat`` parsed (:class:`~jaxdist.config.Remat`; a string is
    parsed the same way).  ``none`` stashes every tagged intermediate
    (CHECKPOINT_NAMES; untagged elementwise results are recomputed), ``full``
    only each block's input, ``save:A,B`` those names, a policy name that
    ``jax.checkpoint_policies`` policy.  With chunks the key/value projections
    are left out: the key/value stash already holds them.
    """
    cp = jax.checkpoint_policies
    spec = remat if isinstance(remat, Remat) else Remat.parse(remat)
    if spec.kind == "none":
        names = list(CHECKPOINT_NAMES)
    elif spec.kind == "full":
        return cp.nothing_saveable
    elif spec.kind == "names":
        names = list(spec.names)
    else:
        policy = getattr(cp, spec.policy, None)
        if spec.kind in ("auto", "selected") or policy is None or not callable(policy):
            raise ValueError(
                f"remat policy '{spec}' is unknown: use none, full, save:NAME[,NAME] or a jax.checkpoint_policies name."
            )
        return policy
    if chunks > 1:
        names = [n for n in names if n not in ("key_proj", "value_proj")]
    return cp.save_only_these_names(*names)


# --------------------------------------------------------------------------- residuals


def _vjp_split(fn: Callable, args: tuple, resupplied: tuple):
    """(out, kept residuals, treedef, layout): layout[i] is the index of residual i among the
    leaves of ``resupplied`` (given again at the backward), or -1 if it must be stored."""
    out, vjp = jax.vjp(fn, *args)
    leaves, treedef = jax.tree.flatten(vjp)  # the vjp function is a pytree whose leaves are the residuals
    ids = {id(v): i for i, v in enumerate(jax.tree.leaves(resupplied))}
    layout = tuple(ids.get(id(leaf), -1) for leaf in leaves)
    assert any(j >= 0 for j in layout), "jax.vjp no longer exposes its residuals as pytree leaves"
    return out, [leaf for leaf, j in zip(leaves, layout) if j < 0], treedef, layout


def _merge(kept: list, resupplied: tuple, layout: tuple) -> list:
    again, it = jax.tree.leaves(resupplied), iter(kept)
    return [next(it) if j < 0 else again[j] for j in layout]


def _pad(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if x.shape == tuple(shape):
        return x
    return jnp.pad(x, [(0, n - m) for n, m in zip(shape, x.shape)])


def _take(x: jax.Array, i) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)


def _put(x: jax.Array, v: jax.Array, i) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(x, v.astype(x.dtype), i, 0)


def _at(x: jax.Array, index: tuple, shape: tuple[int, ...] = (), starts: tuple[int, ...] = ()) -> jax.Array:
    """x[index] (dynamic leading indices), its first ``len(shape)`` axes cropped to ``shape`` from ``starts``."""
    rest = x.shape[len(index) :]
    sizes = tuple(shape) + rest[len(shape) :]
    begin = tuple(index) + tuple(starts or (0,) * len(shape)) + (0,) * (len(rest) - len(shape))
    return jax.lax.dynamic_slice(x, begin, (1,) * len(index) + sizes).reshape(sizes)


def _set(x: jax.Array, index: tuple, v: jax.Array) -> jax.Array:
    """x with x[index][:v.shape...] = v (leading dynamic indices, the rest from 0)."""
    starts = tuple(index) + (0,) * v.ndim
    return jax.lax.dynamic_update_slice(x, v.astype(x.dtype).reshape((1,) * len(index) + v.shape), starts)


def _add(x: jax.Array, index: tuple, v: jax.Array) -> jax.Array:
    return _set(x, index, _at(x, index, v.shape) + v.astype(x.dtype))


def run_stage(
    layers: dict,
    shared: dict,
    tokens: jax.Array,
    tables,
    n_tokens: jax.Array,
    *,
    model: ModelConfig,
    plan,
    remat: str | Remat,
    rules: Rules,
    packed: bool = False,
    sync=None,
):
    """One stage's program, inside ``shard_map`` manual over ``pipeline`` (and the rows' axes of ``sync``).

    ``layers``: this stage's blocks [L/p, ...]; ``shared``: embedding, final norm
    (and lm_head); ``tokens`` [m, B/m, T+1]; ``tables``: (``ExecutorTables.
    stacked()``, ``unit_slot``); ``plan``: a PipelinePlan (static shapes);
    ``n_tokens``: the predictions the global batch's loss counts (float32 scalar; the loss is their mean).
    ``packed``: rows packed from documents (jaxdist.models.packed): a chunk's tokens attend within their
    documents, their positions restart at each, and only the targets count in the loss.
    ``sync``: a :class:`~jaxdist.parallel.pipeline_sync.StageSync` (``train.grad_sync=per_block``: the
    weights arrive as fsdp shards and the gradients leave reduced, see that module), or None.
    Returns (loss summed over stages, this stage's layer grads, shared grads
    summed over stages, trace [1, ticks]).
    """
    with activation_sharding(jax.sharding.get_abstract_mesh(), rules):
        return _StageRun(layers, shared, tokens, tables, model, plan, remat, n_tokens, sync, packed).run()


class _StageRun:
    """Traces one stage's tick loop; a class only to share the many static pieces between branches."""

    def __init__(
        self, layers, shared, tokens, tables, cfg: ModelConfig, plan, remat: str | Remat, n_tokens, sync, packed
    ):
        self.cfg, self.plan, self.n_tokens, self.sync, self.packed = cfg, plan, n_tokens, sync, packed
        self.layer_shards = {k: (v.shape, v.dtype) for k, v in layers.items()}  # what leaves reduced (per_block)
        if sync is not None:  # per_block: the stage's weights whole along fsdp, once per step
            layers, shared = sync.gather_layers(layers), sync.gather_shared(shared)
        sch = plan.schedule
        self.p, self.s = sch.stages, sch.chunks
        self.dt = array_dtype(cfg.dtype)
        # Cast once per step, so every unit's vjp refers to these same arrays (not a copy per unit).  An MoE
        # block's router and experts keep their storage dtype: the MoE computes its own (jaxdist.models.moe).
        self.moe_keys = set(moe_param_specs(cfg)) if cfg.moe.experts else set()
        self.lp = {k: v if k in self.moe_keys else v.astype(self.dt) for k, v in layers.items()}
        self.param_dtypes = {k: v.dtype for k, v in layers.items()}
        self.shared, self.tokens = shared, tokens
        self.stage = jax.lax.axis_index(AXIS)
        self.is_first, self.is_last = self.stage == 0, self.stage == self.p - 1
        self.n_layers = layers["wq"].shape[0]
        # The block loop's steps: one block (dense), or a group of moe.every blocks whose last is an MoE block.
        self.members = cfg.moe.every if cfg.moe.experts else 1
        self.groups = self.n_layers // self.members
        self.grouped = split_group(self.lp, cfg, self.groups) if cfg.moe.experts else self.lp
        self.microbatches = tokens.shape[0]
        self.batch = tokens.shape[1]
        # A microbatch's tokens (its router losses' count): with sync, every device of the stage holds a part.
        self.rows = () if sync is None else sync.rows
        self.mb_tokens = float(self.batch * plan.bounds[-1] * (1 if sync is None else sync.row_devices))
        self.lengths = plan.chunk_lengths
        self.tmax = max(self.lengths)
        self.policy = stage_remat_policy(remat, self.s)
        self.table, self.unit_slot = tables
        # Per chunk, per member of a step: what its vjp keeps (the stash holds the longest chunk's shapes).
        self.res = [[self._residual_layout(c, j) for j in range(self.members)] for c in range(self.s)]
        self.res_shapes, self.res_dtypes = [], []
        for j in range(self.members):
            first = self.res[0][j]
            n = len(first["shapes"])
            assert all(len(r[j]["shapes"]) == n for r in self.res), "residual structure differs between chunks"
            self.res_shapes.append(
                [
                    tuple(max(r[j]["shapes"][i][d] for r in self.res) for d in range(len(first["shapes"][i])))
                    for i in range(n)
                ]
            )
            self.res_dtypes.append(first["dtypes"])

    # ---------------------------------------------------------------- per-chunk pieces

    def _member(self, group: dict, j: int) -> dict:
        """The weights of block j of one step of the block loop (a dense model's step is one block)."""
        return group_member(group, j, self.cfg) if self.cfg.moe.experts else group

    def _grad_index(self, name: str, j: int) -> tuple:
        """Where block j's gradient of weight ``name`` goes in a step's slice of the grouped accumulators."""
        return () if not self.cfg.moe.experts or name in self.moe_keys else (j,)

    def _ungroup(self, grads: dict) -> dict:
        """Grouped gradients [groups, blocks per group, ...] back to the stage's stacked layout [blocks, ...]."""
        if not self.cfg.moe.experts:
            return grads
        return {k: g if k in self.moe_keys else g.reshape(-1, *g.shape[2:]) for k, g in grads.items()}

    def _block(self, c: int) -> Callable:
        cfg = self.cfg
        if c == 0:  # packed rows: one segments argument, the queries' and the keys' (one array, one residual)
            fn = lambda p, x, cos, sin, *seg: block_forward_cached(p, x, cos, sin, cfg, None, None, *seg, *seg)  # noqa: E731
        else:
            fn = lambda p, x, cos, sin, kp, vp, *seg: block_forward_cached(p, x, cos, sin, cfg, kp, vp, *seg)  # noqa: E731
        return jax.checkpoint(fn, policy=self.policy)

    def _rotary(self, c: int, positions=None):
        """cos, sin of chunk c: [Tc, head_dim/2] at positions bounds[c].., or per row [B, Tc, head_dim/2] from the
        packed rows' ``positions`` [B, Tc] (each restarting at its document's first token)."""
        if positions is None:
            a, e = self.plan.bounds[c], self.plan.bounds[c + 1]
            return rotary_tables(jnp.arange(a, e), self.cfg.head_dim, self.cfg.rope_theta, self.cfg)
        cos, sin = rotary_tables(positions.reshape(-1), self.cfg.head_dim, self.cfg.rope_theta, self.cfg)
        return cos.reshape(*positions.shape, -1), sin.reshape(*positions.shape, -1)

    def _documents(self, c: int, mb):
        """Packed rows: (positions [B, Tc], (segments of chunk c's tokens [B, Tc], of positions 0..end [B, e])) of
        microbatch mb (chunk 0: its tokens' segments only, the same for keys); otherwise (None, ())."""
        if not self.packed:
            return None, ()
        a, e = self.plan.bounds[c], self.plan.bounds[c + 1]
        seg = _take(self.segments, mb)
        return _take(self.positions, mb)[:, a:e], (seg[:, :e],) if c == 0 else (seg[:, a:e], seg[:, :e])

    def _args(self, c: int, p_l, x, cos, sin, kp, vp, seg=()):
        full = (p_l, x, cos, sin, *seg) if c == 0 else (p_l, x, cos, sin, kp, vp, *seg)
        again = (p_l, cos, sin, *seg) if c == 0 else (p_l, cos, sin, kp, vp, *seg)
        return full, again

    def _residual_layout(self, c: int, j: int) -> dict:
        """Shapes of the residuals block j of a step stores for chunk c, its vjp treedef and layout (traced
        abstractly)."""
        cfg, n, bsz = self.cfg, self.lengths[c], self.batch
        a = self.plan.bounds[c]
        sd = lambda shape: jax.ShapeDtypeStruct(shape, self.dt)  # noqa: E731
        group = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in self.grouped.items()}
        kv = sd((bsz, a, cfg.n_kv_heads, cfg.head_dim))
        out = {}

        def trace(group, x, kp, vp, positions, seg):
            p_l = self._member(group, j)
            cos, sin = self._rotary(c, positions)
            full, again = self._args(c, p_l, x, cos, sin, kp, vp, seg)
            _, kept, treedef, layout = _vjp_split(self._block(c), full, again)
            out.update(treedef=treedef, layout=layout)
            return kept

        positions, seg = None, ()
        if self.packed:
            i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
            positions, seg = i32((bsz, n)), (i32((bsz, n)),) if c == 0 else (i32((bsz, n)), i32((bsz, a + n)))
        kept = jax.eval_shape(trace, group, sd((bsz, n, cfg.d_model)), kv, kv, positions, seg)
        out.update(shapes=[k.shape for k in kept], dtypes=[k.dtype for k in kept])
        return out

    def _prefix_kv(self, carry, mb, c: int, layer):
        """Keys and values of chunks 0..c-1 of microbatch mb in one block of this stage: [B, bounds[c], KV, D]."""
        if c == 0:
            return None, None
        slots = [self.unit_slot[self.stage, mb, j] for j in range(c)]
        ks = [_at(carry["kv_k"], (sl, layer), (self.batch, self.lengths[j])) for j, sl in enumerate(slots)]
        vs = [_at(carry["kv_v"], (sl, layer), (self.batch, self.lengths[j])) for j, sl in enumerate(slots)]
        return jnp.concatenate(ks, axis=1), jnp.concatenate(vs, axis=1)

    # ---------------------------------------------------------------- embedding and head

    def _embed(self, table, tok):
        return embed_tokens(table, tok, self.cfg)

    # ---------------------------------------------------------------- branches
    # Row fields: 0 branch, 1 microbatch, 2 chunk, 3 slot, 4 in_slot, 5 recv_act, 6 recv_grad.

    def _forward(self, c: int):
        n = self.lengths[c]
        block = self._block(c)

        def branch(carry, row, x_in):
            mb, slot = row[1], row[3]
            positions, seg = self._documents(c, mb)
            cos, sin = self._rotary(c, positions)

            # The stash travels through the block loop so that each block's residuals are
            # written into their slot in place (no stacked copy of a whole unit).
            def step(state, xs):
                x, carry = state
                group, g = xs
                for j in range(self.members):
                    l = g * self.members + j
                    p_l = self._member(group, j)
                    kp, vp = self._prefix_kv(carry, mb, c, l)
                    full, again = self._args(c, p_l, x, cos, sin, kp, vp, seg)
                    outs, kept, _, layout = _vjp_split(block, full, again)
                    assert layout == self.res[c][j]["layout"], (
                        "residual layout differs from the plan",
                        layout,
                        self.res[c][j]["layout"],
                    )
                    stash = list(carry["stash"])
                    stash[j] = [
                        _set(st, (slot, g), _pad(r, shape)) for st, r, shape in zip(stash[j], kept, self.res_shapes[j])
                    ]
                    carry = dict(carry, stash=stash)
                    x, k, v = outs[:3]
                    if len(outs) == 4:  # an MoE block: its router's sums over this chunk, added to the microbatch's
                        sums = dict(outs[3])
                        if self.rows:  # the counts of the stage's rows: every backward of mb needs them whole
                            sums["tokens"] = jax.lax.psum(sums["tokens"], self.rows)
                        carry["router"] = {key: _add(carry["router"][key], (mb, g), sums[key]) for key in ROUTER_SUMS}
                    if self.s > 1:
                        carry["kv_k"] = _set(carry["kv_k"], (slot, l), self._pad_tokens(k))
                        carry["kv_v"] = _set(carry["kv_v"], (slot, l), self._pad_tokens(v))
                return (x, carry), None

            xs = (self.grouped, jnp.arange(self.groups))
            (y, carry), _ = jax.lax.scan(step, (x_in[:, :n], carry), xs)
            return carry, self._pad_tokens(y)

        return branch

    def _backward(self, c: int):
        a, n, s = self.plan.bounds[c], self.lengths[c], self.s
        kv_shape = (self.batch, n, self.cfg.n_kv_heads, self.cfg.head_dim)

        def branch(carry, row, dy_in):
            mb, slot = row[1], row[3]
            positions, seg = self._documents(c, mb)
            cos, sin = self._rotary(c, positions)

            def step(state, xs):
                dx, carry = state
                group, g = xs
                for j in reversed(range(self.members)):
                    l = g * self.members + j
                    p_l = self._member(group, j)
                    res = self.res[c][j]
                    kp, vp = self._prefix_kv(carry, mb, c, l)
                    kept = [_at(st, (slot, g), shape) for st, shape in zip(carry["stash"][j], res["shapes"])]
                    if c < s - 1:  # cotangents of this chunk's keys/values from the later chunks' attention
                        dke = _at(carry["dkv_k"], (l,), (self.batch, n), (0, a))
                        dve = _at(carry["dkv_v"], (l,), (self.batch, n), (0, a))
                    else:
                        dke = dve = jnp.zeros(kv_shape, self.dt)
                    _, again = self._args(c, p_l, None, cos, sin, kp, vp, seg)
                    vjp = jax.tree.unflatten(res["treedef"], _merge(kept, again, res["layout"]))
                    cotangent = (dx, dke, dve)
                    if "router" in p_l:  # the router losses' share of the objective (jaxdist.models.moe)
                        cotangent += (self._router_cotangent(carry, mb, g),)
                    cts = vjp(cotangent)
                    carry = dict(
                        carry,
                        g_layers={
                            k: _add(gl, (g, *self._grad_index(k, j)), cts[0][k]) if k in cts[0] else gl
                            for k, gl in carry["g_layers"].items()
                        },
                    )
                    if c > 0:  # the first backward of a microbatch (c = s-1) starts the accumulation afresh
                        upd = _set if c == s - 1 else _add
                        carry["dkv_k"] = upd(carry["dkv_k"], (l,), cts[4])
                        carry["dkv_v"] = upd(carry["dkv_v"], (l,), cts[5])
                    dx = cts[1]
                return (dx, carry), None

            xs = (self.grouped, jnp.arange(self.groups))
            (dx, carry), _ = jax.lax.scan(step, (dy_in[:, :n], carry), xs, reverse=True)
            return carry, self._pad_tokens(dx)

        return branch

    def _router_cotangent(self, carry, mb, g) -> dict:
        """The cotangent of an MoE block's router sums in a backward of microbatch mb: the router losses enter
        the objective as the microbatches' mean of their means over the model's MoE blocks (as
        jaxdist.train.step.loss_metrics_and_grads adds them), and by the first backward of a microbatch every
        chunk of it has passed this stage's forward, so its counts per expert are whole."""
        tokens = _at(carry["router"]["tokens"], (mb, g), (self.cfg.moe.experts,))
        weight = 1.0 / (moe_layer_count(self.cfg) * self.microbatches)
        return sums_cotangent(tokens, self.mb_tokens, weight, self.cfg)

    def _head(self, carry, y, tok, n, targets=None):
        """Last stage, after a forward: loss of the unit and the gradient of its output (padded tokens masked, and
        with packed rows every prediction that is not a target, ``targets`` [B, tmax])."""
        mask = (jnp.arange(self.tmax) < n)[None]
        if targets is not None:
            mask = mask & targets

        def loss_fn(y, weights):
            ce = token_cross_entropy(head(weights, y, self.cfg), tok[:, 1:])
            return jnp.sum(jnp.where(mask, ce, 0.0)) / self.n_tokens

        loss, vjp = jax.vjp(loss_fn, y, head_params(self.shared, self.cfg))
        dy, dw = vjp(jnp.ones((), jnp.float32))
        carry = dict(carry, loss=carry["loss"] + loss)
        for k, g in dw.items():
            key = self._head_key(k)
            carry[key] = carry[key] + g.astype(carry[key].dtype)
        return carry, dy

    def _head_key(self, name: str) -> str:
        """The accumulator of the head's gradient of ``name``: per_block keeps the tied table's apart from its
        lookup gradient (they are reduced apart, jaxdist.parallel.grad_sync)."""
        return "gh_embed" if name == "embed" and self.sync is not None else "g_" + name

    def _embed_grad(self, carry, dx, tok):
        tok = tok[:, :-1]
        if self.sync is not None:  # per_block: the lookup's gradient from the rows of the whole stage
            dx, tok = self.sync.gather_rows(dx, tok)
        _, vjp = jax.vjp(lambda table: self._embed(table, tok), self.shared["embed"])
        return dict(carry, g_embed=carry["g_embed"] + vjp(dx)[0].astype(carry["g_embed"].dtype))

    def _idle(self, carry, row, x):
        return carry, jnp.zeros_like(x)

    def _pad_tokens(self, x):
        return _pad(x, (x.shape[0], self.tmax, *x.shape[2:]))

    # ---------------------------------------------------------------- the loop

    def _init_carry(self) -> dict:
        tab, cfg, dt = self.plan.tables, self.cfg, self.dt
        msg = jnp.zeros((self.batch, self.tmax, cfg.d_model), dt)
        carry = {
            "out": msg,
            "op": jnp.zeros((), jnp.int32),  # the last tick's output and branch, sent next tick
            "act_in": jnp.zeros((tab.act_buffers + 1, *msg.shape), dt),
            "grad_in": jnp.zeros((tab.grad_buffers + 1, *msg.shape), dt),
            "dy": jnp.zeros((tab.slots, *msg.shape), dt),
            "stash": [
                [jnp.zeros((tab.slots, self.groups, *shape), dtype) for shape, dtype in zip(shapes, dtypes)]
                for shapes, dtypes in zip(self.res_shapes, self.res_dtypes)
            ],
            "loss": jnp.zeros((), jnp.float32),
            "g_layers": {k: jnp.zeros(v.shape, self.param_dtypes[k]) for k, v in self.grouped.items()},
        }
        if cfg.moe.experts:  # per microbatch and MoE block of this stage, the router's sums (ROUTER_SUMS)
            shapes = {"probs": (cfg.moe.experts,), "tokens": (cfg.moe.experts,)}
            carry["router"] = {
                k: jnp.zeros((self.microbatches, self.groups, *shapes.get(k, ())), jnp.float32) for k in ROUTER_SUMS
            }
        for k, v in self.shared.items():
            carry["g_" + k] = jnp.zeros_like(v)
        if self.sync is not None:
            carry["g_reduced"] = {k: jnp.zeros(shape, dtype) for k, (shape, dtype) in self.layer_shards.items()}
            if self.cfg.tie_embeddings:
                carry["gh_embed"] = jnp.zeros_like(self.shared["embed"])
        if self.s > 1:
            kv = (self.n_layers, self.batch, self.tmax, cfg.n_kv_heads, cfg.head_dim)
            carry["kv_k"] = carry["kv_v"] = jnp.zeros((tab.slots, *kv), dt)
            acc = (self.n_layers, self.batch, self.plan.bounds[-2], cfg.n_kv_heads, cfg.head_dim)
            carry["dkv_k"] = carry["dkv_v"] = jnp.zeros(acc, dt)
        return carry

    def run(self):
        p, s, tm = self.p, self.s, self.tmax
        branches = [self._idle] + [self._forward(c) for c in range(s)] + [self._backward(c) for c in range(s)]
        starts = jnp.asarray(self.plan.bounds[:-1], jnp.int32)  # first token of each chunk
        lengths = jnp.asarray(self.lengths, jnp.int32)
        tokens, targets = self.tokens, None
        if self.packed:  # the ids, and per microbatch row the segments, positions and targets of the whole row
            m, b, t1 = tokens.shape
            _, seg, pos, _, targets = (x.reshape(m, b, t1 - 1) for x in unpack(tokens.reshape(m * b, t1)))
            self.segments, self.positions = seg, pos
            tokens = tokens & ID_MASK
            targets = jnp.pad(targets, ((0, 0), (0, 0), (0, tm)))
        # Tokens padded so that a chunk's window [start, start + tmax + 1) never runs off the end.
        tokens = jnp.pad(tokens, ((0, 0), (0, 0), (0, tm)))

        # The tick of this stage's last backward (per_block reduces the stage's gradients right after it).
        ticks = jnp.arange(self.table.shape[0])
        last_backward = jnp.max(jnp.where(self.table[:, self.stage, 0] > s, ticks, -1))

        def tick(carry, xs):
            rows, t = xs
            row = _take(rows, self.stage)
            op, mb, chunk, slot = row[0], row[1], row[2], row[3]
            is_f, is_b = (op >= 1) & (op <= s), op > s
            # Deliver the previous tick's outputs first.  Sending at the top of the tick, from the
            # loop carry, keeps every collective in one order on every device: XLA:CPU may start a
            # send as soon as its operand is ready, even while another device still runs a
            # conditional that holds the stage's data/tensor reductions, and then they deadlock.
            prev, prev_op = carry["out"], carry["op"]
            zeros = jnp.zeros_like(prev)
            act = jax.lax.ppermute(
                jnp.where((prev_op >= 1) & (prev_op <= s), prev, zeros), AXIS, [(k, k + 1) for k in range(p - 1)]
            )
            grad = jax.lax.ppermute(jnp.where(prev_op > s, prev, zeros), AXIS, [(k + 1, k) for k in range(p - 1)])
            carry = dict(carry, act_in=_put(carry["act_in"], act, row[5]), grad_in=_put(carry["grad_in"], grad, row[6]))
            tok = jax.lax.dynamic_slice_in_dim(_take(tokens, mb), starts[chunk], tm + 1, axis=1)
            # Input of a forward (stage 0: the embedding) or of a backward (last stage: its stashed dy).
            x_f = jnp.where(
                self.is_first, self._embed(self.shared["embed"], tok[:, :-1]), _take(carry["act_in"], row[4])
            )
            x_b = jnp.where(self.is_last, _take(carry["dy"], slot), _take(carry["grad_in"], row[4]))
            carry, out = jax.lax.switch(op, branches, carry, row, jnp.where(is_f, x_f, x_b))
            tgt = (
                None if targets is None else jax.lax.dynamic_slice_in_dim(_take(targets, mb), starts[chunk], tm, axis=1)
            )
            carry, dy = jax.lax.cond(
                self.is_last & is_f,
                partial(self._head, tok=tok, n=lengths[chunk], targets=tgt),
                lambda carry, y: (carry, jnp.zeros_like(y)),
                carry,
                out,
            )
            carry["dy"] = _put(carry["dy"], jnp.where(self.is_last & is_f, dy, _take(carry["dy"], slot)), slot)
            carry = jax.lax.cond(
                self.is_first & is_b, partial(self._embed_grad, tok=tok), lambda carry, dx: carry, carry, out
            )
            carry["out"], carry["op"] = out, op
            if self.sync is not None:
                carry = jax.lax.cond(t == last_backward, self._reduce_layers, lambda carry: carry, carry)
            return carry, op

        carry, trace = jax.lax.scan(tick, self._init_carry(), (self.table, ticks))  # table: [ticks, stages, 7]
        carry["g_layers"] = self._ungroup(carry["g_layers"])
        if self.sync is not None:
            return self._reduced(carry, trace)
        loss = jax.lax.psum(carry["loss"], AXIS)
        g_shared = {k: jax.lax.psum(carry["g_" + k], AXIS).astype(v.dtype) for k, v in self.shared.items()}
        return (loss, carry["g_layers"], g_shared, trace[None], *self._router_figures(carry))

    def _router_figures(self, carry) -> tuple:
        """An MoE model's router losses and figures per microbatch and MoE block of this stage [m, groups, ...]
        (the stage's rows' sums added up), or nothing for a dense model."""
        if not self.cfg.moe.experts:
            return ()
        sums = carry["router"]
        if self.rows:  # the counts are whole already
            sums = dict(
                jax.lax.psum({k: v for k, v in sums.items() if k != "tokens"}, self.rows), tokens=sums["tokens"]
            )
        return (losses_from_sums(sums, self.mb_tokens, self.cfg),)

    def _reduce_layers(self, carry):
        reduced = self.sync.reduce_layers(self._ungroup(carry["g_layers"]))
        return dict(carry, g_reduced={k: v.astype(carry["g_reduced"][k].dtype) for k, v in reduced.items()})

    def _reduced(self, carry, trace):
        """per_block's outputs: the loss over every device, the reduced layer and shared gradients."""
        loss = jax.lax.psum(carry["loss"], self.sync.manual)
        head = {k: carry[self._head_key(k)] for k in head_params(self.shared, self.cfg)}
        g_shared = self.sync.reduce_shared(head, carry["g_embed"])
        return (loss, carry["g_reduced"], g_shared, trace[None], *self._router_figures(carry))

"""Expert parallelism against single-device references: dispatch, whole model, accounting, training."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxdist.parallel.moe as EP
from jaxdist.config import load_config, validate
from jaxdist.models import create_abstract, init_params, moe as M
from jaxdist.models.hooks import dispatching_experts
from jaxdist.parallel.layout import Parallelism
from jaxdist.parallel.mesh import build_mesh
from jaxdist.parallel.rules import DEFAULT_RULES, activation_sharding
from jaxdist.train.step import loss_and_grads
from tests.trees import leaf_pairs

# (id, mesh overrides, mesh.expert_tensor).  The last runs attention 4-way tensor-parallel
# and the experts 4-way expert-parallel x 2-way tensor-parallel on the same 8 devices.
MESHES = [
    ("expert=8", ["mesh.expert=8"], 0),
    ("expert=4,tensor=2", ["mesh.expert=4", "mesh.tensor=2"], 0),
    ("data=2,expert=2,tensor=2", ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2"], 0),
    ("attn-tensor=4,experts=4x2", ["mesh.tensor=4", "mesh.expert=2"], 2),
]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def layout_for(mesh_overrides, expert_tensor, exchange=None):
    mesh = build_mesh(load_config(None, ["model=moe-tiny", *mesh_overrides]).mesh)
    return mesh, EP.expert_layout(mesh, expert_tensor, exchange=exchange)


def layer_cfg(*overrides):
    return load_config(None, ["model=moe-tiny", "model.d_model=16", "model.moe.d_ff=8", *overrides]).model


def layer_params(cfg, n=64, seed=0):
    d, e, f = cfg.d_model, cfg.moe.experts, M.expert_d_ff(cfg)
    ks = jax.random.split(jax.random.key(seed), 5)
    p = {
        "router": jax.random.normal(ks[0], (d, e)),
        "we_gate": 0.3 * jax.random.normal(ks[1], (e, d, f)),
        "we_up": 0.3 * jax.random.normal(ks[2], (e, d, f)),
        "we_down": 0.3 * jax.random.normal(ks[3], (e, f, d)),
    }
    return p, jax.random.normal(ks[4], (n, d))


def layer_loss(cfg, experts_fn):
    def loss(p, x):
        r = M.route(x, p["router"], cfg)
        y, keep = experts_fn(x, r.experts, r.weights, {k: p[k] for k in M.EXPERT_KEYS})
        return jnp.sum(jnp.sin(y)), (y, keep)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def reference_experts(x, e, w, q):
    return M.experts_reference(x, e, w, q), jnp.ones(e.shape, bool)


# --------------------------------------------------------------------------- dispatch


@pytest.fixture(scope="module")
def dropless_reference():
    cfg = layer_cfg()
    p, x = layer_params(cfg)
    (_, (y, _)), grads = layer_loss(cfg, reference_experts)(p, x)
    return cfg, p, x, y, grads


@pytest.mark.parametrize(
    "mesh_overrides,expert_tensor,exchange",
    [
        *[(m, et, "padded") for _, m, et in MESHES],
        (MESHES[3][1], 2, "ragged-emulated"),  # the GPU exchange's offsets, over a padded all_to_all
    ],
    ids=[*(i for i, _, _ in MESHES), "ragged-emulated"],
)
def test_dropless_dispatch_equals_dense_reference(dropless_reference, mesh_overrides, expert_tensor, exchange):
    cfg, p, x, y_ref, g_ref = dropless_reference
    mesh, layout = layout_for(mesh_overrides, expert_tensor, exchange)
    with activation_sharding(mesh), EP.expert_parallelism(layout):
        (_, (y, keep)), grads = layer_loss(cfg, lambda *a: EP.run_experts(*a, cfg))(p, x)
    assert layout.size(layout.token_axes) * layout.etp_size == 8  # every device busy, no token twice
    assert bool(jnp.all(keep))
    assert rel_err(y, y_ref) < 1e-5
    for a, b in leaf_pairs(grads, g_ref):
        assert rel_err(a, b) < 1e-5


def test_layouts_of_the_test_meshes():
    got = {i: (lay.ep_axes, lay.etp_axes, lay.token_axes) for i, m, et in MESHES for lay in [layout_for(m, et)[1]]}
    assert got == {
        "expert=8": (("expert",), (), ("expert",)),
        "expert=4,tensor=2": (("expert",), ("tensor",), ("expert",)),
        "data=2,expert=2,tensor=2": (("expert",), ("tensor",), ("data", "expert")),
        "attn-tensor=4,experts=4x2": (("expert", "tensor_ep"), ("tensor",), ("expert", "tensor_ep")),
    }


def test_capacity_dispatch_keeps_per_device_slots_and_counts_drops():
    cfg = layer_cfg("model.moe.dispatch=capacity", "model.moe.capacity_factor=1.0")
    p, x = layer_params(cfg, n=64, seed=2)
    mesh, layout = layout_for(["mesh.expert=4", "mesh.tensor=2"], 0)
    with activation_sharding(mesh), EP.expert_parallelism(layout):
        (_, (y, keep)), _ = layer_loss(cfg, lambda *a: EP.run_experts(*a, cfg))(p, x)
    # Brute force: 4 token groups (one per expert shard) of 16 tokens, C = ceil(1.0 * 16 * 2 / 8) = 4 slots each.
    r = M.route(x, p["router"], cfg)
    experts = np.asarray(r.experts)
    keep_ref = np.zeros(experts.shape, bool)
    cap = M.expert_capacity(16, 2, 8, 1.0)
    assert cap == 4
    for g in range(4):
        used = np.zeros(8, int)
        for j in range(2):
            for t in range(g * 16, (g + 1) * 16):
                keep_ref[t, j] = used[experts[t, j]] < cap
                used[experts[t, j]] += 1
    assert 0 < (~keep_ref).sum()
    np.testing.assert_array_equal(np.asarray(keep), keep_ref)
    assert rel_err(y, M.experts_reference(x, r.experts, r.weights * keep_ref, p)) < 1e-5
    assert 1 - float(np.mean(keep)) == pytest.approx((~keep_ref).sum() / keep_ref.size)


# --------------------------------------------------------------------------- whole model


_MODEL_REFERENCE = ["model=moe-tiny", "model.d_model=32", "model.moe.d_ff=16", "model.moe.shared_d_ff=16"]


@pytest.fixture(scope="module")
def model_reference():
    cfg = load_config(None, _MODEL_REFERENCE)
    graphdef, abstract, names = create_abstract(cfg.model)
    params = jax.jit(lambda: init_params(cfg.model, seed=3))()
    tokens = jax.random.randint(jax.random.key(5), (8, 17), 0, cfg.model.vocab_size)
    # Experts computed directly (every token through its k experts), no sorting or exchange.
    with dispatching_experts(lambda x, e, w, q, c: reference_experts(x, e, w, q)):
        loss, grads = jax.jit(lambda p, t: loss_and_grads(graphdef, p, t))(params, tokens)
    return cfg, graphdef, names, params, tokens, loss, grads


@pytest.mark.parametrize(
    "mesh_overrides,expert_tensor", [MESHES[2][1:], MESHES[3][1:]], ids=[MESHES[2][0], MESHES[3][0]]
)
def test_sharded_moe_model_equals_single_device(model_reference, mesh_overrides, expert_tensor):
    cfg, graphdef, names, params, tokens, loss_ref, grads_ref = model_reference
    mesh, layout = layout_for(mesh_overrides, expert_tensor)
    is_names = lambda v: isinstance(v, tuple)
    p_sh = jax.tree.map(lambda n, a: layout.sharding(n, a.shape, DEFAULT_RULES, mesh), names, params, is_leaf=is_names)
    t_sh = NamedSharding(mesh, P(("data", "fsdp", "expert")))
    fn = jax.jit(
        lambda p, t: loss_and_grads(graphdef, p, t),
        in_shardings=(p_sh, t_sh),
        out_shardings=(NamedSharding(mesh, P()), p_sh),
    )
    with activation_sharding(mesh), EP.expert_parallelism(layout):
        loss, grads = fn(jax.device_put(params, p_sh), jax.device_put(tokens, t_sh))
    assert rel_err(loss, loss_ref) < 1e-5
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert rel_err(g, _at(grads_ref, path)) < 1e-5, jax.tree_util.keystr(path)


@pytest.mark.parametrize(
    "mesh_overrides",
    [["mesh.context=2", "mesh.expert=2", "mesh.data=2"], ["mesh.context=2", "mesh.data=2", "mesh.tensor=2"]],
    ids=["context=2,expert=2,data=2", "context=2,data=2,tensor=2"],
)
def test_moe_with_the_sequence_split_over_context_equals_single_device(model_reference, mesh_overrides):
    """MoE x context (the Trainer's path: Parallelism.build, its bound loss): attention runs as the ring, and each
    device routes the tokens of its own sequence chunk through the expert axis (context is one of the MoE layer's
    token axes: the chunks are not gathered); loss and gradients equal one device's to 1e-5."""
    cfg, graphdef, names, params, tokens, loss_ref, grads_ref = model_reference
    cfg = load_config(None, _MODEL_REFERENCE + mesh_overrides + ["train.seq_len=16", "train.batch_size=8"])
    validate(cfg, 8)
    par = Parallelism.build(cfg, jax.devices())
    assert "context" in EP.expert_layout(par.mesh).token_axes
    p_sh = par.param_shardings(names, params)
    fn = jax.jit(
        par.bind(lambda p, t: loss_and_grads(graphdef, p, t)),
        in_shardings=(p_sh, par.batch_sharding),
        out_shardings=(par.replicated, p_sh),
    )
    loss, grads = fn(jax.device_put(params, p_sh), jax.device_put(np.asarray(tokens), par.batch_sharding))
    text = fn.lower(params, np.asarray(tokens)).as_text()
    assert "collective_permute" in text or "ppermute" in text  # the ring ran
    assert rel_err(loss, loss_ref) < 1e-5
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert rel_err(g, _at(grads_ref, path)) < 1e-5, jax.tree_util.keystr(path)


def _at(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


# --------------------------------------------------------------------------- accounting


@pytest.mark.parametrize(
    "mesh_overrides,expert_tensor", [MESHES[1][1:], MESHES[3][1:]], ids=[MESHES[1][0], MESHES[3][0]]
)
def test_expert_bytes_per_device(mesh_overrides, expert_tensor):
    cfg = load_config(None, ["model=moe-tiny", *mesh_overrides, f"mesh.expert_tensor={expert_tensor}"])
    m = cfg.model
    mesh, layout = layout_for(mesh_overrides, expert_tensor)
    _, abstract, names = create_abstract(m)
    sh = jax.tree.map(
        lambda n, a: layout.sharding(n, a.shape, DEFAULT_RULES, mesh),
        names,
        abstract,
        is_leaf=lambda v: isinstance(v, tuple),
    )
    params = jax.jit(lambda: init_params(m), out_shardings=sh)()
    per_device = sum(params["layers"][k].addressable_shards[0].data.nbytes for k in M.EXPERT_KEYS)
    # E * 3 * h * f * bytes / (expert * tensor), per MoE layer.
    expect = m.n_layers * m.moe.experts * 3 * m.d_model * m.moe.d_ff * 4 // (cfg.mesh.expert * cfg.mesh.tensor)
    assert per_device == expect == m.n_layers * EP.expert_param_bytes(m, layout, 4)
    assert {s.data.shape for s in params["layers"]["we_gate"].addressable_shards} == {
        (m.n_layers, m.moe.experts // layout.ep_size, m.d_model, m.moe.d_ff // layout.etp_size)
    }


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
@pytest.mark.parametrize(
    "mesh_overrides,expert_tensor", [MESHES[0][1:], MESHES[3][1:]], ids=[MESHES[0][0], MESHES[3][0]]
)
def test_compiled_all_to_all_bytes_equal_prediction(mesh_overrides, expert_tensor, dispatch):
    cfg = layer_cfg(f"model.moe.dispatch={dispatch}")
    p, x = layer_params(cfg, n=64)
    mesh, layout = layout_for(mesh_overrides, expert_tensor)

    def forward(p, x):
        r = M.route(x, p["router"], cfg)
        return EP.run_experts(x, r.experts, r.weights, {k: p[k] for k in M.EXPERT_KEYS}, cfg)[0]

    with activation_sharding(mesh), EP.expert_parallelism(layout):
        hlo = jax.jit(forward).lower(p, x).compile().as_text()
    predicted = EP.dispatch_bytes(cfg, layout, 64, 4)
    assert EP.collective_bytes(hlo, "all-to-all") == predicted["total"] > 0
    n = 64 // layout.size(layout.token_axes)  # tokens per device
    if dispatch == "dropless":  # ep peers x n*min(k, E/ep) rows x d x 4 bytes, there and back, + int32 ids
        rows = layout.ep_size * n * min(2, 8 // layout.ep_size)
        assert predicted["total"] == 2 * rows * 16 * 4 + rows * 4
    else:  # E x C slots x d x 4 bytes, there and back
        assert predicted["total"] == 2 * 8 * math.ceil(1.25 * n * 2 / 8) * 16 * 4


def test_collective_bytes_parser():
    hlo = (
        "  %a = f32[2,3]{1,0} all-to-all(f32[2,3]{1,0} %x), dimensions={0}\n"
        "  %b = (bf16[4]{0}, s32[5]{0}) all-to-all(%y, %z)\n"
        "  %c = f32[7]{0} all-reduce(%w)\n"
    )
    assert EP.collective_bytes(hlo) == 2 * 3 * 4 + 4 * 2 + 5 * 4
    assert EP.collective_bytes(hlo, "all-reduce") == 7 * 4


# --------------------------------------------------------------------------- training


def train_config(tmp_path, name, extra=()):
    return load_config(
        None,
        [
            "model=moe-tiny",
            "model.moe.aux_loss_coef=0.3",
            "train.steps=24",
            "train.seq_len=32",
            "train.batch_size=16",
            "train.log_every=4",
            "train.eval_every=0",
            "train.eval_batches=1",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.every=12",
            "data.max_bytes=400000",
            "mesh.data=2",
            "mesh.expert=2",
            "mesh.tensor=2",
            "train.warmup_steps=3",
            f"train.runs_dir={tmp_path}",
            f"train.name={name}",
            *extra,
        ],
    )


def test_moe_trains_balanced_and_resumes_bit_identical(tmp_path, capsys):
    from jaxdist.cli import main
    from jaxdist.models import apply_with_aux
    from jaxdist.train.metrics import read_metrics
    from jaxdist.train.trainer import Trainer

    with Trainer(train_config(tmp_path, "full")) as t:
        history = t.fit()
        full = jax.device_get(t.state)
        # per-expert share of the assignments on a training batch, per MoE layer
        _, aux = jax.jit(t.parallelism.bind(lambda p, b: apply_with_aux(t.graphdef, p, b[:, :-1])))(
            t.state["params"], t.batch(0)
        )
    share = np.asarray(aux["moe_expert_share"])
    print("per-expert token share (mean over MoE layers):", np.round(share, 3))
    first, last = history[0], history[-1]
    assert last["loss"] < first["loss"] - 1.5  # 5.4 -> about 3.3 nats/token
    assert share.sum() == pytest.approx(1.0, abs=1e-6)
    # The balancing loss works: here the busiest expert gets about 1.8x its even share of 1/8 and the
    # idlest 0.2x; with moe.aux_loss_coef=0.01 they are about 3.4x and 0.004x at this step.
    assert last["moe_load_max"] < 2.4 and last["moe_load_min"] > 0.1 and last["moe_aux_loss"] < 1.03
    assert all(r["moe_drop_rate"] == 0.0 for r in history)  # dropless
    # The router per MoE block, in the run's metrics.jsonl (and so TensorBoard): the tokens of the busiest,
    # idlest and mean expert in the step, whose mean is the step's assignments over the experts.
    logged = read_metrics(tmp_path / "full")[-1]
    c, t1 = load_config(None, ["model=moe-tiny"]).model, train_config(tmp_path, "full").train
    blocks = [k.split("/")[1] for k in logged if k.startswith("moe/") and k.endswith("/tokens_max")]
    assert blocks == [f"block{i}" for i in range(c.n_layers)]  # every block is an MoE block in moe-tiny
    for b in blocks:
        mean = t1.batch_size * t1.seq_len * c.moe.top_k / c.moe.experts
        assert logged[f"moe/{b}/tokens_min"] <= logged[f"moe/{b}/tokens_mean"] == mean <= logged[f"moe/{b}/tokens_max"]
        assert logged[f"moe/{b}/drop_rate"] == 0.0 and logged[f"moe/{b}/aux_loss"] > 0
    # `jaxdist status` shows the same figures (this run has no controller: the router alone, and why)
    assert main(["status", str(tmp_path / "full")]) == 0
    out = capsys.readouterr().out
    b = blocks[-1]
    want = f"{logged[f'moe/{b}/tokens_min']:.0f} / {mean:.0f} / {logged[f'moe/{b}/tokens_max']:.0f} tokens"
    assert f"router at step {logged['step']}" in out and f"  {b}: {want}" in out and "no per-node health" in out

    with Trainer(train_config(tmp_path, "split")) as t:
        t.fit(steps=12)
        t.checkpointer.wait()
    with Trainer(train_config(tmp_path, "split")) as t:
        t.init_state()
        assert int(t.state["step"]) == 12
        t.fit()
        resumed = jax.device_get(t.state)
    for a, b in leaf_pairs(resumed, full):
        np.testing.assert_array_equal(a, b)

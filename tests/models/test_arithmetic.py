"""Model arithmetic (jaxdist.models.arithmetic) against the model code, closed forms and XLA's own FLOP count."""

import functools
import subprocess
import sys

import jax
import pytest

from jaxdist.cluster import load_cluster
from jaxdist.config import MODEL_PRESETS, load_config
from jaxdist.models import arithmetic, create_abstract
from jaxdist.models.arithmetic import matmul_params, param_count, train_flops_per_token, train_state_bytes
from jaxdist.planner.candidates import Strategy
from jaxdist.planner.cluster import cluster_view
from jaxdist.planner.computation import computation_view
from jaxdist.planner.cost import estimate, memory
from jaxdist.train.trainer import Trainer


def test_importing_it_loads_no_jax():
    code = "import sys, jaxdist.models.arithmetic; assert 'jax' not in sys.modules and 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("preset", list(MODEL_PRESETS))
def test_parameter_counts_match_the_model(preset):
    m = load_config(None, [f"model={preset}"]).model
    _, abstract, _ = create_abstract(m)  # shapes only, nothing allocated
    assert param_count(m) == sum(a.size for a in jax.tree.leaves(abstract)) == computation_view(m, 128).param_count
    # Matmul parameters: all but the input embedding (a lookup) and the norm scales (Qwen3's q/k head norms
    # among them); a tied head multiplies too.
    head = m.d_model * m.vocab_size if m.tie_embeddings else 0
    norms = (2 * m.n_layers + 1) * m.d_model + (2 * m.n_layers * m.head_dim if m.qk_norm else 0)
    assert matmul_params(m) == param_count(m, active=True) - m.vocab_size * m.d_model - norms + head


@pytest.mark.parametrize("preset", list(MODEL_PRESETS))
def test_training_flops_are_palm_accounting(preset):
    m = load_config(None, [f"model={preset}"]).model
    for seq in (64, 2048):
        palm = 6 * matmul_params(m) + 12 * m.n_layers * m.n_heads * m.head_dim * seq
        assert train_flops_per_token(m, seq) == palm == computation_view(m, seq).flops_per_token()


def test_train_state_bytes_per_device():
    m = load_config(None, ["model=llama-8b"]).model
    n = param_count(m)
    fp32 = train_state_bytes(n / 8, "float32")  # fsdp=8, every weight split alike
    assert (fp32.params, fp32.grads, fp32.optimizer, fp32.total) == (n / 2, n / 2, n, 2 * n)  # 16 bytes/param
    assert train_state_bytes(n, "bfloat16").total == 8 * n
    # The planner's memory model takes its parameter, gradient and optimizer bytes from here.
    small = load_config(None, ["model=small"]).model
    mem = memory(computation_view(small, 128), Strategy(data=8), 32)
    state = train_state_bytes(param_count(small), "float32")
    assert (mem.params, mem.optimizer, mem.grads) == (state.params, state.optimizer, state.grads)


# preset -> (batch, seq_len, extra overrides, tolerance on XLA / planner - 1); see the test's docstring.
XLA_CASES = {
    "small": (8, 128, [], 0.03),
    "llama-1b": (2, 256, [], 0.02),
    "moe-tiny": (8, 128, ["model.moe.dispatch=capacity", "model.moe.capacity_factor=1.0"], 0.065),
}


@pytest.mark.parametrize("preset", list(XLA_CASES))
def test_planner_flops_per_step_equal_xla_cost_analysis(preset, tmp_path, monkeypatch):
    """The planner's FLOPs per step (through jaxdist.models.arithmetic) against ``cost_analysis()["flops"]`` of
    the Trainer's compiled train step, on one device, ``train.remat=none``: no recompute in the program, and
    none in the planner's model FLOPs (which exclude it by definition), so both count the same step.

    Measured XLA / planner (JAX 0.10.2, XLA:CPU): small 1.0201, llama-1b 1.0094, moe-tiny 1.0540.  The matmuls
    are counted alike on both sides (2 x M x N x K; the attention scores in full: the model computes the whole
    masked score matrix and the arithmetic does not discount causal masking), so XLA never counts less, and
    the excess is what the arithmetic leaves out:

    * element-wise work of the model (RMSNorm, rotary, SiLU, the score softmax, the loss; MoE: the router's
      softmax and top-k, the capacity slots' one-hot cumulative sum).  Per token it scales with d_model,
      the matmuls with d_model^2: forward + backward 1.8 % for small (d_model 128), 0.3 % for llama-1b
      (2048), 4.8 % for moe-tiny (64);
    * the AdamW update (15 FLOPs per parameter per step in XLA's count) and the gradient-norm clipping:
      about 0.3 % for small, 0.6 % for llama-1b (1.2e9 parameters against 512 tokens), 0.6 % for moe-tiny.

    Each tolerance is its measured excess plus about one percentage point (other XLA versions count
    element-wise ops a little differently); a missing output head (3.5 % of small's FLOPs) or a causal
    discount (7 % of them) falls outside.  XLA's cost analysis counts a ``while`` body once, so the layer
    scan is traced unrolled (``jax.lax.scan(..., unroll=True)``: the same step with the loop written out).
    moe-tiny runs with capacity dispatch at factor 1.0: every expert then holds exactly tokens x k / experts
    slots, so its matmuls are the k routed experts per token.  The preset's dropless dispatch uses
    ``jax.lax.ragged_dot``, which XLA:CPU expands into a matmul of every routed token against every expert
    (3.86 x the model FLOPs measured), work the model arithmetic rightly does not count.
    """
    batch, seq, extra, tol = XLA_CASES[preset]
    xla, planner = _xla_and_planner_flops(preset, batch, seq, extra, tmp_path, monkeypatch)
    assert 1.0 <= xla / planner <= 1.0 + tol, (preset, xla / planner)


def test_dropless_moe_on_cpu_runs_every_expert_for_every_routed_token(tmp_path, monkeypatch):
    """What ``hfu`` counts for an MoE model on CPU, as an operation count: with the preset's dropless dispatch,
    XLA:CPU expands each ``ragged_dot`` (forward and both gradients) into a matmul of every routed row against
    every expert, so the compiled step holds (E - 1) x the routed experts' FLOPs more than the same step with
    capacity dispatch at factor 1.0 (whose slots hold exactly the routed rows).  ``mfu`` counts the routed
    FLOPs only (top-k experts per token, jaxdist.models.arithmetic) on every platform.  Measured with JAX 0.10.2:
    7.09 x the routed FLOPs more (the rest of the excess: dropless's sort and permutation of the rows)."""
    batch, seq, capacity, _ = XLA_CASES["moe-tiny"]
    dropless, planner = _xla_and_planner_flops("moe-tiny", batch, seq, [], tmp_path, monkeypatch)
    slots, _ = _xla_and_planner_flops("moe-tiny", batch, seq, capacity, tmp_path, monkeypatch)
    m = load_config(None, ["model=moe-tiny"]).model
    routed = 6 * batch * seq * m.moe.top_k * 3 * m.d_model * m.moe.d_ff * arithmetic.moe_blocks(m)  # fwd + bwd
    assert (dropless - slots) / routed == pytest.approx(m.moe.experts - 1, rel=0.03)
    assert dropless / planner > 3  # hfu / mfu on CPU for moe-tiny (3.86 measured)


def _xla_and_planner_flops(preset, batch, seq, extra, tmp_path, monkeypatch) -> tuple[float, float]:
    """(XLA's flops of the Trainer's compiled train step on one device, the planner's model FLOPs per step)."""
    cfg = load_config(
        None,
        [
            f"model={preset}",
            "mesh.data=1",
            f"train.batch_size={batch}",
            f"train.seq_len={seq}",
            "train.remat=none",
            f"train.runs_dir={tmp_path / str(len(extra))}",
            "checkpoint.enabled=false",
            "train.progress=false",
            "train.tensorboard=false",
            "data.max_bytes=200000",
            *extra,
        ],
    )
    m, tokens = cfg.model, batch * seq
    est = estimate(computation_view(m, seq), cluster_view(load_cluster("cpu-8")), Strategy(), batch)
    planner = est.extra["model_flops_per_device"]
    assert planner == train_flops_per_token(m, seq) * tokens
    assert est.flops_per_device == pytest.approx(planner, rel=1e-12)  # remat none: nothing recomputed

    monkeypatch.setattr(jax.lax, "scan", functools.partial(jax.lax.scan, unroll=True))
    with Trainer(cfg, devices=jax.devices()[:1]) as trainer:
        assert trainer.flops_per_step == planner  # the Trainer's MFU divides by the same number
        cost = trainer.compile_train_step().cost_analysis()
    monkeypatch.undo()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"], planner


def test_moe_blocks_and_block_flops():
    m = load_config(None, ["model=moe-tiny", "model.n_layers=4", "model.moe.every=2"]).model
    assert arithmetic.moe_blocks(m) == 2
    view = computation_view(m, 128)
    assert [(b.name, b.count, b.flops_fwd) for b in view.blocks] == [
        ("dense", 2, arithmetic.dense_block_flops_fwd(m, 128)),
        ("moe", 2, arithmetic.moe_block_flops_fwd(m, 128)),
    ]
    # Router (d x experts) and the top-k experts' SwiGLU, forward: 2 FLOPs per weight.
    d, fe = m.d_model, m.moe.d_ff
    assert arithmetic.moe_block_flops_fwd(m, 128) - arithmetic.attention_flops_fwd(m, 128) == 2 * (
        d * m.moe.experts + m.moe.top_k * 3 * d * fe
    )

"""The one-line notice when bf16 was asked for but the compiled step multiplies in float32 (issue 24)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp

from jaxdist.parallel.hlo import dot_operand_types
from jaxdist.train.trainer import Trainer

UPCAST = """
HloModule m

ENTRY %main (a: bf16[4,8], b: bf16[8,4]) -> f32[4,4] {
  %a = bf16[4,8]{1,0} parameter(0)
  %b = bf16[8,4]{1,0} parameter(1)
  %ca = f32[4,8]{1,0} convert(%a)
  %cb = f32[8,4]{1,0} convert(%b)
  %d1 = f32[4,4]{1,0} dot(%ca, %cb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %d2 = f32[4,4]{1,0} dot(%ca, %cb), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %d3 = f32[4,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
NATIVE = UPCAST.replace("dot(%ca, %cb)", "dot(%a, %b)")


def _trainer_like(dtype: str, hlo: str):
    """What bf16_notice reads from a Trainer: the config's dtype, the compiled step's text, the devices."""
    compiled = SimpleNamespace(as_text=lambda: hlo)
    return SimpleNamespace(
        config=SimpleNamespace(model=SimpleNamespace(dtype=dtype)),
        compiled_train_step=lambda: compiled,
        devices=jax.devices(),
    )


def test_a_mostly_upcast_bf16_step_gets_one_sentence_naming_the_count():
    notice = Trainer.bf16_notice(_trainer_like("bfloat16", UPCAST))
    assert notice is not None and "\n" not in notice
    assert notice.startswith("2 of the train step's 3 matmuls run in float32 although model.dtype=bfloat16")
    assert jax.__version__ in notice


def test_no_notice_for_native_bf16_or_for_float32():
    assert Trainer.bf16_notice(_trainer_like("bfloat16", NATIVE)) is None
    assert Trainer.bf16_notice(_trainer_like("float32", UPCAST)) is None


def test_the_count_comes_from_this_backends_compiled_program():
    """A compiled bf16 matmul on this JAX: the notice's reading is what XLA made of it, whichever that is."""
    a = jnp.ones((64, 64), jnp.bfloat16)
    dots = dot_operand_types(jax.jit(lambda x, y: x @ y).lower(a, a).compile().as_text())
    assert sum(dots.values()) >= 1 and set(dots) <= {"bf16", "f32"}
    notice = Trainer.bf16_notice(_trainer_like("bfloat16", jax.jit(lambda x, y: x @ y).lower(a, a).compile().as_text()))
    assert (notice is not None) == (dots.get("f32", 0) > dots.get("bf16", 0))

"""The Python API's entry points refuse a wrong argument in one sentence naming it (issue 39, item 2).

Before, ``Trainer({"model": ...})`` failed with ``AttributeError: 'dict' object has no attribute 'mesh'``
deep inside, ``load_config(None, "train.steps=5")`` read the string character by character ("unknown config
key 't'"), and ``generate(..., max_new_tokens=5.5)`` failed inside NumPy.  No devices are used: each
refusal comes before anything is built.
"""

from __future__ import annotations

import pytest

from jaxdist.config import ConfigError, load_config
from jaxdist.sample.config import check_request
from jaxdist.sample.sampler import Sampler
from jaxdist.train.trainer import Trainer

CFG = load_config(None, ["model=tiny"])

ROWS = [
    (lambda: Trainer({"model": "tiny"}), "Trainer's config must be a jaxdist Config"),
    (lambda: Trainer("run.toml"), "Trainer's config must be a jaxdist Config"),
    (lambda: Trainer(CFG, devices="cpu"), "Trainer's devices must be a list of JAX devices"),
    (lambda: Trainer(CFG, devices=[]), "the device list is empty"),  # was a ZeroDivisionError in validate
    (lambda: load_config(None, "train.steps=5"), "load_config's overrides must be a list"),
    (lambda: load_config(None, [("train.steps", 5)]), "load_config's overrides must be a list"),
    (lambda: load_config(5), "load_config's path must be a TOML file path"),
    (
        lambda: Sampler(CFG.to_dict(), {}),
        "Sampler's config must be a jaxdist Config (or use Sampler.from_run(run_dir))",
    ),
    (lambda: Sampler(CFG, [1, 2]), "Sampler's params must be the model's parameter dict"),
    (lambda: Sampler.from_run(7), "Sampler.from_run's run_dir must be a run directory path"),
    (lambda: Sampler.from_run("r", step="last"), "Sampler.from_run's step must be a checkpoint step number or None"),
    (
        lambda: Sampler.from_run("r", overrides="data.tokenizer=bytes"),
        'Sampler.from_run\'s overrides must be a list of "key=value" strings',
    ),
    (lambda: check_request(5.5, 0.0, 0, 1.0), "max_new_tokens must be a whole number"),
    (lambda: check_request(True, 0.0, 0, 1.0), "max_new_tokens must be a whole number"),
    (lambda: check_request(5, "hot", 0, 1.0), "temperature must be a number"),
    (lambda: check_request(5, 0.5, 2.0, 1.0), "top_k must be a whole number"),
    (lambda: check_request(5, 0.5, 0, None), "top_p must be a number"),
]


@pytest.mark.parametrize("call,phrase", ROWS, ids=[p for _, p in ROWS])
def test_a_wrong_argument_is_one_sentence_naming_it(call, phrase):
    with pytest.raises(ConfigError) as e:
        call()
    msg = str(e.value)
    assert phrase in msg and "\n" not in msg and msg.endswith("."), msg


def test_legitimate_values_pass_the_edge():
    import numpy as np

    check_request(np.int64(5), np.float32(0.5), np.int32(3), 1)  # NumPy numbers are numbers
    assert load_config(None, ("train.steps=5",)).train.steps == 5  # a tuple of overrides is a sequence too

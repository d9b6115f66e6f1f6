"""The Trainer with mesh.pipeline > 1 trains exactly like the Trainer without a pipeline."""

from __future__ import annotations

import pytest

from jaxdist.config import load_config
from jaxdist.train.trainer import Trainer

COMMON = [
    "train.steps=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.eval_batches=1",
    "train.progress=false",
    "train.tensorboard=false",
    "checkpoint.enabled=false",
    "data.max_bytes=400000",
]


def run(tmp_path, name, overrides):
    cfg = load_config(None, COMMON + [f"train.runs_dir={tmp_path}", f"train.name={name}"] + overrides)
    with Trainer(cfg) as trainer:
        history = trainer.fit()
        return [(r["loss"], r["grad_norm"]) for r in history], trainer.evaluate(), trainer


@pytest.mark.parametrize(
    "overrides",
    [
        # The embedded default (small model, seq 128, seq1f1b with 2 chunks, 1 microbatch) on two stages.
        ["train.batch_size=16"],
        # 1F1B with gradient accumulation over 4 microbatches and full remat; data=2 x tensor=2 in each stage.
        [
            "model=tiny",
            "train.seq_len=32",
            "train.batch_size=16",
            "train.microbatches=4",
            "pipeline.schedule=1f1b",
            "train.remat=full",
            "mesh.tensor=2",
        ],
    ],
    ids=["default", "1f1b-accumulation"],
)
def test_pipelined_trainer_matches_plain_trainer(tmp_path, overrides):
    plain, plain_eval, _ = run(tmp_path, "plain", overrides)
    piped, piped_eval, trainer = run(tmp_path, "piped", overrides + ["mesh.pipeline=2"])
    assert dict(trainer.mesh.shape)["pipeline"] == 2
    # The layer stack is split over the stages: each device holds half of the layers.
    wq = trainer.state["params"]["layers"]["wq"]
    assert wq.addressable_shards[0].data.shape[0] == wq.shape[0] // 2
    assert len(piped) == len(plain) == 2
    for (l1, g1), (l2, g2) in zip(plain, piped):
        assert l2 == pytest.approx(l1, rel=1e-5) and g2 == pytest.approx(g1, rel=1e-4)
    assert piped_eval == pytest.approx(plain_eval, rel=1e-5)

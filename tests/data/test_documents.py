"""data.packing=documents (jaxdist/data/documents.py): rows packed from whole documents, a token attending only
within its document, positions restarting per document, no loss across a boundary or on padding.

The reference for the model is each document run alone through the same model (no packing, no mask): a packed
row must give every document's per-token losses and the gradients of their sum as that does.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdist.config import ConfigError, load_config, validate
from jaxdist.data import add_data, check_exactly_once, digest_problems, load_source
from jaxdist.data.documents import (
    DOCUMENTS,
    ID_MASK,
    NO_LOSS,
    START,
    PackedStream,
    pack,
    targets,
)
from jaxdist.models import apply, create_abstract, init_params
from jaxdist.models.packed import unpack
from jaxdist.models.transformer import apply_with_aux
from jaxdist.resolve import resolve
from jaxdist.train.metrics import read_metrics
from jaxdist.train.step import init_state, make_train_step
from jaxdist.train.trainer import Trainer
from tests.trees import leaf_pairs


def _stream(lengths, vocab, seed=0):
    """Documents of ``lengths`` random ids (below ``vocab``), concatenated; (stream, starts, documents)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, n).astype(np.uint16) for n in lengths]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return np.concatenate(docs), starts, docs


def test_every_prediction_inside_a_document_is_made_once_and_none_across():
    """Random lengths, some longer than a row (cut into overlapping pieces), some of one token: over all packed rows,
    each stream position but a document's first is a target exactly once; a document's first never is."""
    rng = np.random.default_rng(1)
    lengths = np.concatenate([rng.integers(1, 40, 300), [1, 1, 200, 33, 34, 35, 66, 67]])
    rng.shuffle(lengths)
    seq_len = 32
    stream, starts, _ = _stream(lengths, 200)
    p = pack(starts, len(stream), seq_len)
    rows = p.read(stream, np.arange(p.rows))
    assert rows.shape == (p.rows, seq_len + 1) and rows.dtype == np.int32
    covered = np.zeros(len(stream), np.int64)
    for r in range(p.rows):
        at = 0
        for i in range(p.row_ptr[r], p.row_ptr[r + 1]):
            s, n = p.piece_start[i], p.piece_len[i]
            np.testing.assert_array_equal(rows[r, at : at + n] & ID_MASK, stream[s : s + n])  # the tokens, in order
            covered[s + 1 : s + n] += 1  # the piece's predictions
            at += n
        assert ((rows[r, at:] & NO_LOSS) != 0).all()  # padding is never a target
    first = np.zeros(len(stream), bool)
    first[starts] = True
    assert (covered[~first] == 1).all() and (covered[first] == 0).all()
    # the same, as the train step counts it: targets are exactly the covered positions
    assert targets(rows).sum() == (~first).sum()
    # next fit in stream order: the pieces follow the stream; each row holds at least one piece and no row
    # would have taken the next row's first piece
    assert (np.diff(p.piece_start) > 0).all()
    free = seq_len + 1 - np.add.reduceat(p.piece_len, p.row_ptr[:-1])
    assert (free[:-1] < p.piece_len[p.row_ptr[1:-1]]).all()
    assert p.efficiency == pytest.approx(p.piece_len.sum() / (p.rows * (seq_len + 1)))


def test_segments_and_positions_restart_at_each_document():
    words = np.array([[5 | START, 6, 7, 8 | START, 9, 0 | START | NO_LOSS, 0 | NO_LOSS]], np.int32)
    ids, seg, pos, labels, tgt = (np.asarray(a) for a in unpack(jnp.asarray(words)))  # the inputs: all but the last
    np.testing.assert_array_equal(seg, [[1, 1, 1, 2, 2, 3]])
    np.testing.assert_array_equal(pos, [[0, 1, 2, 0, 1, 0]])
    np.testing.assert_array_equal(ids, [[5, 6, 7, 8, 9, 0]])
    np.testing.assert_array_equal(labels, [[6, 7, 8, 9, 0, 0]])
    np.testing.assert_array_equal(tgt, [[True, True, False, True, False, False]])


@pytest.mark.parametrize(
    "attention,remat", [("xla", "none"), ("xla", "full"), ("blockwise", "none"), ("blockwise", "full")]
)
def test_a_packed_batch_gives_each_documents_own_losses_and_gradients(attention, remat):
    """Seven documents packed into rows of 33 tokens (fp32): the per-token losses at the targets equal each
    document's alone and the gradients of their sum too, to 1e-5, for the xla attention and the blockwise one
    (blocks of 8 tokens: documents span blocks, and blocks before a query block's documents are skipped), with
    train.remat=full as well."""
    cfg = load_config(None, ["model=tiny", f"model.attention={attention}", "model.attention_block=8"])
    graphdef, _, _ = create_abstract(cfg.model, remat_policy=None if remat == "none" else "full")
    params = init_params(cfg.model, seed=2)
    stream, starts, docs = _stream([5, 9, 3, 12, 7, 14, 8], cfg.model.vocab_size, seed=3)
    p = pack(starts, len(stream), 32)
    assert p.rows == 2 and len(p.piece_len) == len(docs)  # every document whole
    words = jnp.asarray(p.read(stream, np.arange(p.rows)))

    def packed(params):
        ids, seg, pos, labels, tgt = unpack(words)
        logits, _ = apply_with_aux(graphdef, params, ids, seg, pos)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(jnp.where(tgt, ce, 0.0)), ce

    # Each document alone in a row of its own from position 0, right-padded to the longest: under the causal mask
    # no real token sees the padding, so its predictions are the document's run by itself (one program for all).
    rows = np.zeros((len(docs), max(map(len, docs))), np.int32)
    for i, d in enumerate(docs):
        rows[i, : len(d)] = d
    real = np.arange(rows.shape[1] - 1)[None] < np.array([len(d) - 1 for d in docs])[:, None]

    def alone(params):
        ce = optax.softmax_cross_entropy_with_integer_labels(apply(graphdef, params, rows[:, :-1]), rows[:, 1:])
        return jnp.sum(jnp.where(real, ce, 0.0)), ce

    (total, ce), g = jax.jit(jax.value_and_grad(packed, has_aux=True))(params)
    ce = np.asarray(ce)[targets(np.asarray(words))]  # row by row: the documents in order
    (ref_total, ref_ce), ref_g = jax.jit(jax.value_and_grad(alone, has_aux=True))(params)
    ref_ce = np.asarray(ref_ce)[real]  # row by row: the documents in order
    assert ce.shape == (sum(len(d) - 1 for d in docs),)
    np.testing.assert_allclose(ce, ref_ce, rtol=1e-5, atol=1e-5)
    for a, b in leaf_pairs(g, ref_g):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_microbatches_of_packed_rows_give_the_whole_batch_mean():
    """Rows hold different numbers of targets: two microbatches still give the whole batch's mean loss and gradient
    (plain SGD at rate 1, so the new parameters show the gradient)."""
    cfg = load_config(None, ["model=tiny", "model.attention=xla"])
    graphdef, _, _ = create_abstract(cfg.model)
    params = init_params(cfg.model, seed=4)
    stream, starts, _ = _stream([30, 3, 4, 2, 25, 33, 5, 6, 7, 8, 9, 2], cfg.model.vocab_size, seed=5)
    p = pack(starts, len(stream), 32)
    words = jnp.asarray(p.read(stream, np.arange(4)))
    assert len(set(np.asarray(targets(np.asarray(words))).sum(axis=1).tolist())) > 1  # unequal rows
    sgd = optax.sgd(1.0)
    out = {}
    for m in (1, 2):
        step = jax.jit(make_train_step(graphdef, sgd, lambda s: 1.0, microbatches=m, packed=True))
        out[m] = step(init_state(params, sgd, 0), words)
    np.testing.assert_allclose(out[2][1]["loss"], out[1][1]["loss"], rtol=1e-5)
    assert float(out[1][1]["targets"]) == float(targets(np.asarray(words)).sum())
    for a, b in leaf_pairs(out[2][0]["params"], out[1][0]["params"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _config(tmp_path, extra=()):
    return load_config(
        None,
        [
            "model=tiny",
            "data.packing=documents",
            "train.steps=6",
            "train.seq_len=64",
            "train.batch_size=8",
            "train.log_every=2",
            "train.eval_every=3",
            "train.eval_batches=1",
            "train.progress=false",
            "train.tensorboard=false",
            "checkpoint.every=3",
            "data.max_bytes=200000",
            f"train.runs_dir={tmp_path}",
            "train.name=docs",
            *extra,
        ],
    )


def test_a_documents_run_trains_resumes_and_trains_each_row_once(tmp_path):
    """The default source (the standard library's files, each a document) packed by documents on the default mesh:
    the first lines say the packing efficiency, the metrics count the targets, each step's tokens are the packed
    rows its batch id names, and a resume continues the same list.  A stream run of the same name is refused."""
    cfg = _config(tmp_path)
    with Trainer(cfg) as t:
        described = t.describe()
        t.fit(steps=3)
        packing = t.packing
    assert "packed by documents" in described and f"{packing.efficiency:.1%} real tokens" in described
    assert 0.5 < packing.efficiency < 1
    with Trainer(cfg) as t:
        t.fit()
    run = tmp_path / "docs"
    rows = read_metrics(run)
    assert [r["step"] for r in rows if "targets" in r] == list(range(1, 7))
    for r in rows:
        if "targets" in r:
            assert 0 < r["targets"] <= 8 * 64 and r["target_share"] == pytest.approx(r["targets"] / (8 * 64))
    assert check_exactly_once(run)["ok"]
    split = load_source(cfg.data)
    assert digest_problems(run, PackedStream(split.train, pack(split.train_starts, len(split.train), 64))) == []
    with pytest.raises(ConfigError, match="data.packing=documents but the config has stream"):
        Trainer(_config(tmp_path, ["data.packing=stream"]))


def test_remat_auto_trains_packed_documents_as_no_remat_does(tmp_path):
    """train.remat=auto (the selector's choice compiled against the budget) on packed rows: the same per-step losses
    as no remat, to 1e-5, over 3 steps (remat=full's exactness is the gradient test above).  The budget (2.4 MB per
    device, below the save-everything peak of about 2.9 MiB) is the point: the choice recomputes."""
    losses = {}
    for remat in ("none", "auto"):
        over = [
            f"train.remat={remat}",
            "train.steps=3",
            f"train.name=remat-{remat}",
            "train.memory_budget_bytes=2400000",
        ]
        resolved = resolve(_config(tmp_path, over), jax.devices())  # auto: the loop compiles the packed step
        if remat == "auto":
            assert resolved.remat.plan.chosen.recompute_flops > 0, resolved.remat.plan.describe()
        with Trainer(resolved) as t:
            losses[remat] = [r["loss"] for r in t.fit()]
    np.testing.assert_allclose(losses["auto"], losses["none"], rtol=1e-5)


def test_data_added_to_a_documents_run_is_packed_too(tmp_path):
    """A text file added while a documents run trains joins at the next step boundary as packed rows (its lines
    of bytes end with EOS: one document), and every step's tokens are still the rows its batch id names."""
    new = tmp_path / "new.txt"
    rng = np.random.default_rng(0)
    new.write_bytes(bytes(rng.integers(97, 123, 40 * 8 * 64, dtype=np.uint8)))
    cfg = _config(tmp_path, ["train.steps=8"])

    def add_once(trainer, step, metrics):
        if step == 3 and trainer.batches.version == 1:
            add_data(trainer.run_dir, [new], seed=7)

    with Trainer(cfg) as t:
        t.add_hook(add_once, every=1)
        t.fit()
        bl = t.batches.current
    added = bl.sources[1]
    assert bl.version == 2 and added.packing == "documents"
    assert added.rows == pack(np.array([0]), added.n_tokens, 64).rows  # one document, cut into overlapping rows
    run = tmp_path / "docs"
    assert check_exactly_once(run)["ok"]
    split = load_source(cfg.data)
    assert digest_problems(run, PackedStream(split.train, pack(split.train_starts, len(split.train), 64))) == []


def test_what_documents_cannot_run_on_yet_and_files_without_boundaries_are_one_sentence(tmp_path):
    for extra, says in (
        (["model.attention=cudnn", "model.dtype=bfloat16"], "set model.attention=auto"),
        (["train.grad_sync=per_block"], "set train.grad_sync=end"),
    ):
        with pytest.raises(ConfigError, match=says) as e:
            validate(_config(tmp_path, extra))
        assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")
    tokens = tmp_path / "tokens.bin"
    np.arange(5000, dtype=np.uint16).tofile(tokens)
    data = ["data.source=tokens", f"data.path={tokens}"]
    with pytest.raises(ConfigError, match="needs the document boundaries .* prepare the corpus again"):
        load_source(_config(tmp_path, data).data)
    (tmp_path / DOCUMENTS).write_bytes(np.array([0, 900, 800], np.uint64).tobytes())  # not increasing
    with pytest.raises(ConfigError, match="damaged or from another corpus"):
        load_source(_config(tmp_path, data).data)
    (tmp_path / DOCUMENTS).write_bytes(np.array([0, 900, 4900], np.uint64).tobytes())
    split = load_source(_config(tmp_path, data).data)  # eval is whole documents: the last one
    assert len(split.train) == 4900 and list(split.train_starts) == [0, 900] and list(split.eval_starts) == [0]
    assert json.dumps(list(map(int, split.eval[:2]))) == "[4900, 4901]"

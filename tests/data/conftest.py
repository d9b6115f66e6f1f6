"""Tokenizers and corpora made in the tests from the embedded corpus (the standard library's .py files).

A byte-level BPE ``tokenizer.json`` (512 tokens, the ``tokenizers`` library)
and a SentencePiece ``.model`` (BPE, 400 pieces), each trained in well under
a second on a few stdlib packages; nothing is downloaded.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from .corpora import TRAIN_PACKAGES, stdlib_texts


@pytest.fixture(scope="session")
def bpe_json(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json with 512 tokens; <|endoftext|> (id 0) is its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stdlib_texts(TRAIN_PACKAGES), trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory) -> Path:
    """A SentencePiece BPE model of 400 pieces: unk=0, bos=1, eos=2 (SentencePiece's defaults), byte fallback."""
    import sentencepiece

    lines = [line for t in stdlib_texts(TRAIN_PACKAGES) for line in t.splitlines() if line.strip()]
    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        vocab_size=400,
        model_type="bpe",
        character_coverage=0.995,
        byte_fallback=True,
        minloglevel=2,
    )
    path = tmp_path_factory.mktemp("sp") / "tok.model"
    path.write_bytes(buf.getvalue())
    return path

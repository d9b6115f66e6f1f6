"""Tokenizer files (jaxdist/data/tokenizer_files.py, tokenizer.py's load_tokenizer), the model.vocab_size rule
(jaxdist/data/manifest.py settle_tokenizer) and the sampler decoding with the run's tokenizer.

The references are the libraries themselves (``tokenizers``, ``sentencepiece``) called directly.
"""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
import sentencepiece
from tokenizers import Tokenizer as HFLibTokenizer

from jaxdist.config import load_config
from jaxdist.data.manifest import settle_tokenizer
from jaxdist.data.sources import write_token_file
from jaxdist.data.tokenizer import ByteTokenizer, load_tokenizer
from jaxdist.data.tokenizer_files import HFTokenizer, SentencePieceTokenizer, file_sha256
from jaxdist.errors import ConfigError

from .corpora import stdlib_texts

TEXT = "def f(x):\n    return {'π': x}  # ≈ 3.14 😀\n"


def test_bytes_is_the_byte_tokenizer():
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer) and (tok.vocab_size, tok.eos_id, tok.add_bos) == (260, 258, False)


def test_hf_tokenizer_json_matches_the_library(bpe_json):
    tok = load_tokenizer(str(bpe_json))
    lib = HFLibTokenizer.from_file(str(bpe_json))
    assert isinstance(tok, HFTokenizer)
    assert (tok.vocab_size, tok.eos_id, tok.bos_id, tok.add_bos, tok.pad_id) == (512, 0, None, False, 0)
    assert tok.fingerprint == file_sha256(bpe_json)
    texts = stdlib_texts(("json",), limit=3) + [TEXT]
    for t, ids in zip(texts, tok.encode_batch(texts)):
        assert ids.tolist() == lib.encode(t, add_special_tokens=False).ids
        assert tok.decode(ids) == t  # byte-level BPE round-trips any text
    ids = tok.encode(TEXT, eos=True)
    assert ids[-1] == 0 and tok.decode(ids) == TEXT  # EOS (special) dropped from the text
    assert tok.decode([*ids[:3], 600, -1]) == lib.decode(ids[:3].tolist())  # ids outside the vocabulary dropped


def test_tokenizer_config_json_names_the_specials(bpe_json, tmp_path):
    shutil.copy(bpe_json, tmp_path / "tokenizer.json")
    lib = HFLibTokenizer.from_file(str(bpe_json))
    a, b = lib.id_to_token(300), lib.id_to_token(301)  # two ordinary tokens made specials by the config
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": a}, "eos_token": b, "add_bos_token": True})
    )
    tok = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (300, 301, True)
    assert tok.encode("x", bos=True, eos=True).tolist() == [300, *lib.encode("x").ids, 301]


def test_sentencepiece_model_matches_the_library(sp_model):
    tok = load_tokenizer(str(sp_model))
    lib = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.add_bos) == (400, 1, 2, True)
    texts = stdlib_texts(("json",), limit=2)
    for t, ids in zip(texts, tok.encode_batch(texts)):
        assert ids.tolist() == lib.encode(t)
    ids = tok.encode("import json", bos=True, eos=True)
    assert ids.tolist() == [1, *lib.encode("import json"), 2] and tok.decode(ids) == "import json"


def test_unreadable_and_missing_tokenizers_get_one_sentence(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match=r"is not a readable Hugging Face tokenizer.json .*: point data.tokenizer"):
        load_tokenizer(str(bad))
    (tmp_path / "x.model").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="is not a readable SentencePiece model"):
        load_tokenizer(str(tmp_path / "x.model"))
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.tokenizer={tmp_path / 'nope.json'}"])
    assert str(e.value) == (
        f"data.tokenizer '{tmp_path / 'nope.json'}' does not exist: point it at a tokenizer.json or a "
        "SentencePiece .model, or set data.tokenizer=bytes."
    )
    with pytest.raises(ConfigError, match=r"data.source='stdlib' is read byte by byte.*jaxdist data prepare"):
        load_config(None, [f"data.tokenizer={bad}"])


@pytest.fixture
def token_file(tmp_path):
    return write_token_file(tmp_path / "t.bin", np.arange(100) % 256)


def _cfg(token_file, tokenizer, *extra):
    return load_config(
        None, ["model=tiny", "data.source=tokens", f"data.path={token_file}", f"data.tokenizer={tokenizer}", *extra]
    )


def test_model_vocab_size_follows_the_tokenizer(bpe_json, sp_model, token_file):
    assert settle_tokenizer(_cfg(token_file, bpe_json)).model.vocab_size == 512
    assert settle_tokenizer(_cfg(token_file, sp_model)).model.vocab_size == 400
    assert settle_tokenizer(_cfg(token_file, "bytes")).model.vocab_size == 260  # unchanged without a file
    assert settle_tokenizer(_cfg(token_file, bpe_json, "model.vocab_size=640")).model.vocab_size == 640  # padded
    with pytest.raises(ConfigError) as e:
        settle_tokenizer(_cfg(token_file, bpe_json, "model.vocab_size=300"))
    assert str(e.value) == (
        f"data.tokenizer '{bpe_json}' has a vocabulary of 512 tokens, larger than model.vocab_size=300: "
        "set model.vocab_size to at least 512, or leave it unset to follow the tokenizer."
    )


def test_the_sampler_decodes_with_the_runs_tokenizer(bpe_json, token_file):
    from jaxdist.models.transformer import create_abstract
    from jaxdist.parallel.layout import Parallelism
    from jaxdist.sample.sampler import Sampler  # JAX: only this test needs it

    cfg = settle_tokenizer(_cfg(token_file, bpe_json, "mesh.data=1"))
    _, abstract, _ = create_abstract(cfg.model)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map(lambda a: rng.normal(0.0, 0.1, a.shape).astype(np.float32), abstract)
    sampler = Sampler(cfg, params, Parallelism.build(cfg, jax.devices()[:1]))
    tok = load_tokenizer(str(bpe_json))
    assert sampler.tokenizer is tok and sampler.vocab == 512
    (g,) = sampler.generate("import json\n", max_new_tokens=8, stop_at_eos=False)
    (d,) = sampler.decode([tok.encode("import json\n")], 8, stop_at_eos=False).tokens
    assert g.tokens == d.tolist() and g.text == tok.decode(d)
    assert max(g.tokens) >= 260  # BPE ids beyond the byte range were generated and decoded

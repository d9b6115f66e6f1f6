"""The tokenizer travels with a Hugging Face model: into the run, through sampling and data prepare, and back out.

The model directory is made here with the libraries themselves: a byte-level
BPE trained by ``tokenizers`` on some Python source, wrapped in
``PreTrainedTokenizerFast`` (BOS/EOS/pad, a chat template) and saved with
``save_pretrained`` beside a random ``LlamaForCausalLM`` (default rope).
The reference for every continuation is ``transformers``' greedy
``generate()``, decoded by its own tokenizer.
"""

from __future__ import annotations

import inspect
import json
import logging
import textwrap

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from jaxdist.cli import main  # noqa: E402
from jaxdist.config import load_config  # noqa: E402
from jaxdist.convert import run_to_hf  # noqa: E402
from jaxdist.convert_config import stored_config  # noqa: E402
from jaxdist.data.manifest import settle_tokenizer  # noqa: E402
from jaxdist.errors import ConfigError  # noqa: E402
from jaxdist.sample.sampler import Sampler  # noqa: E402
from tests.test_cli import TRAIN_TIMEOUT, jaxdist  # noqa: E402

PROMPT = "def dumps(obj, indent"
NEW_TOKENS = 32
VOCAB = 384
CORPUS = [inspect.getsource(json), inspect.getsource(textwrap)]


def _bpe(vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens trained on CORPUS; documents start with <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(directory, transformers tokenizer, the prompt's ids, generate()'s new ids) of a tiny Llama with a BPE."""
    d = tmp_path_factory.mktemp("llama-bpe")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_bpe(VOCAB), bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    fast.save_pretrained(d)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        initializer_range=0.2,  # logits far enough apart that greedy choices are not float32 ties
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(d)
    prompt = fast(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
    return d, fast, prompt[0].tolist(), out[0, prompt.shape[1] :].tolist()


@pytest.fixture(scope="module")
def run_dir(hf_model, tmp_path_factory):
    """``jaxdist convert hf-to-jaxdist`` of the model directory (a subprocess, as a user runs it)."""
    d = hf_model[0]
    work = tmp_path_factory.mktemp("converted")
    r = jaxdist(
        "convert", "hf-to-jaxdist", str(d), "run", "mesh.cluster=cpu-1", "data.max_bytes=20000",
        cwd=work, timeout=TRAIN_TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return work / "run"


def test_convert_then_sample_prints_generate_continuation(hf_model, run_dir):
    d, fast, _, new_ids = hf_model
    assert len(new_ids) == NEW_TOKENS  # no EOS: the whole continuation is compared
    recorded = json.loads((run_dir / "config.json").read_text())["data"]["tokenizer"]
    assert recorded == str(run_dir / "tokenizer" / "tokenizer.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (run_dir / "tokenizer" / name).read_bytes() == (d / name).read_bytes(), name
    r = jaxdist(
        "sample", str(run_dir), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS),
        cwd=run_dir.parent, timeout=TRAIN_TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "token ids" not in r.stderr  # same vocabulary on both sides: no warning
    assert r.stdout == PROMPT + fast.decode(new_ids, skip_special_tokens=True) + "\n"


def test_sampler_from_run_with_tokenizer_override_equals_generate(hf_model, run_dir):
    d, _, prompt_ids, new_ids = hf_model
    # data.source=stdlib stays in the run's config: sampling never reads it, so the override is accepted.
    sampler = Sampler.from_run(run_dir, overrides=[f"data.tokenizer={d / 'tokenizer.json'}"], devices=jax.devices()[:1])
    assert sampler.config.data.source == "stdlib" and sampler.tokenizer.name == str(d / "tokenizer.json")
    assert sampler.parallelism.mesh.devices.size == 1  # the devices given, not every device
    assert sampler.tokenizer.encode(PROMPT, bos=sampler.tokenizer.add_bos).tolist() == prompt_ids
    (g,) = sampler.generate(PROMPT, NEW_TOKENS, temperature=0.0)
    assert g.tokens == new_ids


def test_vocabulary_mismatch_is_told_once(hf_model, run_dir, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="jaxdist.sample.sampler")
    small = Sampler.from_run(run_dir, overrides=["data.tokenizer=bytes"], devices=jax.devices()[:1])
    d = small.decode([hf_model[2]], 8)
    small.decode([hf_model[2]], 8)
    notes = [r.getMessage() for r in caplog.records]
    assert notes == [
        f"the model has {VOCAB} token ids but tokenizer 'bytes' decodes only 260: sampling draws from ids 0..259 "
        "only (set data.tokenizer to the model's own tokenizer if this is not it)"
    ]
    assert d.tokens[0].max() < 260  # never an id the byte tokenizer cannot decode

    big = tmp_path / "tokenizer.json"
    _bpe(VOCAB + 128).save(str(big))
    caplog.clear()
    sampler = Sampler.from_run(run_dir, overrides=[f"data.tokenizer={big}"], devices=jax.devices()[:1])
    assert [r.getMessage() for r in caplog.records] == [
        f"tokenizer '{big}' has {VOCAB + 128} token ids, more than the model's {VOCAB}: a prompt that encodes "
        f"to an id >= {VOCAB} is refused"
    ]
    text = CORPUS[0][:400]
    assert sampler.tokenizer.encode(text).max() >= VOCAB  # the larger BPE's later merges occur in its corpus
    with pytest.raises(ConfigError, match=f"which the model's {VOCAB} ids lack"):
        sampler.generate(text, 4)


def test_data_prepare_ids_equal_transformers(hf_model, tmp_path, capsys):
    d, fast, _, _ = hf_model
    docs = ["def f(x):\n    return x + 1\n", "import json\nprint(json.dumps({'a': [1, 2]}, indent=4))", "naïve café ✓"]
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    out = tmp_path / "prepared"
    assert main(["data", "prepare", str(src), str(out), "--tokenizer", str(d / "tokenizer.json")]) == 0
    want = [i for t in docs for i in fast(t).input_ids + [fast.eos_token_id]]  # [BOS] text EOS, each document
    manifest = json.loads((out / "manifest.json").read_text())
    got = np.fromfile(out / "tokens.bin", dtype=manifest["token_dtype"]).tolist()
    assert got == want and want[0] == fast.bos_token_id


def test_init_from_takes_the_tokenizer_for_a_token_file(hf_model, tmp_path, caplog):
    d = hf_model[0]
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    assert main(["data", "prepare", str(src), str(tmp_path / "c"), "--tokenizer", str(d / "tokenizer.json")]) == 0
    base = [f"model.init_from={d}", "model.max_seq_len=64", "train.seq_len=32"]
    cfg = load_config(None, [*base, "data.source=tokens", f"data.path={tmp_path / 'c' / 'tokens.bin'}"])
    assert cfg.data.tokenizer == str(d / "tokenizer.json")
    assert settle_tokenizer(cfg).model.vocab_size == VOCAB  # the manifest's tokenizer is the model's: accepted
    caplog.set_level(logging.WARNING, logger="jaxdist.config.hf_dir")
    assert load_config(None, base).data.tokenizer == "bytes"  # stdlib is read byte by byte ...
    assert "is not used: data.source=stdlib is read byte by byte" in caplog.text  # ... and the user is told


def test_export_writes_the_tokenizer_back(hf_model, run_dir, tmp_path):
    d, fast, prompt_ids, new_ids = hf_model
    out = tmp_path / "exported"
    files = run_to_hf(stored_config(run_dir), out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (d / name).read_bytes() and out / name in files, name
    back = transformers.AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": "hi"}]
    assert back(PROMPT).input_ids == prompt_ids
    assert back.apply_chat_template(messages, tokenize=False) == fast.apply_chat_template(messages, tokenize=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert (model.config.bos_token_id, model.config.eos_token_id) == (fast.bos_token_id, fast.eos_token_id)
    with torch.no_grad():
        again = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert again[0, len(prompt_ids) :].tolist() == new_ids


def test_chat_prompts_are_apply_chat_template_and_the_answer_is_generate(hf_model, run_dir):
    """``generate(..., chat=True)`` (``jaxdist sample --chat``): the prompt is the user message rendered by the
    chat template saved with the model, with the ids ``apply_chat_template(add_generation_prompt=True)`` gives, and
    the answer is ``transformers``' greedy ``generate()`` from them."""
    d, fast, _, _ = hf_model
    message = [{"role": "user", "content": "def dumps"}]
    ids = list(
        fast.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    )
    model = transformers.LlamaForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    want = out[0, len(ids) :].tolist()
    without = fast.apply_chat_template(message, add_generation_prompt=False, tokenize=True, return_dict=True)
    assert len(ids) > len(without["input_ids"])  # the template has a generation prompt: the answer starts after it
    sampler = Sampler.from_run(run_dir, devices=jax.devices()[:1])
    assert [p.tolist() for p in sampler.prompt_ids(["def dumps"], chat=True)] == [list(ids)]
    (g,) = sampler.generate("def dumps", NEW_TOKENS, temperature=0.0, chat=True)
    assert g.tokens == want[: len(g.tokens)] and g.prompt == "def dumps"
    r = jaxdist(
        "sample", str(run_dir), "--chat", "--prompt", "def dumps", "--temperature", "0",
        "--max-new-tokens", str(NEW_TOKENS), cwd=run_dir.parent, timeout=TRAIN_TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout == g.text + "\n", r.stderr  # the answer only
    with pytest.raises(ConfigError, match="chat prompts need a Hugging Face tokenizer.json"):
        Sampler.from_run(run_dir, overrides=["data.tokenizer=bytes"], devices=jax.devices()[:1]).prompt_ids(
            ["x"], chat=True
        )

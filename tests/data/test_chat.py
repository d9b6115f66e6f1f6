"""Chat data against ``transformers``: the rendered ids equal ``apply_chat_template``'s, and the assistant-only
targets equal its ``return_assistant_tokens_mask`` on templates that mark the assistant's part with
``{% generation %}`` -- found here without those marks (the same templates with them removed give the same
targets).  Two templates written here, Llama-3-style and Qwen-style, over 24 conversations: system prompts,
several turns, empty content, unicode, a prompt/completion pair.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from jaxdist.data.chat import ChatTemplate, conversation, encode_chat, read_conversations
from jaxdist.data.tokenizer import load_tokenizer
from jaxdist.errors import ConfigError

from .corpora import TRAIN_PACKAGES, stdlib_texts

transformers = pytest.importorskip("transformers", reason="transformers (the reference) is not installed")

LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}\n"
    "{%- elif message['role'] == 'tool' %}\n"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] | tojson + '<|eot_id|>' }}\n"
    "{%- else %}\n"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n"
)
# Written without whitespace control, indented: the output depends on trim_blocks and lstrip_blocks as set by
# apply_chat_template.
QWEN = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
    {% endif %}
    {% if message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] }}<|im_end|>
{% endgeneration %}
    {% elif message['role'] not in ['system', 'user', 'tool'] %}
{{ raise_exception('unknown role ' + message['role']) }}
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "<|endoftext|>"]  # fmt: skip
TEMPLATES = {
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen": (QWEN, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
}


def _conversations() -> list[list[dict]]:
    u = ["What is 2 + 2?", "Say ünïcödé — 你好, мир! 🙂", "", "  spaces around  ", "tabs\tand\nnew lines"]
    a = ["4", "ünïcödé 你好 🙂", "", "The answer,\nover two lines.", "def f(x):\n    return x[::-1]"]
    convs = []
    for i in range(20):
        msgs = [{"role": "system", "content": f"Be brief ({i})."}] if i % 3 == 0 else []
        for t in range(1 + i % 3):
            msgs += [{"role": "user", "content": u[(i + t) % 5]}, {"role": "assistant", "content": a[(i + 2 * t) % 5]}]
        convs.append(msgs)
    convs.append([{"role": "user", "content": "only a question"}])
    convs.append(
        [{"role": "system", "content": ""}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
    )
    convs.append(conversation({"prompt": "reverse: stressed", "completion": "desserts"}, "pair"))
    convs.append([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                  {"role": "tool", "content": '{"ok": true, "note": "<ü> & 你"}'}, {"role": "assistant", "content": "done"}])  # fmt: skip
    return convs


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    """Per template, a folder with a byte-level BPE tokenizer.json (the chat specials as added special tokens)
    and the tokenizer_config.json that names the template and the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(stdlib_texts(TRAIN_PACKAGES), trainer)
    dirs = {}
    for name, (template, specials) in TEMPLATES.items():
        d = tmp_path_factory.mktemp(name)
        tok.save(str(d / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, **specials}
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        dirs[name] = d
    return dirs


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_ids_and_assistant_targets_equal_apply_chat_template(tokenizer_dirs, name):
    d = tokenizer_dirs[name]
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    tok, template = load_tokenizer(str(d / "tokenizer.json")), ChatTemplate.beside(d / "tokenizer.json")
    # trim_blocks ate the newline after a block tag: it goes with the tag
    unmarked = ChatTemplate(
        re.sub(r"{% ?generation ?%}|{% ?endgeneration ?%}\n?", "", template.source), template.specials
    )
    assert "{% generation" not in unmarked.source and "{% generation" in template.source
    convs = _conversations()
    assert len(convs) >= 20
    some_targets = 0
    for conv in convs:
        want = ref.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, targets = encode_chat(tok, template, conv)
        assert ids.tolist() == list(want["input_ids"]), conv
        assert targets.astype(int).tolist() == list(want["assistant_masks"]), conv
        ids2, targets2 = encode_chat(tok, unmarked, conv)
        assert ids2.tolist() == ids.tolist() and targets2.tolist() == targets.tolist()
        _, every = encode_chat(tok, template, conv, all_targets=True)
        assert every.all() and len(every) == len(ids)
        some_targets += int(targets.sum())
        # with the generation prompt, as the sampler will use it
        prompt = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert template.render(conv, add_generation_prompt=True) == prompt
    assert some_targets > 0


def test_assistant_targets_are_exactly_the_assistant_text(tokenizer_dirs):
    """Decoded, the targets of a conversation are each assistant message's content and end-of-turn text."""
    d = tokenizer_dirs["qwen"]
    tok, template = load_tokenizer(str(d / "tokenizer.json")), ChatTemplate.beside(d / "tokenizer.json")
    conv = [{"role": "user", "content": "reverse: stressed"}, {"role": "assistant", "content": "desserts"},
            {"role": "user", "content": "reverse: drawer"}, {"role": "assistant", "content": "reward"}]  # fmt: skip
    ids, targets = encode_chat(tok, template, conv)
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(targets.astype(int))) + 1)
    spans = [tok._tok.decode(ids[r].tolist(), skip_special_tokens=False) for r in runs if targets[r[0]]]
    assert spans == ["desserts<|im_end|>\n", "reward<|im_end|>\n"]


def test_bad_conversations_and_templates_are_one_sentence(tmp_path, tokenizer_dirs):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"line 2 is a JSON list, not an object"):
        list(read_conversations(bad))
    bad.write_text('{"messages": [{"role": "robot", "content": "hi"}]}\n')
    with pytest.raises(ConfigError, match=r"line 1: message 0 has role 'robot', which is not one of"):
        list(read_conversations(bad))
    bad.write_text('{"text": "no conversation"}\n')
    with pytest.raises(ConfigError, match="has neither 'messages' nor string 'prompt' and 'completion'"):
        list(read_conversations(bad))
    broken = ChatTemplate("{% for m in messages %}{{ m.content }}")  # no endfor
    with pytest.raises(ConfigError, match="is not valid Jinja"):
        broken.render([{"role": "user", "content": "x"}])
    refusing = ChatTemplate("{{ raise_exception('no system messages') }}")
    with pytest.raises(ConfigError, match="the chat template failed on the conversation starting 'x'.*no system"):
        refusing.render([{"role": "user", "content": "x"}])
    # a template that rewrites earlier turns as the conversation grows: the assistant's part cannot be found
    drifting = ChatTemplate("{% for m in messages %}{{ m.content if loop.last else '.' }}{% endfor %}")
    tok = load_tokenizer(str(tokenizer_dirs["qwen"] / "tokenizer.json"))
    conv = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}, {"role": "user", "content": "e"}]
    with pytest.raises(ConfigError, match="renders a conversation differently from its beginning"):
        encode_chat(tok, drifting, conv)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="has no chat template"):
        ChatTemplate.beside(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match="chat data needs a Hugging Face tokenizer.json"):
        encode_chat(load_tokenizer("bytes"), drifting, conv)


def test_prepare_chat_writes_the_reference_ids_and_targets_and_a_documents_run_trains_on_them(tokenizer_dirs, tmp_path):
    """``jaxdist data prepare --chat``: each conversation's ids are apply_chat_template's, targets.bin its
    assistant_masks, documents.bin where each starts (several pieces); packed by documents, the targets the step
    counts are the assistant tokens; a tiny model trains on them.  Bad conversations stop it, nothing written."""
    from jaxdist.config import load_config
    from jaxdist.data import load_source
    from jaxdist.data.documents import pack, targets
    from jaxdist.data.prepare import prepare
    from jaxdist.train.trainer import Trainer

    d = tokenizer_dirs["llama3"]
    ref = transformers.AutoTokenizer.from_pretrained(str(d))
    convs = _conversations() * 3
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs), encoding="utf-8")
    m = prepare(src, tmp_path / "c", str(d / "tokenizer.json"), piece_bytes=2048, progress=False, chat="assistant")
    assert m["plan"]["pieces"] > 2 and m["n_documents"] == len(convs)
    want = [
        ref.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True) for c in convs
    ]
    out = tmp_path / "c"
    np.testing.assert_array_equal(
        np.fromfile(out / "tokens.bin", m["token_dtype"]), [i for w in want for i in w["input_ids"]]
    )
    mask = np.fromfile(out / "targets.bin", np.uint8)
    np.testing.assert_array_equal(mask, [t for w in want for t in w["assistant_masks"]])
    lengths = [len(w["input_ids"]) for w in want]
    np.testing.assert_array_equal(np.fromfile(out / "documents.bin", np.uint64), np.cumsum([0, *lengths[:-1]]))

    over = [
        "model=tiny",
        "model.vocab_size=640",
        "data.source=tokens",
        f"data.path={out / 'tokens.bin'}",
        f"data.tokenizer={d / 'tokenizer.json'}",
    ]
    over += [
        "data.packing=documents",
        "train.seq_len=64",
        "train.batch_size=8",
        "train.steps=3",
        "train.progress=false",
    ]
    over += ["train.tensorboard=false", "train.eval_every=0", "checkpoint.enabled=false", f"train.runs_dir={tmp_path}"]
    cfg = load_config(None, over)
    split = load_source(cfg.data)
    p = pack(split.train_starts, len(split.train), 64, split.train_targets)
    rows = p.read(split.train, np.arange(p.rows))
    # every assistant token but a conversation's first token is a target once; nothing else is
    starts = np.zeros(len(split.train), bool)
    starts[split.train_starts] = True
    assert targets(rows).sum() == int((np.asarray(split.train_targets, bool) & ~starts).sum()) > 0
    with Trainer(cfg) as t:
        records = t.fit()
    assert [r["step"] for r in records] == [1, 2, 3] and all(np.isfinite(r["loss"]) for r in records)
    assert all(0 < r["targets"] < 8 * 64 for r in records)  # the assistant's tokens only

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": convs[0]}) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n"
    )
    with pytest.raises(ConfigError, match="role 'robot'"):
        prepare(bad, tmp_path / "b", str(d / "tokenizer.json"), progress=False, chat="assistant")
    assert not (tmp_path / "b" / "tokens.bin").exists()
    with pytest.raises(ConfigError, match="--chat reads JSONL conversations"):
        prepare(tokenizer_dirs["qwen"], tmp_path / "q", str(d / "tokenizer.json"), progress=False, chat="assistant")

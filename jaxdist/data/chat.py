"""Conversations for supervised fine-tuning: read, rendered with the tokenizer's chat template, and masked.

A conversation is a list of ``{"role", "content"}`` messages (roles: system, user, assistant, tool), read from
a JSONL line's ``messages`` or from its ``prompt``/``completion`` pair.  The template is the Jinja text that
Hugging Face saves with a tokenizer (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``), rendered as ``transformers``' ``apply_chat_template`` renders it (the same Jinja
settings, filters and globals, the tokenizer's special tokens as variables) and tokenized without adding
special tokens, so the ids are the ones ``apply_chat_template`` gives.

Which tokens are targets: an assistant message's span is what the message adds to the rendering of the
conversation before it with the generation prompt (its content and the end-of-turn text the template writes
after it: the model learns to stop).  A token is a target when its characters overlap such a span -- the rule
``apply_chat_template(return_assistant_tokens_mask=True)`` applies to a template's ``{% generation %}`` blocks,
but found without them, so any template whose rendering of a conversation starts with the rendering of its
beginning works.  ``all_targets=True`` makes every token a target.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from jaxdist import optional
from jaxdist.data.tokenizer_files import read_settings, token_text
from jaxdist.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
# tokenizer_config.json keys passed to the template by name, as transformers passes its special_tokens_map
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Message = dict[str, str]


def conversation(record: Any, where: str) -> list[Message]:
    """The messages of one JSONL record (``messages``, or ``prompt`` and ``completion``); ConfigError naming
    ``where`` (file and line) for anything else."""
    if not isinstance(record, dict):
        raise ConfigError(
            f"{where} is a JSON {type(record).__name__}, not an object: each line must be one "
            'conversation, {"messages": [...]} or {"prompt": ..., "completion": ...}.'
        )
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects.")
    elif isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str):
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
    else:
        raise ConfigError(f"{where} has neither 'messages' nor string 'prompt' and 'completion': give one of them.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content", ""), str):
            raise ConfigError(f"{where}: message {i} must be an object with a string 'content'.")
        if m.get("role") not in ROLES:
            raise ConfigError(
                f"{where}: message {i} has role {m.get('role')!r}, which is not one of {', '.join(ROLES)}: rename it."
            )
        out.append({**m, "content": m.get("content", "")})
    return out


def read_conversations(path: str | Path) -> Iterator[list[Message]]:
    """Each line's conversation of a JSONL file (blank lines skipped); ConfigError naming the line that is not
    one."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"'{path}' line {n}"
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{where} is not JSON ({e}): fix or remove it.") from None
            yield conversation(record, where)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's Jinja text and the special tokens it may name (``bos_token`` ...)."""

    source: str
    specials: dict[str, str] = field(default_factory=dict)

    @classmethod
    def beside(cls, tokenizer_json: str | Path) -> ChatTemplate:
        """The template saved with the tokenizer: ``chat_template.jinja`` beside it, else ``chat_template`` in its
        ``tokenizer_config.json`` (the ``default`` one of a list of named templates)."""
        folder = Path(tokenizer_json).parent
        settings = read_settings(folder / "tokenizer_config.json")
        specials = {k: v for k in SPECIAL_KEYS if (v := token_text(settings.get(k))) is not None}
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), specials)
        source = settings.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source.strip():
            raise ConfigError(
                f"the tokenizer in '{folder}' has no chat template (no chat_template.jinja, no chat_template in "
                "tokenizer_config.json): save the tokenizer with its template, or prepare the data without --chat."
            )
        return cls(source, specials)

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        """The template's text of ``messages`` (ConfigError when the template fails on them)."""
        jinja2 = optional.require("jinja2", "a chat template")
        try:
            return _compiled(self.source).render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.specials,
            )
        except jinja2.TemplateError as e:
            first = messages[0]["content"][:40] if messages else ""
            raise ConfigError(
                f"the chat template failed on the conversation starting {first!r} ({type(e).__name__}: "
                f"{str(e)[:120]}): fix the conversation or the template."
            ) from None

    def assistant_spans(self, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
        """The rendering of ``messages`` and the [start, end) characters of each assistant message's part in it."""
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ConfigError(
                    "the chat template renders a conversation differently from its beginning (message "
                    f"{i}), so its assistant tokens cannot be told apart: use a template whose text of a "
                    "conversation starts with the text of its first messages, or train on every token."
                )
            if len(upto) > len(before):
                spans.append((len(before), len(upto)))
        return text, spans


def encode_chat(
    tokenizer: Any,
    template: ChatTemplate,
    messages: list[Message],
    all_targets: bool = False,
    generation_prompt: bool = False,
):
    """``(ids, targets)`` of one conversation: the ids ``apply_chat_template`` gives (uint32 [n]) and whether
    each token is a target (bool [n]: assistant tokens, or all with ``all_targets``).  ``generation_prompt``:
    ended by the template's generation prompt (what a model answers after), every token a target."""
    if not hasattr(tokenizer, "encode_offsets"):
        raise ConfigError(
            "chat data needs a Hugging Face tokenizer.json (its chat template and character offsets): "
            "point --tokenizer at one."
        )
    if all_targets or generation_prompt:
        ids, _ = tokenizer.encode_offsets(template.render(messages, add_generation_prompt=generation_prompt))
        return ids, np.ones(len(ids), bool)
    text, spans = template.assistant_spans(messages)
    ids, offsets = tokenizer.encode_offsets(text)
    targets = np.zeros(len(ids), bool)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        targets[t] = end > spans[k][0]
    return ids, targets


_COMPILED: dict[str, Any] = {}


def _compiled(source: str):
    """The template compiled in the environment ``apply_chat_template`` uses: sandboxed, ``trim_blocks`` and
    ``lstrip_blocks``, loop controls, ``{% generation %}`` blocks (rendered as their body), a ``tojson`` that
    does not escape HTML, ``raise_exception`` and ``strftime_now``."""
    if source in _COMPILED:
        return _COMPILED[source]
    jinja2 = optional.require("jinja2", "a chat template")
    from jinja2 import ext, nodes, sandbox  # jinja2's submodules, once the package is known to be there

    class Generation(ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        compiled = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"the chat template is not valid Jinja (line {e.lineno}: {e.message}): fix it.") from None
    _COMPILED[source] = compiled
    return compiled

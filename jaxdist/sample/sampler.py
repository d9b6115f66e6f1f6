"""The sampler: a trained run's model generating text on the training mesh axes.

    sampler = Sampler.from_run("runs/default")            # newest good checkpoint, the run's mesh
    for g in sampler.generate(["def fib(", "import "], max_new_tokens=100, temperature=0.8, top_p=0.95):
        print(g.prompt + g.text)

:meth:`Sampler.from_run` reads the run's config (``config.json``; dotted
overrides such as ``mesh.tensor=2 mesh.data=-1`` change the mesh), builds
the run's :class:`~jaxdist.parallel.Parallelism` (the same mesh, logical
rules and expert layout as training) and restores the parameters of the
newest (or a given) committed checkpoint directly sharded
(:mod:`jaxdist.sample.load`, read-only: safe beside a running trainer).

:meth:`Sampler.decode` runs the prompts as one batch: the prefill program,
then one decoding-step program per new token (:mod:`jaxdist.sample.decode`:
left padding with per-row positions, a fixed-size key/value cache sharded
like the activations, a ring past ``model.max_seq_len``).  Both programs
are jitted with this parallelism bound (``Parallelism.bind``: the model's
activation constraints and MoE expert dispatch), so decoding is
tensor-parallel over ``tensor`` with rows over the data axes, for dense and
MoE models.  The batch is filled up to a multiple of the data-parallel ways
with rows that generate nothing, so rows always split evenly (MoE dispatch
requires it).  :meth:`Sampler.generate` adds the tokenizer: text in, text
out, stop strings.

The host sees the tokens every step only when it must (a streaming
``on_token`` callback or stop strings); otherwise it looks every
``HOST_CHECK_EVERY`` steps whether every row has ended (EOS), so steps are
dispatched back to back, except on several XLA:CPU devices, where each
program is waited for before the next starts (:attr:`Sampler.one_at_a_time`:
XLA:CPU's in-process collectives can deadlock with several in flight).
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TextIO

import jax
import numpy as np

from jaxdist.config import Config
from jaxdist.data.chat import ChatTemplate, encode_chat
from jaxdist.data.tokenizer import Tokenizer, load_tokenizer
from jaxdist.errors import ConfigError, expect, expect_strings
from jaxdist.models.transformer import KV_CACHE_NAMES, create_abstract
from jaxdist.parallel.layout import Parallelism
from jaxdist.parallel.mesh import describe_mesh
from jaxdist.parallel.rules import logical_to_spec
from jaxdist.sample.config import check_request, check_texts, run_config
from jaxdist.sample.decode import Settings, decode_step, left_pad, prefill
from jaxdist.sample.load import abstract_params, restore_params

log = logging.getLogger(__name__)

# Without a streaming callback or stop strings, the host checks for the end of every row this often (steps).
HOST_CHECK_EVERY = 8

# on_token(i, ids): the i-th new token (0-based) of every prompt, ids [prompts] int32, -1 for prompts already ended.
OnToken = Callable[[int, np.ndarray], None]
# until(row, ids): whether prompt ``row`` should end after its generated ``ids`` so far (a stop string, say).
Until = Callable[[int, list[int]], bool]


@dataclass(frozen=True)
class Decoded:
    """Token ids out of :meth:`Sampler.decode`.

    ``tokens``: per prompt, the generated ids (int32), up to and including
    EOS or the token after which ``until`` said stop; ``finish``: per prompt
    ``"eos"``, ``"stop"`` or ``"length"``; ``logits`` (with ``keep_logits``):
    [prompts, steps, V] float32, the logits each new token was chosen from
    (row b's first ``len(tokens[b])`` entries are its own).
    """

    tokens: list[np.ndarray]
    finish: list[str]
    logits: np.ndarray | None = None
    prefill_s: float = 0.0  # seconds until the first new tokens were on the device (compile included, if any)
    decode_s: float = 0.0  # seconds of the decoding steps after that, until the tokens were on the host


@dataclass(frozen=True)
class Generation:
    """One prompt's continuation: ``text`` (EOS and a stop string, with what follows, cut off),
    the generated ``tokens`` (up to and including EOS or the stop string) and ``finish``
    (``"eos"``, ``"stop"`` or ``"length"``)."""

    prompt: str
    text: str
    tokens: list[int]
    finish: str


class Sampler:
    """Generates from ``params`` of ``config.model`` on ``parallelism``'s mesh (default: the config's mesh).

    ``params``: the model's parameter dict (``init_params``' structure), placed
    onto the parameter shardings if it is not there already; ``step``: the
    checkpoint step it came from, if any.  The tokenizer defaults to the one
    the run trained with (``data.tokenizer``: bytes or a tokenizer file).
    """

    def __init__(
        self,
        config: Config,
        params: dict,
        parallelism: Parallelism | None = None,
        tokenizer: Tokenizer | None = None,
        step: int | None = None,
    ):
        expect(config, Config, "Sampler's config", "a jaxdist Config (or use Sampler.from_run(run_dir))")
        expect(params, dict, "Sampler's params", "the model's parameter dict")
        self.config, self.model = config, config.model
        self.parallelism = parallelism if parallelism is not None else Parallelism.build(config)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.data.tokenizer)
        self.step = step
        _, abstract, names = create_abstract(self.model)
        self.param_shardings = self.parallelism.param_shardings(names, abstract)
        self.params = jax.device_put(params, self.param_shardings)
        self.vocab = min(self.model.vocab_size, self.tokenizer.vocab_size)  # ids both sides know
        note = vocab_note(self.model.vocab_size, self.tokenizer)
        if note:
            log.warning("%s", note)  # once per sampler: ids the tokenizer cannot decode are never drawn silently
        self.row_multiple = self._row_multiple()
        # XLA:CPU's in-process collectives block a thread per device while they wait; with several executions in
        # flight those threads can all end up waiting on devices that have none left (a deadlock, seen with
        # 8 simulated devices on 2 cores).  There each program runs alone: the host waits for every device.
        devices = self.parallelism.mesh.devices
        self.one_at_a_time = devices.size > 1 and devices.flat[0].platform == "cpu"
        self._programs: dict[tuple, Callable] = {}

    @classmethod
    def from_run(
        cls,
        run_dir: str | Path,
        step: int | None = None,
        overrides: Sequence[str] = (),
        devices: Sequence | None = None,
    ) -> Sampler:
        """A sampler of the run at ``run_dir``: its config plus ``overrides``, the checkpoint of ``step``
        (default: the newest good one), on ``devices`` (default: all).  ConfigError (one sentence) if unusable."""
        expect(run_dir, (str, os.PathLike), "Sampler.from_run's run_dir", "a run directory path")
        expect(
            step, (numbers.Integral, type(None)), "Sampler.from_run's step", "a checkpoint step number or None (newest)"
        )
        expect_strings(overrides, "Sampler.from_run's overrides", 'a list of "key=value" strings')
        cfg = run_config(run_dir, overrides)
        par = Parallelism.build(cfg, devices)
        _, abstract, names = create_abstract(cfg.model)
        params, restored = restore_params(
            run_dir, abstract_params(abstract, par.param_shardings(names, abstract)), step
        )
        return cls(cfg, params, par, step=restored)

    def _row_multiple(self) -> int:
        """Rows must split evenly over the batch axes and the MoE token shards: the batch is a multiple of this."""
        par = self.parallelism
        spec = logical_to_spec(("batch",), par.rules, par.mesh)[0]
        axes = () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)
        layout = par.expert_layout
        return math.lcm(math.prod(par.mesh.shape[a] for a in axes), layout.size(layout.token_axes))

    # ------------------------------------------------------------------ programs

    def _shardings(self, rows: int, prompt_len: int, length: int) -> dict:
        m, par = self.model, self.parallelism
        cache = par.sharding(KV_CACHE_NAMES, (m.n_layers, rows, length, m.n_kv_heads, m.head_dim))
        return {
            "row": par.sharding(("batch",), (rows,)),
            "prompt": par.sharding(("batch", "seq"), (rows, prompt_len)),
            "logits": par.sharding(("batch", "vocab"), (rows, m.vocab_size)),
            "cache": {"k": cache, "v": cache},
            "rep": par.replicated,
        }

    def _prefill(self, rows: int, prompt_len: int, length: int) -> Callable:
        """The jitted prefill of [rows, prompt_len] prompts into a cache of ``length`` slots (built once per shape)."""
        key = ("prefill", rows, prompt_len, length)
        if key not in self._programs:
            s = self._shardings(rows, prompt_len, length)
            fn = partial(prefill, cfg=self.model, length=length, vocab=self.vocab, pad=self.tokenizer.pad_id)
            self._programs[key] = jax.jit(
                self.parallelism.bind(fn),
                in_shardings=(self.param_shardings, s["prompt"], s["row"], s["row"], s["rep"], s["rep"]),
                out_shardings=(s["row"], s["logits"], s["cache"], s["row"]),
            )
        return self._programs[key]

    def _decode_step(self, rows: int, length: int) -> Callable:
        """The jitted decoding step for ``rows`` rows and a cache of ``length`` slots (its time slot is traced)."""
        key = ("decode", rows, length)
        if key not in self._programs:
            s = self._shardings(rows, 1, length)
            fn = partial(decode_step, cfg=self.model, vocab=self.vocab, pad=self.tokenizer.pad_id)
            self._programs[key] = jax.jit(
                self.parallelism.bind(fn),
                in_shardings=(
                    self.param_shardings,
                    s["row"],
                    s["rep"],
                    s["row"],
                    s["cache"],
                    s["row"],
                    s["rep"],
                    s["rep"],
                ),
                out_shardings=(s["row"], s["logits"], s["cache"], s["row"]),
                donate_argnums=(4,),  # the cache is updated in place
            )
        return self._programs[key]

    # ------------------------------------------------------------------ decoding

    def cache_length(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots for prompts of ``prompt_len`` tokens and ``max_new_tokens``: all of them, at most max_seq_len."""
        return min(self.model.max_seq_len, prompt_len + max_new_tokens)

    def decode(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_eos: bool = True,
        on_token: OnToken | None = None,
        until: Until | None = None,
        keep_logits: bool = False,
    ) -> Decoded:
        """Generate up to ``max_new_tokens`` ids after each prompt (token ids) as one batch.

        ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 cut nothing;
        ``seed``: the sampling key (same seed, same tokens).  A prompt ends at
        EOS (unless ``stop_at_eos`` is False) or when ``until`` says so; the
        loop ends when every prompt has.  ConfigError (one sentence) for a bad request.
        """
        check_request(max_new_tokens, temperature, top_k, top_p)
        rows_in = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        self._check_prompts(rows_in)
        n_real = len(rows_in)
        rows = -(-n_real // self.row_multiple) * self.row_multiple
        tokens, pads = left_pad(rows_in, rows, self.tokenizer.pad_id)
        p = tokens.shape[1]
        length = self.cache_length(p, max_new_tokens)
        done = np.arange(rows) >= n_real  # the filler rows generate nothing
        eos = self.tokenizer.eos_id if stop_at_eos and self.tokenizer.eos_id is not None else -1
        s = self._shardings(rows, p, length)  # the per-step inputs go to the devices once
        settings = jax.device_put(
            Settings(np.float32(temperature), np.int32(top_k), np.float32(top_p), np.int32(eos)), s["rep"]
        )
        key = jax.device_put(jax.random.key(seed), s["rep"])
        pads, done = jax.device_put(pads, s["row"]), jax.device_put(done, s["row"])

        start = time.perf_counter()
        token, logits, cache, done = self._prefill(rows, p, length)(self.params, tokens, pads, done, key, settings)
        jax.block_until_ready((token, cache))  # every device (fetching a replicated array waits for one only)
        prefilled = time.perf_counter()
        step = self._decode_step(rows, length)
        columns, kept_logits = [], []
        per_step = on_token is not None or until is not None
        history: list[list[int]] = [[] for _ in range(n_real)]  # host copies (per_step only)
        ended_at = np.full((n_real,), -1)
        finish = ["length"] * n_real
        for i in range(max_new_tokens):
            if i:
                token, logits, cache, done = step(
                    self.params, token, np.int32(p + i - 1), pads, cache, done, key, settings
                )
                if self.one_at_a_time:
                    jax.block_until_ready((token, cache))
            columns.append(token)
            if keep_logits:
                kept_logits.append(logits)
            if per_step:
                ids = np.asarray(token)[:n_real].astype(np.int32)
                ids[ended_at >= 0] = -1
                for b in np.flatnonzero(ended_at < 0):
                    history[b].append(int(ids[b]))
                    if ids[b] == eos or (until is not None and until(int(b), history[b])):
                        ended_at[b], finish[b] = i, "eos" if ids[b] == eos else "stop"
                if on_token is not None:
                    on_token(i, ids)
                if (ended_at >= 0).all():
                    break
            elif (i + 1) % HOST_CHECK_EVERY == 0 and np.asarray(done)[:n_real].all():
                break

        jax.block_until_ready((token, logits, cache, done))  # every device done before the next program
        generated = np.stack([np.asarray(c) for c in columns], axis=1)[:n_real]  # [prompts, steps]
        decoded = time.perf_counter()
        out = []
        for b in range(n_real):
            ids = generated[b]
            if ended_at[b] >= 0:
                ids = ids[: ended_at[b] + 1]
            elif eos >= 0 and (ids == eos).any():
                ids, finish[b] = ids[: int(np.argmax(ids == eos)) + 1], "eos"
            out.append(ids.astype(np.int32))
        stacked = np.stack([np.asarray(x) for x in kept_logits], axis=1)[:n_real] if keep_logits else None
        return Decoded(out, finish, stacked, prefilled - start, decoded - prefilled)

    def _check_prompts(self, rows: list[np.ndarray]) -> None:
        if not rows:
            raise ConfigError("no prompt given: pass at least one prompt.")
        limit = self.model.max_seq_len
        for i, r in enumerate(rows):
            if len(r) == 0:
                raise ConfigError(f"prompt {i} has no tokens: give it at least one token.")
            if len(r) > limit:
                raise ConfigError(
                    f"prompt {i} has {len(r)} tokens, more than the model's max length model.max_seq_len={limit}: "
                    "shorten it."
                )
            if r.min() < 0 or r.max() >= self.model.vocab_size:
                raise ConfigError(f"prompt {i} has token ids outside 0..{self.model.vocab_size - 1}: fix its ids.")

    def prompt_ids(self, texts: Sequence[str], chat: bool = False) -> list[np.ndarray]:
        """The token ids :meth:`generate` feeds for each prompt text; ``chat``: each text is a user message,
        rendered with the chat template saved beside the tokenizer and its generation prompt, with the ids
        ``apply_chat_template`` gives (jaxdist.data.chat)."""
        tok = self.tokenizer
        if chat:
            if not hasattr(tok, "encode_offsets"):
                raise ConfigError(
                    f"chat prompts need a Hugging Face tokenizer.json with a chat template, but the tokenizer is "
                    f"'{tok.name}': sample a run trained with one, or set data.tokenizer=PATH/tokenizer.json."
                )
            template = ChatTemplate.beside(tok.name)
            return [
                encode_chat(tok, template, [{"role": "user", "content": t}], generation_prompt=True)[0] for t in texts
            ]
        # Documents were trained as [BOS] text EOS: a prompt starts like one (BOS only where the tokenizer's
        # convention has it; never for bytes).
        start = [tok.bos_id] if tok.add_bos else []
        return [tok.encode(t, bos=tok.add_bos) if t else np.array([tok.eos_id, *start]) for t in texts]

    def generate(
        self,
        prompts: str | Sequence[str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: str | Sequence[str] | None = None,
        on_token: OnToken | None = None,
        stop_at_eos: bool = True,
        chat: bool = False,
    ) -> list[Generation]:
        """Continue each prompt (text) by up to ``max_new_tokens`` tokens; see :meth:`decode` for the settings.

        A prompt ends at EOS or once its continuation contains a ``stop``
        string (cut off in ``text``).  An empty prompt starts from EOS, the
        boundary between files in the training data (the model begins a new one).  ``chat``: each prompt is a
        user message and the text is the assistant's answer (:meth:`prompt_ids`).
        """
        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not s for s in stops):
            raise ConfigError("a stop string is empty: give stop strings of at least one character.")
        check_texts(texts, stops)
        tok = self.tokenizer
        ids = self.prompt_ids(texts, chat)
        for i, row in enumerate(ids):
            if len(row) and int(row.max()) >= self.model.vocab_size:
                raise ConfigError(
                    f"prompt {i} encodes to token id {int(row.max())}, which the model's {self.model.vocab_size} "
                    f"ids lack (tokenizer '{tok.name}' has {tok.vocab_size}): sample with the model's own tokenizer "
                    "(data.tokenizer=PATH)."
                )
        until = (lambda b, hist: any(s in tok.decode(hist) for s in stops)) if stops else None
        d = self.decode(ids, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos, on_token, until)
        out = []
        for prompt, generated, finish in zip(texts, d.tokens, d.finish):
            text = tok.decode(generated[:-1] if finish == "eos" else generated)  # without EOS
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            out.append(Generation(prompt, text if cut < 0 else text[:cut], generated.tolist(), finish))
        return out


class TextStream:
    """An ``on_token`` callback that prints prompt ``row``'s new text to ``out`` as it comes, flushed each token.

    Text that may still turn into a stop string (an ending that begins one)
    or an incomplete UTF-8 character is held back until it cannot;
    :meth:`finish` prints the rest of the final text and a newline.
    """

    def __init__(self, tokenizer: Tokenizer, out: TextIO, stops: Sequence[str] | None = None, row: int = 0):
        self.tokenizer, self.out, self.row = tokenizer, out, row
        self.stops = list(stops or [])
        self.ids: list[int] = []
        self.shown = ""

    def __call__(self, i: int, ids: np.ndarray) -> None:
        if ids[self.row] < 0:
            return
        self.ids.append(int(ids[self.row]))
        text = self.tokenizer.decode(self.ids)
        cuts = [text.find(s) for s in self.stops if s in text]
        if cuts:
            text = text[: min(cuts)]
        else:  # hold back the longest ending that begins a stop string
            text = text[
                : len(text) - max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            ]
        text = text.rstrip("\ufffd")  # perhaps the first bytes of a character
        if len(text) > len(self.shown):
            self.out.write(text[len(self.shown) :])
            self.out.flush()
            self.shown = text

    def finish(self, text: str) -> None:
        """Print what the stream held back of the final ``text``, then a newline."""
        self.out.write(text[len(self.shown) :] + "\n")
        self.out.flush()


def vocab_note(model_vocab: int, tokenizer: Tokenizer) -> str | None:
    """One line when the model's vocabulary (``model_vocab`` ids) and ``tokenizer``'s differ, else None."""
    t = tokenizer.vocab_size
    if t == model_vocab:
        return None
    if t < model_vocab:
        return (
            f"the model has {model_vocab} token ids but tokenizer '{tokenizer.name}' decodes only {t}: sampling "
            f"draws from ids 0..{t - 1} only (set data.tokenizer to the model's own tokenizer if this is not it)"
        )
    return (
        f"tokenizer '{tokenizer.name}' has {t} token ids, more than the model's {model_vocab}: a prompt that "
        f"encodes to an id >= {model_vocab} is refused"
    )


def describe(sampler: Sampler) -> str:
    """One line: model, checkpoint step, mesh (for the command line's stderr)."""
    step = "" if sampler.step is None else f", step {sampler.step}"
    return f"model {sampler.model.preset}{step}; mesh {describe_mesh(sampler.parallelism.mesh)}"

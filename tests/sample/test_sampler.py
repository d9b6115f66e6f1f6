"""The sampler (jaxdist/sample/sampler.py, decode.py): cached decoding equals recomputation, the sampling
settings, stop strings and EOS, user errors, and ``jaxdist sample`` on a trained run.

The reference is the training forward pass (``jaxdist.models.apply``) on one
device, recomputing every row's whole sequence, unpadded, at every step.
"""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdist.cluster import without_device_count
from jaxdist.config import load_config
from jaxdist.data.tokenizer import ByteTokenizer
from jaxdist.errors import ConfigError
from jaxdist.models.transformer import apply, create_abstract, forward_with_cache, init_kv_cache
from jaxdist.parallel.layout import Parallelism
from jaxdist.sample.sampler import Sampler, TextStream, describe
from tests.trees import leaf_pairs

TEXTS = ["Hello", "de", "import o"]  # 5, 2 and 8 tokens: one batch of different lengths
PROMPTS = [ByteTokenizer().encode(t).tolist() for t in TEXTS]
NEW = 6  # every test decodes PROMPTS by NEW tokens, so one sampler compiles its two programs once
MESH = ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]


def _config(model: str, mesh: list[str], *extra: str):
    return load_config(None, [f"model={model}", *mesh, *extra])


def _params(cfg) -> dict:
    """Random weights, std 0.1 (peaked next-token distributions: no near-ties for argmax), norm scales 1.

    Built with numpy: jitting ``init_params`` would take seconds of compile per model.
    """
    _, abstract, _ = create_abstract(cfg.model)
    rng = np.random.default_rng(0)

    def leaf(path, a):
        if str(path[-1].key).endswith("norm"):
            return np.ones(a.shape, np.float32)
        return rng.normal(0.0, 0.1, a.shape).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, abstract)


@functools.cache
def _sampler(model: str, mesh: tuple[str, ...] = (), tokenizer=None) -> Sampler:
    """One sampler per model, mesh and tokenizer for the whole module (its programs compile once)."""
    cfg = _config(model, list(mesh) or ["mesh.data=1"])
    devices = jax.devices() if mesh else jax.devices()[:1]
    return Sampler(cfg, _params(cfg), Parallelism.build(cfg, devices), tokenizer)


@functools.cache
def _recompute_greedy(model: str, steps: int = NEW) -> tuple[list[list[int]], np.ndarray]:
    """(greedy tokens, logits [rows, steps, V]) of PROMPTS by the full forward pass over each row's sequence at
    every step, on one device, without a cache."""
    cfg = _config(model, [])
    graphdef, _, _ = create_abstract(cfg.model)
    forward = jax.jit(lambda p, x: apply(graphdef, p, x))
    params = _params(cfg)
    seqs = [list(p) for p in PROMPTS]
    width = max(map(len, PROMPTS)) + steps  # right padding: the causal logits of a position ignore what follows
    logits = np.zeros((len(PROMPTS), steps, cfg.model.vocab_size), np.float32)
    for i in range(steps):
        batch = np.zeros((len(seqs), width), np.int32)
        for b, s in enumerate(seqs):
            batch[b, : len(s)] = s
        out = np.asarray(forward(params, batch))
        for b, s in enumerate(seqs):
            logits[b, i] = out[b, len(s) - 1]
            s.append(int(np.argmax(logits[b, i])))
    return [s[len(p) :] for s, p in zip(seqs, PROMPTS)], logits


def _ids(decoded) -> list[list[int]]:
    return [t.tolist() for t in decoded.tokens]


@pytest.mark.parametrize("mesh", [(), tuple(MESH)], ids=["1-device", "data2-fsdp2-tensor2"])
@pytest.mark.parametrize("model", ["tiny", "moe-tiny"])
def test_cached_greedy_decoding_equals_recomputation(model, mesh):
    sampler = _sampler(model, mesh)
    got = sampler.decode(PROMPTS, NEW, stop_at_eos=False, keep_logits=True)
    want_tokens, want_logits = _recompute_greedy(model)
    assert _ids(got) == want_tokens
    np.testing.assert_allclose(got.logits, want_logits, rtol=0, atol=1e-5)
    if mesh:  # the cache is sharded like the activations: rows over data x fsdp, key/value heads over tensor
        spec = sampler._shardings(4, 8, 14)["cache"]["k"].spec
        assert tuple(spec)[1:4] == (("data", "fsdp"), None, "tensor")


def test_past_max_seq_len_the_cache_is_a_sliding_window():
    full = _sampler("tiny")
    window = Sampler(
        _config("tiny", ["mesh.data=1", "model.max_seq_len=12", "train.seq_len=12"]), full.params, full.parallelism
    )
    assert window.cache_length(8, NEW) == 12 and full.cache_length(8, NEW) == 14
    a = window.decode(PROMPTS, NEW, stop_at_eos=False)  # 8 + 6 slots in 12: the ring wraps at the 6th new token
    b = full.decode(PROMPTS, NEW, stop_at_eos=False)
    assert [t[:5] for t in _ids(a)] == [t[:5] for t in _ids(b)]  # the same until slot 0 is overwritten
    assert all(len(t) == NEW and ((t >= 0) & (t < 260)).all() for t in a.tokens)


def test_after_the_ring_wraps_decoding_equals_a_sliding_window_recomputation():
    """Decoding well past the wrap (12 cache slots; 8 + 10 time slots, so slots 0..5 are overwritten) equals a
    recomputation without the ring: at every step each row's whole sequence, alone and unpadded, through the model
    with a fresh buffer as long as the sequence, every query seeing the newest 12 positions up to its own (in
    every layer: a cached token's upper-layer keys were computed from its own window, so the newest 12 tokens
    alone through the model are not the reference).  That forward shares the attention code with the sampler,
    checked against the training forward pass above; not the ring's slot arithmetic, writes and masks.
    The short row ("de") never holds 12 tokens of its own, but the ring overwrites its padding slots: it checks
    that they stay masked."""
    steps, length = 10, 12
    full = _sampler("tiny")
    window = Sampler(
        _config("tiny", ["mesh.data=1", f"model.max_seq_len={length}", f"train.seq_len={length}"]),
        full.params,
        full.parallelism,
    )
    assert window.cache_length(8, steps) == length
    got = window.decode(PROMPTS, steps, stop_at_eos=False, keep_logits=True)

    m = _config("tiny", []).model

    @jax.jit
    def banded(params, tokens):  # tokens [1, n]: logits [1, n, V], position i seeing positions i-11..i
        i = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        visible = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - length)
        cache = init_kv_cache(m, 1, tokens.shape[1])
        return forward_with_cache(params, tokens, i[None, :], cache, jnp.int32(0), visible[None], m)[0]

    seqs = [list(p) for p in PROMPTS]
    want = np.zeros((len(PROMPTS), steps, m.vocab_size), np.float32)
    for i in range(steps):
        for b, s in enumerate(seqs):
            want[b, i] = np.asarray(banded(full.params, np.array([s], np.int32)))[0, -1]
            s.append(int(np.argmax(want[b, i])))
    assert max(len(s) for s in seqs) - 1 > length + 4  # the longest row decoded 5 tokens past its first window
    assert _ids(got) == [s[len(p) :] for s, p in zip(seqs, PROMPTS)]
    np.testing.assert_allclose(got.logits, want, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- sampling settings


def test_top_k_1_and_tiny_top_p_equal_greedy():
    tiny = _sampler("tiny")
    greedy = _ids(tiny.decode(PROMPTS, NEW, stop_at_eos=False))
    for kw in (dict(top_k=1), dict(top_p=1e-4)):
        assert _ids(tiny.decode(PROMPTS, NEW, temperature=1.0, seed=3, stop_at_eos=False, **kw)) == greedy, kw


def test_seeds_repeat_and_differ_and_cuts_hold():
    tiny = _sampler("tiny")

    def draw(seed, **kw):
        return tiny.decode(PROMPTS, NEW, temperature=1.5, seed=seed, stop_at_eos=False, keep_logits=True, **kw)

    a, b, c = draw(7), draw(7), draw(8)
    assert _ids(a) == _ids(b) and _ids(a) != _ids(c)
    k = draw(1, top_k=3)
    for row, logits in zip(k.tokens, k.logits):  # each drawn token is one of its step's 3 likeliest
        top3 = np.argsort(logits, axis=-1)[:, -3:]
        assert all(t in top3[i] for i, t in enumerate(row))
    p = draw(2, top_p=0.3)
    for row, logits in zip(p.tokens, p.logits):  # ... one of the smallest set of likeliest with probability >= 0.3
        for i, t in enumerate(row):
            probs = np.exp(logits[i] / 1.5 - np.max(logits[i] / 1.5))
            probs /= probs.sum()
            order = np.argsort(-probs)
            assert t in order[: int(np.searchsorted(np.cumsum(probs[order]), 0.3)) + 1]
    assert all(((t >= 0) & (t < 260)).all() for t in a.tokens + c.tokens)


def test_a_continuation_given_back_as_the_prompt_goes_on_with_the_same_draws():
    """Each token is drawn with the seed's key folded with the time slot of the token fed in, so the draws belong
    to positions: generating 6 tokens, or generating from the prompt followed by the first k of them (same seed),
    gives the same tokens.  Temperature 1.5: the draws decide, not the argmax."""
    tiny = _sampler("tiny")
    prompt = PROMPTS[0]
    full = tiny.decode([prompt], NEW, temperature=1.5, seed=11, stop_at_eos=False).tokens[0].tolist()
    for k in (1, 3):
        rest = tiny.decode([prompt + full[:k]], NEW - k, temperature=1.5, seed=11, stop_at_eos=False)
        assert rest.tokens[0].tolist() == full[k:], (k, full, rest.tokens[0].tolist())


class AsciiTokenizer(ByteTokenizer):
    """Decodes ids 0..127 only: a tokenizer whose vocabulary is smaller than the model's."""

    vocab_size = 128


ASCII = AsciiTokenizer()  # one instance: the cached sampler of this tokenizer is shared by the tests


def test_ids_the_tokenizer_cannot_decode_are_never_chosen():
    assert any((t >= 128).any() for t in _sampler("tiny").decode(PROMPTS, NEW, stop_at_eos=False).tokens)
    ascii_only = _sampler("tiny", (), ASCII)
    assert all((t < 128).all() for t in ascii_only.decode(PROMPTS, NEW, stop_at_eos=False).tokens)
    assert all((t < 128).all() for t in ascii_only.decode(PROMPTS, NEW, 2.0, seed=1, stop_at_eos=False).tokens)


def test_stop_string_and_eos_end_a_prompt():
    sampler = _sampler("tiny", (), ASCII)  # ASCII text: every token is one character
    draw = dict(temperature=1.0, seed=0)  # varied text (greedy repeats one character); the same draws each time
    full = sampler.generate(TEXTS, NEW, stop_at_eos=False, **draw)
    j = next(i for i, ch in enumerate(full[0].text) if i >= 1 and full[0].text.index(ch) == i)  # a new character
    stopped = sampler.generate(TEXTS, NEW, stop=full[0].text[j], **draw)
    assert stopped[0].text == full[0].text[:j] and stopped[0].finish == "stop"
    assert stopped[0].tokens == full[0].tokens[: j + 1] and stopped[0].prompt == "Hello"
    for f, s in zip(full[1:], stopped[1:]):  # the other prompts end at the same string, or run to the end
        assert s.text == f.text.split(full[0].text[j])[0] and s.finish == ("stop" if s.text != f.text else "length")

    eos = full[0].tokens[2]
    sampler.tokenizer.eos_id = eos  # the token ending a prompt is a traced setting: the same programs
    try:
        ended = sampler.generate(TEXTS, NEW, **draw)
    finally:
        del sampler.tokenizer.eos_id
    assert ended[0].finish == "eos" and ended[0].tokens == full[0].tokens[: full[0].tokens.index(eos) + 1]
    assert ended[0].text == full[0].text[: full[0].tokens.index(eos)]


def test_text_stream_prints_as_it_comes_and_holds_back_a_possible_stop():
    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), out, stops=["END"])
    for i, ch in enumerate(b"ab\xc3\xa9cEN"):
        stream(i, np.array([ch, -1]))
    assert out.getvalue() == "ab\u00e9c"  # "EN" may still become "END"; the two bytes of the e-acute came together
    stream(8, np.array([ord("X"), -1]))
    assert out.getvalue() == "ab\u00e9cENX"  # "ENX" cannot
    stream(9, np.array([-1, -1]))  # ended
    stream.finish("ab\u00e9cENX")
    assert out.getvalue() == "ab\u00e9cENX\n"


def test_text_stream_cuts_at_the_first_stop_and_shows_id_0():
    """Id 0 is a token like any other (byte 0 here), not the end of a row (-1); once a stop string is complete the
    text is cut at its first occurrence, and nothing after it is ever printed, a second occurrence included."""
    out = io.StringIO()
    stream = TextStream(ByteTokenizer(), out, stops=["END"], row=1)
    for i, ch in enumerate(b"a\x00bEND"):
        stream(i, np.array([-1, ch]))
    assert out.getvalue() == "a\x00b"
    for i, ch in enumerate(b"xEND!", start=6):
        stream(i, np.array([-1, ch]))
    assert out.getvalue() == "a\x00b"  # "a\x00bENDxEND!" is cut at the first END, not the last


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(top_p=0.0), "top_p=0.0 is outside (0, 1]"),
        (dict(top_p=1.5), "top_p=1.5 is outside (0, 1]"),
        (dict(prompts=[list(range(129))]), "more than the model's max length model.max_seq_len=128"),
    ],
)
def test_bad_requests_raise_config_error(kw, words):
    args = dict(prompts=PROMPTS, max_new_tokens=NEW) | kw
    with pytest.raises(ConfigError) as e:
        _sampler("tiny").decode(args.pop("prompts"), **args)
    assert words in str(e.value) and str(e.value).count(". ") == 0  # one sentence


def test_decode_refuses_prompts_with_its_whole_sentences_and_takes_the_edges():
    """No prompt, an empty one, one longer than max_seq_len, an id below 0 or at vocab_size: one sentence each. A
    prompt of exactly max_seq_len tokens with ids 0 and vocab_size - 1 decodes, and a prompt given as a 2-D array
    is its flattened ids."""
    sampler = _sampler("tiny")
    vocab, limit = sampler.model.vocab_size, sampler.model.max_seq_len
    outside = f"prompt 0 has token ids outside 0..{vocab - 1}: fix its ids."
    for prompts, sentence in [
        ([], "no prompt given: pass at least one prompt."),
        ([[1], []], "prompt 1 has no tokens: give it at least one token."),
        (
            [[1] * (limit + 1)],
            f"prompt 0 has {limit + 1} tokens, more than the model's max length model.max_seq_len={limit}: shorten it.",
        ),
        ([[1, -1]], outside),
        ([[1, vocab]], outside),
    ]:
        with pytest.raises(ConfigError) as e:
            sampler.decode(prompts, 2)
        assert str(e.value) == sentence
    assert len(sampler.decode([[0] * (limit - 1) + [vocab - 1]], 1).tokens[0]) == 1
    flat = sampler.decode([PROMPTS[0][:4]], 2).tokens[0].tolist()
    assert sampler.decode([np.array(PROMPTS[0][:4]).reshape(2, 2)], 2).tokens[0].tolist() == flat


def test_decode_defaults_end_at_eos_draw_with_seed_0_and_keep_no_logits():
    sampler = _sampler("tiny", (), ASCII)
    full = sampler.decode(PROMPTS, NEW, stop_at_eos=False)
    assert full.logits is None
    warm = sampler.decode(PROMPTS, NEW, temperature=1.5)
    assert _ids(warm) == _ids(sampler.decode(PROMPTS, NEW, temperature=1.5, seed=0))
    eos = int(full.tokens[0][2])
    first = int(full.tokens[0][0])
    streamed = []
    sampler.tokenizer.eos_id = eos  # a traced setting: the same programs
    try:
        ended = sampler.decode(PROMPTS, NEW)
        assert _ids(sampler.decode(PROMPTS, NEW, stop_at_eos=False)) == _ids(full)  # EOS is only a token then
        sampler.tokenizer.eos_id = first  # prompt 0 ends at its first token: after it, it streams -1
        sampler.decode(PROMPTS, NEW, on_token=lambda i, ids: streamed.append(ids.copy()))
    finally:
        del sampler.tokenizer.eos_id
    assert [int(ids[0]) for ids in streamed] == [first] + [-1] * (len(streamed) - 1) and len(streamed) > 1
    assert all(ids.dtype == np.int32 for ids in streamed)
    assert (
        ended.finish[0] == "eos"
        and ended.tokens[0].tolist() == full.tokens[0].tolist()[: full.tokens[0].tolist().index(eos) + 1]
    )


def test_generate_defaults_are_greedy_and_seed_0():
    """``generate`` without settings is greedy (temperature 0), and a temperature without a seed draws with seed 0."""
    sampler = _sampler("tiny")
    greedy = sampler.decode(PROMPTS, NEW)
    assert [g.tokens for g in sampler.generate(TEXTS, NEW)] == [t.tolist() for t in greedy.tokens]
    warm = sampler.generate(TEXTS, NEW, temperature=1.5)
    assert warm == sampler.generate(TEXTS, NEW, temperature=1.5, seed=0)
    assert warm != sampler.generate(TEXTS, NEW, temperature=1.5, seed=1)


def test_an_empty_prompt_starts_from_eos():
    """An empty prompt text is EOS (the boundary between training documents), then BOS where the tokenizer adds one;
    other texts are their encoding."""
    sampler = _sampler("tiny")
    tok = sampler.tokenizer
    assert [p.tolist() for p in sampler.prompt_ids(["de", ""])] == [tok.encode("de").tolist(), [tok.eos_id]]
    with pytest.MonkeyPatch.context() as mp:  # a tokenizer that adds BOS: after the EOS of an empty prompt too
        mp.setattr(tok, "add_bos", True)
        want = [tok.encode("de", bos=True).tolist(), [tok.eos_id, tok.bos_id]]
        assert [p.tolist() for p in sampler.prompt_ids(["de", ""])] == want
    (g,) = sampler.generate([""], 3, stop_at_eos=False)
    assert len(g.tokens) == 3 and g.prompt == ""


def test_generate_refuses_with_its_whole_sentences():
    """An empty stop string; a stop string, then a prompt, that is not UTF-8 (each named as what it is); a prompt
    that encodes to the first id past the model's vocabulary (``vocab_size`` itself), while the last id the model
    has passes."""
    sampler = _sampler("tiny")
    with pytest.raises(ConfigError) as e:
        sampler.generate(TEXTS, 2, stop=["ab", ""])
    assert str(e.value) == "a stop string is empty: give stop strings of at least one character."
    with pytest.raises(ConfigError) as e:
        sampler.generate(TEXTS, 2, stop=["ab", "x\udcff"])
    assert str(e.value) == "stop string 1 is not valid UTF-8 text (byte 1 of it): pass it as UTF-8."
    with pytest.raises(ConfigError) as e:
        sampler.generate(["a", "\udcfe"], 2)
    assert str(e.value) == "prompt 1 is not valid UTF-8 text (byte 0 of it): pass it as UTF-8."

    tok, vocab = sampler.tokenizer, sampler.model.vocab_size
    for last in (vocab - 1, vocab):  # "!" encodes to that id
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(
                tok, "encode", lambda t, bos=False, last=last: np.array([last if c == "!" else ord(c) for c in t])
            )
            if last < vocab:
                assert len(sampler.generate(["a", "b!"], 1)) == 2
                continue
            with pytest.raises(ConfigError) as e:
                sampler.generate(["a", "b!"], 1)
    assert str(e.value) == (
        f"prompt 1 encodes to token id {vocab}, which the model's {vocab} ids lack (tokenizer '{tok.name}' has "
        f"{tok.vocab_size}): sample with the model's own tokenizer (data.tokenizer=PATH)."
    )


def test_one_stop_string_of_several_characters_is_one_string():
    """``stop="xy"`` stops at "xy", not at "x" or "y" alone; ``on_token`` sees every new id as it is chosen."""
    sampler = _sampler("tiny", (), ASCII)  # ASCII text: every token is one character
    draw = dict(temperature=1.0, seed=0, stop_at_eos=False)
    (full,) = sampler.generate(TEXTS[:1], NEW, **draw)
    ch = full.text[1]
    stop = ch + next(c for c in "qwertyuiopQWERTY" if ch + c not in full.text)
    seen = []
    (g,) = sampler.generate(TEXTS[:1], NEW, stop=stop, on_token=lambda i, ids: seen.append((i, int(ids[0]))), **draw)
    assert g.text == full.text and g.finish == "length" and g.tokens == full.tokens
    assert seen == list(enumerate(full.tokens))


def test_the_text_is_cut_at_the_first_stop_even_at_its_start():
    """With a tokenizer whose every token decodes to two characters, the first token already holds the stop string
    twice: the text is cut before the first, to nothing."""
    sampler = _sampler("tiny", (), ASCII)
    draw = dict(temperature=1.0, seed=0, stop_at_eos=False)
    (full,) = sampler.generate(TEXTS[:1], NEW, **draw)
    tok = sampler.tokenizer
    plain = tok.decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tok, "decode", lambda ids: "".join(2 * ch for ch in plain(ids)))
        (g,) = sampler.generate(TEXTS[:1], NEW, stop=full.text[0], **draw)
    assert g.text == "" and g.finish == "stop" and g.tokens == full.tokens[:1]


@pytest.mark.parametrize(
    "mesh, rows",
    [
        ((), 1),
        (("mesh.data=8",), 8),
        (tuple(MESH), 4),  # data x fsdp; tensor does not split rows
        (("mesh.data=2", "mesh.context=4"), 8),  # the tokens split over context too
    ],
)
def test_the_rows_are_a_multiple_of_what_splits_them(mesh, rows):
    """A batch of prompts is padded to a multiple of the batch axes and of the axes that split the tokens."""
    assert _sampler("tiny", mesh)._row_multiple() == rows


def test_rows_split_over_an_axis_the_tokens_are_not_split_over():
    """Rules of one's own that split rows over ``tensor`` (data 4 x tensor 2), where the experts' hidden width is
    split too, so the MoE tokens are not: the rows are a multiple of 8, not of the tokens' 4."""
    from jaxdist.parallel.rules import DEFAULT_RULES

    rules = tuple(("batch", ("data", "tensor")) if name == "batch" else (name, axes) for name, axes in DEFAULT_RULES)
    cfg = _config("tiny", ["mesh.data=4", "mesh.tensor=2"])
    par = Parallelism.for_mesh(Parallelism.build(cfg, jax.devices()).mesh, rules)
    assert par.expert_layout.size(par.expert_layout.token_axes) == 4
    assert Sampler(cfg, _params(cfg), par)._row_multiple() == 8


@pytest.mark.parametrize(
    "mesh, extra, n",
    [
        (["mesh.data=2", "mesh.tensor=4"], [], 3),  # 2 KV heads: the cache is not split over tensor
        (["mesh.data=2", "mesh.context=4"], [], 2),  # prompts of 5 and 2 tokens: 5 is not split over context
        (["mesh.data=4", "mesh.tensor=2"], ["model.vocab_size=259"], 3),  # the logits' 259 ids are not split
    ],
    ids=["tensor4-kv2", "context4-prompt5", "tensor2-vocab259"],
)
def test_shapes_the_mesh_does_not_divide_decode_as_one_device_does(mesh, extra, n):
    """The shardings follow the shapes (an axis that does not divide a dimension does not split it), and the tokens
    are the single device's."""
    cfg, one = _config("tiny", mesh, *extra), _config("tiny", ["mesh.data=1"], *extra)
    sampler = Sampler(cfg, _params(cfg), Parallelism.build(cfg, jax.devices()))
    single = Sampler(one, _params(one), Parallelism.build(one, jax.devices()[:1]))
    assert _ids(sampler.decode(PROMPTS[:n], NEW)) == _ids(single.decode(PROMPTS[:n], NEW))


def test_one_sampler_decodes_a_second_shape_as_a_new_sampler_does():
    """A sampler keeps one prefill and one decoding program per shape: after a short request, a longer one (a longer
    prompt, more tokens: a longer cache) decodes as a sampler that never saw the first; its KV cache and logits come
    out on the shardings planned for them."""
    cfg = _config("tiny", MESH)
    used, fresh = (Sampler(cfg, _params(cfg), Parallelism.build(cfg, jax.devices())) for _ in range(2))
    used.decode([PROMPTS[1]], 2, stop_at_eos=False)
    seen = {}

    def spy(program, name, p_of):
        def build(rows, *shape):
            fn = program(rows, *shape)

            def call(*args):
                out = fn(*args)
                seen[name] = (args, out, used._shardings(rows, p_of(shape), shape[-1]))
                return out

            return call

        return build

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(used, "_prefill", spy(used._prefill, "prefill", lambda shape: shape[0]))
        mp.setattr(used, "_decode_step", spy(used._decode_step, "decode", lambda shape: 1))
        again = used.decode(PROMPTS, NEW + 4, stop_at_eos=False)
    assert _ids(again) == _ids(fresh.decode(PROMPTS, NEW + 4, stop_at_eos=False))
    for name in ("prefill", "decode"):  # the logits and the KV cache on their planned shardings
        _, (_, logits, cache, _), planned = seen[name]
        assert logits.sharding.is_equivalent_to(planned["logits"], logits.ndim), name
        assert all(cache[k].sharding.is_equivalent_to(planned["cache"][k], cache[k].ndim) for k in "kv"), name
    args, _, _ = seen["decode"]
    assert args[4]["k"].is_deleted() and args[4]["v"].is_deleted()  # the step updated the cache in place


def test_the_parameters_are_placed_and_several_cpu_devices_run_one_program_at_a_time():
    """Without a parallelism the config's mesh on every device; the parameters on their shardings (some split);
    one program at a time on two or more XLA:CPU devices, not on one."""
    cfg = _config("tiny", MESH)
    assert Sampler(cfg, _params(cfg)).parallelism.mesh.devices.size == 8
    sharded = _sampler("tiny", tuple(MESH))
    pairs = leaf_pairs(sharded.params, sharded.param_shardings)
    assert pairs and all(p.sharding == s for p, s in pairs)
    assert not all(p.sharding.is_fully_replicated for p, _ in pairs)
    two = _config("tiny", ["mesh.data=2"])
    pair = Sampler(two, _params(two), Parallelism.build(two, jax.devices()[:2]))
    assert (sharded.one_at_a_time, pair.one_at_a_time, _sampler("tiny").one_at_a_time) == (True, True, False)


def test_a_mesh_of_one_data_axis_samples():
    """A mesh built by hand with only a ``data`` axis (the others absent, not of size 1) pads to 8 rows and decodes
    as the single device does."""
    from jax.sharding import Mesh

    cfg = _config("tiny", ["mesh.data=8"])
    sampler = Sampler(cfg, _params(cfg), Parallelism.for_mesh(Mesh(np.array(jax.devices()), ("data",))))
    assert sampler._row_multiple() == 8
    assert _ids(sampler.decode(PROMPTS, NEW)) == _ids(_sampler("tiny").decode(PROMPTS, NEW))


def test_from_run_restores_the_step_asked_for(tmp_path):
    """A run with checkpoints at steps 1 and 2: ``from_run(step=1)`` holds step 1's parameters and says so; without
    a step, the newest."""
    from jaxdist.train.trainer import Trainer

    cfg = _config(
        "tiny",
        [],
        "train.steps=2",
        "train.seq_len=32",
        "train.batch_size=8",
        "data.max_bytes=20000",
        "checkpoint.every=1",
        "train.progress=false",
        "train.tensorboard=false",
        f"train.runs_dir={tmp_path}",
        "train.name=two",
    )
    with Trainer(cfg) as t:
        t.fit()
        final = jax.device_get(t.state["params"])
    devices = jax.devices()[:1]
    first, newest = (
        Sampler.from_run(tmp_path / "two", step=1, devices=devices),
        Sampler.from_run(tmp_path / "two", devices=devices),
    )
    assert (first.step, newest.step) == (1, 2)
    assert describe(first).startswith("model tiny, step 1;") and describe(newest).startswith("model tiny, step 2;")
    same = [np.array_equal(a, b) for a, b in leaf_pairs(jax.device_get(newest.params), final)]
    assert same and all(same)
    assert not all(np.array_equal(a, b) for a, b in leaf_pairs(jax.device_get(first.params), final))


def test_describe_names_the_model_the_step_and_the_mesh():
    """The line ``jaxdist sample`` prints on stderr; the step only when the parameters came from a checkpoint."""
    one = _sampler("tiny")
    stepped = Sampler(one.config, one.params, one.parallelism, step=7)
    assert describe(one) == "model tiny; mesh single device (1 device, 1 process)"
    assert describe(stepped) == "model tiny, step 7; mesh single device (1 device, 1 process)"


def test_runs_without_a_checkpoint_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Sampler.from_run(tmp_path / "nope")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(_config("tiny", []).to_dict()))
    with pytest.raises(ConfigError, match="has no committed checkpoint"):
        Sampler.from_run(run)


# --------------------------------------------------------------------------- jaxdist sample


def _jaxdist(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # the CLI sets up the run's devices itself; conftest's compile flags stay
    env = {**os.environ, "XLA_FLAGS": without_device_count(os.environ["XLA_FLAGS"])}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "jaxdist.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


def test_cli_samples_a_trained_run_and_reports_errors(tmp_path):
    train = ["model=tiny", "train.seq_len=32", "train.batch_size=16", "train.steps=2", "data.max_bytes=200000"]
    train += ["train.eval_batches=0", "train.tensorboard=false"]  # no evaluation program to compile
    r = _jaxdist("train", *train, "train.progress=false", "train.name=s", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _jaxdist("sample", "runs/s", "--prompt", "def f(", "--max-new-tokens", "12", "mesh.tensor=2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("def f(") and len(r.stdout) > len("def f(\n")
    assert "model tiny, step 2; mesh data=4 tensor=2 (8 devices" in r.stderr
    for args, words in [
        (["runs/missing"], "run directory 'runs/missing' does not exist"),
        (["runs/s", "--top-p", "2"], "top_p=2.0 is outside (0, 1]"),
    ]:
        r = _jaxdist("sample", *args, cwd=tmp_path)
        assert r.returncode == 2 and words in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------- the batch layout and the ring, without a model


def test_left_pad_right_aligns_the_prompts_after_pad_ids():
    from jaxdist.sample.decode import left_pad

    tokens, pads = left_pad([np.array([5, 6, 7]), np.array([8])], 3, pad=9)
    assert tokens.dtype == np.int32 and pads.dtype == np.int32
    assert tokens.tolist() == [[5, 6, 7], [9, 9, 8], [9, 9, 9]]  # the third row is filler: all padding
    assert pads.tolist() == [0, 2, 3]


def test_ring_slots_and_visibility_equal_a_simulated_ring():
    """Writing time slot tau's token to cache slot tau mod S, step by step: at time t slot j holds the newest tau
    written there (none yet: a negative time), and a query of row b sees it when tau >= pads[b]."""
    from jaxdist.sample.decode import slot_times, visible_slots

    length, pads = 4, np.array([0, 2, 5], np.int32)
    ring = [-1] * length
    for t in range(11):
        ring[t % length] = t
        held = np.asarray(slot_times(jnp.int32(t), length))
        written = np.array(ring) >= 0
        assert held[written].tolist() == np.array(ring)[written].tolist(), t
        assert (held[~written] < 0).all(), t
        seen = np.asarray(visible_slots(jnp.array([t], jnp.int32), jnp.asarray(pads), length))  # [B, 1, S]
        want = [[written[j] and ring[j] >= p for j in range(length)] for p in pads]
        assert seen[:, 0, :].tolist() == want, t


def test_next_token_ends_rows_at_eos_and_pads_rows_already_done():
    """Greedy: the argmax per row; a done row gets the pad id; a row that drew EOS is done from now on.  Sampling:
    the key is folded with the time slot, so the same slot repeats its draws and another slot draws others."""
    from jaxdist.sample.decode import Settings, _next

    logits = jnp.asarray(np.eye(6, dtype=np.float32)[[2, 4, 1]] * 5.0)
    key = jax.random.key(0)
    greedy = Settings(jnp.float32(0), jnp.int32(0), jnp.float32(1), jnp.int32(4))
    token, done = jax.jit(_next, static_argnums=(5, 6))(
        logits, key, jnp.int32(3), jnp.array([False, False, True]), greedy, 6, 7
    )
    assert np.asarray(token).tolist() == [2, 4, 7] and np.asarray(done).tolist() == [False, True, True]

    sample = Settings(jnp.float32(1), jnp.int32(0), jnp.float32(1), jnp.int32(-1))
    wide = jnp.zeros((256, 6), jnp.float32)  # uniform: 256 draws of 6 ids
    draw = jax.jit(lambda t: _next(wide, key, t, jnp.zeros(256, bool), sample, 6, 0)[0])
    a, b, c = (np.asarray(draw(jnp.int32(t))) for t in (3, 3, 4))
    assert (
        (a == b).all()
        and (a != c).any()
        and (a == np.asarray(jax.random.categorical(jax.random.fold_in(key, 3), wide))).all()
    )

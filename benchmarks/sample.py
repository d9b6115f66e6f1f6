"""Sampling speed: jaxdist's Sampler against a hand-written plain-JAX decode loop over the same weights.

On 8 simulated CPU devices (default mesh data=2, fsdp=2, tensor=2; the
``small`` preset with random weights, or a trained run with ``--run``) and
for batches of 1 and 16 prompts of ``--prompt-len`` random bytes, both
generate ``--new`` tokens greedily:

- ``sampler``: ``Sampler.decode`` as a user calls it (left padding,
  per-row positions, the cache sharded like the activations with the
  model's constraints, the one program for every sampling setting, EOS
  off so every row runs to the end);
- ``hand``: what a user would write without jaxdist: the same transformer
  (RMSNorm, rotary, grouped-query attention, SwiGLU, tied embeddings)
  written out in ``jax.numpy``, a [layers, B, S, kv, hd] cache written with
  ``dynamic_update_slice`` at one shared position, argmax, one jitted prefill
  and one jitted step, with the sampler's parameter and cache shardings and
  cache donation but no activation constraints.

Prefill tokens/s = batch x prompt length / the prefill's seconds (until the
first tokens are on the device); decode tokens/s = batch x (new - 1) / the
seconds of the decoding steps (until the tokens are on the host).  Medians
over ``--reps`` alternating repetitions after a warmup (which compiles).
The table also says whether the two produced the same tokens.

    python benchmarks/sample.py
    python benchmarks/sample.py --run runs/default --mesh data=8 --new 128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxdist.config import load_config  # noqa: E402
from jaxdist.models.transformer import KV_CACHE_NAMES, init_params  # noqa: E402
from jaxdist.parallel.layout import Parallelism  # noqa: E402
from jaxdist.sample.sampler import Sampler  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="small", help="model preset with random weights (default: small)")
    p.add_argument("--run", help="a trained run directory: its newest checkpoint instead of random weights")
    p.add_argument("--mesh", default="data=2,fsdp=2,tensor=2", help="mesh axis sizes AXIS=SIZE,... (8 devices)")
    p.add_argument("--batches", default="1,16", help="batch sizes, comma-separated (default: 1,16)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default: 64)")
    p.add_argument("--new", type=int, default=64, help="tokens generated per prompt (default: 64)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per variant (default: 5)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mesh = [f"mesh.{kv.strip()}" for kv in args.mesh.split(",") if kv.strip()]
    if args.run:
        sampler = Sampler.from_run(args.run, overrides=mesh)
    else:
        cfg = load_config(None, [f"model={args.preset}", *mesh])
        params = jax.jit(lambda: init_params(cfg.model, 0))()
        sampler = Sampler(cfg, params, Parallelism.build(cfg))
    cfg = sampler.model
    assert not cfg.moe.experts, "the hand-written loop is the dense model"
    rng = np.random.default_rng(0)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = rng.integers(32, 127, size=(batch, args.prompt_len)).astype(np.int32)
        hand = HandLoop(sampler, batch, args.prompt_len + args.new)
        times = {"sampler": [], "hand": []}
        same = True
        for rep in range(args.reps + 1):  # the first is the warmup (compiles)
            d = sampler.decode(list(prompts), args.new, stop_at_eos=False)
            tokens, prefill_s, decode_s = hand.generate(prompts, args.new)
            same &= np.array_equal(np.stack(d.tokens), tokens)
            if rep:
                times["sampler"].append((d.prefill_s, d.decode_s))
                times["hand"].append((prefill_s, decode_s))
        med = {k: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v)) for k, v in times.items()}
        rate = {k: (batch * args.prompt_len / p, batch * (args.new - 1) / d) for k, (p, d) in med.items()}
        rows.append((batch, rate, same))

    print(
        f"model {cfg.preset} ({'run ' + args.run if args.run else 'random weights'}), mesh {args.mesh}, "
        f"{len(jax.devices())} {jax.devices()[0].platform} devices, prompt {args.prompt_len} tokens, "
        f"{args.new} new tokens, greedy, median of {args.reps}; JAX {jax.__version__}"
    )
    head = f"{'batch':>5} | {'prefill tok/s':>13} {'hand':>9} {'ratio':>6} | {'decode tok/s':>12} {'hand':>9} {'ratio':>6} | same tokens"
    print(head)
    print("-" * len(head))
    for batch, rate, same in rows:
        (sp, sd), (hp, hd) = rate["sampler"], rate["hand"]
        print(
            f"{batch:>5} | {sp:>13.0f} {hp:>9.0f} {sp / hp:>6.2f} | {sd:>12.0f} {hd:>9.0f} {sd / hd:>6.2f} | "
            f"{'yes' if same else 'NO'}"
        )
    return 0


class HandLoop:
    """A plain-JAX greedy decoder of a dense jaxdist model's parameter dict: one jitted prefill, one jitted step."""

    def __init__(self, sampler: Sampler, batch: int, length: int):
        cfg, par = sampler.model, sampler.parallelism
        self.params, self.one_at_a_time = sampler.params, sampler.one_at_a_time
        cache_shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
        cache = par.sharding(KV_CACHE_NAMES, cache_shape)
        cache = (cache, cache)
        rep = par.replicated
        f32 = jnp.float32

        def rms(x, scale):
            return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.norm_eps) * scale

        def rope(x, pos):  # x [B, T, H, D], pos [T]
            half = cfg.head_dim // 2
            inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, cfg.head_dim, 2, dtype=f32) / cfg.head_dim))
            ang = pos.astype(f32)[:, None] * inv[None, :]
            c, s = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
            x1, x2 = x[..., :half], x[..., half:]
            return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)

        def forward(params, tokens, start, kc_all, vc_all):  # tokens [B, T] at positions start..start+T-1
            t = tokens.shape[1]
            pos = start + jnp.arange(t)
            x = params["embed"][tokens]
            g = cfg.n_heads // cfg.n_kv_heads

            def layer(x, xs):
                p, kc, vc = xs
                h = rms(x, p["attn_norm"])
                q = rope(jnp.einsum("btd,dhk->bthk", h, p["wq"]), pos)
                k = rope(jnp.einsum("btd,dhk->bthk", h, p["wk"]), pos)
                v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
                kc = jax.lax.dynamic_update_slice(kc, k, (0, start, 0, 0))
                vc = jax.lax.dynamic_update_slice(vc, v, (0, start, 0, 0))
                qg = q.reshape(*q.shape[:2], cfg.n_kv_heads, g, cfg.head_dim)
                scores = jnp.einsum("btkgd,bskd->bkgts", qg, kc) / jnp.sqrt(f32(cfg.head_dim))
                mask = pos[:, None] >= jnp.arange(length)[None, :]
                probs = jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)
                ctx = jnp.einsum("bkgts,bskd->btkgd", probs, vc).reshape(q.shape)
                x = x + jnp.einsum("bthk,hkd->btd", ctx, p["wo"])
                h = rms(x, p["mlp_norm"])
                x = x + jnp.einsum("btf,fd->btd", jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"]), p["w_down"])
                return x, (kc, vc)

            x, (kc_all, vc_all) = jax.lax.scan(layer, x, (params["layers"], kc_all, vc_all))
            logits = rms(x[:, -1], params["final_norm"]) @ params["embed"].T
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), kc_all, vc_all

        def prefill(params, tokens):
            zeros = jnp.zeros(cache_shape, f32)
            return forward(params, tokens, 0, zeros, zeros)

        def step(params, token, pos, kc, vc):
            return forward(params, token[:, None], pos, kc, vc)

        shardings = sampler.param_shardings
        self._prefill = jax.jit(prefill, in_shardings=(shardings, rep), out_shardings=(rep, *cache))
        self._step = jax.jit(
            step, in_shardings=(shardings, rep, rep, *cache), out_shardings=(rep, *cache), donate_argnums=(3, 4)
        )

    def generate(self, prompts, new: int):
        """(tokens [B, new], prefill seconds, decode seconds), measured like Sampler.decode."""
        start = time.perf_counter()
        token, kc, vc = self._prefill(self.params, prompts)
        jax.block_until_ready((token, kc, vc))
        prefilled = time.perf_counter()
        out = [token]
        for i in range(1, new):
            token, kc, vc = self._step(self.params, token, np.int32(prompts.shape[1] + i - 1), kc, vc)
            if self.one_at_a_time:  # as the Sampler does on XLA:CPU (see Sampler.one_at_a_time)
                jax.block_until_ready((token, kc, vc))
            out.append(token)
        jax.block_until_ready((token, kc, vc))  # every device done, as in Sampler.decode
        tokens = np.stack([np.asarray(t) for t in out], axis=1)
        return tokens, prefilled - start, time.perf_counter() - prefilled


if __name__ == "__main__":
    sys.exit(main())

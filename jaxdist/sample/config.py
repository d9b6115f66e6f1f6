"""What sampling reads and checks before JAX starts: a run's config and the settings of a request.

``jaxdist sample RUN_DIR`` needs the run's config first, to know how many
simulated CPU devices its cluster file asks for (``prepare_host_devices``
must run before JAX is imported).  The run directory holds the config it was
trained with (``config.json``, written by the Trainer); dotted overrides
(``mesh.tensor=2 mesh.data=-1``) change it for sampling, the mesh above all.
No JAX here.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from pathlib import Path

from jaxdist.config import Config, from_dict, parse_overrides, validate_model_on_mesh
from jaxdist.config.hf_dir import run_tokenizer
from jaxdist.errors import ConfigError, expect
from jaxdist.run_owner import check_not_own_model

_FLOAT32_MAX = 3.4028234663852886e38  # the sampling settings reach the devices as float32


def run_config(run_dir: str | Path, overrides: Sequence[str] = ()) -> Config:
    """The config ``run_dir`` was trained with, plus ``overrides``; ConfigError (one sentence) if unusable.

    Only what sampling uses is checked: the model, the mesh and the model's fit to it, and the tokenizer
    file; the training data settings (``data.source``, ``train.*``) are never read here.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise ConfigError(f"run directory '{run}' does not exist: pass the run's folder, e.g. runs/<train.name>.")
    stored = run / "config.json"
    if not stored.is_file():
        raise ConfigError(f"'{run}' has no config.json: pass a run directory written by `jaxdist train`.")
    check_not_own_model(run, "jaxdist sample")
    try:
        cfg = from_dict(json.loads(stored.read_text()))
    except ValueError as e:
        raise ConfigError(
            f"'{stored}' is not a readable config ({e}): pass a run directory written by jaxdist."
        ) from None
    cfg = cfg.set(**{"data.tokenizer": run_tokenizer(run, cfg.data.tokenizer)})
    for key, value in parse_overrides(list(overrides)):
        cfg = cfg.set(**{key: value})
    validate_model_on_mesh(cfg)
    if cfg.data.tokenizer != "bytes" and not Path(cfg.data.tokenizer).is_file():
        raise ConfigError(
            f"data.tokenizer '{cfg.data.tokenizer}' does not exist: point it at the run's tokenizer.json or "
            "SentencePiece .model (data.tokenizer=PATH), or use bytes."
        )
    if cfg.mesh.auto:
        raise ConfigError("sampling needs explicit mesh sizes, not mesh=auto: pass e.g. mesh.data=-1 mesh.tensor=1.")
    if cfg.mesh.pipeline > 1:
        raise ConfigError(
            f"sampling runs without pipeline stages, the run has mesh.pipeline={cfg.mesh.pipeline}: "
            "pass mesh.pipeline=1 mesh.data=-1 (or other sizes without pipeline)."
        )
    return cfg


def check_texts(prompts: Sequence[str], stops: Sequence[str] = ()) -> None:
    """ConfigError (one sentence) for a prompt or stop string that is not valid UTF-8 text: a shell passes invalid
    bytes as lone surrogates (``\\udcff``), which no tokenizer can encode and no terminal can print."""
    for what, texts in (("prompt", prompts), ("stop string", stops)):
        for i, text in enumerate(texts):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ConfigError(
                    f"{what} {i} is not valid UTF-8 text (byte {e.start} of it): pass it as UTF-8."
                ) from None


def check_request(max_new_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
    """ConfigError (one sentence saying what to change) for sampling settings that cannot work."""
    expect(max_new_tokens, numbers.Integral, "max_new_tokens", "a whole number of tokens")
    expect(temperature, numbers.Real, "temperature", "a number (0: greedy)")
    expect(top_k, numbers.Integral, "top_k", "a whole number of tokens (0: no cut)")
    expect(top_p, numbers.Real, "top_p", "a number in (0, 1]")
    if max_new_tokens <= 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens} generates nothing: ask for at least 1 token.")
    if not abs(temperature) <= _FLOAT32_MAX:  # nan, inf, or inf once a float32 on the devices
        raise ConfigError(
            f"temperature={temperature} is not a finite number: use 0 (greedy) or a positive temperature such as 0.8."
        )
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} is negative: use 0 (greedy) or a positive temperature.")
    if top_k < 0:
        raise ConfigError(f"top_k={top_k} is negative: use 0 (no top-k cut) or a positive number of tokens.")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p} is outside (0, 1]: use 1 (no nucleus cut) or a share like 0.9.")


def clamp_new_tokens(max_new_tokens: int, longest_prompt: int, max_seq_len: int) -> tuple[int, str | None]:
    """(tokens to generate, a notice or None): ``max_new_tokens`` clamped so the longest prompt (tokens) and its
    continuation fit ``max_seq_len`` (past it the sampler's cache is a sliding window over positions the model
    never trained on).  ConfigError (one sentence) when a prompt leaves no room at all."""
    room = max_seq_len - longest_prompt
    if room < 1:
        raise ConfigError(
            f"a prompt has {longest_prompt} tokens, which leaves no room in model.max_seq_len={max_seq_len} "
            "for new tokens: shorten it."
        )
    if max_new_tokens <= room:
        return max_new_tokens, None
    return room, (
        f"--max-new-tokens={max_new_tokens} does not fit model.max_seq_len={max_seq_len} after the longest "
        f"prompt's {longest_prompt} tokens: generating at most {room} tokens (clamped)."
    )

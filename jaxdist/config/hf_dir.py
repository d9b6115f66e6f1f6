"""What a Hugging Face model directory holds besides the weights (no JAX): config.json's numbers, the tokenizer.

:func:`check_numbers` refuses, in one sentence, a ``config.json`` whose shape
keys are missing, not whole numbers or not positive, before any of them is
used (``int("abc")`` or a division by zero heads would otherwise be a
traceback).  :func:`model_tokenizer` makes ``model.init_from`` bring the
directory's tokenizer (``tokenizer.json``, else a SentencePiece
``tokenizer.model``) as ``data.tokenizer`` for a run that trains on a token
file, unless the user chose one;
:func:`copy_tokenizer` copies a tokenizer file and the files that belong to it
(``tokenizer_config.json``: BOS/EOS/pad; ``special_tokens_map.json``; the chat
template) into a run directory or an exported model directory.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

from jaxdist.errors import ConfigError

log = logging.getLogger(__name__)

# The tokenizer itself, in order of preference (a fast tokenizer.json over a SentencePiece model).
TOKENIZER_MAIN = ("tokenizer.json", "tokenizer.model")
# The files that travel with it: its settings (special tokens, add_bos_token, the chat template) and the template
# as transformers 5 saves it beside them.
TOKENIZER_FILES = (
    *TOKENIZER_MAIN,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
# The folder of a run (or a converted run) that holds its copy of the tokenizer.
RUN_TOKENIZER_DIR = "tokenizer"

# config.json keys that fix the model's shape: (key, required).  Each must be a whole number >= 1 when present.
_SHAPE_KEYS = (
    ("vocab_size", True),
    ("hidden_size", True),
    ("num_hidden_layers", True),
    ("num_attention_heads", True),
    ("intermediate_size", True),
    ("num_key_value_heads", False),
    ("head_dim", False),
    ("max_position_embeddings", False),
    ("num_local_experts", False),
    ("num_experts_per_tok", False),
)
# Keys that must be positive numbers when present.
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
# Keys that must be a table (or null) when present.
_TABLES = ("rope_scaling", "rope_parameters")


def check_numbers(hf: dict[str, Any], where: str = "config.json") -> None:
    """ConfigError (one sentence) for a missing, non-integer or non-positive shape key, a non-positive
    ``rms_norm_eps``/``rope_theta`` or a rope table that is not a table, in the config.json ``hf``."""
    for key, required in _SHAPE_KEYS:
        value = hf.get(key)
        if value is None:
            if required:
                raise ConfigError(f"{where} has no '{key}': download the model's config.json again.")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ConfigError(f"'{key}' in {where} is {value!r}, not a whole number: write it as a number.")
        if value < 1:
            raise ConfigError(f"'{key}' in {where} is {value}: it must be at least 1.")
    heads, d = hf["num_attention_heads"], hf["hidden_size"]
    if hf.get("head_dim") is None and d % heads:
        raise ConfigError(
            f"hidden_size={d} in {where} is not divisible by num_attention_heads={heads} and no head_dim is given: "
            "add the model's head_dim."
        )
    for key in _POSITIVE_NUMBERS:
        value = hf.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ConfigError(f"'{key}' in {where} is {value!r}, not a positive number: fix it.")
    for key in _TABLES:
        value = hf.get(key)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(
                f"'{key}' in {where} is {value!r}, not a table: write it as {{\"rope_type\": ...}} or remove it."
            )


def tokenizer_in(hf_dir: str | Path) -> Path | None:
    """The tokenizer file of a model directory (``tokenizer.json``, else ``tokenizer.model``), or None."""
    for name in TOKENIZER_MAIN:
        p = Path(hf_dir) / name
        if p.is_file():
            return p.absolute()
    return None


def model_tokenizer(cfg: Any, explicit: set[str]) -> Any:
    """``cfg`` with ``data.tokenizer`` set to ``model.init_from``'s tokenizer, unless the user set
    ``data.tokenizer`` (``explicit``: the dotted keys given) or the directory has none.

    Only a token file (``data.source=tokens``) can be in the model's ids; a text source is read byte by byte,
    so there the tokenizer is left out and a warning says so (the run trains and samples with bytes).
    """
    if not cfg.model.init_from or "data.tokenizer" in explicit:
        return cfg
    found = tokenizer_in(cfg.model.init_from)
    if found is None:
        return cfg
    if cfg.data.source != "tokens":
        log.warning(
            "model.init_from's tokenizer %s is not used: data.source=%s is read byte by byte; prepare the text "
            "with `jaxdist data prepare SRC OUT --tokenizer %s` and train with data.source=tokens",
            found,
            cfg.data.source,
            found,
        )
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(found)))


def copy_tokenizer(tokenizer: str | Path, dst_dir: str | Path) -> Path:
    """Copy the tokenizer file ``tokenizer`` and the files of :data:`TOKENIZER_FILES` beside it into ``dst_dir``
    (created); returns the copy of the tokenizer file.  The main file keeps its name."""
    src = Path(tokenizer)
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if name in TOKENIZER_MAIN:
            continue
        if (src.parent / name).is_file():
            shutil.copyfile(src.parent / name, dst / name)
    shutil.copyfile(src, dst / src.name)
    return (dst / src.name).absolute()


def run_tokenizer(run_dir: str | Path, spec: str) -> str:
    """``data.tokenizer`` = ``spec`` of the run at ``run_dir``: a recorded file that no longer exists but whose copy
    lies in the run's own ``tokenizer/`` folder (the run was moved) becomes that copy."""
    if spec == "bytes" or Path(spec).is_file():
        return spec
    copy = Path(run_dir) / RUN_TOKENIZER_DIR / Path(spec).name
    return str(copy.absolute()) if copy.is_file() else spec

"""Fuzzing the config reader (issue 39): any TOML text and any override value either loads or is refused with a
ConfigError (one sentence, exit 2 at the CLI), never another exception.

hypothesis draws TOML documents over the real keys with values of every TOML type, and dotted overrides of
every key with arbitrary text; a fixed seed keeps CI repeatable.
"""

from __future__ import annotations

import tomllib

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import (  # noqa: E402
    HealthCheck,
    given,
    seed,
    settings,
    strategies as st,  # noqa: E402
)

from jaxdist.config import ConfigError, all_keys, load_config  # noqa: E402

KEYS = all_keys()
SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3), st.dictionaries(st.text(max_size=4), SCALARS, max_size=2))


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == float("-inf") else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return (
        "{"
        + ", ".join(f'"{k.encode("unicode_escape").decode("ascii")}" = {_toml_value(x)}' for k, x in v.items())
        + "}"
    )


def _loads_or_refuses(path=None, overrides=()):
    try:
        load_config(path, list(overrides))
    except ConfigError as e:
        assert str(e) and "\n" not in str(e).strip(), str(e)


@seed(39)
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=4))
def test_toml_documents_load_or_are_refused(tmp_path_factory, items):
    lines = []
    for key, value in items:
        section, _, name = key.rpartition(".")
        lines.append(f"[{section}]\n{name} = {_toml_value(value)}\n")
    text = "\n".join(lines)
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        pass  # a table given twice: the reader says it is not valid TOML, which is the refusal
    path = tmp_path_factory.mktemp("fuzz") / "c.toml"
    path.write_text(text, encoding="utf-8")
    _loads_or_refuses(path)


@seed(39)
@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(KEYS), st.one_of(st.text(max_size=24), st.text(alphabet="0a.-e \n\x00[]{}'\"=", max_size=8)))
def test_overrides_load_or_are_refused(key, text):
    _loads_or_refuses(overrides=[f"{key}={text}"])


@seed(39)
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=200))
def test_arbitrary_bytes_as_a_config_file_are_refused_or_load(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("bytes") / "c.toml"
    path.write_bytes(data)
    _loads_or_refuses(path)

"""The error a user can cause and fix: one sentence that says what to change (the CLI exits with code 2)."""


class ConfigError(ValueError):
    """A user-caused configuration mistake, reported as one sentence."""


def expect(value: object, types: type | tuple[type, ...], name: str, what: str) -> None:
    """ConfigError unless ``value`` is one of ``types`` (a bool is not an int here): the edge of the Python API,
    so that a wrong argument is one sentence naming it, not an AttributeError deep inside."""
    kinds = types if isinstance(types, tuple) else (types,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        raise ConfigError(f"{name} must be {what}, not {type(value).__name__} {_short(value)}.")


def expect_strings(value: object, name: str, what: str) -> None:
    """ConfigError unless ``value`` is a list or tuple of strings (a lone string is refused: it would be read
    character by character)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{name} must be {what}, not {type(value).__name__} {_short(value)}.")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

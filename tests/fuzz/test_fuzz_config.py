"""Generated run configs: TOML files and ``--set`` overrides load, or fail with one line.

Values are drawn for each key by its declared type (the field's own type most of the
time, any other TOML value sometimes), under the real keys and under made-up ones. A
file (or a list of overrides) gives a ``RunConfig`` or a ``ValueError`` whose message
is one line: never a ``TypeError``, ``KeyError``, ``AttributeError`` or
``ZeroDivisionError`` out of a section's checks. A config that loads survives its own
round trips: ``from_dict(to_dict())`` and ``--set key=<its value as TOML>`` give it back.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tetrarec.config import RunConfig
from tetrarec.config.convert import _dataclass_of
from tetrarec.types import OpenEnum

FUZZ = settings.get_profile("tetrarec-fuzz")


def leaves(cls: type, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: declared type}`` of every value (not section) under ``cls``."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            out.update(leaves(sub, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = hints[f.name]
    return out


LEAVES = leaves(RunConfig)
KEYS = sorted(LEAVES)
TEXT = st.text(st.characters(blacklist_categories=["Cs"]), max_size=8)
SCALARS = st.one_of(
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(),
    TEXT,
)
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3), max_leaves=6)


def typed(hint: Any) -> st.SearchStrategy[Any]:
    """Values of the declared type ``hint`` (as TOML would give them), edges included."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([typed(a) for a in typing.get_args(hint) if a is not type(None)])
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(typed(args[0]), max_size=4)
        return st.tuples(*(typed(a) for a in args)).map(list)
    if isinstance(hint, type) and issubclass(hint, enum.Enum | OpenEnum):
        return st.sampled_from([str(m.value) for m in hint]) | TEXT
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(-3, 4096) | st.integers(-(2**63), 2**63 - 1)
    if hint is float:
        return st.floats(-10, 10) | st.floats() | st.sampled_from(["inf", "-inf"])
    return st.sampled_from(["", "a", "synthetic", "criteo", "/nonexistent", "x.toml"]) | TEXT


def mostly(usual: st.SearchStrategy[Any], rare: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``usual`` nine times in ten, else ``rare`` (``|`` would draw each half the time)."""
    return st.integers(0, 9).flatmap(lambda i: usual if i else rare)


def value_for(key: str) -> st.SearchStrategy[Any]:
    return mostly(typed(LEAVES[key]), ANY)


KEY = mostly(
    st.sampled_from(KEYS),
    st.sampled_from(KEYS).map(lambda k: k + "x")
    | st.text("abcdefghijklmnopqrstuvwxyz._", min_size=1, max_size=12),
)


def toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\' or ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    """``value`` as TOML text (tomllib reads it back as the same value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise AssertionError(value)


def toml_key(key: str) -> str:
    return ".".join(
        p if p and all(c.isalnum() or c in "_-" for c in p) and p.isascii() else toml_string(p)
        for p in key.split(".")
    )


def load(path, overrides=()) -> RunConfig | ValueError:
    try:
        return RunConfig.from_toml(path, overrides)
    except ValueError as e:
        error = e
    assert "\n" not in str(error).strip(), str(error)
    event("refused")
    return error


def assert_round_trips(config: RunConfig) -> None:
    event("loaded")
    assert RunConfig.from_dict(config.to_dict()) == config


@FUZZ
@given(
    entries=st.dictionaries(KEY, st.none(), max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries(
            {k: (value_for(k) if k in LEAVES else ANY) for k in keys}
        )
    )
)
def test_generated_toml_loads_or_is_one_value_error(tmp_path, entries) -> None:
    """Typed values at their edges and values of the wrong type, under real and made-up
    keys: a ``RunConfig`` that round-trips, or one ``ValueError`` naming the file."""
    lines = []
    for key, value in entries.items():
        lines.append(f"{toml_key(key)} = {toml_value(value)}")
    p = tmp_path / "run.toml"
    p.write_text("\n".join(lines) + "\n")
    got = load(p)
    if isinstance(got, ValueError):
        # a key that is both a value and a section is TOML's own error
        assert str(got).startswith(str(p)), got
        return
    assert_round_trips(got)


@FUZZ
@given(
    sets=st.lists(
        KEY.flatmap(
            lambda k: st.tuples(
                st.just(k), mostly((value_for(k) if k in LEAVES else ANY).map(toml_value), TEXT)
            )
        ),
        max_size=4,
    ),
    separator=st.sampled_from(["=", " = ", ""]),
)
def test_set_overrides_load_or_are_one_value_error(tmp_path, sets, separator) -> None:
    """``--set KEY=TEXT`` with any text (bare, TOML, lists, ``none``), malformed items
    (no ``=``) and unknown keys: a ``RunConfig`` that round-trips, or one ``ValueError``."""
    p = tmp_path / "run.toml"
    p.write_text("")
    got = load(p, [f"{k}{separator}{v}" for k, v in sets])
    if not isinstance(got, ValueError):
        assert_round_trips(got)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes_are_a_value_error_or_a_config(tmp_path, raw) -> None:
    """A file of any bytes (not UTF-8, not TOML, a TOML of other shapes): a config or one
    ``ValueError`` naming the file, never a ``UnicodeDecodeError`` of its own."""
    p = tmp_path / "run.toml"
    p.write_bytes(raw)
    got = load(p)
    if isinstance(got, ValueError):
        assert type(got) is ValueError
        assert str(got).startswith(str(p))


@FUZZ
@given(data=st.data())
def test_set_to_the_current_value_changes_nothing(data) -> None:
    """Every key, set to the value the config already holds (written as TOML), gives the
    same config back: ``--set`` reads each type as the file does (a list read as one
    string, an infinity or an enum not read back, fails here)."""
    base = data.draw(
        st.sampled_from([RunConfig(), RunConfig.from_dict({"data": {"dense_clip": [-1e30, 5.0]}})])
    )
    flat: dict[str, Any] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v

    walk(base.to_dict(), "")
    key = data.draw(st.sampled_from(sorted(flat)))
    assert base.with_overrides([f"{key}={toml_value(flat[key])}"]) == base

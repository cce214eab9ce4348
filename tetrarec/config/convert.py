"""Strict conversion between the frozen config sections and plain dicts.

``config_from_dict`` builds a section from the values a TOML file (or JSON, or
``--set``) gives: an unknown key is a ``ValueError`` that lists the valid keys of its
section, and each value is converted to its field's declared type (``int`` fields
reject ``1.5``, enum fields take their string value, a list is a tuple field's).

A float field also takes the strings ``"inf"`` and ``"-inf"`` (in the file, an override
or a dict): ``config_to_dict`` writes an infinity so, since JSON has no number for it
and a checkpoint's ``meta.json`` must give the config back (``tetrarec.jsonio``).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import TYPE_CHECKING, Any, TypeVar

from tetrarec import jsonio
from tetrarec.types import OpenEnum

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["config_from_dict", "config_to_dict"]


_T = TypeVar("_T", bound="DataclassInstance")


def config_to_dict(obj: Any) -> Any:
    """Convert a config dataclass (recursively) into TOML- and JSON-compatible plain values.

    An infinite float becomes ``"inf"``/``"-inf"`` (JSON has no number for it), which
    ``config_from_dict`` reads back as the float.
    """
    if isinstance(obj, float):
        return jsonio.inf_text(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _fields_to_dict(obj)
    if isinstance(obj, enum.Enum | OpenEnum):  # OpenEnum: ShardingType
        return obj.value
    if isinstance(obj, tuple | list):
        return [config_to_dict(v) for v in obj]
    return obj


def _fields_to_dict(obj: DataclassInstance) -> dict[str, Any]:
    """``config_to_dict`` of one dataclass instance: its fields, ``None`` left out."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is not None:
            out[f.name] = config_to_dict(value)
    return out


def config_from_dict(cls: type[_T], values: Any, where: str) -> _T:
    """Build dataclass ``cls`` from ``values``, strictly (``where`` names the section).

    Raises:
        ValueError: on an unknown key (listing the valid ones) or a bad value.
    """
    if not isinstance(values, dict):
        raise ValueError(f"{where or 'config'} must be a table, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(values) - set(names))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(
            f"unknown config key {prefix}{unknown[0]}; valid keys of "
            f"{where or 'the top level'}: {', '.join(names)}"
        )
    kwargs = {k: _convert(hints[k], v, f"{where}.{k}" if where else k) for k, v in values.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        if where and str(e).startswith(f"{where}."):  # it names its key already
            raise ValueError(str(e)) from e
        raise ValueError(f"{where or 'config'}: {e}") from e


def _convert(hint: Any, value: Any, where: str) -> Any:
    """Convert ``value`` to the type ``hint`` (see ``config_from_dict``)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        arms = typing.get_args(hint)
        if value is None and type(None) in arms:
            return None
        errors: dict[Any, str] = {}
        for arm in (a for a in arms if a is not type(None)):
            try:
                return _convert(arm, value, where)
            except ValueError as e:
                errors[arm] = str(e)
        # Name only the arms of the value's shape: "'foo' is not one of host, ..." for
        # an ``enum | tuple[enum, ...]`` field given one bad name, not also "expected
        # a list".
        is_list = isinstance(value, list | tuple)
        shaped = [e for a, e in errors.items() if (typing.get_origin(a) is tuple) == is_list]
        raise ValueError(" / ".join(shaped or errors.values()))
    if origin is tuple:
        return _convert_tuple(typing.get_args(hint), value, where)
    section = _dataclass_of(hint)
    if section is not None:
        return config_from_dict(section, value, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum | OpenEnum):
        if isinstance(value, hint):
            return value
        valid = ", ".join(str(m.value) for m in hint)
        if isinstance(value, str):
            for member in hint:
                if str(member.value) == value.lower():
                    return member
        raise ValueError(f"{where}: {value!r} is not one of {valid}")
    return _convert_scalar(hint, value, where)


def _convert_tuple(args: tuple[Any, ...], value: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"{where}: expected a list, got {value!r}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if len(args) != len(value):
        raise ValueError(f"{where}: expected {len(args)} values, got {list(value)}")
    return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))


_SCALARS: dict[type, tuple[type, ...]] = {
    bool: (bool,),
    int: (int,),
    float: (int, float),
    str: (str,),
}


def _convert_scalar(hint: Any, value: Any, where: str) -> Any:
    accepted = _SCALARS.get(hint)
    if hint is float:  # "inf"/"-inf": an infinity as config_to_dict writes it for JSON
        value = jsonio.parse_inf(value)
    if accepted is None:
        raise TypeError(f"{where}: unsupported config field type {hint!r}")
    # bool is an int subclass: an int field must not take True, nor a bool field 1.
    if isinstance(value, bool) != (hint is bool) or not isinstance(value, accepted):
        raise ValueError(f"{where}: expected {hint.__name__}, got {value!r}")
    return hint(value)


def _dataclass_of(hint: Any) -> type[DataclassInstance] | None:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    return None

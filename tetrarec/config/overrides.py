"""How the text of a dotted override (``--set KEY=VALUE``) is read for its field.

Each value is read as a TOML value first, for every type::

    train.steps=10                       int          optim.dense_lr=1e-3      float
    train.deterministic=true             bool         optim.sparse.kind=adam   enum
    train.checkpoint_dir="out/ck"        str: out/ck (the quotes are TOML's, not the path's)
    train.checkpoint_dir=none            None, for a field that may be unset (also null)
    model.dlrm.bottom_mlp=[64, 16]       tuple        model.num_embeddings=1000 (int | tuple)
    data.train_path=["a.parquet", "b.parquet"]

and only when the TOML reading does not fit the field, as plain text: a bare string
(``train.checkpoint_dir=out/ck``, ``train.checkpoint_dir=123`` stays the string
``"123"``), or, for a list field, comma-separated items (``model.dlrm.top_mlp=64,1``,
``data.train_path=a.tsv,b.tsv``, or one bare path). To set a ``str | None`` field to
the text "none", quote it (``="none"``).

The overrides are merged into the file's values before anything is validated
(``RunConfig.from_toml``, ``RunConfig.with_overrides``).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
import types
import typing
from typing import Any

from tetrarec.config.convert import _convert, _dataclass_of

__all__: list[str] = []


def _field_type(cls: type, path: list[str]) -> Any:
    """The declared type of dotted ``path`` under dataclass ``cls``.

    Raises:
        ValueError: on an unknown key (listing the valid ones) or a path that stops at
            a section.
    """
    hint: Any = cls
    for i, part in enumerate(path):
        sub = _dataclass_of(hint)
        where = ".".join(path[:i]) or "the top level"
        if sub is None:
            raise ValueError(f"{'.'.join(path[:i])} is a value, not a section")
        names = [f.name for f in dataclasses.fields(sub) if f.init]
        if part not in names:
            raise ValueError(
                f"unknown config key {'.'.join(path[: i + 1])}; valid keys of {where}: "
                f"{', '.join(names)}"
            )
        hint = typing.get_type_hints(sub)[part]
    if _dataclass_of(hint) is not None:
        raise ValueError(f"{'.'.join(path)} is a section; set one of its keys")
    return hint


_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _parse_text(text: str, hint: Any, where: str) -> Any:
    """Parse an override's text for the field ``where`` of type ``hint``.

    The first reading that converts to the field's type wins, in this order:

    1. ``none`` or ``null`` (any case) for a field that may be ``None``, and for a list
       field the empty list (so does an empty text: ``data.eval_path=none``,
       ``data.dense_columns=``);
    2. the text as a TOML value (``10``, ``1e-3``, ``true``, ``[64, 16]``, ``"out/ck"``);
       a TOML string for a list field is a one-item list;
    3. for a float field, a decimal TOML refuses (``.5``, ``5.``); then the bare text
       (``out/ck``, ``adam``, or ``123`` for a ``str`` field);
    4. for a list field, comma-separated items (``64,16``), each parsed the same way.

    When none converts, the TOML reading (else the bare text; for a list field written
    ``[a, b]``, its items) is returned, so that the conversion's error names the value
    as TOML read it, or the bad item.
    """
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    arms = typing.get_args(hint) if union else (hint,)
    if text.lower() in ("none", "null"):
        if type(None) in arms:
            return None
        if typing.get_origin(hint) is tuple:  # a list field: none is the empty list
            return []
    if not text.strip() and typing.get_origin(hint) is tuple:  # data.dense_columns=
        return []
    candidates: list[Any] = []
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    else:
        candidates.append(value)
        if isinstance(value, str):
            candidates.append([value])
    if float in arms and _DECIMAL.fullmatch(text):  # ".5" and "5." are not TOML floats
        candidates.append(float(text))
    candidates.append(text)
    listed = None
    for arm in arms:
        if typing.get_origin(arm) is tuple:
            item = typing.get_args(arm)[0]
            bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
            items = [t.strip() for t in bare.split(",")]
            listed = [_parse_text(t, item, f"{where}[{i}]") for i, t in enumerate(items)]
            candidates.append(listed)
            break
    for candidate in candidates:
        try:
            _convert(hint, candidate, where)
        except (ValueError, TypeError):
            continue
        return candidate
    if listed is not None and text.startswith("["):  # "[host, foo]": name the bad item
        return listed
    return candidates[0]

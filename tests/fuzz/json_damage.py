"""Damage done to a JSON document the way a hand edit or a bad tool might.

Shared by the fuzz tests of the plan file and of a checkpoint's ``meta.json``: a value
anywhere replaced by any JSON value (huge integers, floats, strings, nesting), a key or
an item removed, an integer moved by one or by a lot.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(10**400), 10**400)
    | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path (keys and indices) to a value inside ``value``, ``()`` the whole."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths(v, (*prefix, i))
    return out


@st.composite
def damaged(draw: st.DrawFn, document: Any, max_edits: int = 3) -> Any:
    """A copy of ``document`` with 0 to ``max_edits`` edits at random places."""
    doc = copy.deepcopy(document)
    for _ in range(draw(st.integers(0, max_edits))):
        where = draw(st.sampled_from(paths(doc)))
        if not where:
            doc = draw(JSON)
            continue
        *head, last = where
        node = doc
        for k in head:
            node = node[k]
        how = draw(st.sampled_from(["replace", "delete", "nudge"]))
        if how == "delete":
            del node[last]
        elif how == "nudge" and isinstance(node[last], int) and not isinstance(node[last], bool):
            node[last] += draw(st.sampled_from([-1, 1, -(10**6), 2**63]))
        else:
            node[last] = draw(JSON)
    return doc

"""``Handle``: a result that may still be in flight; ``wait()`` returns it.

Collectives start when called and return a ``Handle``; the caller waits when it needs the
result, so that communication overlaps whatever runs in between (the pipelined loop
starts batch i+1's input dist before batch i's backward). No lazy tensor magic: a value
is only usable after ``wait()``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Handle"]

T = TypeVar("T")
U = TypeVar("U")

_UNSET = object()


class Handle(Generic[T]):
    """A value produced by ``wait_fn`` on the first ``wait()`` (then memoized).

    Args:
        wait_fn: completes the operation and returns its value.

    Example:
        >>> h = Handle.done(3).then(lambda x: x + 1)
        >>> h.wait()
        4
    """

    def __init__(self, wait_fn: Callable[[], T]) -> None:
        self._wait_fn: Callable[[], T] | None = wait_fn
        self._value: object = _UNSET

    @staticmethod
    def done(value: U) -> Handle[U]:
        """A handle whose value is already there."""
        return Handle(lambda: value)

    def wait(self) -> T:
        """Complete the operation (once) and return its value."""
        if self._value is _UNSET:
            assert self._wait_fn is not None
            self._value = self._wait_fn()
            self._wait_fn = None  # drop references to buffers and work objects
        return self._value  # type: ignore[return-value]  # set from wait_fn's T above

    def then(self, fn: Callable[[T], U]) -> Handle[U]:
        """A handle whose value is ``fn`` of this one's (applied on ``wait``)."""
        return Handle(lambda: fn(self.wait()))

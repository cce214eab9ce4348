"""Leaf enums that carry behaviour. This module imports nothing from tetrarec.

Following FBGEMM's ``SparseType`` and ``EmbOptimType``, each enum answers the
questions the rest of the code would otherwise re-derive with ``if`` chains:
how many bits a precision takes, which torch dtype stores it, how many optimizer
state values a row needs.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from typing import Any, ClassVar, Self

import torch

__all__ = [
    "NamedEnum",
    "OpenEnum",
    "OptimizerKind",
    "Placement",
    "PoolingMode",
    "Precision",
    "ShardingType",
]


class NamedEnum(enum.Enum):
    """An enum whose members are named by lower-case strings, parsed from config text."""

    #: The noun used in error messages ("unknown precision 'x'; valid: ...").
    __noun__ = "value"

    @classmethod
    def parse(cls, value: str | Self) -> Self:
        """Return the member named by ``value`` (case-insensitive), or ``value`` itself.

        Raises:
            ValueError: if ``value`` names no member; the message lists the valid ones.
        """
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(str(m.value) for m in cls)
            raise ValueError(f"unknown {cls.__noun__} {value!r}; valid: {valid}") from None


class Precision(NamedEnum):
    """How the values of an embedding row (or a message) are stored.

    Integer formats are row-wise affine: ``x ~= q * scale + bias`` with one FP16 scale
    and one FP16 bias per row, stored after the packed values so that a row is one
    contiguous block of bytes (FBGEMM's fused row layout).
    """

    __noun__ = "precision"

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int:
        """Bits per stored value."""
        return _BITS[self]

    @property
    def is_integer(self) -> bool:
        """True for the row-wise affine integer formats (INT8, INT4)."""
        return self in (Precision.INT8, Precision.INT4)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the storage tensor (``uint8`` for packed integer rows)."""
        return _DTYPES[self]

    def row_bytes(self, dim: int) -> int:
        """Bytes one row of ``dim`` values takes, with its scale and bias if any.

        Integer rows are padded to ``row_alignment`` bytes so that rows start aligned.
        """
        payload = (dim * self.bits + 7) // 8
        if not self.is_integer:
            return payload
        raw = payload + 4  # FP16 scale + FP16 bias
        align = self.row_alignment
        return (raw + align - 1) // align * align

    @property
    def row_alignment(self) -> int:
        """Byte alignment of a stored row (FBGEMM's ``align_size``)."""
        return 4 if self.is_integer else self.bits // 8


_BITS = {
    Precision.FP32: 32,
    Precision.FP16: 16,
    Precision.BF16: 16,
    Precision.FP8: 8,
    Precision.INT8: 8,
    Precision.INT4: 4,
}
_DTYPES = {
    Precision.FP32: torch.float32,
    Precision.FP16: torch.float16,
    Precision.BF16: torch.bfloat16,
    Precision.FP8: torch.float8_e4m3fn,
    Precision.INT8: torch.uint8,
    Precision.INT4: torch.uint8,
}


class PoolingMode(NamedEnum):
    """How the embeddings of one bag are combined."""

    __noun__ = "pooling"

    SUM = "sum"
    MEAN = "mean"


class OptimizerKind(NamedEnum):
    """Sparse (embedding) optimizers, with the per-row state each keeps."""

    __noun__ = "sparse optimizer"

    SGD = "sgd"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    ADAM = "adam"
    ROWWISE_ADAM = "rowwise_adam"

    def state_layout(self, dim: int) -> dict[str, int]:
        """Names and widths (values per row) of the optimizer state for rows of ``dim``.

        >>> OptimizerKind.ROWWISE_ADAGRAD.state_layout(64)
        {'sum': 1}
        """
        layouts: dict[OptimizerKind, dict[str, int]] = {
            OptimizerKind.SGD: {},
            OptimizerKind.ADAGRAD: {"sum": dim},
            OptimizerKind.ROWWISE_ADAGRAD: {"sum": 1},
            OptimizerKind.ADAM: {"exp_avg": dim, "exp_avg_sq": dim},
            OptimizerKind.ROWWISE_ADAM: {"exp_avg": dim, "exp_avg_sq": 1},
        }
        return layouts[self]

    @property
    def counts_steps(self) -> bool:
        """True when the rule needs a per-row step count (bias correction)."""
        return self in (OptimizerKind.ADAM, OptimizerKind.ROWWISE_ADAM)


class _OpenEnumType(type):
    """The metaclass of ``OpenEnum``: a class iterates over its members, as an enum does."""

    _members: dict[str, Any]  # each class's own, set by OpenEnum.__init_subclass__

    def __iter__(cls) -> Iterator[Any]:
        return iter(tuple(cls._members.values()))

    def __len__(cls) -> int:
        return len(cls._members)


class OpenEnum(metaclass=_OpenEnumType):
    """A ``NamedEnum`` whose set of members can grow after the class is made.

    Members behave as enum members do: ``member.value`` is the lower-case text of config
    files and JSON, ``member.name`` its upper-case spelling, ``Cls(value)`` looks one up
    (``ValueError`` if there is none), ``parse`` reads config text, members compare with
    ``is``, pickle by value and iterate in declaration order. The built-in members are
    declared next to the class; ``declare`` adds one later (a plug-in, a test), and the
    new member is as good as a built-in everywhere (``parse``, JSON, ``is``). A process
    that unpickles or parses a declared member must have declared it first.

    Why not an ``enum.Enum``: an enum's members are fixed when its class is made, and
    adding one afterwards means writing the enum module's private tables.
    """

    __slots__ = ("_name", "_value")
    _name: str
    _value: str
    #: The noun used in error messages ("unknown sharding type 'x'; valid: ...").
    __noun__: ClassVar[str] = "value"
    _members: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._members = {}

    def __new__(cls, value: str) -> Self:
        """The member whose value is ``value`` (as ``Enum(value)``).

        Raises:
            ValueError: if no member has that value.
        """
        member = cls._members.get(value) if isinstance(value, str) else None
        if member is None:
            raise ValueError(f"{value!r} is not a valid {cls.__name__}")
        return member  # type: ignore[no-any-return]  # _members holds cls's members

    @classmethod
    def declare(cls, value: str) -> Self:
        """Add the member ``value`` (lower-case: letters, digits, ``_``), or return it.

        Declaring a value twice returns the same member, so a module that declares one
        may be imported again (a spawned process re-imports it).

        Raises:
            ValueError: if ``value`` is not a lower-case identifier.
        """
        if value in cls._members:
            return cls._members[value]  # type: ignore[no-any-return]  # cls's members
        if not (isinstance(value, str) and value.isidentifier() and value == value.lower()):
            raise ValueError(f"a {cls.__noun__} is named by a lower-case identifier, got {value!r}")
        name = value.upper()
        if hasattr(cls, name):
            raise ValueError(f"{cls.__name__}.{name} exists already: pick another name")
        member = object.__new__(cls)
        object.__setattr__(member, "_name", name)
        object.__setattr__(member, "_value", value)
        cls._members[value] = member
        type.__setattr__(cls, name, member)
        return member

    @classmethod
    def parse(cls, value: str | Self) -> Self:
        """Return the member named by ``value`` (case-insensitive), or ``value`` itself.

        Raises:
            ValueError: if ``value`` names no member; the message lists the valid ones.
        """
        if isinstance(value, cls):
            return value
        member = cls._members.get(str(value).lower())
        if member is None:
            valid = ", ".join(cls._members)
            raise ValueError(f"unknown {cls.__noun__} {value!r}; valid: {valid}")
        return member  # type: ignore[no-any-return]  # _members holds cls's members

    @property
    def name(self) -> str:
        """The upper-case name (``TABLE_WISE``)."""
        return self._name

    @property
    def value(self) -> str:
        """The lower-case value (``table_wise``): the config and JSON form."""
        return self._value

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} members are read-only")

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self._name}: {self._value!r}>"

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self._name}"

    def __reduce__(self) -> tuple[type[Self], tuple[str]]:
        return type(self), (self._value,)

    def __copy__(self) -> Self:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self


class ShardingType(OpenEnum):
    """How one table is placed over ranks: the six built-ins, and any type declared later.

    A new type is declared once (``ShardingType.declare("my_type")``) and registered
    with its strategy (``tetrarec.sharding.strategy.register``).
    """

    __slots__ = ()
    __noun__ = "sharding type"

    TABLE_WISE: ClassVar[ShardingType]
    ROW_WISE: ClassVar[ShardingType]
    COLUMN_WISE: ClassVar[ShardingType]
    DATA_PARALLEL: ClassVar[ShardingType]
    TABLE_ROW_WISE: ClassVar[ShardingType]
    TABLE_COLUMN_WISE: ClassVar[ShardingType]


for _value in (
    "table_wise",
    "row_wise",
    "column_wise",
    "data_parallel",
    "table_row_wise",
    "table_column_wise",
):
    ShardingType.declare(_value)
del _value


class Placement(NamedEnum):
    """Where the rows of a table live."""

    __noun__ = "placement"

    DEVICE = "device"
    HOST = "host"
    CACHED = "cached"
    SSD = "ssd"  # cached, the backing rows in a memory-mapped file (tetrarec.cache)

"""Leaf enums that carry behaviour. This module imports nothing from tetrarec.

Following FBGEMM's ``SparseType`` and ``EmbOptimType``, each enum answers the
questions the rest of the code would otherwise re-derive with ``if`` chains:
how many bits a precision takes, which torch dtype stores it, how many optimizer
state values a row needs.
"""

from __future__ import annotations

import enum
from typing import Self

import torch

__all__ = [
    "NamedEnum",
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


class ShardingType(NamedEnum):
    """How one table is placed over ranks."""

    __noun__ = "sharding type"

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    DATA_PARALLEL = "data_parallel"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"


class Placement(NamedEnum):
    """Where the rows of a table live."""

    __noun__ = "placement"

    DEVICE = "device"
    HOST = "host"
    CACHED = "cached"
    SSD = "ssd"  # cached, the backing rows in a memory-mapped file (tetrarec.cache)

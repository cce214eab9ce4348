"""Leaf enums that carry behaviour. This module imports nothing from tetrarec.

Following FBGEMM's ``SparseType`` and ``EmbOptimType``, each enum answers the
questions the rest of the code would otherwise re-derive with ``if`` chains:
how many bits a precision takes, which torch dtype stores it, how many optimizer
state values a row needs.
"""

from __future__ import annotations

import enum

import torch

__all__ = [
    "OptimizerKind",
    "Placement",
    "PoolingMode",
    "Precision",
    "ShardingType",
]


class Precision(enum.Enum):
    """How the values of an embedding row (or a message) are stored.

    Integer formats are row-wise affine: ``x ~= q * scale + bias`` with one FP16 scale
    and one FP16 bias per row, stored after the packed values so that a row is one
    contiguous block of bytes (FBGEMM's fused row layout).
    """

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

    @classmethod
    def parse(cls, value: str | Precision) -> Precision:
        """Return the precision named by ``value`` (case-insensitive).

        Raises:
            ValueError: if ``value`` names no precision; the message lists the valid ones.
        """
        if isinstance(value, Precision):
            return value
        try:
            return cls(value.lower())
        except ValueError:
            valid = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown precision {value!r}; valid: {valid}") from None


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


class PoolingMode(enum.Enum):
    """How the embeddings of one bag are combined."""

    SUM = "sum"
    MEAN = "mean"

    @classmethod
    def parse(cls, value: str | PoolingMode) -> PoolingMode:
        """Return the pooling mode named by ``value``.

        Raises:
            ValueError: if ``value`` names no pooling mode.
        """
        if isinstance(value, PoolingMode):
            return value
        try:
            return cls(value.lower())
        except ValueError:
            raise ValueError(f"unknown pooling {value!r}; valid: sum, mean") from None


class OptimizerKind(enum.Enum):
    """Sparse (embedding) optimizers, with the per-row state each keeps."""

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

    @classmethod
    def parse(cls, value: str | OptimizerKind) -> OptimizerKind:
        """Return the optimizer named by ``value``.

        Raises:
            ValueError: if ``value`` names no optimizer; the message lists the valid ones.
        """
        if isinstance(value, OptimizerKind):
            return value
        try:
            return cls(value.lower())
        except ValueError:
            valid = ", ".join(o.value for o in cls)
            raise ValueError(f"unknown sparse optimizer {value!r}; valid: {valid}") from None


class ShardingType(enum.Enum):
    """How one table is placed over ranks."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    DATA_PARALLEL = "data_parallel"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"


class Placement(enum.Enum):
    """Where the rows of a table live."""

    DEVICE = "device"
    HOST = "host"
    CACHED = "cached"

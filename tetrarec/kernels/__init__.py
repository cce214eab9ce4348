"""Table-batched embedding kernels: pooled lookup and fused backward + sparse optimizer.

Rows are stored in FP32, FP16, BF16, INT8 or INT4 and computed in FP32. The portable
PyTorch path runs on any device (``reference_batched.py``: all tables in a few batched
operations, no host reads in a step); a compiled CPU kernel (``csrc/``, built on first
use) sits behind the same ``tetrarec::`` ops (``ops.py``), and where it cannot build the
CPU runs the per-table loop (``reference.py``, the definition; the same bits).
``TETRAREC_KERNELS=reference`` forces the loop on the CPU, ``TETRAREC_KERNELS=batched``
the batched path a GPU runs (modes: ``_build.py``). ``build_cpu_kernels()`` builds
(or loads from the cache) the compiled kernel ahead of time; ``make demo`` and
``make test`` call it during set-up, so no run pays the build. ``LocalLookup``
(``lookup.py``) is the protocol the sharding code runs every local lookup module through.
"""

from tetrarec.kernels._build import compiled_cpu_kernels as build_cpu_kernels
from tetrarec.kernels.fused_optim import FusedOptimizer, FusedState
from tetrarec.kernels.lookup import LocalLookup, PreparedIds
from tetrarec.kernels.optim_rules import OPTIM_RULES, state_layout
from tetrarec.kernels.quant import (
    decode_rows,
    dequantize_rows,
    encode_rows,
    quantize_rows,
    row_width,
    stochastic_round,
)
from tetrarec.kernels.tbe import FusedEmbeddingBagCollection

__all__ = [
    "OPTIM_RULES",
    "FusedEmbeddingBagCollection",
    "FusedOptimizer",
    "FusedState",
    "LocalLookup",
    "PreparedIds",
    "build_cpu_kernels",
    "decode_rows",
    "dequantize_rows",
    "encode_rows",
    "quantize_rows",
    "row_width",
    "state_layout",
    "stochastic_round",
]

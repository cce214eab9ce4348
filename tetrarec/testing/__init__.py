"""Test support importable by spawned ranks: the multi-process harness and workers.

Nothing in ``tetrarec`` imports this package; tests and benchmarks do.
"""

from tetrarec.testing.multiprocess import RankContext, RankFailedError, run_ranks

__all__ = ["RankContext", "RankFailedError", "run_ranks"]

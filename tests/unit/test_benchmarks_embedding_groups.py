"""``bench embedding``'s grouping: no requested implementation disappears silently."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).parents[2] / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCH))
    import bench_embedding

    return bench_embedding


def test_the_anchor_that_fits_beside_nobody_is_still_timed() -> None:
    """Bug caught (issue 32 item 5): at 8 x 2M x 128 with ``--precision fp32`` and a
    10 GiB budget FBGEMM (the anchor) fit beside no other worker, the anchor-only group was never
    kept, and its rows vanished from the results."""
    bench = _bench()
    args = bench.parse_args(["--max-gib", "10", "--precision", "fp32"])
    point = bench.Point(8, 2_000_000, 128, 2048, 20)
    impls = ["fbgemm-cpu", "tetrarec-fp32"]
    gib = {i: bench.estimate_gib(i, point, args.optimizer) for i in impls}
    assert all(g <= 10 for g in gib.values()), gib  # each fits alone
    assert sum(gib.values()) > 10  # but not together
    groups = bench.plan_groups(impls, point, args)
    assert sorted(i for g in groups for i in g) == sorted(impls), groups
    assert bench.too_big(impls, point, args) == {}


def test_a_worker_over_the_budget_alone_is_named_not_dropped() -> None:
    """Bug caught: an implementation whose tables alone exceed ``--max-gib`` run anyway
    (or vanish) instead of being reported as not run, with the reason."""
    bench = _bench()
    args = bench.parse_args(["--max-gib", "4", "--precision", "fp32,int8"])
    point = bench.Point(8, 2_000_000, 128, 2048, 20)
    impls = ["fbgemm-cpu", "tetrarec-fp32", "tetrarec-int8"]
    big = bench.too_big(impls, point, args)
    assert set(big) == {"fbgemm-cpu", "tetrarec-fp32"}, big
    assert "over --max-gib 4" in big["tetrarec-fp32"]
    assert bench.plan_groups(impls, point, args) == [["tetrarec-int8"]]


def test_fbgemm_without_the_optimizer_is_named_with_the_reason() -> None:
    """Bug caught: a requested FBGEMM that cannot run (no CPU Adam, not importable)
    only mentioned on stderr and absent from the JSON."""
    bench = _bench()
    args = bench.parse_args(["--optimizer", "adam", "--impls", "fbgemm,tetrarec"])
    names, not_run = bench.requested_impls(args)
    assert "fbgemm-cpu" not in names
    assert "adam" in not_run["fbgemm-cpu"]

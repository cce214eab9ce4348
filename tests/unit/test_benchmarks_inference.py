"""``bench inference --smoke``: every variant measured, or skipped with its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inference_bench_smoke_reports_every_variant(tmp_path: Path) -> None:
    """Bug caught: a variant silently missing from the results (the INT8-MLP one must be
    measured or carry its skip reason), ratios not against the fp32 row, or the report
    not naming the machine it ran on."""
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "bench_inference.py"), "--smoke", "--json", str(out)],
        capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, "PYTHONPATH": str(BENCH.parent)},  # this tree's tetrarec
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    payload = json.loads(out.read_text())
    rows = {r["variant"]: r for r in payload["results"]}
    assert set(rows) == {
        "fp32",
        "int8-emb",
        "int8-emb+int8-mlp",
        "int8-emb+int8-mlp-dynamic",
        "int8-emb+int8-mlp+pruned",
        "int4-emb",
        "searched",
    }
    for name, r in rows.items():
        if "skipped" in r:
            assert name.startswith("int8-emb+int8-mlp")
            assert f"{name}: skipped: " in proc.stdout
            continue
        for key in ("model_bytes", "auc", "ne", "samples_per_s", "latency_ms_p50",
                    "latency_ms_p99"):  # fmt: skip
            assert r[key] > 0, (name, key)
        assert r["bytes_ratio"] == pytest.approx(r["model_bytes"] / rows["fp32"]["model_bytes"])
    assert rows["fp32"]["ne_change_pct"] == 0.0
    assert rows["int4-emb"]["model_bytes"] < rows["int8-emb"]["model_bytes"]
    pruned, int8 = rows["int8-emb+int8-mlp+pruned"], rows["int8-emb+int8-mlp"]
    assert pruned["model_bytes"] <= int8["model_bytes"]
    search = rows["searched"]["search"]
    assert search["fits"] == (search["search_ne_pct"] <= search["budget_ne_pct"])
    assert payload["machine"]["cpu"]["model"]
    assert payload["machine"]["kernels"]["kernels"] in ("compiled", "portable")

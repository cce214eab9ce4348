"""The scoring server (``inference.serve``): endpoints, refusals, batching, shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from starlette.testclient import TestClient

from tetrarec.config import RunConfig
from tetrarec.inference import InferenceModel, load
from tetrarec.inference.rows import RowReader
from tetrarec.inference.serve import ServeSettings, create_app
from tetrarec.testing.models import trained_model_dir

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny synthetic model (3 tables, multi-hot bags), trained 2 steps and exported."""
    root = tmp_path_factory.mktemp("serve")
    config = RunConfig.from_dict(
        {
            "data": {"source": "synthetic", "batch_size": 64,
                     "synthetic": {"num_samples": 500, "eval_samples": 100, "num_dense": 4,
                                   "pooling": 2}},
            "model": {"num_sparse": 3, "num_embeddings": [100, 50, 20],
                      "dlrm": {"num_dense": 4, "bottom_mlp": [8, 4], "top_mlp": [8, 1]}},
            "train": {"steps": 2, "checkpoint_every": 2, "eval_every": 0},
        }
    )  # fmt: skip
    return trained_model_dir(config, root)


@pytest.fixture(scope="module")
def model(model_dir: Path) -> InferenceModel:
    return load(model_dir)


def row(k: int) -> dict[str, Any]:
    """A valid row, different for each ``k``."""
    return {
        "dense0": 0.1 * k, "dense1": 1.0, "dense2": -k / 7, "dense3": 3,
        "C1": [k % 100, (3 * k) % 100], "C2": k % 50, "C3": [] if k % 5 == 0 else [k % 20],
    }  # fmt: skip


def direct_scores(model: InferenceModel, rows: list[dict[str, Any]]) -> list[float]:
    """What the model gives the rows scored in one call, without the server."""
    batch = RowReader.for_model(model).batch(rows)
    return [float(v) for v in model.predict(batch.dense, batch.sparse).tolist()]


def test_score_healthz_readyz_and_metrics(model: InferenceModel) -> None:
    """Bug caught: an endpoint missing or answering the wrong scores, another model's
    hash, or metrics that do not count what was served."""
    rows = [row(k) for k in range(5)]
    with TestClient(create_app(model, ServeSettings())) as client:
        assert client.get("/healthz").status_code == 200
        ready = client.get("/readyz")
        assert ready.status_code == 200
        assert ready.json()["ready"] is True
        got = client.post("/v1/score", json={"rows": rows})
        assert got.status_code == 200
        assert got.json() == {
            "scores": direct_scores(model, rows),
            "model": model.manifest.content_hash,
        }
        assert client.post("/v1/score", json={"rows": []}).json()["scores"] == []
        client.post("/v1/score", json={"rows": [{"C1": 1}]})
        text = client.get("/metrics").text
    samples = parse_prometheus(text)
    assert samples['tetrarec_serve_requests_total{code="200"}'] == 2
    assert samples['tetrarec_serve_requests_total{code="422"}'] == 1
    assert samples["tetrarec_serve_rows_scored_total"] == 5
    assert samples["tetrarec_serve_request_seconds_count"] == 3
    assert samples['tetrarec_serve_request_seconds_bucket{le="+Inf"}'] == 3
    assert samples["tetrarec_serve_batch_rows_sum"] == 5
    assert samples["tetrarec_serve_queue_depth"] == 0
    info = [k for k in samples if k.startswith("tetrarec_serve_model_info{")]
    assert len(info) == 1
    assert f'content_hash="{model.manifest.content_hash}"' in info[0]


def parse_prometheus(text: str) -> dict[str, float]:
    """``{name{labels}: value}`` of a Prometheus text page; fails on a malformed line."""
    out: dict[str, float] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
            continue
        if line.startswith("#"):
            assert line.startswith("# HELP "), line
            continue
        key, value = line.rsplit(" ", 1)
        base = key.split("{")[0]
        family = next((t for t in types if base == t or base.startswith(t + "_")), None)
        assert family is not None, f"sample before its # TYPE: {line}"
        assert key not in out, f"sample twice: {line}"
        out[key] = float(value)
    return out


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (b"{not json", 400, "the body is not valid JSON: "),
        (b'{"rows": [1e999]}', 422, "row 0: expected an object"),
        (b'{"rows": [NaN]}', 400, "the body is not valid JSON: NaN is not a JSON number"),
        (b"[1, 2]", 400, 'the body must be a JSON object {"rows": [...]}'),
        (b'{"rows": 3}', 422, "rows must be a list of objects, got an integer"),
        (json.dumps({"rows": [{**row(1), "C9": 1}]}).encode(), 422, "row 0: unknown feature 'C9'"),
        (
            json.dumps({"rows": [row(1), {**row(2), "dense2": [1]}]}).encode(),
            422,
            "row 1, field 'dense2': expected a number or null, got a list",
        ),
        (
            json.dumps({"rows": [{**row(1), "C2": {"$type": "os.system"}}]}).encode(),
            422,
            "row 0, field 'C2': expected an integer table row or a list of them, got an object",
        ),
        (json.dumps({"rows": [row(1)] * 9}).encode(), 413, "the request has 9 rows; at most 8"),
        (b'{"rows": [' + b" " * 5000 + b"]}", 413, "the body has 5012 bytes; at most 4096"),
    ],
)
def test_a_malformed_request_gets_a_4xx_and_the_server_keeps_serving(
    model: InferenceModel, body: bytes, status: int, error: str
) -> None:
    """Bug caught: a bad request crashing the server or a batch (500), a wrong status,
    an error that does not name the row and field, or the next good request failing."""
    settings = ServeSettings(max_rows=8, max_body_bytes=4096)
    with TestClient(create_app(model, settings)) as client:
        got = client.post("/v1/score", content=body, headers={"content-type": "application/json"})
        assert got.status_code == status, got.text
        assert got.json()["error"].startswith(error)
        good = client.post("/v1/score", json={"rows": [row(3)]})
        assert good.status_code == 200
        assert good.json()["scores"] == direct_scores(model, [row(3)])


def test_a_body_over_the_limit_without_a_length_header_is_refused(model: InferenceModel) -> None:
    """Bug caught: the limit checked only against Content-Length, so a chunked upload
    (no length declared) is read whole into memory."""

    def chunks() -> Any:
        yield b'{"rows": ['
        for _ in range(100):
            yield b" " * 100

    with TestClient(create_app(model, ServeSettings(max_body_bytes=1000))) as client:
        got = client.post("/v1/score", content=chunks())
        assert got.status_code == 413
        assert got.json()["error"] == "the body has over 1000 bytes; at most 1000"


async def _concurrent(app: Any, bodies: list[dict[str, Any]]) -> tuple[list[Any], str]:
    """Send ``bodies`` at once (lifespan running); the answers and the metrics page."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
            answers = await asyncio.gather(*(client.post("/v1/score", json=b) for b in bodies))
            metrics = (await client.get("/metrics")).text
    return [a.json() for a in answers], metrics


@pytest.mark.parametrize("batching", [True, False])
def test_concurrent_requests_are_merged_and_get_their_own_scores(
    model: InferenceModel, batching: bool
) -> None:
    """Bug caught: batched requests answered with another request's rows (a wrong
    split), different scores than alone, or no merging at all (one call per request)."""
    bodies = [{"rows": [row(10 * i + k) for k in range(1 + i % 3)]} for i in range(12)]
    settings = ServeSettings(batching=batching, max_wait_ms=200.0, max_batch=64)
    answers, metrics = asyncio.run(_concurrent(create_app(model, settings), bodies))
    for body, answer in zip(bodies, answers):
        want = direct_scores(model, body["rows"])
        assert answer["scores"] == pytest.approx(want, rel=1e-6, abs=1e-7)
    samples = parse_prometheus(metrics)
    calls = samples["tetrarec_serve_model_calls_total"]
    assert samples["tetrarec_serve_batch_rows_sum"] == sum(len(b["rows"]) for b in bodies)
    if batching:
        assert calls < len(bodies) / 2
    else:
        assert calls == len(bodies)


def test_batches_never_pass_max_batch_rows(model: InferenceModel) -> None:
    """Bug caught: merging requests past ``max_batch`` rows (a request carried over to
    the next batch lost or scored twice)."""
    bodies = [{"rows": [row(k), row(k + 1), row(k + 2)]} for k in range(10)]
    settings = ServeSettings(max_wait_ms=200.0, max_batch=7)
    answers, metrics = asyncio.run(_concurrent(create_app(model, settings), bodies))
    assert [len(a["scores"]) for a in answers] == [3] * 10
    samples = parse_prometheus(metrics)
    assert (
        samples['tetrarec_serve_batch_rows_bucket{le="7"}']
        == samples["tetrarec_serve_batch_rows_count"]
    )
    assert samples["tetrarec_serve_batch_rows_sum"] == 30
    assert samples["tetrarec_serve_model_calls_total"] >= 5  # 2 requests (6 rows) per call


def test_a_lone_request_does_not_wait_for_a_full_batch(model: InferenceModel) -> None:
    """Bug caught: the batcher waiting for ``max_batch`` rows rather than at most
    ``max_wait_ms`` (a lone request would hang); the bound is generous, not a timing."""
    with TestClient(create_app(model, ServeSettings(max_wait_ms=50.0))) as client:
        started = time.monotonic()
        assert client.post("/v1/score", json={"rows": [row(1)]}).status_code == 200
        assert time.monotonic() - started < 20.0


def test_settings_are_checked(raises_exactly: Any) -> None:
    """Bug caught: a zero batch or negative wait accepted (a batcher that never scores)."""
    with raises_exactly("--max-batch must be >= 1, got 0"):
        ServeSettings(max_batch=0)
    with raises_exactly("--max-wait-ms must be >= 0, got -1.0"):
        ServeSettings(max_wait_ms=-1.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_the_command_serves_and_exits_0_on_sigterm(model_dir: Path, model: InferenceModel) -> None:
    """Bug caught: ``tetrarec serve`` not listening, or SIGTERM ending it with a
    non-zero status (uvicorn re-raising the signal; the CLI's 143)."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tetrarec", "-q", "serve", "--model", str(model_dir),
         "--port", str(port), "--threads", "1"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f"on http://127.0.0.1:{port}" in first, first
        got = httpx.post(f"http://127.0.0.1:{port}/v1/score", json={"rows": [row(4)]}, timeout=30)
        assert got.json()["scores"] == direct_scores(model, [row(4)])
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert torch.get_num_threads() >= 1  # the server's --threads stayed in its process

"""``tetrarec serve``: an HTTP JSON scoring server with dynamic batching (Starlette, uvicorn).

Endpoints::

    POST /v1/score  {"rows": [{"I1": 3, ..., "C26": "68fd1e64"}, ...]}
                    -> 200 {"scores": [0.12, ...], "model": "<content hash>"}
    GET  /healthz   -> 200 while the process serves (liveness)
    GET  /readyz    -> 200 once the model is loaded and batches run, 503 while stopping
    GET  /metrics   -> the Prometheus text format (``serve_metrics``)

A bad request gets ``{"error": "<one line>"}``: 400 for a body that is not a JSON
object ``{"rows": [...]}``, 413 for a body over ``max_body_bytes`` or more than
``max_rows`` rows, 422 for a missing or unknown feature or a value of the wrong type
(naming the row and the field, ``inference.rows``); the server keeps serving. Requests
are parsed with the standard library's ``json`` and read as data only: nothing in one
can run code or name a file.

**Dynamic batching.** Each request's rows are checked on the event loop, then queued.
One batching task takes the oldest request, adds the next ones while they fit in
``max_batch`` rows and the oldest has waited under ``max_wait_ms``, and scores them in
one model call on the single scoring thread (torch releases the GIL, so the loop keeps
accepting meanwhile); each request then gets its own rows' scores. Requests that arrive
during a call are batched as soon as it ends. Without batching each request is one
call. Starlette was chosen over FastAPI because the server needs none of FastAPI's
validation layer (rows are checked by the training reader's rules) and Starlette is
what FastAPI runs on: fewer dependencies, the same ASGI stack.

**Shutdown.** SIGTERM or SIGINT stops accepting connections, lets every queued and
running request finish, stops the batching task and returns (the command exits 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import FrameType
from typing import Any, Literal

import numpy as np
import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tetrarec.inference.model import InferenceModel
from tetrarec.inference.rows import (
    ParsedRows,
    RowError,
    RowReader,
    TooManyRowsError,
    parse_request,
)
from tetrarec.inference.serve_metrics import ServeMetrics

__all__ = ["Batcher", "ServeSettings", "create_app", "run_server"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServeSettings:
    """How the server batches and what it accepts.

    Args:
        max_batch: the most rows one model call scores (a larger request is scored alone).
        max_wait_ms: how long the oldest queued request waits for more to batch with.
        batching: ``False`` scores each request alone.
        threads: torch's intra-op threads for the model (``None``: torch's default).
        max_body_bytes: the largest request body (413 beyond).
        max_rows: the most rows one request holds (413 beyond).

    Raises:
        ValueError: naming a setting that is not positive.
    """

    max_batch: int = 4096
    max_wait_ms: float = 2.0
    batching: bool = True
    threads: int | None = None
    max_body_bytes: int = 16 << 20
    max_rows: int = 4096

    def __post_init__(self) -> None:
        """Check every setting (``ValueError`` names the option)."""
        for name in ("max_batch", "max_body_bytes", "max_rows"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if not self.max_wait_ms >= 0:
            raise ValueError(f"--max-wait-ms must be >= 0, got {self.max_wait_ms}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")


class _BadRequestError(ValueError):
    """A body that is not a JSON object (400)."""


class _BodyTooLargeError(ValueError):
    """A body over ``max_body_bytes`` (413)."""


class _StoppingError(RuntimeError):
    """The server is shutting down (503)."""


# The status each refusal gets: the first class of the error's MRO listed here.
_STATUS: dict[type[Exception], int] = {
    _BadRequestError: 400,
    _BodyTooLargeError: 413,
    TooManyRowsError: 413,
    RowError: 422,
    _StoppingError: 503,
}


def _status(error: Exception) -> int | None:
    return next((_STATUS[c] for c in type(error).__mro__ if c in _STATUS), None)


@dataclass(frozen=True)
class _Pending:
    """A queued request: its rows, the future of its scores, when it was queued."""

    parsed: ParsedRows
    future: asyncio.Future[np.ndarray]
    queued_at: float


class Batcher:
    """Merges concurrent requests into model calls of at most ``max_batch`` rows.

    Call order: ``start`` (on the event loop), ``submit`` from any number of requests,
    ``close`` (waits for every queued request to be scored).

    Args:
        score: scores parsed rows, ``(n,)`` float32; runs on the one scoring thread.
        settings: ``max_batch``, ``max_wait_ms`` and ``batching``.
        on_call: called on the loop with the rows of each model call (metrics).
    """

    def __init__(
        self,
        score: Callable[[ParsedRows], np.ndarray],
        settings: ServeSettings,
        on_call: Callable[[int], None] = lambda rows: None,
    ) -> None:
        self.score, self.settings, self.on_call = score, settings, on_call
        self.max_wait_s = settings.max_wait_ms / 1000.0
        self.waiting = 0  # requests submitted and not yet handed to the scoring thread
        self._queue: asyncio.Queue[_Pending | None] = asyncio.Queue()
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def running(self) -> bool:
        """Whether requests are accepted (started and not closing)."""
        return self._executor is not None and not self._closed

    async def start(self) -> None:
        """Start the scoring thread and (with batching) the batching task."""
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tetrarec-score")
        if self.settings.batching:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def submit(self, parsed: ParsedRows) -> np.ndarray:
        """The ``(n,)`` scores of ``parsed`` (at least one row), once its batch ran.

        Raises:
            _StoppingError: when the batcher is not running.
            Exception: what scoring raised (for every request of the batch).
        """
        if not self.running:
            raise _StoppingError("the server is shutting down")
        self.waiting += 1
        if not self.settings.batching:
            try:
                return await self._score_on_thread(parsed)
            finally:
                self.waiting -= 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()
        self._queue.put_nowait(_Pending(parsed, future, loop.time()))
        return await future

    async def close(self) -> None:
        """Stop accepting, score everything queued, stop the scoring thread."""
        self._closed = True
        if self._task is not None:
            self._queue.put_nowait(None)
            await self._task
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def _run(self) -> None:
        """The batching loop: gather requests into batches until the ``None`` sentinel."""
        carry: _Pending | None = None
        while True:
            first = carry if carry is not None else await self._queue.get()
            carry = None
            if first is None:
                return
            batch, stop = [first], False
            rows = first.parsed.rows
            while rows < self.settings.max_batch:
                item = await self._next(first.queued_at + self.max_wait_s)
                if item is False:
                    break
                if item is None:
                    stop = True
                    break
                if rows + item.parsed.rows > self.settings.max_batch:
                    carry = item
                    break
                batch.append(item)
                rows += item.parsed.rows
            await self._call(batch)
            if stop:
                return

    async def _next(self, deadline: float) -> _Pending | Literal[False] | None:
        """The next queued item, or ``False`` when none came before ``deadline``."""
        with contextlib.suppress(asyncio.QueueEmpty):
            return self._queue.get_nowait()
        timeout = deadline - asyncio.get_running_loop().time()
        if timeout <= 0:
            return False
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return False

    async def _score_on_thread(self, parsed: ParsedRows) -> np.ndarray:
        """One model call over ``parsed``, on the scoring thread."""
        assert self._executor is not None
        self.on_call(parsed.rows)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.score, parsed)

    async def _call(self, batch: Sequence[_Pending]) -> None:
        """Score ``batch`` in one model call; resolve each request's future."""
        try:
            scores = await self._score_on_thread(ParsedRows.concatenate([p.parsed for p in batch]))
        except Exception as e:  # every request of the batch fails with it (500)
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(e)
            return
        finally:
            self.waiting -= len(batch)
        start = 0
        for p in batch:
            if not p.future.done():  # a client that went away cancelled its future
                p.future.set_result(scores[start : start + p.parsed.rows])
            start += p.parsed.rows


def _no_scores() -> np.ndarray:
    return np.empty(0, dtype=np.float32)


def _scorer(model: InferenceModel, reader: RowReader) -> Callable[[ParsedRows], np.ndarray]:
    """Parsed rows -> ``(n,)`` float32 click probabilities (runs on the scoring thread)."""

    def score(parsed: ParsedRows) -> np.ndarray:
        batch = reader.features(parsed).to(model.device)
        out: np.ndarray = model.predict(batch.dense, batch.sparse).float().cpu().numpy()
        return out

    return score


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise _BadRequestError(f"Content-Length {declared[:30]!r} is not a number")
        if int(declared) > limit:
            raise _BodyTooLargeError(f"the body has {declared} bytes; at most {limit}")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _BodyTooLargeError(f"the body has over {limit} bytes; at most {limit}")
        parts.append(chunk)
    return b"".join(parts)


def _refuse_constant(name: str) -> Any:
    raise _BadRequestError(f"the body is not valid JSON: {name} is not a JSON number")


def _parse_json(body: bytes) -> dict[str, object]:
    """The JSON object in ``body`` (the standard library's parser, data only)."""
    try:
        payload = json.loads(body, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise _BadRequestError(f"the body is not valid JSON: {str(e)[:200]}") from None
    if type(payload) is not dict:
        raise _BadRequestError('the body must be a JSON object {"rows": [...]}')
    return payload


def create_app(model: InferenceModel, settings: ServeSettings) -> Starlette:
    """The ASGI application scoring ``model`` (its lifespan starts and stops batching).

    Args:
        model: the loaded model (scored on its device).
        settings: batching and limits.
    """
    reader = RowReader.for_model(model, max_rows=settings.max_rows)
    batcher = Batcher(_scorer(model, reader), settings)
    if settings.batching and model.manifest.dense.get("activations") == "dynamic":
        logger.warning(
            "the model's INT8 MLP quantizes its activations per batch (dynamic): with "
            "batching a row's score moves slightly with the requests it is batched with; "
            "quantize with --activations static (ranges calibrated on training rows) for "
            "scores that do not depend on the traffic"
        )
    content_hash = str(model.manifest.content_hash or "")
    precisions = ",".join(sorted({p.value for p in model.table_precisions().values()}))
    metrics = ServeMetrics(
        model_labels={
            "content_hash": content_hash,
            "path": str(model.path or ""),
            "table_precisions": precisions,
            "dense_precision": str(model.manifest.dense.get("precision", "")),
            "batching": str(settings.batching).lower(),
        },
        max_batch=settings.max_batch,
        queue_depth=lambda: batcher.waiting,
    )
    batcher.on_call = metrics.model_call

    async def score(request: Request) -> Response:
        started, rows = time.perf_counter(), 0
        try:
            body = await _read_body(request, settings.max_body_bytes)
            parsed = parse_request(_parse_json(body), reader)
            values = await batcher.submit(parsed) if parsed.rows else _no_scores()
            rows = parsed.rows
            response: Response = JSONResponse({"scores": values.tolist(), "model": content_hash})
        except Exception as e:
            status = _status(e)
            if status is None:
                logger.exception("scoring request failed")
                status, e = 500, RuntimeError("internal error while scoring (see the server log)")
            response = JSONResponse({"error": str(e)}, status_code=status)
        metrics.request(response.status_code, time.perf_counter() - started, rows)
        return response

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready = batcher.running
        return JSONResponse(
            {"ready": ready, "model": content_hash}, status_code=200 if ready else 503
        )

    async def metrics_text(request: Request) -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await batcher.start()
        try:
            yield
        finally:
            await batcher.close()

    app = Starlette(
        routes=[
            Route("/v1/score", score, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics_text, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.batcher = batcher
    app.state.metrics = metrics
    return app


class _Server(uvicorn.Server):
    """uvicorn's server, stopped (not re-signalled) by SIGTERM or SIGINT.

    uvicorn re-raises a caught signal after its graceful shutdown, which would end the
    command as killed; here the shutdown is the whole answer, so the command exits 0.
    A second SIGINT forces the exit without waiting for open requests.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        stops = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, self._stop) for s in stops}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        if self.should_exit and signum == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def run_server(
    model: InferenceModel,
    settings: ServeSettings,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve ``model`` until SIGTERM or SIGINT, then finish queued requests and return.

    Args:
        model: the loaded model.
        settings: batching and limits (``threads`` sets torch's intra-op threads).
        host: the address to listen on.
        port: the TCP port.
        on_ready: called with the server's URL once it listens.
    """
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    app = create_app(model, settings)
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
        timeout_graceful_shutdown=60,
    )  # fmt: skip
    server = _Server(config)
    if on_ready is not None:

        async def announce() -> None:
            while not server.started and not server.should_exit:
                await asyncio.sleep(0.02)
            if server.started:
                on_ready(f"http://{host}:{port}")

        async def serve() -> None:
            watcher = asyncio.get_running_loop().create_task(announce())
            await server.serve()
            await watcher

        asyncio.run(serve())
        return
    server.run()

"""Load test of ``tetrarec serve``: QPS and latency, with and without dynamic batching.

Starts ``tetrarec serve`` as a subprocess on a free loopback port (``--model DIR``, or a
small synthetic model built here with ``--smoke``), once with batching and once with
``--no-batching``; for each request size in ``--batch-sizes`` (rows per request),
``--clients`` concurrent httpx clients send requests for ``--seconds`` and the script
reports QPS, rows/s, p50/p99 latency and errors. With ``--bad-every K`` it runs each
size once more on the batching server with one request in K malformed (rotating: a
missing feature, a wrong type, an unknown feature, a body over the server's
``--max-body-bytes``) and checks that every bad one got a 4xx, and that every good one
got a 200 with the same scores as the same request in the clean run.

    .venv/bin/python benchmarks/bench_serve.py --model MODEL --clients 16 --seconds 30 \\
        --bad-every 10 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]  # this tree's tetrarec, then _harness
from _harness import (  # noqa: E402
    describe_run,
    json_path,
    kernel_summary,
    print_table,
    unwind_on_signals,
    write_json,
)

from tetrarec.data import DataSource  # noqa: E402
from tetrarec.inference import InferenceModel, load  # noqa: E402
from tetrarec.inference.rows import RowReader  # noqa: E402

_BODY_LIMIT = 1 << 20  # the server's --max-body-bytes here; the "huge" request is larger
_POOL = 32  # distinct good requests per size (answers are compared per request)


def _smoke_model(root: Path) -> Path:
    """A tiny synthetic model, trained 2 steps and exported under ``root``."""
    from tetrarec.config import RunConfig
    from tetrarec.testing.models import trained_model_dir

    config = RunConfig.from_dict(
        {
            "data": {"source": "synthetic", "batch_size": 64,
                     "synthetic": {"num_samples": 500, "eval_samples": 100, "pooling": 2}},
            "model": {"num_sparse": 8, "num_embeddings": 1000,
                      "dlrm": {"bottom_mlp": [32, 16], "top_mlp": [32, 1]}},
            "train": {"steps": 2, "checkpoint_every": 2, "eval_every": 0},
        }
    )  # fmt: skip
    return trained_model_dir(config, root)


# Random raw values a source reads, per kind of feature: (dense, sparse(rows of table)).
_VALUES: dict[DataSource, tuple[Callable[[random.Random], Any], Callable[..., Any]]] = {
    DataSource.CRITEO: (lambda r: r.randrange(100), lambda r, n: f"{r.getrandbits(32):08x}"),
    DataSource.BINARY: (lambda r: r.randrange(100), lambda r, n: f"{r.getrandbits(32):08x}"),
    DataSource.CSV: (lambda r: r.random() * 10, lambda r, n: f"v{r.randrange(10**6)}"),
    DataSource.PARQUET: (lambda r: r.random() * 10, lambda r, n: r.getrandbits(40)),
    DataSource.SYNTHETIC: (lambda r: r.gauss(0, 1), lambda r, n: r.randrange(n)),
}


def make_rows(model: InferenceModel, n: int, rng: random.Random) -> list[dict[str, Any]]:
    """``n`` valid rows for ``model`` (random raw values of its source)."""
    reader = RowReader.for_model(model)
    dense, sparse = _VALUES[DataSource(model.config.data.source)]
    rows_per = dict(zip(reader.sparse_names, (t.num_embeddings for t in reader.tables)))
    return [
        {
            **{c: dense(rng) for c in reader.dense_names},
            **{c: sparse(rng, rows_per[c]) for c in reader.sparse_names},
        }
        for _ in range(n)
    ]


def bad_body(kind: int, rows: list[dict[str, Any]]) -> bytes:
    """A malformed request of one of 4 kinds, built from good ``rows``."""
    first = dict(rows[0])
    name = next(iter(first))
    if kind == 0:  # a missing feature
        del first[name]
    elif kind == 1:  # a wrong type
        first[name] = {"not": ["a value"]}
    elif kind == 2:  # an unknown feature
        first["not_a_feature"] = 1
    else:  # a body over the server's limit
        return b'{"rows": [' + b" " * _BODY_LIMIT + b"]}"
    return json.dumps({"rows": [first, *rows[1:]]}).encode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``tetrarec serve`` in a subprocess; ``stop`` sends SIGTERM and returns its status."""

    def __init__(self, model_dir: Path, batching: bool, args: argparse.Namespace) -> None:
        self.port = _free_port()
        argv = [sys.executable, "-m", "tetrarec", "-q", "serve", "--model", str(model_dir),
                "--port", str(self.port), "--max-body-bytes", str(_BODY_LIMIT),
                "--max-batch", str(args.max_batch),
                "--max-wait-ms", str(args.max_wait_ms)]  # fmt: skip
        if args.threads:
            argv += ["--threads", str(args.threads)]
        if not batching:
            argv.append("--no-batching")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "serving" not in line:
            self.proc.kill()
            raise RuntimeError(f"tetrarec serve did not start: {line!r}")
        self.url = f"http://127.0.0.1:{self.port}/v1/score"

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=120)
        return int(self.proc.returncode)


async def load_run(
    url: str, bodies: list[bytes], bad_every: int, model_rows: list[list[dict[str, Any]]],
    clients: int, seconds: float,
) -> dict[str, Any]:  # fmt: skip
    """``clients`` concurrent clients for ``seconds``; each answer kept by request."""
    latencies: list[float] = []
    answers: list[tuple[int, int, list[float] | None]] = []  # (body index or -1, status, scores)
    bad_status: list[int] = []
    errors = 0
    end = time.perf_counter() + seconds

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal errors
        i = 0
        while time.perf_counter() < end:
            n = c * 7919 + i
            bad = bad_every > 0 and n % bad_every == bad_every - 1
            idx = n % len(bodies)
            body = bad_body((n // bad_every) % 4, model_rows[idx]) if bad else bodies[idx]
            i += 1
            t0 = time.perf_counter()
            try:
                r = await http.post(url, content=body, headers={"content-type": "application/json"})
            except httpx.HTTPError:
                errors += 1
                continue
            if bad:
                bad_status.append(r.status_code)
                continue
            latencies.append(time.perf_counter() - t0)
            scores = r.json().get("scores") if r.status_code == 200 else None
            answers.append((idx, r.status_code, scores))

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=120) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        elapsed = time.perf_counter() - started
    lat = np.array(latencies) * 1000 if latencies else np.zeros(1)
    return {
        "elapsed": elapsed, "answers": answers, "bad_status": bad_status,
        "errors": errors + sum(1 for _, s, _ in answers if s != 200),
        "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
    }  # fmt: skip


def compare(
    answers: list[tuple[int, int, list[float] | None]], clean: dict[int, list[float]]
) -> int:
    """Good answers whose scores differ from the clean run's for the same request."""
    bad = 0
    for idx, status, scores in answers:
        want = clean.get(idx)
        if status != 200 or scores is None or want is None:
            continue
        if len(scores) != len(want) or not np.allclose(scores, want, rtol=1e-5, atol=1e-7):
            bad += 1
    return bad


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", type=Path, help="an exported model directory")
    p.add_argument("--smoke", action="store_true", help="a tiny model, short runs")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--batch-sizes", default="1,32,256", help="rows per request")
    p.add_argument("--bad-every", type=int, default=0, help="one malformed request in K")
    p.add_argument("--max-batch", type=int, default=4096)
    p.add_argument("--max-wait-ms", type=float, default=2.0)
    p.add_argument("--threads", type=int, help="the server's torch threads")
    p.add_argument("--json", type=json_path, metavar="PATH")
    args = p.parse_args()
    if args.smoke:
        args.clients, args.seconds, args.bad_every = min(args.clients, 4), 0.5, args.bad_every or 10
    if args.model is None and not args.smoke:
        p.error("give --model DIR or --smoke")
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    # On SIGTERM (what `tetrarec bench` forwards) unwind: the servers are stopped in
    # `finally`, never left running, and the scratch model is deleted.
    with (
        unwind_on_signals("bench_serve"),
        tempfile.TemporaryDirectory(prefix="bench_serve_") as tmp,
    ):
        model_dir = args.model or _smoke_model(Path(tmp))
        model = load(model_dir)
        rng = random.Random(0)
        pools = {b: [make_rows(model, b, rng) for _ in range(_POOL)] for b in sizes}
        results, statuses = [], {}
        for batching in (True, False):
            server = Server(model_dir, batching, args)
            impl = "serve-batching" if batching else "serve-no-batching"
            try:
                for b in sizes:
                    bodies = [json.dumps({"rows": rows}).encode() for rows in pools[b]]
                    runs = [0] + ([args.bad_every] if batching and args.bad_every else [])
                    clean: dict[int, list[float]] = {}
                    for bad_every in runs:
                        out = asyncio.run(load_run(
                            server.url, bodies, bad_every, pools[b], args.clients, args.seconds
                        ))  # fmt: skip
                        if not bad_every:
                            clean = {i: s for i, st, s in out["answers"] if st == 200 and s}
                        good = len(out["answers"])
                        bad_4xx = sum(400 <= s < 500 for s in out["bad_status"])
                        results.append({
                            "impl": impl, "kernels": kernel_summary()["kernels"],
                            "request_rows": b, "clients": args.clients, "bad_every": bad_every,
                            "seconds": round(out["elapsed"], 3), "requests": good,
                            "qps": good / out["elapsed"], "rows_per_s": good * b / out["elapsed"],
                            "latency_ms_p50": out["p50"], "latency_ms_p99": out["p99"],
                            "errors": out["errors"], "bad_sent": len(out["bad_status"]),
                            "bad_4xx": bad_4xx, "good_mismatch": compare(out["answers"], clean),
                            "unchecked": sum(1 for i, _, _ in out["answers"] if i not in clean),
                        })  # fmt: skip
            finally:
                statuses[impl] = server.stop()
    print(describe_run())
    print(f"clients {args.clients}, {args.seconds} s per run, server exit statuses {statuses}")
    columns = ["impl", "request_rows", "bad_every", "requests", "qps", "rows_per_s",
               "latency_ms_p50", "latency_ms_p99", "errors", "bad_sent", "bad_4xx",
               "good_mismatch", "unchecked"]  # fmt: skip
    print_table(results, columns, digits={"latency_ms_p50": 2, "latency_ms_p99": 2})
    failed = [
        r for r in results
        if r["errors"] or r["good_mismatch"] or r["bad_4xx"] != r["bad_sent"]
    ]  # fmt: skip
    config = {"clients": args.clients, "seconds": args.seconds, "batch_sizes": sizes,
              "bad_every": args.bad_every, "max_batch": args.max_batch,
              "max_wait_ms": args.max_wait_ms, "model": str(args.model or "smoke"),
              "server_exit": statuses}  # fmt: skip
    write_json(args.json, config, results)
    if failed or any(statuses.values()):
        print(f"FAILED: {len(failed)} run(s) with errors, wrong answers or a bad request not 4xx")
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""The scoring server's metrics, in the Prometheus text exposition format (version 0.0.4).

``ServeMetrics`` is updated on the server's event loop only (no lock) and rendered by
``GET /metrics``::

    # TYPE tetrarec_serve_requests_total counter
    tetrarec_serve_requests_total{code="200"} 41
    # TYPE tetrarec_serve_request_seconds histogram
    tetrarec_serve_request_seconds_bucket{le="0.001"} 3
    ...
    tetrarec_serve_request_seconds_bucket{le="+Inf"} 41
    tetrarec_serve_request_seconds_sum 0.12
    tetrarec_serve_request_seconds_count 41
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Histogram", "ServeMetrics"]

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def _label(value: str) -> str:
    """``value`` escaped for a label value (backslash, quote, newline)."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass
class Histogram:
    """Counts of observations at or under each upper bound (cumulative when rendered).

    Args:
        bounds: increasing upper bounds (``+Inf`` is added when rendered).
    """

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        """Start every bucket at zero."""
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose bound is at least it."""
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        """The histogram's sample lines (``_bucket``, ``_sum``, ``_count``)."""
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_number(self.total)}")
        out.append(f"{name}_count {self.count}")
        return out


def _batch_bounds(max_batch: int) -> tuple[float, ...]:
    """Powers of two up to ``max_batch`` (and ``max_batch`` itself)."""
    bounds, b = [], 1
    while b < max_batch:
        bounds.append(float(b))
        b *= 2
    return (*bounds, float(max_batch))


class ServeMetrics:
    """What the server counts: requests by status, rows, latency, batches, queue depth.

    Args:
        model_labels: the ``tetrarec_serve_model_info`` labels (content hash, ...).
        max_batch: the largest model batch (the batch-size histogram's last bound).
        queue_depth: returns the requests waiting to be scored, read when rendered.
    """

    def __init__(
        self, *, model_labels: dict[str, str], max_batch: int, queue_depth: Callable[[], int]
    ) -> None:
        self.model_labels = dict(model_labels)
        self.queue_depth = queue_depth
        self.requests: dict[int, int] = {}
        self.rows_scored = 0
        self.model_calls = 0
        self.latency = Histogram(_LATENCY_BUCKETS)
        self.batch_rows = Histogram(_batch_bounds(max_batch))

    def request(self, status: int, seconds: float, rows: int) -> None:
        """Count one answered request (``rows`` scored, 0 unless it succeeded)."""
        self.requests[status] = self.requests.get(status, 0) + 1
        self.rows_scored += rows
        self.latency.observe(seconds)

    def model_call(self, rows: int) -> None:
        """Count one model call of ``rows`` rows."""
        self.model_calls += 1
        self.batch_rows.observe(rows)

    def render(self) -> str:
        """Every metric, in the Prometheus text format."""
        out: list[str] = []

        def family(name: str, kind: str, help_text: str, lines: Sequence[str]) -> None:
            out.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *lines])

        by_code = sorted(self.requests.items())
        family(
            "tetrarec_serve_requests_total", "counter", "Scoring requests answered, by status.",
            [f'tetrarec_serve_requests_total{{code="{c}"}} {n}' for c, n in by_code],
        )  # fmt: skip
        family(
            "tetrarec_serve_rows_scored_total", "counter", "Rows scored.",
            [f"tetrarec_serve_rows_scored_total {self.rows_scored}"],
        )  # fmt: skip
        family(
            "tetrarec_serve_model_calls_total", "counter", "Model calls (merged batches).",
            [f"tetrarec_serve_model_calls_total {self.model_calls}"],
        )  # fmt: skip
        family(
            "tetrarec_serve_request_seconds", "histogram", "Scoring request latency in seconds.",
            self.latency.lines("tetrarec_serve_request_seconds"),
        )  # fmt: skip
        family(
            "tetrarec_serve_batch_rows", "histogram", "Rows per model call.",
            self.batch_rows.lines("tetrarec_serve_batch_rows"),
        )  # fmt: skip
        family(
            "tetrarec_serve_queue_depth", "gauge", "Scoring requests waiting for the model.",
            [f"tetrarec_serve_queue_depth {self.queue_depth()}"],
        )  # fmt: skip
        labels = ",".join(f'{k}="{_label(v)}"' for k, v in sorted(self.model_labels.items()))
        family(
            "tetrarec_serve_model_info", "gauge", "The model served (value 1).",
            [f"tetrarec_serve_model_info{{{labels}}} 1"],
        )  # fmt: skip
        return "\n".join(out) + "\n"

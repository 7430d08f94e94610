"""Server metrics in the Prometheus text format (no client library needed).

Per profile (``label``: the store name, ``inline``, or ``none``): requests, prompt and generated tokens, a
latency and a time-to-first-token histogram, and the mean narrative mass and KL from the processors' traces.
Server-wide: ``generate`` calls (batches) and the rows they held, rejected requests by reason, queue depth.

>>> m = Metrics()
>>> m.request_done("chat", "space", prompt_tokens=5, completion_tokens=7, seconds=0.3, ttft=0.1)
>>> 'ngrav_requests_total{endpoint="chat",profile="space"} 1' in m.render()
True
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable

__all__ = ["Metrics"]

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class _Histogram:
    def __init__(self, buckets: Iterable[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> list[str]:
        sep = "," if labels else ""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            le = "+Inf" if bound == float("inf") else _num(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {total}')
        wrapped = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{wrapped} {_num(self.sum)}")
        out.append(f"{name}_count{wrapped} {self.count}")
        return out


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) and not float(x).is_integer() else str(int(x))


def _labels(**kv: str) -> str:
    return ",".join(f'{k}="{_escape(v)}"' for k, v in kv.items())


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Counters updated by the request handlers and the scheduler; :meth:`render` is the ``/metrics`` body."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.prompt_tokens: defaultdict[str, int] = defaultdict(int)
        self.generated_tokens: defaultdict[str, int] = defaultdict(int)
        self.latency: dict[str, _Histogram] = {}
        self.ttft: dict[str, _Histogram] = {}
        self.gravity_rows: defaultdict[str, int] = defaultdict(int)
        self.mass_sum: defaultdict[str, float] = defaultdict(float)
        self.kl_sum: defaultdict[str, float] = defaultdict(float)
        self.errors: defaultdict[tuple[int, str], int] = defaultdict(int)
        self.batches = 0
        self.batch_rows = 0
        self.batch_size = _Histogram(BATCH_BUCKETS)
        self.batch_seconds = _Histogram(LATENCY_BUCKETS)

    def request_done(
        self,
        endpoint: str,
        profile: str,
        *,
        prompt_tokens: int,
        completion_tokens: int,
        seconds: float,
        ttft: float | None,
    ) -> None:
        with self._lock:
            self.requests[(endpoint, profile)] += 1
            self.prompt_tokens[profile] += prompt_tokens
            self.generated_tokens[profile] += completion_tokens
            self.latency.setdefault(profile, _Histogram(LATENCY_BUCKETS)).observe(seconds)
            if ttft is not None:
                self.ttft.setdefault(profile, _Histogram(LATENCY_BUCKETS)).observe(ttft)

    def gravity_row(self, profile: str, mass: float, kl: float) -> None:
        with self._lock:
            self.gravity_rows[profile] += 1
            self.mass_sum[profile] += mass
            self.kl_sum[profile] += kl

    def error(self, status: int, code: str | None) -> None:
        with self._lock:
            self.errors[(status, code or "")] += 1

    def batch(self, rows: int, seconds: float) -> None:
        with self._lock:
            self.batches += 1
            self.batch_rows += rows
            self.batch_size.observe(rows)
            self.batch_seconds.observe(seconds)

    def render(self, gauges: dict[str, tuple[str, float]] | None = None) -> str:
        """The exposition text; ``gauges`` adds ``{name: (help, value)}`` read at scrape time."""
        out: list[str] = []

        def family(name: str, kind: str, help_: str, lines: Callable[[], list[str]]) -> None:
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines()])

        with self._lock:
            family(
                "ngrav_requests_total",
                "counter",
                "Completed requests by endpoint and profile.",
                lambda: [
                    f"ngrav_requests_total{{{_labels(endpoint=e, profile=p)}}} {n}"
                    for (e, p), n in sorted(self.requests.items())
                ],
            )
            family(
                "ngrav_prompt_tokens_total",
                "counter",
                "Prompt tokens of completed requests, by profile.",
                lambda: [
                    f"ngrav_prompt_tokens_total{{{_labels(profile=p)}}} {n}"
                    for p, n in sorted(self.prompt_tokens.items())
                ],
            )
            family(
                "ngrav_generated_tokens_total",
                "counter",
                "Generated tokens of completed requests, by profile.",
                lambda: [
                    f"ngrav_generated_tokens_total{{{_labels(profile=p)}}} {n}"
                    for p, n in sorted(self.generated_tokens.items())
                ],
            )
            family(
                "ngrav_request_latency_seconds",
                "histogram",
                "Time from request to last token, by profile.",
                lambda: [
                    ln
                    for p, h in sorted(self.latency.items())
                    for ln in h.lines("ngrav_request_latency_seconds", _labels(profile=p))
                ],
            )
            family(
                "ngrav_time_to_first_token_seconds",
                "histogram",
                "Time from request to first generated token, by profile.",
                lambda: [
                    ln
                    for p, h in sorted(self.ttft.items())
                    for ln in h.lines("ngrav_time_to_first_token_seconds", _labels(profile=p))
                ],
            )
            family(
                "ngrav_narrative_mass_mean",
                "gauge",
                "Mean narrative mass (after the pull) over generated rows, by profile.",
                lambda: [
                    f"ngrav_narrative_mass_mean{{{_labels(profile=p)}}} {self.mass_sum[p] / n:.6f}"
                    for p, n in sorted(self.gravity_rows.items())
                ],
            )
            family(
                "ngrav_kl_mean",
                "gauge",
                "Mean KL(p'||p) per step in nats over generated rows, by profile.",
                lambda: [
                    f"ngrav_kl_mean{{{_labels(profile=p)}}} {self.kl_sum[p] / n:.6f}"
                    for p, n in sorted(self.gravity_rows.items())
                ],
            )
            family(
                "ngrav_gravity_rows_total",
                "counter",
                "Rows generated with gravity (the count behind the means), by profile.",
                lambda: [
                    f"ngrav_gravity_rows_total{{{_labels(profile=p)}}} {n}"
                    for p, n in sorted(self.gravity_rows.items())
                ],
            )
            family(
                "ngrav_request_errors_total",
                "counter",
                "Requests answered with an error, by HTTP status and error code.",
                lambda: [
                    f"ngrav_request_errors_total{{{_labels(status=str(s), code=c)}}} {n}"
                    for (s, c), n in sorted(self.errors.items())
                ],
            )
            family(
                "ngrav_generate_calls_total",
                "counter",
                "Batches run (model.generate calls).",
                lambda: [f"ngrav_generate_calls_total {self.batches}"],
            )
            family(
                "ngrav_batch_rows_total",
                "counter",
                "Rows run in all batches.",
                lambda: [f"ngrav_batch_rows_total {self.batch_rows}"],
            )
            family(
                "ngrav_batch_size",
                "histogram",
                "Rows per batch.",
                lambda: self.batch_size.lines("ngrav_batch_size", ""),
            )
            family(
                "ngrav_batch_seconds",
                "histogram",
                "Wall time per batch.",
                lambda: self.batch_seconds.lines("ngrav_batch_seconds", ""),
            )
        for name, (help_, value) in (gauges or {}).items():
            family(name, "gauge", help_, lambda value=value, name=name: [f"{name} {_num(value)}"])
        return "\n".join(out) + "\n"

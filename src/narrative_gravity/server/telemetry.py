"""Server metrics for ``/metrics``, kept in a ``prometheus_client`` registry of the app's own.

Per profile (``label``: the store name, ``inline``, or ``none``): requests, prompt and generated tokens, a
latency and a time-to-first-token histogram, and the mean narrative mass and KL from the processors' traces.
Per stored profile and arm (``live``, ``pinned``, ``split:a``, ``split:b``, ``shadow``; see
:mod:`~narrative_gravity.profiles.rollout`): finished requests, generated tokens, latency, and summaries (``_sum`` and
``_count``, so ``_sum / _count`` is the mean per request) of narrative mass after and before the pull, KL per token
and the off-topic rate; shadow runs skipped (by reason) and the tokens shadows decoded. At most
:data:`MAX_ARM_PROFILES` profile names get series of their own, the rest share ``profile="other"``.

Server-wide: rejected requests by reason, batches and the rows they held (engines that batch whole requests),
engine steps and the rows each step advanced (engines that admit rows at any step), and gauges read at scrape
time (queue depth, running rows, and an engine's own gauges through :meth:`Metrics.register`).

>>> m = Metrics()
>>> m.request_done("chat", "space", prompt_tokens=5, completion_tokens=7, seconds=0.3, ttft=0.1)
>>> 'ngrav_requests_total{endpoint="chat",profile="space"} 1.0' in m.render()
True
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import ConfigurationError

try:  # the `server` extra; without it the module imports and Metrics() says what to install
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, generate_latest
    from prometheus_client.core import GaugeMetricFamily
except ModuleNotFoundError:  # pragma: no cover - depends on the environment
    _HAVE_CLIENT = False
else:
    _HAVE_CLIENT = True

__all__ = ["CONTENT_TYPE", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The exposition format :meth:`Metrics.render` writes (Prometheus text, version 0.0.4)."""

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_ARM_PROFILES = 64
"""Profile names with per-arm series of their own; later names are counted as ``profile="other"``."""
ARM_NAMES = frozenset({"live", "pinned", "split:a", "split:b", "shadow"})


class _ScrapeGauges:
    """Gauges whose values are read when ``/metrics`` is scraped: ``{name: (help, read)}``."""

    def __init__(self) -> None:
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def collect(self) -> Iterator[Any]:
        for name, (help_, read) in list(self.gauges.items()):
            yield GaugeMetricFamily(name, help_, value=float(read()))


class Metrics:
    """Counters updated by the request handlers and the scheduler; :meth:`render` is the ``/metrics`` body.

    Every :class:`Metrics` has a registry of its own, so several apps in one process (tests) do not share counts.
    """

    def __init__(self) -> None:
        if not _HAVE_CLIENT:
            raise ConfigurationError(
                "server metrics need prometheus-client; install it with:\n    pip install 'narrative-gravity[server]'"
            )
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._profile_series(self.registry)
        self._engine_series(self.registry)
        self._arm_series(self.registry)
        self._arm_profiles: set[str] = set()
        self._sums: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])  # mass, kl, rows
        self._scrape = _ScrapeGauges()
        self.registry.register(self._scrape)
        self._batches = 0

    def _profile_series(self, r: Any) -> None:
        """Per profile: requests, tokens, latency, time to first token, the trace means; and errors."""
        self.requests = Counter(
            "ngrav_requests", "Completed requests by endpoint and profile.", ["endpoint", "profile"], registry=r
        )
        self.prompt_tokens = Counter(
            "ngrav_prompt_tokens", "Prompt tokens of completed requests, by profile.", ["profile"], registry=r
        )
        self.generated_tokens = Counter(
            "ngrav_generated_tokens", "Generated tokens of completed requests, by profile.", ["profile"], registry=r
        )
        self.latency = Histogram(
            "ngrav_request_latency_seconds",
            "Time from request to last token, by profile.",
            ["profile"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ngrav_time_to_first_token_seconds",
            "Time from request to first generated token, by profile.",
            ["profile"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.mass_mean = Gauge(
            "ngrav_narrative_mass_mean",
            "Mean narrative mass (after the pull) over generated rows, by profile.",
            ["profile"],
            registry=r,
        )
        self.kl_mean = Gauge(
            "ngrav_kl_mean", "Mean KL(p'||p) per step in nats over generated rows, by profile.", ["profile"], registry=r
        )
        self.gravity_rows = Counter(
            "ngrav_gravity_rows",
            "Rows generated with gravity and a trace (the count behind the means), by profile.",
            ["profile"],
            registry=r,
        )
        self.errors = Counter(
            "ngrav_request_errors",
            "Requests answered with an error, by HTTP status and error code.",
            ["status", "code"],
            registry=r,
        )

    def _engine_series(self, r: Any) -> None:
        """Batches and the rows they held; engine steps and the rows each advanced."""
        self.generate_calls = Counter(
            "ngrav_generate_calls", "Batches run (one blocking generate call each).", registry=r
        )
        self.batch_rows = Counter("ngrav_batch_rows", "Rows run in all batches.", registry=r)
        self.batch_size = Histogram("ngrav_batch_size", "Rows per batch.", buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram(
            "ngrav_batch_seconds", "Wall time per batch.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.engine_steps = Counter(
            "ngrav_engine_steps", "Engine steps that produced tokens (engines that admit rows at any step).", registry=r
        )
        self.step_rows = Histogram(
            "ngrav_step_rows", "Rows that got a token in one engine step.", buckets=BATCH_BUCKETS, registry=r
        )

    def _arm_series(self, r: Any) -> None:
        """Per stored profile and arm: requests, tokens, latency and the means per request; shadows skipped."""
        arm = ["profile", "arm"]
        self.arm_requests = Counter(
            "ngrav_arm_requests", "Finished requests (and shadow runs) by stored profile and arm.", arm, registry=r
        )
        self.arm_tokens = Counter(
            "ngrav_arm_generated_tokens", "Generated tokens of finished requests by profile and arm.", arm, registry=r
        )
        self.arm_latency = Histogram(
            "ngrav_arm_latency_seconds",
            "Time from request to last token (shadows: from their start) by profile and arm.",
            arm,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.arm_mass = Summary(
            "ngrav_arm_narrative_mass",
            "Narrative mass after the pull per request, by profile and arm.",
            arm,
            registry=r,
        )
        self.arm_mass_before = Summary(
            "ngrav_arm_narrative_mass_before",
            "Narrative mass before the pull per request, by profile and arm.",
            arm,
            registry=r,
        )
        self.arm_kl = Summary(
            "ngrav_arm_kl", "Mean KL(p'||p) per token per request, by profile and arm.", arm, registry=r
        )
        self.arm_off_topic = Summary(
            "ngrav_arm_off_topic_rate",
            "Share of a request's generated tokens whose field value is <= 0, by profile and arm.",
            arm,
            registry=r,
        )
        self.shadow_skipped = Counter(
            "ngrav_shadow_skipped",
            "Shadow runs not recorded, by profile and reason (load, budget, preempted, error).",
            ["profile", "reason"],
            registry=r,
        )
        self.shadow_tokens = Counter(
            "ngrav_shadow_decoded_tokens",
            "Tokens decoded by shadow runs, finished or preempted: the shadows' whole decode work.",
            ["profile"],
            registry=r,
        )

    # ------------------------------------------------------------------------------------------- updates

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
        self.requests.labels(endpoint, profile).inc()
        self.prompt_tokens.labels(profile).inc(prompt_tokens)
        self.generated_tokens.labels(profile).inc(completion_tokens)
        self.latency.labels(profile).observe(seconds)
        if ttft is not None:
            self.ttft.labels(profile).observe(ttft)

    def gravity_row(self, profile: str, mass: float, kl: float) -> None:
        with self._lock:
            sums = self._sums[profile]
            sums[0] += mass
            sums[1] += kl
            sums[2] += 1
            self.mass_mean.labels(profile).set(sums[0] / sums[2])
            self.kl_mean.labels(profile).set(sums[1] / sums[2])
        self.gravity_rows.labels(profile).inc()

    def _arm_labels(self, profile: str, arm: str) -> tuple[str, str]:
        with self._lock:
            if profile not in self._arm_profiles and len(self._arm_profiles) < MAX_ARM_PROFILES:
                self._arm_profiles.add(profile)
        return (profile if profile in self._arm_profiles else "other", arm if arm in ARM_NAMES else "other")

    def arm_done(
        self,
        profile: str,
        arm: str,
        *,
        tokens: int,
        seconds: float,
        mass: float | None = None,
        mass_before: float | None = None,
        kl: float | None = None,
        off_topic: float | None = None,
    ) -> None:
        """One finished request (or shadow run) of a stored profile's arm."""
        labels = self._arm_labels(profile, arm)
        self.arm_requests.labels(*labels).inc()
        self.arm_tokens.labels(*labels).inc(tokens)
        self.arm_latency.labels(*labels).observe(seconds)
        for summary, value in (
            (self.arm_mass, mass),
            (self.arm_mass_before, mass_before),
            (self.arm_kl, kl),
            (self.arm_off_topic, off_topic),
        ):
            if value is not None:
                summary.labels(*labels).observe(value)

    def shadow_skip(self, profile: str, reason: str) -> None:
        """A shadow run that was not run or not recorded (``load``, ``budget``, ``preempted``, ``error``)."""
        self.shadow_skipped.labels(self._arm_labels(profile, "shadow")[0], reason).inc()

    def shadow_decoded(self, profile: str, tokens: int) -> None:
        """Tokens a shadow run decoded (finished or not)."""
        self.shadow_tokens.labels(self._arm_labels(profile, "shadow")[0]).inc(tokens)

    def error(self, status: int, code: str | None) -> None:
        self.errors.labels(str(status), code or "").inc()

    def batch(self, rows: int, seconds: float) -> None:
        """One blocking batch of ``rows`` rows ran for ``seconds``."""
        with self._lock:
            self._batches += 1
        self.generate_calls.inc()
        self.batch_rows.inc(rows)
        self.batch_size.observe(rows)
        self.batch_seconds.observe(seconds)

    def engine_step(self, rows: int) -> None:
        """One step of a continuous engine gave a token to ``rows`` rows."""
        self.engine_steps.inc()
        self.step_rows.observe(rows)

    @property
    def batches(self) -> int:
        """Batches run so far (``ngrav_generate_calls_total``)."""
        return self._batches

    # ------------------------------------------------------------------------------------------- scrape

    def watch(self, name: str, help_: str, read: Callable[[], float]) -> None:
        """Expose ``read()`` as the gauge ``name`` at every scrape (replacing an earlier gauge of that name)."""
        self._scrape.gauges[name] = (help_, read)

    def register(self, collectors: Iterable[Any]) -> None:
        """Add collectors (an engine's own metrics) to this registry; their names must not clash with ours."""
        for c in collectors:
            self.registry.register(c)

    def render(self, gauges: dict[str, tuple[str, float]] | None = None) -> str:
        """The exposition text; ``gauges`` adds ``{name: (help, value)}`` read at scrape time."""
        for name, (help_, value) in (gauges or {}).items():
            self.watch(name, help_, lambda value=value: value)
        return generate_latest(self.registry).decode("utf-8")

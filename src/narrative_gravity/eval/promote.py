"""Promote a staged profile version only when an eval says it does not regress (``ngrav profile promote``).

The live and the candidate version run through ``ngrav eval`` (:func:`~narrative_gravity.eval.runner.run_eval`) on
the same prompt set, seeds and settings, so every (prompt, seed) gives a pair. For each limit ``METRIC:DELTA`` the
paired difference ``candidate − live`` of the metric's aggregate (with its 95% bootstrap interval) is read against
the metric's direction (``higher_is_better`` in :mod:`~narrative_gravity.eval.metrics`):

- the *regression* is how far the candidate moved the wrong way: ``live − candidate`` for a metric where higher is
  better, ``candidate − live`` where lower is better, ``|candidate − live|`` for one that is not judged;
- a limit ``DELTA`` allows that much (absolute), ``DELTA%`` that share of the live value;
- any regression beyond its limit refuses the promotion and the live pointer stays where it was. Otherwise it
  moves, and only if the live version is still the one the eval compared against.

>>> Limit.parse("distinct_2:0.05"), Limit.parse("rep_2:10%").allowed(0.3)
(Limit(metric='distinct_2', delta=0.05, relative=False), 0.03)
>>> Limit.parse("distinct2:0.05")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
narrative_gravity.errors.ConfigurationError: --limit 'distinct2:0.05': unknown metric 'distinct2'; did you mean 'distinct_2'? ...
>>> check_limit(Limit.parse("distinct_2:0.05"), live=[0.9, 0.8, 0.9], candidate=[0.5, 0.4, 0.6]).passed
False
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..engines.options import GenerationOptions
from ..errors import ConfigurationError
from .metrics import get_metric
from .runner import EvalModels, EvalSettings, run_eval
from .stats import paired_bootstrap
from .store import RESULTS, ResultStore

__all__ = ["PROMOTE_OPTIONS", "Check", "Limit", "Promotion", "PromotionCheck", "check_limit", "evaluate_promotion"]

LIVE_ARM, CANDIDATE_ARM = "live", "candidate"


@dataclass(frozen=True)
class Limit:
    """How far ``metric`` may regress: ``delta`` absolute, or ``delta`` percent of the live value."""

    metric: str
    delta: float
    relative: bool = False

    @classmethod
    def parse(cls, spec: str) -> Limit:
        """``METRIC:DELTA`` or ``METRIC:DELTA%``, e.g. ``distinct_2:0.05`` or ``rep_2:10%``."""
        metric, sep, raw = spec.partition(":")
        metric, raw = metric.strip(), raw.strip()
        if not sep or not metric or not raw:
            raise ConfigurationError(
                f"--limit {spec!r}: write METRIC:DELTA, e.g. distinct_2:0.05 (absolute) or rep_2:10% (of the live value)"
            )
        try:
            get_metric(metric)
        except ConfigurationError as exc:
            raise ConfigurationError(f"--limit {spec!r}: {exc}") from None
        relative = raw.endswith("%")
        try:
            delta = float(raw.removesuffix("%"))
        except ValueError:
            delta = float("nan")
        if not math.isfinite(delta) or delta < 0:
            raise ConfigurationError(f"--limit {spec!r}: DELTA must be a number >= 0, e.g. 0.05 or 10%")
        return cls(metric, delta, relative)

    def allowed(self, live: float) -> float:
        """The regression allowed when the live version scores ``live``."""
        return round(abs(live) * self.delta / 100.0, 12) if self.relative else self.delta

    def __str__(self) -> str:
        return f"{self.metric}:{self.delta:g}{'%' if self.relative else ''}"


@dataclass(frozen=True)
class Check:
    """One limit read against the eval: the aggregates, the paired difference and its interval, the verdict."""

    metric: str
    limit: str
    higher_is_better: bool | None
    pairs: int
    live: float
    candidate: float
    difference: float
    low: float
    high: float
    regression: float
    allowed: float
    passed: bool

    def describe(self) -> str:
        return (
            f"{self.metric}: live {self.live:.4g} → candidate {self.candidate:.4g}, difference {self.difference:+.4g} "
            f"[{self.low:+.4g}, {self.high:+.4g}] over {self.pairs} pairs; regression {self.regression:.4g}, "
            f"allowed {self.allowed:.4g} ({self.limit})"
        )


def check_limit(limit: Limit, *, live: Sequence[float], candidate: Sequence[float]) -> Check:
    """Read one limit against paired per-sample values (NaN pairs are dropped)."""
    metric = get_metric(limit.metric)
    c = paired_bootstrap(live, candidate, higher_is_better=metric.higher_is_better, how=metric.aggregation)
    if c.n == 0:
        nan = float("nan")
        return Check(limit.metric, str(limit), metric.higher_is_better, 0, nan, nan, nan, nan, nan, nan, nan, False)
    if metric.higher_is_better is None:
        regression = abs(c.difference)
    else:
        regression = -c.difference if metric.higher_is_better else c.difference
    allowed = limit.allowed(c.control)
    return Check(
        limit.metric,
        str(limit),
        metric.higher_is_better,
        c.n,
        c.control,
        c.treated,
        c.difference,
        c.low,
        c.high,
        regression,
        allowed,
        regression <= allowed + 1e-12,
    )


@dataclass
class Promotion:
    """What a checked promotion found and did."""

    name: str
    live: int
    candidate: int
    checks: list[Check] = field(default_factory=list)
    promoted: bool = False
    out: str | None = None

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def to_json(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and not math.isfinite(v) else v

        return {
            "name": self.name,
            "live": self.live,
            "candidate": self.candidate,
            "promoted": self.promoted,
            "out": self.out,
            "checks": [{k: clean(v) for k, v in asdict(c).items()} for c in self.checks],
        }


PROMOTE_OPTIONS = GenerationOptions(max_new_tokens=60, raw=None)
"""How a promotion's eval samples unless told otherwise (``raw=None``: as ``ngrav eval`` decides)."""


@dataclass(frozen=True)
class PromotionCheck:
    """The eval a promotion runs, and what follows it.

    Args:
        prompts: the eval's prompt set (``topics``, ``empath``, a ``.txt`` file or JSONL).
        version: the candidate (default: the newest staged version).
        out: keep the eval's run folder and reports here (a temporary folder without it).
        seeds: the seeds every prompt runs with.
        options: budget, sampling, batch size and engine of the eval.
        model_name, judge, limit_prompts: as ``ngrav eval --model``, ``--judge`` (default: none unless a limit is
            ``judge_ppl``) and ``--limit-prompts``.
        promote: move the live pointer when every limit holds; ``message`` says why.
    """

    prompts: str
    version: int | None = None
    out: str | os.PathLike[str] | None = None
    seeds: Sequence[int] = (0, 1, 2)
    options: GenerationOptions = PROMOTE_OPTIONS
    model_name: str | None = None
    judge: str | None = None
    limit_prompts: int | None = None
    promote: bool = True
    message: str | None = None

    def settings(self, profiles: Sequence[str], metrics: Sequence[str]) -> EvalSettings:
        """The :class:`~narrative_gravity.eval.runner.EvalSettings` of the eval over ``profiles``."""
        o = self.options
        judge = self.judge if self.judge is not None else "gemma3-270m" if "judge_ppl" in metrics else "none"
        return EvalSettings(
            prompts=self.prompts,
            profiles=tuple(profiles),
            seeds=tuple(self.seeds),
            max_new_tokens=o.max_new_tokens,
            top_k=o.top_k,
            temperature=o.temperature,
            raw=o.raw,
            batch_size=o.batch_size,
            model=self.model_name,
            judge=judge,
            metrics=tuple(metrics),
            limit_prompts=self.limit_prompts,
            engine=o.engine,
            device=o.device,
        )


def evaluate_promotion(
    store: Any,
    name: str,
    limits: Sequence[Limit],
    check: PromotionCheck,
    *,
    model: Any = None,
    tokenizer: Any = None,
    console: Any = None,
) -> Promotion:
    """Evaluate the candidate ``check.version`` of ``name`` against the live version and promote it when every
    limit holds (and ``check.promote``). ``model``/``tokenizer`` skip loading ``check.model_name``; ``console``
    shows the eval's progress."""
    if not limits:
        raise ConfigurationError("give at least one --limit METRIC:DELTA, e.g. --limit distinct_2:0.05")
    live = store.live_version(name)
    version = _candidate(store, name, check.version, live)
    arms = {LIVE_ARM: store.get(name, live), CANDIDATE_ARM: store.get(name, version)}
    metrics = tuple(dict.fromkeys(lim.metric for lim in limits))
    out = check.out
    tmp = None if out is not None else tempfile.TemporaryDirectory(prefix="ngrav-promote-")
    run_dir = Path(out if out is not None else tmp.name)  # type: ignore[union-attr]
    try:
        files = run_dir / "profiles"
        files.mkdir(parents=True, exist_ok=True)
        paths = []
        for arm, profile in arms.items():
            path = files / f"{arm}.json"
            path.write_text(json.dumps(profile.model_copy(update={"name": arm}).model_dump(mode="json")) + "\n")
            paths.append(str(path))
        settings = check.settings(paths, metrics)
        progress, report = console is not None, out is not None
        models = EvalModels(model=model, tokenizer=tokenizer)
        run_eval(settings, run_dir, models=models, progress=progress, write_report=report, console=console)
        result = Promotion(name, live, version, out=str(out) if out is not None else None)
        result.checks = _read_checks(run_dir, limits)
    finally:
        if tmp is not None:
            tmp.cleanup()
    if check.promote and not result.failed:
        note = check.message or f"promoted after eval on {check.prompts}: " + "; ".join(
            f"{c.metric} {c.difference:+.3g}" for c in result.checks
        )
        store.promote(name, version, message=note, expect_live=live)
        result.promoted = True
    return result


def _candidate(store: Any, name: str, version: int | None, live: int) -> int:
    """The version to promote: ``version``, or the newest staged one; never the live one."""
    if version is None:
        staged = store.staged(name)
        if not staged:
            raise ConfigurationError(
                f"nothing is staged for {name!r}: its live version {live} is the newest; stage one with "
                f"`ngrav profile stage {name} FILE`, or name a version with --version"
            )
        version = staged[-1]
    if version == live:
        raise ConfigurationError(f"version {version} of {name!r} is already live; name another with --version")
    return version


def _read_checks(run_dir: Path, limits: Sequence[Limit]) -> list[Check]:
    """Each limit read against the eval's results: (prompt, seed) pairs that both arms finished."""
    by_arm: dict[str, dict[tuple[int, int], dict[str, Any]]] = {LIVE_ARM: {}, CANDIDATE_ARM: {}}
    for r in ResultStore(run_dir / RESULTS).load():
        if r.get("profile") in by_arm:
            by_arm[r["profile"]][(int(r["prompt_index"]), int(r["seed"]))] = r.get("metrics", {})
    pairs = sorted(set(by_arm[LIVE_ARM]) & set(by_arm[CANDIDATE_ARM]))

    def values(arm: str, metric: str) -> list[float]:
        got = (by_arm[arm][k].get(metric) for k in pairs)
        return [float(v) if isinstance(v, (int, float)) else float("nan") for v in got]

    return [
        check_limit(lim, live=values(LIVE_ARM, lim.metric), candidate=values(CANDIDATE_ARM, lim.metric))
        for lim in limits
    ]

"""The metric registry of ``ngrav eval``: name → function, ``higher_is_better`` and aggregation.

Every metric maps a batch of :class:`Sample` objects to one float per sample (NaN where it is undefined),
so the same code scores control and profile rows and the comparison can be paired. Expensive models (the
MiniLM encoder, the judge) come from a :class:`MetricContext`, loaded on first use and cached.

>>> s = Sample(prompt="p", text="the cat sat on the mat the cat sat", new_tokens=9)
>>> compute_metrics([s], ["distinct_1", "rep_2", "length"])[0]
{'length': 9.0, 'rep_2': 0.25, 'distinct_1': 0.5555555555555556}
>>> get_metric("topic_sucess")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
narrative_gravity.errors.ConfigurationError: unknown metric 'topic_sucess'; did you mean 'topic_success'? Known metrics: ...
"""

from __future__ import annotations

import difflib
import functools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from wordfreq import zipf_frequency

from ..embeddings import load_minilm
from ..errors import ConfigurationError
from ..text import ngrams
from .judge import load_judge
from .stats import AGGREGATIONS
from .text_metrics import is_cjk, token_field_values

__all__ = [
    "METRICS",
    "RARE_ZIPF",
    "Metric",
    "MetricContext",
    "Sample",
    "compute_metrics",
    "contains_any",
    "get_metric",
    "rare_words",
    "register_metric",
    "repetition",
    "resolve_metrics",
    "word_spans",
]

NAN = float("nan")
# `rare_success` counts a scoring word as rare below this Zipf frequency (wordfreq, English): log10 of its
# frequency per billion words, so under 10 per million words: "the" is 7.73, "orbit" 4.03 (not rare),
# "tarmac" 3.04 (rare).
RARE_ZIPF = 4.0


@dataclass
class Sample:
    """One generation and everything a metric may read.

    ``seconds`` is this row's share of its batch's wall time, ``latency`` the batch's wall time (what the
    request waited), ``ttft`` the time from the call to the first token's logits. ``field`` and
    ``penalized`` come from the profile the sample is scored against (for a control row: the profile it is
    paired with). ``score_words`` score topic relevance and success.
    """

    prompt: str
    text: str
    new_tokens: int = 0
    token_ids: Sequence[int] = ()
    prompt_ids: Sequence[int] = ()
    seconds: float = NAN
    latency: float = NAN
    ttft: float = NAN
    trace_means: dict[str, float] | None = None
    score_words: tuple[str, ...] = ()
    field: Any = None
    penalized: tuple[str, ...] = ()
    tokenizer: Any = None
    judge_context: str | None = None
    required: tuple[str, ...] = ()
    description: str | None = None


class MetricContext:
    """Lazily loaded models shared by metrics, with caches so that re-scoring a text costs nothing.

    Args:
        encoder: ``texts -> [n, d]`` unit rows; default: MiniLM (:func:`~narrative_gravity.embeddings.load_minilm`).
        judge: a :class:`~narrative_gravity.eval.judge.PerplexityJudge`, a model name or path to load one,
            or ``None`` for the default judge (Gemma 3 270M).
        device: where a judge loaded here runs (``cpu``, ``cuda``, ``auto``, ...).
    """

    def __init__(
        self, *, encoder: Callable[[Sequence[str]], Any] | None = None, judge: Any = None, device: str = "cpu"
    ) -> None:
        self._encoder = encoder
        self._judge = judge
        self._device = device
        self._vectors: dict[str, Any] = {}
        self._centroids: dict[tuple[str, ...], Any] = {}
        self._ppl: dict[tuple[str, str], float] = {}

    @property
    def encoder(self) -> Callable[[Sequence[str]], Any]:
        if self._encoder is None:
            self._encoder = load_minilm()
        return self._encoder

    @property
    def judge(self) -> Any:
        if self._judge is None or isinstance(self._judge, str):
            self._judge = load_judge(self._judge, device=self._device)
        return self._judge

    def vectors(self, texts: Sequence[str]) -> list[Any]:
        todo = list(dict.fromkeys(t for t in texts if t not in self._vectors))
        if todo:
            for t, v in zip(todo, self.encoder(todo)):
                self._vectors[t] = v
        return [self._vectors[t] for t in texts]

    def centroid(self, words: tuple[str, ...]) -> Any:
        if words not in self._centroids:
            vecs = torch.stack(self.vectors(list(words)))
            self._centroids[words] = torch.nn.functional.normalize(vecs.mean(dim=0), dim=-1)
        return self._centroids[words]

    def perplexities(self, contexts: Sequence[str], texts: Sequence[str]) -> list[float]:
        keys = list(zip(contexts, texts))
        todo = list(dict.fromkeys(k for k in keys if k not in self._ppl))
        if todo:
            values = self.judge.perplexity([c for c, _ in todo], [t for _, t in todo])
            self._ppl.update(zip(todo, values))
        return [self._ppl[k] for k in keys]


BatchFn = Callable[[Sequence[Sample], MetricContext], list[float]]


@dataclass(frozen=True)
class Metric:
    """A registered metric. ``aggregation`` is ``mean`` or ``geomean`` (see :mod:`~narrative_gravity.eval.stats`);
    ``higher_is_better`` is ``None`` for diagnostics that are reported but not judged."""

    name: str
    fn: BatchFn
    higher_is_better: bool | None
    aggregation: str
    description: str
    unit: str = ""
    needs: frozenset[str] = field(default_factory=frozenset)

    def compute(self, samples: Sequence[Sample], ctx: MetricContext) -> list[float]:
        values = [float(v) for v in self.fn(samples, ctx)]
        if len(values) != len(samples):
            raise RuntimeError(f"metric {self.name!r} returned {len(values)} values for {len(samples)} samples")
        return values


METRICS: dict[str, Metric] = {}


def register_metric(
    name: str,
    *,
    higher_is_better: bool | None,
    description: str,
    aggregation: str = "mean",
    unit: str = "",
    batched: bool = False,
    needs: Iterable[str] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(sample) -> float`` (or, with ``batched=True``, ``fn(samples, ctx) -> list[float]``)."""

    if aggregation not in AGGREGATIONS:
        raise ConfigurationError(f"aggregation {aggregation!r} is unknown; use one of {sorted(AGGREGATIONS)}")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in METRICS:
            raise ConfigurationError(f"metric {name!r} is already registered")
        batch_fn: BatchFn = fn if batched else (lambda samples, ctx: [fn(s) for s in samples])
        METRICS[name] = Metric(name, batch_fn, higher_is_better, aggregation, description, unit, frozenset(needs))
        return fn

    return deco


def get_metric(name: str) -> Metric:
    """The registered metric ``name``; an unknown name raises an error with a did-you-mean hint."""
    try:
        return METRICS[name]
    except KeyError:
        guess = difflib.get_close_matches(name, list(METRICS), n=1, cutoff=0.6)
        hint = f"; did you mean {guess[0]!r}? Known" if guess else "; known"
        raise ConfigurationError(f"unknown metric {name!r}{hint} metrics: {', '.join(METRICS)}") from None


def resolve_metrics(names: Iterable[str] | None) -> list[Metric]:
    """Metrics by name in registry order (all of them for ``None``); checks every name first."""
    if names is None:
        return list(METRICS.values())
    wanted = [n.strip() for n in names if n.strip()]
    for n in wanted:
        get_metric(n)
    if not wanted:
        raise ConfigurationError(f"no metric given; choose from: {', '.join(METRICS)}")
    return [m for m in METRICS.values() if m.name in wanted]


def compute_metrics(
    samples: Sequence[Sample], names: Iterable[str] | None = None, ctx: MetricContext | None = None
) -> list[dict[str, float]]:
    """Every requested metric for every sample: one ``{name: value}`` per sample, in registry order."""
    ctx = ctx if ctx is not None else MetricContext()
    out: list[dict[str, float]] = [{} for _ in samples]
    for m in resolve_metrics(names):
        for row, v in zip(out, m.compute(samples, ctx)):
            row[m.name] = v
    return out


# --------------------------------------------------------------------------------------------------
# helpers


def _word_pattern(word: str) -> re.Pattern[str]:
    if is_cjk(word):
        return re.compile(re.escape(word))
    return re.compile(rf"(?<!\w){re.escape(word)}(?!\w)", flags=re.IGNORECASE)


def word_spans(text: str, words: Iterable[str]) -> list[tuple[int, int]]:
    """Character spans of whole-word, case-insensitive occurrences of ``words`` (substrings for CJK words).

    >>> word_spans("A Rocket, rockets and a rocket.", ["rocket"])
    [(2, 8), (24, 30)]
    """
    spans = []
    for w in words:
        w = " ".join(w.split())
        if w:
            spans.extend(m.span() for m in _word_pattern(w).finditer(text))
    return sorted(spans)


def contains_any(text: str, words: Iterable[str]) -> bool:
    """Whether ``text`` contains one of ``words`` (whole word, case-insensitive).

    >>> contains_any("Orbits of the MOON.", ["moon"]), contains_any("honeymoon", ["moon"])
    (True, False)
    """
    return any(_word_pattern(w).search(text) for w in (" ".join(w.split()) for w in words) if w)


@functools.lru_cache(maxsize=65536)
def _zipf(word: str) -> float:
    return float(zipf_frequency(word, "en"))


def rare_words(words: Iterable[str], threshold: float = RARE_ZIPF) -> tuple[str, ...]:
    """The ``words`` whose English Zipf frequency (wordfreq) is below ``threshold``, in their order.

    >>> rare_words(["the", "harbor", "tarmac", "seaweed"])
    ('tarmac', 'seaweed')
    """
    return tuple(w for w in (" ".join(w.split()) for w in words) if w and _zipf(w) < threshold)


def repetition(text: str, n: int) -> float:
    """rep-n: the share of the text's n-grams that repeat an earlier one, ``1 − unique/total`` (NaN if none).

    >>> repetition("a b a b a b", 2)
    0.6
    """
    grams = ngrams(text, n)
    return 1.0 - len(set(grams)) / len(grams) if grams else NAN


def _distinct(text: str, n: int) -> float:
    grams = ngrams(text, n)
    return len(set(grams)) / len(grams) if grams else NAN


def _token_char_ends(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """End offset of each token in the decoded text (prefix decodes; monotone even across split characters)."""
    prefixes = tokenizer.batch_decode([list(ids[: k + 1]) for k in range(len(ids))], skip_special_tokens=True)
    ends, best = [], 0
    for p in prefixes:
        best = max(best, len(p.rstrip("\ufffd")))
        ends.append(best)
    return ends


def _trace_mean(key: str) -> Callable[[Sample], float]:
    def fn(s: Sample) -> float:
        return (s.trace_means or {}).get(key, NAN)

    return fn


# --------------------------------------------------------------------------------------------------
# the metrics (registry order is report order)


@register_metric(
    "topic_success",
    higher_is_better=True,
    description="1 if the text contains a scoring word (held-out words for `topics`), whole word, case-insensitive",
)
def _topic_success(s: Sample) -> float:
    if not s.score_words:
        return NAN
    return 1.0 if contains_any(s.text, s.score_words) else 0.0


@register_metric(
    "rare_success",
    higher_is_better=True,
    description=f"1 if the text contains a rare scoring word (wordfreq Zipf frequency < {RARE_ZIPF:g}, i.e. under 10 "
    "per million words), whole word, case-insensitive; undefined for prompts without a rare scoring word",
)
def _rare_success(s: Sample) -> float:
    rare = rare_words(s.score_words)
    if not rare:
        return NAN
    return 1.0 if contains_any(s.text, rare) else 0.0


@register_metric(
    "topic_relevance",
    higher_is_better=True,
    batched=True,
    needs=("encoder",),
    description="MiniLM cosine between the text and the centroid of the scoring words",
)
def _topic_relevance(samples: Sequence[Sample], ctx: MetricContext) -> list[float]:
    out = [NAN] * len(samples)
    todo = [i for i, s in enumerate(samples) if s.score_words and s.text.strip()]
    if not todo:
        return out
    vecs = ctx.vectors([samples[i].text for i in todo])
    for i, v in zip(todo, vecs):
        out[i] = float(v @ ctx.centroid(tuple(samples[i].score_words)))
    return out


@register_metric(
    "description_relevance",
    higher_is_better=True,
    batched=True,
    needs=("encoder",),
    description="MiniLM cosine between the text and the prompt's topic description ('a text about space'), which "
    "no profile is given; undefined for prompts without one",
)
def _description_relevance(samples: Sequence[Sample], ctx: MetricContext) -> list[float]:
    out = [NAN] * len(samples)
    todo = [i for i, s in enumerate(samples) if s.description and s.text.strip()]
    if todo:
        texts = ctx.vectors([samples[i].text for i in todo])
        described = ctx.vectors([samples[i].description for i in todo])
        for i, v, d in zip(todo, texts, described):
            out[i] = float(v @ d)
    return out


@register_metric(
    "required_inclusion",
    higher_is_better=True,
    description="share of the prompt's required words (its `require` list) that the text contains, whole word, "
    "case-insensitive; undefined for prompts without required words",
)
def _required_inclusion(s: Sample) -> float:
    if not s.required:
        return NAN
    return sum(contains_any(s.text, [w]) for w in s.required) / len(s.required)


@register_metric(
    "off_topic_rate",
    higher_is_better=False,
    description="share of generated tokens with a negative field value or inside a penalized word",
)
def _off_topic_rate(s: Sample) -> float:
    if s.field is None or not s.token_ids:
        return NAN

    off = token_field_values(s.field, list(s.prompt_ids), list(s.token_ids)) < 0
    spans = word_spans(s.text, s.penalized) if s.penalized and s.tokenizer is not None else []
    if spans:
        ends = _token_char_ends(s.tokenizer, s.token_ids)
        starts = [0, *ends[:-1]]
        inside = [any(a < e and b > st for a, b in spans) for st, e in zip(starts, ends)]
        off = off | torch.tensor(inside, dtype=torch.bool)
    return float(off.float().mean())


@register_metric("length", higher_is_better=None, unit="tokens", description="generated tokens (EOS included)")
def _length(s: Sample) -> float:
    return float(s.new_tokens)


for _n in (2, 4):
    register_metric(
        f"rep_{_n}",
        higher_is_better=False,
        description=f"rep-{_n}: share of repeated word {_n}-grams within the text, 1 − unique/total",
    )(lambda s, _n=_n: repetition(s.text, _n))

for _n in (1, 2, 3):
    register_metric(
        f"distinct_{_n}",
        higher_is_better=True,
        description=f"distinct-{_n}: unique {_n}-grams / all {_n}-grams within the text (of words; of characters "
        "in scripts written without spaces)",
    )(lambda s, _n=_n: _distinct(s.text, _n))


@register_metric(
    "judge_ppl",
    higher_is_better=False,
    aggregation="geomean",
    batched=True,
    needs=("judge",),
    description="perplexity of the continuation given the prompt under the judge model (geometric mean)",
)
def _judge_ppl(samples: Sequence[Sample], ctx: MetricContext) -> list[float]:
    out = [NAN] * len(samples)
    todo = [i for i, s in enumerate(samples) if s.text.strip()]
    if todo:
        contexts = [
            samples[i].judge_context if samples[i].judge_context is not None else samples[i].prompt for i in todo
        ]
        for i, v in zip(todo, ctx.perplexities(contexts, [samples[i].text for i in todo])):
            out[i] = v
    return out


@register_metric(
    "latency_s", higher_is_better=False, unit="s", description="wall time of the request (its batch), seconds"
)
def _latency(s: Sample) -> float:
    return s.latency


@register_metric(
    "ttft_s",
    higher_is_better=False,
    unit="s",
    description="time to first token: from the generate call to the first step's logits, seconds",
)
def _ttft(s: Sample) -> float:
    return s.ttft


@register_metric(
    "tokens_per_s",
    higher_is_better=True,
    unit="tok/s",
    description="generated tokens over this row's share of its batch time (the mean is the batch throughput)",
)
def _tokens_per_s(s: Sample) -> float:
    return s.new_tokens / s.seconds if s.seconds > 0 and math.isfinite(s.seconds) else NAN


register_metric(
    "mean_kl",
    higher_is_better=None,
    unit="nats",
    description="mean KL(p'‖p) per token: what the pull costs (0 for control); reported, not judged",
)(_trace_mean("kl"))
register_metric(
    "mean_strength", higher_is_better=None, description="mean λ per token (0 for control); reported, not judged"
)(_trace_mean("strength"))
register_metric(
    "mean_entropy",
    higher_is_better=None,
    unit="nats",
    description="mean entropy of the model's own next-token distribution; reported, not judged",
)(_trace_mean("entropy"))

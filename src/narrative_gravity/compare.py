"""Control and gravity with the same seeds, side by side, with paired statistics (what ``ngrav compare`` runs).

The table leads with measures the pull does not define (:class:`Scoring`): held-out words, which no field was
built from, and MiniLM similarity to a description of the topic. The narrative-token rate counts the field's
own tokens, so it shows what the pull pushes, not whether the text kept its topic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from .embeddings import encode
from .engines.hf import processor_from_profile
from .engines.hf_generate import generate
from .engines.options import GenerationOptions
from .engines.prompts import encode_prompts
from .engines.results import GenerationResult
from .errors import ProfileError
from .eval.metrics import contains_any
from .eval.text_metrics import distinct_n, mean_ci, narrative_token_rate, penalized_hits
from .lead import lead_sentence, reading_profile
from .profiles.build import field_from_profile
from .profiles.schema import Profile

__all__ = [
    "COMPARE_OPTIONS",
    "METRICS",
    "ComparisonRow",
    "Scoring",
    "compare_runs",
    "row_metrics",
    "summarize",
    "summarize_metrics",
]

COMPARE_OPTIONS = GenerationOptions(max_new_tokens=80)
"""How :func:`compare_runs` samples unless told otherwise (its seeds replace ``seed``)."""

METRICS = (
    ("held-out words (independent of the pull)", "held_out_words", True),
    ("similarity to the description (independent)", "description_similarity", True),
    ("… of the last third", "description_last_third", True),
    ("narrative-token rate (what the pull pushes)", "narrative_rate", True),
    ("penalized-word hits", "penalized_hits", False),
    ("distinct-2", "distinct_2", True),
    ("mean entropy [nats]", "entropy", None),
    ("mean KL [nats/token]", "kl", False),
    ("tokens/s", "tokens_per_s", True),
)


INDEPENDENT = ("held_out_words", "description_similarity", "description_last_third")
"""The keys of :data:`METRICS` that the pull does not define."""


@dataclass(frozen=True)
class Scoring:
    """What a text is scored against besides the profile: ``held_out`` words (a hit is any of them in the text,
    whole word, case-insensitive) and a ``description`` of the topic (MiniLM cosine with the whole text and with
    its last third). Neither builds the field, so neither can be raised by pushing the field's own tokens.

    >>> s = Scoring(held_out=("comet", "moon"))
    >>> s.metrics("The moon rose.")["held_out_words"], s.metrics("It rained.")["held_out_words"]
    (1.0, 0.0)
    >>> Scoring().metrics("anything")["held_out_words"]  # nothing to score against: not a number
    nan
    >>> Scoring(held_out=[" moon ", ""], description="  ")  # trimmed; blanks dropped
    Scoring(held_out=('moon',), description=None)
    """

    held_out: tuple[str, ...] = ()
    description: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "held_out", tuple(w.strip() for w in self.held_out if w.strip()))
        object.__setattr__(self, "description", (self.description or "").strip() or None)

    @cached_property
    def _description_vector(self) -> torch.Tensor:
        """The description's MiniLM vector, encoded once for every text scored."""
        return encode([self.description or ""])[0]

    def check(self, profile: Profile) -> None:
        """Refuse held-out words that the profile names: those would score what the pull pushes.

        >>> Scoring(held_out=("orbit",)).check(Profile(core_semantics=["orbit", "planet"]))
        Traceback (most recent call last):
        ...
        narrative_gravity.errors.ProfileError: held-out word 'orbit' is in the profile's words; held-out words must be ones the field was not built from (take it out of one list)
        """
        named = {w.lower().replace("_", " ") for w in (*profile.core_semantics, *profile.keywords())}
        for word in self.held_out:
            if word.lower().replace("_", " ") in named:
                raise ProfileError(
                    f"held-out word {word!r} is in the profile's words; held-out words must be ones the field was "
                    "not built from (take it out of one list)"
                )

    def metrics(self, text: str) -> dict[str, float]:
        """The independent metrics of one text (NaN where there is nothing to score against)."""
        nan = float("nan")
        out = {
            "held_out_words": (1.0 if contains_any(text, self.held_out) else 0.0) if self.held_out else nan,
            "description_similarity": nan,
            "description_last_third": nan,
        }
        if self.description and text.strip():
            last = text[2 * len(text) // 3 :]
            whole, end = encode([text, last if last.strip() else text])
            out["description_similarity"] = float(whole @ self._description_vector)
            out["description_last_third"] = float(end @ self._description_vector)
        return out


@dataclass
class ComparisonRow:
    """One seed: the control and gravity generations and their metrics."""

    seed: int
    control: GenerationResult
    gravity: GenerationResult
    metrics: dict[str, dict[str, float]]


def row_metrics(
    prof: Profile,
    field: Any,
    prompt_ids: list[int],
    token_ids: list[int],
    text: str,
    *,
    seconds: float,
    means: dict[str, float] | None = None,
) -> dict[str, float]:
    """One generation's metrics (the keys of ``METRICS``); ``means`` are its trace means, if measured."""
    means = means or {}
    return {
        "narrative_rate": narrative_token_rate(field, prompt_ids, token_ids),
        "penalized_hits": float(penalized_hits(text, prof.penalized())),
        "distinct_2": distinct_n([text], 2),
        "entropy": means.get("entropy", float("nan")),
        "kl": means.get("kl", float("nan")),
        "tokens_per_s": len(token_ids) / seconds if seconds > 0 else float("nan"),
    }


def _metrics(result: GenerationResult, prof: Profile, field: Any, prompt_ids: list[int]) -> dict[str, float]:
    return row_metrics(
        prof,
        field,
        prompt_ids,
        result.token_ids,
        result.text,
        seconds=result.seconds,
        means=result.trace_means,
    ) | {"tokens_per_s": result.new_tokens / result.seconds if result.seconds > 0 else float("nan")}


def compare_runs(
    model: Any,
    tokenizer: Any,
    profile: Profile,
    prompt: str,
    options: GenerationOptions = COMPARE_OPTIONS,
    *,
    seeds: int = 3,
    progress: Callable[[], None] | None = None,
    scoring: Scoring | None = None,
) -> list[ComparisonRow]:
    """Generate control and gravity for seeds ``0..seeds-1`` with ``options`` and measure both (with
    ``scoring``'s independent metrics too; default: none, which leaves them NaN)."""
    scoring = scoring or Scoring()
    scoring.check(profile)
    raw = not options.chat_template(tokenizer)
    field = field_from_profile(profile, tokenizer, model=model)  # model: for fields from the LM's embeddings
    prompt_ids = encode_prompts(tokenizer, [prompt], raw=raw)[0]
    lead = lead_sentence(profile, raw=raw)  # gravity's rows read the topic sentence first; control's do not
    rows = []
    for seed in range(seeds):
        opts = options.replace(seed=seed, batch_size=1, trace=True, raw=raw)
        pair = {}
        for mode in ("control", "gravity"):

            def factory(budget: int, trace: Any, _mode: str = mode) -> Any:
                pull = profile if _mode == "control" else reading_profile(profile, raw=raw)
                return processor_from_profile(
                    pull, tokenizer, max_new_tokens=budget, trace=trace, measure_only=_mode == "control", model=model
                )

            lead_read = lead if mode == "gravity" else None
            (res,) = generate(model, tokenizer, [prompt], opts, processor_factory=factory, lead=lead_read)
            pair[mode] = res
            if progress is not None:
                progress()
        rows.append(
            ComparisonRow(
                seed=seed,
                control=pair["control"],
                gravity=pair["gravity"],
                metrics={
                    m: scoring.metrics(pair[m].text) | _metrics(pair[m], profile, field, prompt_ids)
                    for m in ("control", "gravity")
                },
            )
        )
    return rows


def summarize(rows: list[ComparisonRow]) -> dict[str, dict[str, Any]]:
    """Per metric: control and gravity means with 95% bootstrap intervals, and the paired difference."""
    return summarize_metrics([r.metrics for r in rows])


def summarize_metrics(pairs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """:func:`summarize` from each seed's ``{"control": metrics, "gravity": metrics}``."""
    out: dict[str, dict[str, Any]] = {}
    nan = float("nan")
    for label, key, higher in METRICS:
        c = np.array([p["control"].get(key, nan) for p in pairs], dtype=float)
        g = np.array([p["gravity"].get(key, nan) for p in pairs], dtype=float)
        ok = ~(np.isnan(c) | np.isnan(g))
        out[key] = {
            "label": label,
            "higher_is_better": higher,
            "control": mean_ci(c[ok].tolist()),
            "gravity": mean_ci(g[ok].tolist()),
            "difference": mean_ci((g[ok] - c[ok]).tolist()),
        }
    return out

"""Plan-level pruning, the drafting half: write short outlines, score them, and turn the best into stages.

1. **Draft** ``n`` short outlines with sampling (``"Write a 3-point outline for: ..."``), in one batch
   (:func:`draft_outlines`; the pipeline hands the same prompts to its own engine).
2. **Score** each: *fit* (MiniLM cosine of the outline to the prompt, and to the profile's narrative when
   given), *coherence* (mean pairwise cosine of its sections, less a penalty for each pair that is a
   near-duplicate), *completeness* (sections found / sections asked for), and *distinctness* from the other
   drafts (1 - mean cosine to them). ``score = completeness · (fit + coherence_weight · coherence -
   duplicate_penalty · duplicate share)``; the best draft is kept (:func:`select_outlines` with ``k > 1``
   keeps several by MMR, trading score against similarity to the drafts already kept).
3. **Stages**: each section becomes a :class:`~narrative_gravity.profiles.build.Stage` (its content words, a
   share of the token budget) (:func:`stages_from_outline`), which
   :func:`~narrative_gravity.profiles.build.stage_plan` compiles for the kernel. Writing along them is
   :mod:`narrative_gravity.levels.write`.

>>> parse_outline("1. Early lenses\\n2. Galileo's telescope\\n3. Modern observatories")
['Early lenses', "Galileo's telescope", 'Modern observatories']
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..embeddings import encode
from ..engines.hf_generate import generate
from ..engines.options import GenerationOptions
from ..engines.results import GenerationResult
from ..errors import ConfigurationError
from ..profiles.build import Stage, parse_stages
from ..text import STOPWORDS, content_words, word_set

__all__ = [
    "DRAFT_OPTIONS",
    "OUTLINE_WORDS",
    "Encoder",
    "Outline",
    "draft_outlines",
    "embed",
    "outline_prompt",
    "parse_outline",
    "score_outlines",
    "select_outlines",
    "stages_from_outline",
]

Encoder = Callable[[Sequence[str]], Any]

DRAFT_OPTIONS = GenerationOptions(max_new_tokens=28, top_k=40, temperature=0.8, raw=None)
"""How outline drafts are sampled, by every engine (the plan's ``outline_tokens`` replace the budget)."""

# words of outline boilerplate that say nothing about a section's topic
OUTLINE_WORDS = word_set(
    "introduction conclusion overview summary section part intro body final first second third fourth fifth "
    "discuss discussion discussing discusses explore exploring talk talks brief briefly key main important "
    "including include includes example examples title outline short article essay story paragraph text post blog "
    "rewritten rewrite version revised numbered point points"
)


def outline_prompt(prompt: str, sections: int = 3) -> str:
    return (
        f"Write a {sections}-point outline for: {prompt}\n"
        f"Answer with exactly {sections} numbered points (1., 2., ...), a few words each, no title."
    )


_ITEM = re.compile(r"^\s*(?:\d+[.)]|[-*•]|[IVX]+\.)\s*(.+?)\s*$")
_HEADER = re.compile(r"^(?:title|outline|sections?|points?|plan)\b.*$|^.*:$", re.IGNORECASE)


def parse_outline(text: str, max_sections: int | None = None) -> list[str]:
    """The sections of an outline: numbered or bulleted lines; without any, the non-empty lines. Markup
    (``**``, ``<<>>``, ``#``) is stripped, and header lines (``Title``, ``Outline:``) are left out."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    items = [m.group(1) for ln in lines if (m := _ITEM.match(ln))]
    if not items:
        items = lines
    items = [re.sub(r"[*#<>\[\]_`\"]+", "", i).strip(" :-") for i in items]
    items = [i for i in items if i and not _HEADER.match(i)]
    return items[:max_sections] if max_sections else items


@dataclass(frozen=True)
class Outline:
    text: str
    sections: list[str]
    fit: float
    coherence: float
    duplicates: float
    completeness: float
    distinct: float
    score: float

    def to_json(self) -> dict[str, Any]:
        return {
            "sections": self.sections,
            **{k: round(getattr(self, k), 4) for k in ("fit", "coherence", "duplicates", "completeness")},
            "distinct": round(self.distinct, 4),
            "score": round(self.score, 4),
        }


def _default_encoder() -> Encoder:
    return encode


def embed(encoder: Encoder, texts: Sequence[str]) -> np.ndarray:
    """Unit vectors of ``texts`` from ``encoder`` (cosine = dot product)."""
    out = encoder(list(texts))
    arr = (out.detach().cpu().numpy() if hasattr(out, "detach") else np.asarray(out)).astype(np.float64)
    norms = np.linalg.norm(arr, axis=1, keepdims=True)
    return arr / np.where(norms > 0, norms, 1.0)


def score_outlines(
    prompt: str,
    texts: Sequence[str],
    *,
    sections: int = 3,
    narrative: str | None = None,
    encoder: Encoder | None = None,
    coherence_weight: float = 0.3,
    duplicate_threshold: float = 0.9,
    duplicate_penalty: float = 0.5,
) -> list[Outline]:
    """Score outline drafts for fit, coherence, completeness and distinctness (see the module doc)."""
    if not texts:
        return []
    encoder = encoder or _default_encoder()
    parsed = [parse_outline(t, sections) for t in texts]
    flat = [s for secs in parsed for s in secs]
    whole = ["\n".join(secs) or t for secs, t in zip(parsed, texts)]
    targets = [prompt] + ([narrative] if narrative else [])
    emb = embed(encoder, targets + whole + flat)
    tgt = emb[: len(targets)]
    doc = emb[len(targets) : len(targets) + len(texts)]
    sec = emb[len(targets) + len(texts) :]
    pair = doc @ doc.T
    out, k = [], 0
    for i, secs in enumerate(parsed):
        e = sec[k : k + len(secs)]
        k += len(secs)
        fit = float((doc[i] @ tgt.T).mean())
        if len(secs) > 1:
            sims = (e @ e.T)[np.triu_indices(len(secs), 1)]
            coherence, dup = float(sims.mean()), float((sims >= duplicate_threshold).mean())
        else:
            coherence, dup = 0.0, 0.0
        informative = sum(1 for x in secs if any(w not in OUTLINE_WORDS for w in content_words(x)))
        completeness = min(1.0, informative / sections)
        others = np.delete(pair[i], i)
        distinct = float(1.0 - others.mean()) if others.size else 1.0
        score = completeness * (fit + coherence_weight * coherence - duplicate_penalty * dup)
        out.append(Outline(texts[i], secs, fit, coherence, dup, completeness, distinct, score))
    return out


def select_outlines(
    outlines: Sequence[Outline], k: int = 1, *, diversity: float = 0.3, encoder: Encoder | None = None
) -> list[Outline]:
    """The ``k`` best outlines: the top score first, then by MMR (score less ``diversity`` × the highest
    cosine to an outline already kept)."""
    if k < 1:
        raise ConfigurationError(f"`k` has to be >= 1, but is {k}")
    if not outlines:
        return []
    ranked = sorted(outlines, key=lambda o: -o.score)
    if k == 1 or len(ranked) == 1:
        return ranked[:1]
    emb = embed(encoder or _default_encoder(), ["\n".join(o.sections) or o.text for o in ranked])
    chosen = [0]
    while len(chosen) < min(k, len(ranked)):
        rest = [i for i in range(len(ranked)) if i not in chosen]
        best = max(rest, key=lambda i: ranked[i].score - diversity * max(float(emb[i] @ emb[j]) for j in chosen))
        chosen.append(best)
    return [ranked[i] for i in chosen]


def stages_from_outline(
    outline: Outline | Sequence[str],
    *,
    words_per_stage: int = 6,
    extra_words: Sequence[str] = (),
    ignore: Collection[str] = (),
) -> list[Stage]:
    """One stage per section: its first ``words_per_stage`` content words (boilerplate like "introduction",
    and the words in ``ignore``, left out) plus ``extra_words`` (e.g. the profile's core words), equal shares.

    >>> [s.core_semantics for s in stages_from_outline(["Here's a rewritten version: exactly 3 points", "Magma"],
    ...                                                 extra_words=["volcano"], ignore={"exactly"})]
    [['volcano'], ['magma', 'volcano']]
    """
    sections = outline.sections if isinstance(outline, Outline) else list(outline)
    stages = []
    for i, sec in enumerate(sections):
        ws = [w for w in content_words(sec) if w not in OUTLINE_WORDS and w not in STOPWORDS and w not in ignore]
        ws = list(dict.fromkeys(ws))[:words_per_stage]
        ws += [w for w in extra_words if w not in ws]
        if ws:
            stages.append({"name": sec[:60] or f"section {i + 1}", "core_semantics": ws})
    if not stages:
        raise ConfigurationError(
            f"no section of the outline has a content word ({sections!r}); draft again or pass stages by hand"
        )
    return parse_stages(stages)


def draft_outlines(
    model: Any,
    tokenizer: Any,
    prompt: str,
    *,
    n: int = 4,
    sections: int = 3,
    options: GenerationOptions = DRAFT_OPTIONS,
) -> list[GenerationResult]:
    """``n`` sampled outline drafts in one batch, on the transformers engine (``options.max_new_tokens`` each).

    With ``options.raw=None`` (as :data:`DRAFT_OPTIONS`) the chat template is used when the tokenizer has one,
    plain continuation otherwise."""
    if n < 1:
        raise ConfigurationError(f"`n` has to be >= 1, but is {n}")
    return generate(model, tokenizer, [outline_prompt(prompt, sections)] * n, options.replace(batch_size=n))

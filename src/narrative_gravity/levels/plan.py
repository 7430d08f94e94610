"""Plan-level pruning: draft short outlines, keep the one that fits the narrative, and write along its sections.

1. **Draft** ``n`` short outlines with sampling (``"Write a 3-point outline for: ..."``), in one batch.
2. **Score** each: *fit* (MiniLM cosine of the outline to the prompt, and to the profile's narrative when
   given), *coherence* (mean pairwise cosine of its sections, less a penalty for each pair that is a
   near-duplicate), *completeness* (sections found / sections asked for), and *distinctness* from the other
   drafts (1 - mean cosine to them). ``score = completeness · (fit + coherence_weight · coherence -
   duplicate_penalty · duplicate share)``; the best draft is kept (:func:`select_outlines` with ``k > 1``
   keeps several by MMR, trading score against similarity to the drafts already kept).
3. **Stages**: each section becomes a :class:`Stage` (its content words, a share of the token budget), each
   stage a lexical field (:func:`~narrative_gravity.fields.build_lexical_field`); :func:`stage_plan` turns
   them into the kernel's :class:`~narrative_gravity.gravity.stages.StagePlan`, a field source of the one
   logits processor: every row pulls toward its current stage, moving on when the stage's content is
   covered (``cover_fraction`` of its words generated) or its token share is spent
   (:func:`~narrative_gravity.gravity.stages.advance_stages`, per row, no loop over rows).

Stages can also be declared by hand (``[{"name": ..., "core_semantics": [...], "share": 0.5}, ...]``, see
:func:`parse_stages`).

>>> parse_outline("1. Early lenses\\n2. Galileo's telescope\\n3. Modern observatories")
['Early lenses', "Galileo's telescope", 'Modern observatories']
>>> [s.share for s in parse_stages([{"name": "a", "core_semantics": ["x"], "share": 0.25},
...                                {"name": "b", "core_semantics": ["y"]}])]
[0.25, 0.75]
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..engines.hf import NarrativeGravityLogitsProcessor
from ..errors import ConfigurationError
from ..fields import NarrativeField, combine_fields
from ..fields.lexical import build_lexical_field, reach, surface_forms
from ..gravity.controllers import ConstantController, StrengthController
from ..gravity.stages import StagePlan
from ..text import STOPWORDS, content_words, word_set

__all__ = [
    "Outline",
    "PlanResult",
    "Stage",
    "build_stage_fields",
    "draft_outlines",
    "outline_prompt",
    "parse_outline",
    "parse_stages",
    "plan_table",
    "plan_then_write",
    "score_outlines",
    "select_outlines",
    "stage_plan",
    "staged_processor",
    "stages_from_outline",
]

Encoder = Callable[[Sequence[str]], Any]

# words of outline boilerplate that say nothing about a section's topic
_OUTLINE_WORDS = word_set(
    "introduction conclusion overview summary section part intro body final first second third fourth fifth "
    "discuss discussion discussing discusses explore exploring talk talks brief briefly key main important "
    "including include includes example examples title outline short article essay story paragraph text post blog "
    "rewritten rewrite version revised numbered point points"
)


# --------------------------------------------------------------------------------------------------
# stages


@dataclass(frozen=True)
class Stage:
    """One section of a plan: a name, the words it should cover, and its share of the token budget."""

    name: str
    core_semantics: list[str]
    share: float

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "core_semantics": list(self.core_semantics), "share": round(self.share, 4)}


def parse_stages(stages: Sequence[Mapping[str, Any] | Stage]) -> list[Stage]:
    """Validate hand-written stages; shares left out split what the given shares leave, equally.

    Each entry needs ``core_semantics`` (a non-empty list of words); ``name`` defaults to ``stage N``;
    ``share`` is a fraction in ``(0, 1]``. Shares that add up to more than 1 are an error.
    """
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise ConfigurationError(
            f"`stages` has to be a non-empty list of {{name, core_semantics, share}} mappings, but is {stages!r}"
        )
    names, words, shares = [], [], []
    for i, s in enumerate(stages):
        if isinstance(s, Stage):
            s = s.to_json()
        if not isinstance(s, Mapping):
            raise ConfigurationError(f"stages[{i}] has to be a mapping, but is {type(s).__name__}")
        extra = set(s) - {"name", "core_semantics", "share"}
        if extra:
            raise ConfigurationError(
                f"stages[{i}] has unknown keys {sorted(extra)}; allowed are name, core_semantics, share"
            )
        ws = s.get("core_semantics")
        if isinstance(ws, str) or not isinstance(ws, Sequence) or not [w for w in ws if str(w).strip()]:
            raise ConfigurationError(f"stages[{i}].core_semantics has to be a non-empty list of words, but is {ws!r}")
        share = s.get("share")
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise ConfigurationError(f"stages[{i}].share has to be a number in (0, 1], but is {share!r}")
        names.append(str(s.get("name") or f"stage {i + 1}"))
        words.append([str(w).strip() for w in ws if str(w).strip()])
        shares.append(None if share is None else float(share))
    given = sum(x for x in shares if x is not None)
    if given > 1 + 1e-9:
        raise ConfigurationError(f"stage shares add up to {given:g}, more than 1; lower them or leave some out")
    missing = [i for i, x in enumerate(shares) if x is None]
    rest = (1.0 - given) / len(missing) if missing else 0.0
    if missing and rest <= 0:
        raise ConfigurationError(
            "the given stage shares use the whole budget and leave nothing for stages without a share"
        )
    return [Stage(n, w, x if x is not None else rest) for n, w, x in zip(names, words, shares)]


def build_stage_fields(tokenizer: Any, stages: Sequence[Stage], **kwargs: Any) -> list[NarrativeField]:
    """One lexical field per stage, from the stage's reachable words (``kwargs`` go to
    :func:`~narrative_gravity.fields.build_lexical_field`). A stage with no reachable word gets a zero field."""
    out = []
    for s in stages:
        ok, _ = reach(tokenizer, s.core_semantics, max_pieces=kwargs.get("max_pieces", 8))
        if ok:
            out.append(build_lexical_field(tokenizer, ok, name=s.name, **kwargs))
        else:
            out.append(NarrativeField(values=torch.zeros(kwargs.get("vocab_size") or len(tokenizer)), name=s.name))
    return out


def stage_plan(
    tokenizer: Any,
    stages: Sequence[Stage] | Sequence[Mapping[str, Any]],
    *,
    base: NarrativeField | None = None,
    base_weight: float = 1.0,
    cover_fraction: float = 0.5,
) -> StagePlan:
    """The kernel's :class:`~narrative_gravity.gravity.stages.StagePlan` of ``stages`` for ``tokenizer``.

    Each stage gets a lexical field of its reachable words (:func:`build_stage_fields`) and the token ids
    of their surface forms, so that a row moves on once it has written ``cover_fraction`` of them. ``base``
    is a field every stage keeps under its own (for example the semantic field of the whole prompt): each
    stage's positive values become ``max(stage, base_weight × base)``, its penalties win
    (:func:`~narrative_gravity.fields.combine_fields`).
    """
    parsed = parse_stages(stages)
    fields = build_stage_fields(tokenizer, parsed)
    if base is not None:
        fields = [combine_fields(f, base, weight=base_weight) for f in fields]
    words = []
    for s in parsed:
        ok, _ = reach(tokenizer, s.core_semantics, max_pieces=8)
        words.append(tuple(tuple(tuple(f) for f in surface_forms(tokenizer, w)) for w in ok))
    return StagePlan(
        fields=tuple(fields),
        shares=tuple(s.share for s in parsed),
        words=tuple(words),
        cover_fraction=cover_fraction,
        names=tuple(s.name for s in parsed),
    )


def staged_processor(
    tokenizer: Any,
    stages: Sequence[Stage] | Sequence[Mapping[str, Any]],
    *,
    base: NarrativeField | None = None,
    base_weight: float = 1.0,
    cover_fraction: float = 0.5,
    **kwargs: Any,
) -> NarrativeGravityLogitsProcessor:
    """A :class:`~narrative_gravity.engines.hf.NarrativeGravityLogitsProcessor` that follows ``stages``
    (:func:`stage_plan`); ``kwargs`` go to the processor (``controller``, ``strength``, ``max_new_tokens``,
    ``trace``, ``repeat_weight``)."""
    plan = stage_plan(tokenizer, stages, base=base, base_weight=base_weight, cover_fraction=cover_fraction)
    return NarrativeGravityLogitsProcessor(stages=plan, **kwargs)


# --------------------------------------------------------------------------------------------------
# outlines


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
    from ..embeddings import encode

    return encode


def _embed(encoder: Encoder, texts: Sequence[str]) -> np.ndarray:
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
    emb = _embed(encoder, targets + whole + flat)
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
        informative = sum(1 for x in secs if any(w not in _OUTLINE_WORDS for w in content_words(x)))
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
    emb = _embed(encoder or _default_encoder(), ["\n".join(o.sections) or o.text for o in ranked])
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
        ws = [w for w in content_words(sec) if w not in _OUTLINE_WORDS and w not in STOPWORDS and w not in ignore]
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
    max_new_tokens: int = 40,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    raw: bool | None = None,
) -> list[Any]:
    """``n`` sampled outline drafts in one batch: :class:`~narrative_gravity.engines.hf_generate.GenerationResult` s.

    ``raw=None`` uses the chat template when the tokenizer has one, plain continuation otherwise."""
    from ..engines.hf_generate import SamplingOptions, generate

    if n < 1:
        raise ConfigurationError(f"`n` has to be >= 1, but is {n}")
    opts = SamplingOptions(max_new_tokens=max_new_tokens, top_k=top_k, temperature=temperature, seed=seed)
    if raw is None:
        raw = not getattr(tokenizer, "chat_template", None)
    return generate(model, tokenizer, [outline_prompt(prompt, sections)] * n, options=opts, batch_size=n, raw=raw)


@dataclass
class PlanResult:
    """The written text, the plan it followed, and what it cost."""

    prompt: str
    text: str
    outline: Outline | None
    outlines: list[Outline]
    stages: list[Stage]
    draft_tokens: int
    write_tokens: int
    seconds: float
    final_stage: list[int] = field(default_factory=list)
    write_prompt: str = ""

    @property
    def generated_tokens(self) -> int:
        return self.draft_tokens + self.write_tokens

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "outline": self.outline.to_json() if self.outline else None,
            "outlines": [o.to_json() for o in self.outlines],
            "stages": [s.to_json() for s in self.stages],
            "draft_tokens": self.draft_tokens,
            "write_tokens": self.write_tokens,
            "seconds": round(self.seconds, 4),
        }


def plan_table(result: PlanResult, *, width: int = 48) -> Any:
    """A ``rich`` table of the outline drafts, the kept one first, with their scores and sections."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"{len(result.outlines)} outline drafts ({result.draft_tokens} tokens)")
    for col in ("kept", "score", "fit", "coherence", "complete", "sections"):
        table.add_column(col, justify="left" if col in ("kept", "sections") else "right")
    for o in sorted(result.outlines, key=lambda o: (o is not result.outline, -o.score)):
        secs = " | ".join(x if len(x) <= width else x[: width - 1] + "…" for x in o.sections) or "(none)"
        table.add_row(
            "[green]yes[/]" if o is result.outline else "[red]no[/]",
            f"{o.score:.3f}",
            f"{o.fit:.3f}",
            f"{o.coherence:.3f}",
            f"{o.completeness:.2f}",
            escape(secs),
        )
    return table


def _writing_controller(schedule: str, strength: float | None) -> StrengthController:
    """The plan's pull: the topic default's thermostat, or a constant λ."""
    from ..gravity.controllers import ThermostatController
    from ..profiles.schema import TOPIC_DEFAULTS

    if strength is not None and (isinstance(strength, bool) or not isinstance(strength, (int, float)) or strength < 0):
        raise ConfigurationError(f"`strength` has to be a number >= 0, but is {strength!r}")
    if schedule == "thermostat":
        knobs = dict(TOPIC_DEFAULTS["thermostat"])
        if strength is not None:
            knobs["max_strength"] = float(strength)
        return ThermostatController(**knobs)
    if schedule == "constant":
        return ConstantController(3.0 if strength is None else float(strength))
    raise ConfigurationError(f"`schedule` has to be 'thermostat' or 'constant', but is {schedule!r}")


def plan_then_write(
    model: Any,
    tokenizer: Any,
    prompt: str,
    *,
    profile: Any = None,
    stages: Sequence[Stage] | Sequence[Mapping[str, Any]] | None = None,
    n_drafts: int = 2,
    sections: int = 3,
    outline_tokens: int = 28,
    max_new_tokens: int = 160,
    strength: float | None = None,
    schedule: str = "thermostat",
    cover_fraction: float = 0.5,
    temperature: float = 1.0,
    top_k: int = 10,
    seed: int = 0,
    encoder: Encoder | None = None,
    include_outline: bool = False,
    raw: bool | None = None,
    prompt_words: int = 4,
    semantic: bool = True,
    semantic_weight: float = 1.0,
    openings: int = 3,
    opening_tokens: int = 24,
    repeat_weight: float = 0.0,
    controller: StrengthController | None = None,
) -> PlanResult:
    """Draft ``n_drafts`` outlines, keep the best, and write ``prompt`` with a staged processor (:func:`staged_processor`).

    The plan reaches the text through the staged field only; ``include_outline=True`` also writes the outline
    into the prompt (with SmolLM2-135M that lowered topic relevance: its outlines are often poor, and in the
    prompt they lead the text away; see ``docs/pruning.md``). With ``stages`` given by hand, no outline is
    drafted. A ``profile`` adds its narrative to the outline
    score and its core words to every stage; without one, the prompt's first ``prompt_words`` content words
    join every stage. With ``semantic=True`` (the default) every stage also keeps the semantic field (MiniLM
    neighbours, :func:`~narrative_gravity.fields.build_semantic_field`) of those words under its own, at
    ``semantic_weight``: the sections say where the text goes next, the semantic field keeps all of it on
    the prompt's topic.

    The pull is the package's topic default (:data:`~narrative_gravity.profiles.schema.TOPIC_DEFAULTS`): with
    ``schedule="thermostat"`` a :class:`~narrative_gravity.gravity.controllers.ThermostatController` with λ_max
    ``strength`` (default 4.25) and targets 0.4 / 0.6 / 0.8, and ``repeat_weight=0`` (a stage word's token
    stops pulling once written, so the pull moves on through the stage). ``schedule="constant"`` pulls with
    a constant λ = ``strength`` (default 3). ``controller`` replaces both.

    With ``openings > 1`` the text is written in two parts (branch pruning): ``openings`` sampled openings
    of ``opening_tokens`` tokens, all under the staged field and in one batch; the one closest to the prompt
    (MiniLM cosine to the prompt, and to the profile's narrative) is kept, and the rest of the text continues
    it from the stage it reached. Every opening's tokens count in ``write_tokens``.
    """
    if isinstance(openings, bool) or not isinstance(openings, int) or openings < 1:
        raise ConfigurationError(f"`openings` has to be a whole number >= 1, but is {openings!r}")
    if isinstance(opening_tokens, bool) or not isinstance(opening_tokens, int) or opening_tokens < 1:
        raise ConfigurationError(f"`opening_tokens` has to be a whole number >= 1, but is {opening_tokens!r}")
    if controller is None:
        controller = _writing_controller(schedule, strength)
    from ..engines.hf_generate import SamplingOptions, generate
    from .context import narrative_text

    t0 = time.perf_counter()
    if raw is None:
        raw = not getattr(tokenizer, "chat_template", None)
    if profile is not None:
        extra = list(profile.keywords())
    else:  # the prompt's own topic words keep every section on the prompt
        extra = [w for w in dict.fromkeys(content_words(prompt)) if w not in _OUTLINE_WORDS][:prompt_words]
    outlines: list[Outline] = []
    best: Outline | None = None
    draft_tokens = 0
    if stages is None:
        drafts = draft_outlines(
            model,
            tokenizer,
            prompt,
            n=n_drafts,
            sections=sections,
            max_new_tokens=outline_tokens,
            seed=seed,
            raw=raw,
        )
        draft_tokens = sum(d.new_tokens for d in drafts)
        outlines = score_outlines(
            prompt,
            [d.text for d in drafts],
            sections=sections,
            narrative=narrative_text(profile) if profile is not None else None,
            encoder=encoder,
        )
        best = select_outlines(outlines, 1)[0]
        # a draft that echoes the instruction ("exactly 3 numbered points") must not pull toward it
        echo = set(content_words(outline_prompt("", sections))) - set(content_words(prompt))
        plan = stages_from_outline(best, extra_words=extra, ignore=echo)
    else:
        plan = parse_stages(stages)
    base = None
    if semantic:
        from ..fields import build_semantic_field
        from ..profiles.schema import FieldOptions

        topic = extra or [w for s in plan for w in s.core_semantics]
        opts = FieldOptions()  # the profile defaults of a semantic field
        base = build_semantic_field(
            tokenizer,
            topic,
            source="minilm",
            top_k=opts.semantic_top_k,
            z_threshold=opts.semantic_z_threshold,
            min_value=opts.semantic_min_value,
            glued_weight=opts.glued_weight,
            progress=False,
        )
    processor = staged_processor(
        tokenizer,
        plan,
        base=base,
        base_weight=semantic_weight,
        controller=controller,
        repeat_weight=repeat_weight,
        max_new_tokens=max_new_tokens,
        cover_fraction=cover_fraction,
    )
    write = prompt
    if include_outline and best is not None:
        write = f"{prompt}\nFollow this outline:\n" + "\n".join(f"{i + 1}. {s}" for i, s in enumerate(best.sections))
    if openings > 1 and opening_tokens < max_new_tokens:
        text, write_tokens, final = _write_from_openings(
            model,
            tokenizer,
            write,
            plan,
            processor,
            target=prompt if profile is None else f"{prompt}\n{narrative_text(profile)}",
            openings=openings,
            opening_tokens=opening_tokens,
            options=SamplingOptions(max_new_tokens=max_new_tokens, top_k=top_k, temperature=temperature, seed=seed),
            raw=raw,
            encoder=encoder,
            stage_kwargs={
                "base": base,
                "base_weight": semantic_weight,
                "cover_fraction": cover_fraction,
                "controller": controller,
                "repeat_weight": repeat_weight,
            },
        )
    else:
        opts = SamplingOptions(max_new_tokens=max_new_tokens, top_k=top_k, temperature=temperature, seed=seed)
        out = generate(model, tokenizer, [write], options=opts, processor_factory=lambda _n, _t: processor, raw=raw)
        text, write_tokens = out[0].text, out[0].new_tokens
        final = processor.stage.tolist() if processor.stage is not None else []
    return PlanResult(
        prompt=prompt,
        text=text,
        outline=best,
        outlines=outlines,
        stages=plan,
        draft_tokens=draft_tokens,
        write_tokens=write_tokens,
        seconds=time.perf_counter() - t0,
        final_stage=final,
        write_prompt=write,
    )


def _write_from_openings(
    model: Any,
    tokenizer: Any,
    write: str,
    plan: list[Stage],
    processor: NarrativeGravityLogitsProcessor,
    *,
    target: str,
    openings: int,
    opening_tokens: int,
    options: Any,
    raw: bool,
    encoder: Encoder | None,
    stage_kwargs: dict[str, Any],
) -> tuple[str, int, list[int]]:
    """Sample ``openings`` openings in one batch, keep the one closest to ``target``, continue it.

    Returns the text, every generated token of the writing (all openings plus the continuation) and the
    final stage.
    """
    from dataclasses import replace as _replace

    from ..engines.hf_generate import encode_prompts, eos_token_ids, sample_ids

    ids = encode_prompts(tokenizer, [write], raw=raw)[0]
    drafts = sample_ids(
        model, tokenizer, [ids] * openings, _replace(options, max_new_tokens=opening_tokens), [processor]
    )
    texts = tokenizer.batch_decode(drafts, skip_special_tokens=True)
    vecs = np.asarray(_embed(encoder or _default_encoder(), [target, *texts]))
    best = int(np.argmax(vecs[1:] @ vecs[0]))
    opening = drafts[best]
    spent = sum(len(d) for d in drafts)
    stage = int(processor.stage[best]) if processor.stage is not None else 0
    left = options.max_new_tokens - len(opening)
    if left <= 0 or (opening and opening[-1] in eos_token_ids(model, tokenizer)):
        return texts[best], spent, [stage]
    rest = plan[stage:]
    total = sum(st.share for st in rest)
    rest = [Stage(st.name, list(st.core_semantics), st.share / total) for st in rest]
    follow = staged_processor(tokenizer, rest, max_new_tokens=left, **stage_kwargs)
    cont = sample_ids(
        model, tokenizer, [ids + opening], _replace(options, max_new_tokens=left, seed=options.seed + 1), [follow]
    )[0]
    text = tokenizer.decode(opening + cont, skip_special_tokens=True)
    final = stage + (int(follow.stage[0]) if follow.stage is not None else 0)
    return text, spent + len(cont), [final]

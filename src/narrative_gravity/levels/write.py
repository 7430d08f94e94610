"""Plan-then-write: draft outlines (:mod:`.plan`), keep the best, and write along its sections with a staged field.

Each stage is a lexical field of its section's words; one logits processor pulls every row toward its current
stage, moving on when the stage's content is covered (``cover_fraction`` of its words generated) or its token
share is spent (:func:`~narrative_gravity.gravity.stages.advance_stages`, per row, no loop over rows). With
several openings, the text is written in two parts (branch pruning): the opening closest to the prompt is kept
and continued from the stage it reached.

>>> PlanSettings(schedule="constant").writing_controller()
ConstantController(3.0)
>>> PlanSettings(openings=0)
Traceback (most recent call last):
...
narrative_gravity.errors.ConfigurationError: `openings` has to be a whole number >= 1, but is 0
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.markup import escape
from rich.table import Table

from ..embeddings import encode
from ..engines.hf import NarrativeGravityLogitsProcessor
from ..engines.hf_generate import generate, sample_ids
from ..engines.options import GenerationOptions
from ..engines.prompts import encode_prompts, eos_token_ids
from ..errors import ConfigurationError
from ..fields import NarrativeField, build_semantic_field
from ..fields.semantic import SemanticSettings
from ..gravity.controllers import ConstantController, StrengthController, ThermostatController, ThermostatOptions
from ..gravity.kernel import Program
from ..profiles.build import Stage, parse_stages, stage_plan
from ..profiles.schema import TOPIC_DEFAULTS, FieldOptions, Profile
from ..text import content_words
from .context import narrative_text
from .plan import (
    DRAFT_OPTIONS,
    OUTLINE_WORDS,
    Encoder,
    Outline,
    draft_outlines,
    embed,
    outline_prompt,
    score_outlines,
    select_outlines,
    stages_from_outline,
)

__all__ = ["PLAN_OPTIONS", "PlanResult", "PlanSettings", "plan_table", "plan_then_write", "staged_processor"]

PLAN_OPTIONS = GenerationOptions(max_new_tokens=160, raw=None)
"""How :func:`plan_then_write` writes unless told otherwise: 160 tokens, top-k 10, temperature 1, the chat
template when the tokenizer has one."""


def staged_processor(
    tokenizer: Any,
    stages: Sequence[Stage] | Sequence[Mapping[str, Any]],
    *,
    base: NarrativeField | None = None,
    base_weight: float = 1.0,
    cover_fraction: float = 0.5,
    repeat_weight: float = 1.0,
    **kwargs: Any,
) -> NarrativeGravityLogitsProcessor:
    """A :class:`~narrative_gravity.engines.hf.NarrativeGravityLogitsProcessor` that follows ``stages``
    (:func:`~narrative_gravity.profiles.build.stage_plan`), each written narrative token keeping ``repeat_weight``
    of its pull; ``kwargs`` go to the processor (``controller``, ``strength``, ``max_new_tokens``, ``trace``)."""
    plan = stage_plan(tokenizer, stages, base=base, base_weight=base_weight, cover_fraction=cover_fraction)
    return NarrativeGravityLogitsProcessor(Program(stages=plan, repeat_weight=repeat_weight), **kwargs)


def _whole(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"`{name}` has to be a whole number >= 1, but is {value!r}")


@dataclass(frozen=True)
class PlanSettings:
    """How a plan is drafted and followed.

    Args:
        n_drafts, sections, outline_tokens: outline drafts to sample, sections per outline, tokens per draft.
        strength: λ_max of the thermostat (default 4.25), or λ with ``schedule="constant"`` (default 3).
        schedule: ``thermostat`` (the topic default) or ``constant``; ``controller`` replaces both.
        cover_fraction: a stage is done once this share of its words is written.
        include_outline: also write the outline into the prompt.
        prompt_words: without a profile, the prompt's first this many content words join every stage.
        semantic, semantic_weight: every stage keeps the semantic field of those words under its own.
        openings, opening_tokens: write from the best of this many openings of this many tokens (1 = one text).
        repeat_weight: the share of its pull a stage word keeps once written.
    """

    n_drafts: int = 2
    sections: int = 3
    outline_tokens: int = 28
    strength: float | None = None
    schedule: str = "thermostat"
    cover_fraction: float = 0.5
    include_outline: bool = False
    prompt_words: int = 4
    semantic: bool = True
    semantic_weight: float = 1.0
    openings: int = 3
    opening_tokens: int = 24
    repeat_weight: float = 0.0
    controller: StrengthController | None = None

    def __post_init__(self) -> None:
        _whole("openings", self.openings)
        _whole("opening_tokens", self.opening_tokens)
        s = self.strength
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or s < 0):
            raise ConfigurationError(f"`strength` has to be a number >= 0, but is {s!r}")
        if self.schedule not in ("thermostat", "constant"):
            raise ConfigurationError(f"`schedule` has to be 'thermostat' or 'constant', but is {self.schedule!r}")

    def writing_controller(self) -> StrengthController:
        """The plan's pull: ``controller``, else the topic default's thermostat, or a constant λ."""
        if self.controller is not None:
            return self.controller
        if self.schedule == "thermostat":
            knobs = dict(TOPIC_DEFAULTS["thermostat"])
            lam_max = knobs.pop("max_strength")
            if self.strength is not None:
                lam_max = float(self.strength)
            return ThermostatController(lam_max, ThermostatOptions(**knobs))
        return ConstantController(3.0 if self.strength is None else float(self.strength))


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


def plan_then_write(
    model: Any,
    tokenizer: Any,
    prompt: str,
    *,
    profile: Profile | None = None,
    stages: Sequence[Stage] | Sequence[Mapping[str, Any]] | None = None,
    settings: PlanSettings = PlanSettings(),
    options: GenerationOptions = PLAN_OPTIONS,
    encoder: Encoder | None = None,
) -> PlanResult:
    """Draft ``settings.n_drafts`` outlines, keep the best, and write ``prompt`` with a staged processor
    (:func:`staged_processor`), ``options.max_new_tokens`` tokens sampled as ``options`` says.

    The plan reaches the text through the staged field only; ``include_outline=True`` also writes the outline
    into the prompt (with SmolLM2-135M that lowered topic relevance: its outlines are often poor, and in the
    prompt they lead the text away; see ``docs/pruning.md``). With ``stages`` given by hand, no outline is
    drafted. A ``profile`` adds its narrative to the outline score and its core words to every stage; without
    one, the prompt's first ``prompt_words`` content words join every stage. With ``semantic=True`` (the
    default) every stage also keeps the semantic field (MiniLM neighbours,
    :func:`~narrative_gravity.fields.build_semantic_field`) of those words under its own, at ``semantic_weight``:
    the sections say where the text goes next, the semantic field keeps all of it on the prompt's topic.

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
    t0 = time.perf_counter()
    resolved = options.replace(raw=not options.chat_template(tokenizer))
    writer = _Writer(model, tokenizer, prompt, profile, settings, resolved, encoder or encode)
    outlines, best, plan, draft_tokens = writer.plan(stages)
    text, write_tokens, final, write = writer.write(plan, best)
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


@dataclass
class _Writer:
    """One :func:`plan_then_write` call: what it writes, with what, and how."""

    model: Any
    tokenizer: Any
    prompt: str
    profile: Profile | None
    settings: PlanSettings
    options: GenerationOptions
    encoder: Encoder

    @property
    def topic_words(self) -> list[str]:
        """The words that join every stage: the profile's, or the prompt's own first content words."""
        if self.profile is not None:
            return list(self.profile.keywords())
        words = [w for w in dict.fromkeys(content_words(self.prompt)) if w not in OUTLINE_WORDS]
        return words[: self.settings.prompt_words]

    def plan(self, stages: Sequence[Any] | None) -> tuple[list[Outline], Outline | None, list[Stage], int]:
        """The scored outline drafts, the kept one, its stages, and the tokens the drafts took (or the
        hand-written ``stages``, and no drafts)."""
        if stages is not None:
            return [], None, parse_stages(stages), 0
        s, prompt = self.settings, self.prompt
        draft = DRAFT_OPTIONS.replace(max_new_tokens=s.outline_tokens, seed=self.options.seed, raw=self.options.raw)
        drafts = draft_outlines(self.model, self.tokenizer, prompt, n=s.n_drafts, sections=s.sections, options=draft)
        narrative = narrative_text(self.profile) if self.profile is not None else None
        outlines = score_outlines(
            prompt, [d.text for d in drafts], sections=s.sections, narrative=narrative, encoder=self.encoder
        )
        best = select_outlines(outlines, 1)[0]
        # a draft that echoes the instruction ("exactly 3 numbered points") must not pull toward it
        echo = set(content_words(outline_prompt("", s.sections))) - set(content_words(prompt))
        plan = stages_from_outline(best, extra_words=self.topic_words, ignore=echo)
        return outlines, best, plan, sum(d.new_tokens for d in drafts)

    def base_field(self, plan: list[Stage]) -> NarrativeField | None:
        """The semantic field every stage keeps under its own (``settings.semantic``), with a profile's defaults."""
        if not self.settings.semantic:
            return None
        topic = self.topic_words or [w for s in plan for w in s.core_semantics]
        settings = SemanticSettings.of(FieldOptions())  # a profile's defaults
        return build_semantic_field(self.tokenizer, topic, source="minilm", settings=settings, progress=False)

    def write(self, plan: list[Stage], best: Outline | None) -> tuple[str, int, list[int], str]:
        """The text, its generated tokens, the stage each row reached, and the prompt it was written from."""
        s, budget = self.settings, self.options.max_new_tokens
        stage_kwargs = {
            "base": self.base_field(plan),
            "base_weight": s.semantic_weight,
            "cover_fraction": s.cover_fraction,
            "controller": s.writing_controller(),
            "repeat_weight": s.repeat_weight,
        }
        processor = staged_processor(self.tokenizer, plan, max_new_tokens=budget, **stage_kwargs)
        write = self.prompt
        if s.include_outline and best is not None:
            steps = "\n".join(f"{i + 1}. {x}" for i, x in enumerate(best.sections))
            write = f"{self.prompt}\nFollow this outline:\n{steps}"
        if s.openings > 1 and s.opening_tokens < budget:
            return (*self._from_openings(write, plan, processor, stage_kwargs), write)
        out = generate(self.model, self.tokenizer, [write], self.options, processor_factory=lambda _n, _t: processor)
        final = processor.stage.tolist() if processor.stage is not None else []
        return out[0].text, out[0].new_tokens, final, write

    def _from_openings(
        self, write: str, plan: list[Stage], processor: NarrativeGravityLogitsProcessor, stage_kwargs: dict[str, Any]
    ) -> tuple[str, int, list[int]]:
        """Sample ``openings`` openings in one batch, keep the one closest to the prompt, continue it.

        Returns the text, every generated token of the writing (all openings plus the continuation) and the
        final stage.
        """
        s, options, tok = self.settings, self.options, self.tokenizer
        target = self.prompt if self.profile is None else f"{self.prompt}\n{narrative_text(self.profile)}"
        ids = encode_prompts(tok, [write], raw=bool(options.raw))[0]
        openings = options.replace(max_new_tokens=s.opening_tokens)
        drafts = sample_ids(self.model, tok, [ids] * s.openings, openings, [processor])
        texts = tok.batch_decode(drafts, skip_special_tokens=True)
        vecs = np.asarray(embed(self.encoder, [target, *texts]))
        best = int(np.argmax(vecs[1:] @ vecs[0]))
        opening = drafts[best]
        spent = sum(len(d) for d in drafts)
        stage = int(processor.stage[best]) if processor.stage is not None else 0
        left = options.max_new_tokens - len(opening)
        if left <= 0 or (opening and opening[-1] in eos_token_ids(self.model, tok)):
            return texts[best], spent, [stage]
        rest = plan[stage:]
        total = sum(st.share for st in rest)
        rest = [Stage(st.name, list(st.core_semantics), st.share / total) for st in rest]
        follow = staged_processor(tok, rest, max_new_tokens=left, **stage_kwargs)
        more = options.replace(max_new_tokens=left, seed=options.seed + 1)
        cont = sample_ids(self.model, tok, [ids + opening], more, [follow])[0]
        text = tok.decode(opening + cont, skip_special_tokens=True)
        final = stage + (int(follow.stage[0]) if follow.stage is not None else 0)
        return text, spent + len(cont), [final]

"""What an eval run is, fixed before anything runs: its settings (:class:`EvalSettings`), its arms (profile files,
``auto`` profiles per topic, the reference baselines) and the plan that cuts the prompts into batches
(:func:`make_plan`; see :mod:`narrative_gravity.eval.runner`)."""

from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..engines.options import check_device_for, check_engine
from ..errors import ConfigurationError
from ..profiles.schema import TOPIC_DEFAULTS, Profile, load_profile
from .judge import DEFAULT_JUDGE
from .metrics import Metric, resolve_metrics
from .prompts import BUILT_IN_SETS, TOPIC_SETS, EvalPrompt, limit_prompts, load_prompts
from .store import CONTROL

__all__ = ["AUTO", "AUTO_DEFAULTS", "BUILT_IN_SETS", "EvalSettings", "check_engine_arms", "make_plan"]

AUTO = "auto"


CHAT_FRAMES = (None, "template", "plain")


# The default topic profile, which `--profile auto` starts from; `core_semantics` is replaced by each topic's
# conditioning words (see `TOPIC_DEFAULTS`).
AUTO_DEFAULTS: dict[str, Any] = TOPIC_DEFAULTS


@dataclass(frozen=True)
class EvalSettings:
    """Everything that decides what a run generates. A resumed run must use the same settings.

    ``raw=None`` means: plain continuation for the built-in topic sets (``topics``, ``empath`` and their
    tuning splits: the protocol continues prefixes), chat otherwise. In chat, ``chat_frame`` ``template`` is the
    model's chat template and ``plain`` a "User:/Assistant:" frame for base models
    (:data:`~narrative_gravity.engines.prompts.PLAIN_FRAME`; an answer ends where the model starts the next "User:"
    line); ``None``: the template where the tokenizer has one, else the plain frame. ``judge="none"`` turns the
    judge off (and with it ``judge_ppl``). ``engine`` is ``hf`` (transformers) or ``vllm`` (see the module doc).
    """

    prompts: str
    profiles: tuple[str, ...]
    seeds: tuple[int, ...] = (0, 1, 2)
    max_new_tokens: int = 60
    top_k: int = 10
    temperature: float = 1.0
    raw: bool | None = None
    batch_size: int = 8
    model: str | None = None
    judge: str = DEFAULT_JUDGE
    metrics: tuple[str, ...] | None = None
    limit_prompts: int | None = None
    auto_template: str | None = None
    engine: str = "hf"
    chat_frame: str | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ConfigurationError("give at least one --profile FILE (or --profile auto for topic prompts)")
        if not self.seeds:
            raise ConfigurationError("give at least one seed (--samples N or --seeds 0,1,2)")
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigurationError(f"seeds must be distinct, got {list(self.seeds)}")
        if self.batch_size < 1:
            raise ConfigurationError(f"`batch_size` has to be >= 1, but is {self.batch_size}")
        if self.max_new_tokens < 1:
            raise ConfigurationError(f"`max_new_tokens` has to be >= 1, but is {self.max_new_tokens}")
        if self.chat_frame not in CHAT_FRAMES:
            raise ConfigurationError(
                f"--chat-frame must be template or plain (or left out: the model's template, else plain), "
                f"got {self.chat_frame!r}"
            )
        check_engine_arms(self.profiles, self.engine)
        check_device_for(self.engine, self.device)

    @property
    def raw_mode(self) -> bool:
        return self.raw if self.raw is not None else self.prompts in TOPIC_SETS

    @property
    def judge_on(self) -> bool:
        return self.judge.lower() != "none"

    def metric_list(self) -> list[Metric]:
        metrics = resolve_metrics(self.metrics)
        if not self.judge_on:
            if self.metrics is not None and "judge_ppl" in self.metrics:
                raise ConfigurationError("metric judge_ppl needs a judge; drop --judge none or drop judge_ppl")
            metrics = [m for m in metrics if "judge" not in m.needs]
        return metrics

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["raw"] = self.raw_mode
        for k in ("profiles", "seeds", "metrics"):
            if d[k] is not None:
                d[k] = list(d[k])
        return d


@dataclass(frozen=True)
class _Arm:
    name: str
    profile: Profile | None  # None: built per topic from the prompt's topic words (auto and baselines)
    template: Profile | None = None  # auto:FILE: the profile the per-topic profiles start from
    baseline: tuple[str, float] | None = None  # ("article", λ) or ("weighted", λ): a reference processor


@dataclass(frozen=True)
class _Chunk:
    arms: tuple[str, ...]
    indices: tuple[int, ...]


@dataclass
class _Plan:
    prompts: dict[int, EvalPrompt]
    arms: dict[str, _Arm]
    chunks: list[_Chunk]
    auto_template: Profile | None = None
    _auto: dict[tuple[str, ...], Profile] = field(default_factory=dict)  # (arm or "auto", *topic words)

    def profile_for(self, arm: str, prompt: EvalPrompt) -> Profile:
        profile = self._topic_profile(arm, prompt)
        if not prompt.required or profile.require is None:
            return profile
        key = ("require", arm, *prompt.topic_words, "\x00", *prompt.required)
        if key not in self._auto:  # the prompt's words in place of the block's own
            require = profile.require.model_copy(update={"words": list(prompt.required)})
            self._auto[key] = profile.model_copy(update={"require": require})
        return self._auto[key]

    def _topic_profile(self, arm: str, prompt: EvalPrompt) -> Profile:
        a = self.arms[arm]
        if a.profile is not None:
            return a.profile
        words = prompt.topic_words
        template = a.template if a.template is not None else self.auto_template
        key = (a.name if a.template is not None else AUTO, *words)
        if key not in self._auto:
            base = template.model_dump(exclude_none=True) if template is not None else dict(AUTO_DEFAULTS)
            base.update(core_semantics=list(words), name=prompt.topic_name or AUTO, penalize=base.get("penalize", []))
            self._auto[key] = Profile.from_mapping(base, source="auto profile")
        return self._auto[key]

    def keys(self, seeds: Sequence[int]) -> list[tuple[str, int, int]]:
        out = []
        for c in self.chunks:
            for seed in seeds:
                for arm in (CONTROL, *c.arms):
                    out.extend((arm, i, seed) for i in c.indices)
        return out


ARTICLE_STRENGTH = 1.2  # the blog post's configuration


# The `ask` arm's system message names this many of the topic's conditioning words (the most central ones).
ASK_WORDS = 3


# Baselines that are not logits processors of ours: `ask` runs on either engine; the rest need transformers.
_ANY_ENGINE = ("ask",)


def _number(spec: str, example: str) -> float:
    raw = spec.split(":", 1)[1]
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value == value or value < 0:  # NaN or negative
        raise ConfigurationError(f"--profile {spec!r}: needs a number >= 0 after the colon, e.g. {example}")
    return value


def _baseline(spec: str) -> _Arm | None:
    """``article``, ``weighted:λ``, ``ask`` or ``cfg:γ`` as an arm, else ``None``.

    ``ask`` names the topic in a system message (in plain continuation: a sentence before the prompt) and
    does not pull; ``cfg:γ`` is ``ask`` amplified by transformers' classifier-free guidance at scale γ, with
    the prompt without the topic as the negative branch (a second forward pass a step).

    >>> [_baseline(s).name for s in ("article", "weighted:4", "ask", "cfg:1.5")]
    ['article', 'weighted-4', 'ask', 'cfg-1.5']
    >>> _baseline("cfg:x")
    Traceback (most recent call last):
    ...
    narrative_gravity.errors.ConfigurationError: --profile 'cfg:x': needs a number >= 0 after the colon, e.g. cfg:1.5
    """
    if spec == "article":
        return _Arm("article", None, baseline=("article", ARTICLE_STRENGTH))
    if spec == "ask":
        return _Arm("ask", None, baseline=("ask", 0.0))
    if spec.startswith("weighted:"):
        return _Arm(f"weighted-{spec.split(':', 1)[1]}", None, baseline=("weighted", _number(spec, "weighted:4")))
    if spec.startswith("cfg:"):
        return _Arm(f"cfg-{spec.split(':', 1)[1]}", None, baseline=("cfg", _number(spec, "cfg:1.5")))
    return None


def check_engine_arms(specs: Sequence[str], engine: str) -> None:
    """Refuse, before anything loads, an engine name that is not known, a malformed baseline arm, and arms
    that ``engine`` cannot run: the ``article`` and ``weighted:λ`` baselines are Python logits processors,
    which vLLM cannot load, and ``cfg:γ`` is transformers' own guidance.

    >>> check_engine_arms(["auto", "weighted:4", "ask"], "hf")
    >>> check_engine_arms(["auto", "ask"], "vllm")
    >>> check_engine_arms(["auto", "weighted:4"], "vllm")
    Traceback (most recent call last):
    ...
    narrative_gravity.errors.ConfigurationError: --profile 'weighted:4' (arm `weighted-4`) runs on transformers \
only; evaluate it with --engine hf, or leave it out of the vLLM run
    """
    check_engine(engine)
    arms = [(spec, _baseline(spec)) for spec in specs]  # a malformed `weighted:` or `cfg:` fails here
    if engine != "vllm":
        return
    for spec, arm in arms:
        if arm is not None and arm.baseline is not None and arm.baseline[0] not in _ANY_ENGINE:
            raise ConfigurationError(
                f"--profile {spec!r} (arm `{arm.name}`) runs on transformers only; "
                "evaluate it with --engine hf, or leave it out of the vLLM run"
            )


def _load_arms(specs: Sequence[str]) -> dict[str, _Arm]:
    """Arms from ``--profile`` specs: a profile file, ``auto``, ``auto:TEMPLATE_FILE``, ``article``, ``weighted:λ``."""

    arms: dict[str, _Arm] = {}
    for spec in specs:
        if spec == AUTO:
            arm = _Arm(AUTO, None)
        elif (base := _baseline(spec)) is not None:
            arm = base
        elif spec.startswith(AUTO + ":"):
            path = spec.split(":", 1)[1]
            template = load_profile(path)
            arm = _Arm(template.name or Path(path).stem, None, template=template)
        else:
            prof = load_profile(spec)
            arm = _Arm(prof.name or Path(spec).stem, prof)
        if arm.name == CONTROL:
            raise ConfigurationError(f"profile {spec!r} is named `control`, which is reserved; rename it")
        if arm.name in arms:
            raise ConfigurationError(f"two profiles are named {arm.name!r}; profile names must be unique")
        arms[arm.name] = arm
    return arms


def make_plan(settings: EvalSettings, prompts: Sequence[EvalPrompt] | None = None) -> _Plan:
    """Load prompts and profiles, assign profiles to prompts, and cut the batches (see the module doc)."""

    items = limit_prompts(prompts if prompts is not None else load_prompts(settings.prompts), settings.limit_prompts)
    arms = _load_arms(settings.profiles)
    template = load_profile(settings.auto_template) if settings.auto_template else None
    per_topic = [name for name, a in arms.items() if a.profile is None]
    if per_topic:
        missing = [p.index for p in items if not p.topic_words]
        if missing:
            raise ConfigurationError(
                f"--profile {per_topic[0]} builds its pull from each prompt's topic words, but prompts "
                f"{missing[:10]} have none; use --prompts topics, or JSONL prompts with a `topic` list"
            )
    plan = _Plan({p.index: p for p in items}, arms, [], template)
    groups: dict[str, list[int]] = {}
    group_arms: dict[str, tuple[str, ...]] = {}
    for p in items:
        if p.profile is not None:
            if p.profile not in arms:
                guess = difflib.get_close_matches(p.profile, list(arms), n=1)
                hint = f"; did you mean {guess[0]!r}?" if guess else ""
                raise ConfigurationError(
                    f"prompt {p.index} asks for profile {p.profile!r}, which was not given{hint} "
                    f"(given: {', '.join(arms)})"
                )
            names: tuple[str, ...] = (p.profile,)
        else:
            names = tuple(arms)
        key = json.dumps(
            [[n, plan.profile_for(n, p).model_dump(mode="json")] for n in names], sort_keys=True, ensure_ascii=False
        )
        groups.setdefault(key, []).append(p.index)
        group_arms[key] = names
    for key, idx in groups.items():
        for s in range(0, len(idx), settings.batch_size):
            plan.chunks.append(_Chunk(group_arms[key], tuple(idx[s : s + settings.batch_size])))
    plan.chunks.sort(key=lambda c: c.indices[0])
    return plan

"""Run control against profiles on a prompt set, score every generation, and append the rows as they come.

The plan is fixed before anything runs: prompts that share their profiles are cut into batches of
``batch_size`` (in index order), and every batch runs once per seed as control (no gravity: the processor
measures with ``measure_only=True``, so entropy is recorded and the logits are untouched) and then once per
profile, with the same seed, the same batch composition and the same sampling settings. A control row and a
profile row with the same (prompt, seed) therefore form a pair.

Each batch's rows are scored and appended to ``results.jsonl`` (flushed and synced) before the next batch
starts. Every row is keyed by ``(profile, prompt index, seed)`` (``profile`` is ``control`` for control), so
a run that was interrupted, even by SIGKILL, resumes with ``resume=True`` without redoing or losing
finished generations; a half-written last line is dropped. Because the plan is fixed, a resumed run
produces exactly the rows an uninterrupted run would have produced.

A prompt that fails (a profile that does not fit the tokenizer, an error while generating) is written to
``failures.jsonl``, reported, and skipped; the run goes on, and ``resume`` retries it.

``engine="vllm"`` generates on an in-process vLLM engine (:mod:`narrative_gravity.engines.vllm_generate`):
every profile arm becomes each request's ``extra_args``, control runs without gravity (and, there, keeps no
trace), and gravity rows get their trace from the processor's ``on_step`` hook. The judge and the other
scoring models stay on transformers. The ``article`` and ``weighted:λ`` baselines are Python logits
processors, which vLLM cannot run: they are refused before anything loads.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..engines.baselines import ArticleGravityLogitsProcessor, WeightedDecodingLogitsProcessor
from ..engines.hf import NarrativeGravityLogitsProcessor, processor_from_profile
from ..engines.hf_generate import profile_head_plan, sample_ids, shortlist_json
from ..engines.options import GenerationOptions, check_engine
from ..engines.prompts import encode_prompts, left_pad, plain_frame, until_next_turn
from ..engines.shortlist import shortlist_head
from ..errors import ConfigurationError, NarrativeGravityError
from ..fields import NarrativeField
from ..gravity.thermo import Trace
from ..lead import lead_sentence, reading_profile
from ..models import load_model, load_tokenizer
from ..profiles.build import field_from_profile, program_from_profile
from ..profiles.schema import TOPIC_DEFAULTS, Profile, load_profile
from .judge import DEFAULT_JUDGE
from .metrics import Metric, MetricContext, Sample, resolve_metrics
from .prompts import BUILT_IN_SETS, TOPIC_SETS, EvalPrompt, limit_prompts, load_prompts
from .report import write_reports
from .store import CONTROL, FAILURES, RESULTS, RUN_FILE, ResultStore, row_key

__all__ = ["AUTO", "BUILT_IN_SETS", "CONTROL", "EvalSettings", "ResultStore", "check_engine_arms", "run_eval"]

AUTO = "auto"
CHAT_FRAMES = (None, "template", "plain")
TRACE_KEYS = ("entropy", "mass", "mass_after", "kl", "strength")
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


# --------------------------------------------------------------------------------------------------
# the results file


# --------------------------------------------------------------------------------------------------
# the plan


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


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def run_manifest(settings: EvalSettings, plan: _Plan) -> dict[str, Any]:
    """What ``run.json`` records: the settings, the prompts and the profiles (for resume checks and reports)."""
    prompts = [
        {
            "index": p.index,
            "text": p.text,
            "topic": p.topic_name,
            "n_topic_words": len(p.topic_words),
            "n_heldout": len(p.heldout_words),
            **({"require": list(p.required)} if p.required else {}),
        }
        for p in plan.prompts.values()
    ]
    profiles = {}
    for name, arm in plan.arms.items():
        if arm.profile is not None:
            profiles[name] = arm.profile.model_dump(mode="json")
        else:
            per_topic = {}
            for p in plan.prompts.values():
                prof = plan.profile_for(name, p)
                per_topic.setdefault(p.topic_name or AUTO, prof.model_dump(mode="json"))
            profiles[name] = {"auto": True, "per_topic": per_topic}
    return {
        "version": 1,
        "settings": settings.to_json(),
        "arms": [CONTROL, *plan.arms],
        "prompts": prompts,
        "prompts_digest": _digest([p.text if not p.required else [p.text, *p.required] for p in plan.prompts.values()]),
        "profiles": profiles,
        "profiles_digest": _digest(profiles),
        "n_chunks": len(plan.chunks),
        "planned": len(plan.keys(settings.seeds)),
    }


_RESUME_KEYS = ("prompts_digest", "profiles_digest")


def _check_resume(old: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    old = {**old, "settings": {"engine": "hf", **old.get("settings", {})}}  # runs from before --engine
    diffs = [k for k, v in new["settings"].items() if old["settings"].get(k) != v]
    diffs += [k.removesuffix("_digest") for k in _RESUME_KEYS if old.get(k) != new[k]]
    if diffs:
        detail = "; ".join(
            f"{k}: was {old.get('settings', {}).get(k)!r}, now {new['settings'].get(k)!r}"
            for k in diffs
            if k in new["settings"]
        )
        raise ConfigurationError(
            f"cannot resume {path.parent}: it was started with other settings ({', '.join(diffs)}"
            f"{'; ' + detail if detail else ''}). Rerun with the same options, or choose a new --out"
        )


# --------------------------------------------------------------------------------------------------
# generation


class _FirstStepClock:
    """A no-op logits processor that notes when the first step's logits arrive (time to first token)."""

    def __init__(self) -> None:
        self.t: float | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.t is None:
            self.t = time.perf_counter()
        return scores


@dataclass(frozen=True)
class _Guidance:
    """The ``cfg:γ`` arm: transformers' classifier-free guidance at scale ``γ``, built per batch."""

    scale: float

    def build(self, model: Any, tokenizer: Any, negative: list[list[int]]) -> Any:
        """The guidance processor of one batch; ``negative``: each row's prompt without the topic."""
        from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        ids, mask = left_pad(negative, pad_id)
        device = next(model.parameters()).device
        return UnbatchedClassifierFreeGuidanceLogitsProcessor(
            self.scale, model, unconditional_ids=ids.to(device), unconditional_attention_mask=mask.to(device)
        )


@dataclass
class _Generated:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    trace: dict[str, list[float]] | None
    trace_means: dict[str, float] | None
    seconds: float
    latency: float
    ttft: float
    batch_size: int
    shortlist: dict[str, Any] | None = None


class _Runner:
    def __init__(
        self,
        settings: EvalSettings,
        plan: _Plan,
        model: Any,
        tokenizer: Any,
        ctx: MetricContext,
        metrics: list[Metric],
        report: Callable[[str], None],
    ) -> None:
        self.s = settings
        self.plan = plan
        self.model = model
        self.plain_frame = not settings.raw_mode and (
            settings.chat_frame == "plain"
            or (settings.chat_frame is None and not getattr(tokenizer, "chat_template", None))
        )
        self.tok = plain_frame(tokenizer) if self.plain_frame else tokenizer
        self.ctx = ctx
        self.metrics = metrics
        self.say = report
        if self.plain_frame:
            report('chat in the plain frame ("User: …" / "Assistant:"); an answer ends where a "User:" line starts')

    def answer(self, ids: list[int]) -> list[int]:
        """A generated row as scored: in the plain frame, up to the model's own next "User:" line."""
        return until_next_turn(self.tok, ids) if self.plain_frame else ids

    def options(self, seed: int, max_new_tokens: int | None = None) -> GenerationOptions:
        """The run's sampling settings with ``seed`` (and another budget, for a warm-up)."""
        return GenerationOptions(
            max_new_tokens=max_new_tokens or self.s.max_new_tokens,
            top_k=self.s.top_k,
            temperature=self.s.temperature,
            seed=seed,
        )

    def generate(self, prompts: Sequence[str], seed: int, processor: Any, lead: str | None = None) -> list[_Generated]:
        options = self.options(seed)
        encoded = encode_prompts(self.tok, prompts, raw=self.s.raw_mode, lead=lead)
        if isinstance(processor, _Guidance):  # the negative branch reads the prompts without the topic
            processor = processor.build(self.model, self.tok, encode_prompts(self.tok, prompts, raw=self.s.raw_mode))
        clock = _FirstStepClock()
        trace = getattr(processor, "trace", None)  # the reference baselines keep none
        head = getattr(processor, "head_plan", None)  # a profile arm with prune.head
        procs = [clock] if processor is None else [clock, processor]
        t0 = time.perf_counter()
        with shortlist_head(self.model, head) as short:
            rows = [self.answer(r) for r in sample_ids(self.model, self.tok, encoded, options, procs)]
        elapsed = time.perf_counter() - t0
        cuts = short.cut_masses([len(r) for r in rows]) if short is not None else None
        ttft = (clock.t - t0) if clock.t is not None else float("nan")
        lengths = [len(row) for row in rows]
        traces = trace.to_numpy() if isinstance(trace, Trace) and len(trace) else None
        means = trace.means(lengths) if isinstance(trace, Trace) and len(trace) else None
        results = []
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            results.append(
                _Generated(
                    prompt_ids=list(encoded[i]),
                    token_ids=row,
                    text=self.tok.decode(row, skip_special_tokens=True),
                    trace={k: [round(float(v), 5) for v in traces[k][i, :n]] for k in TRACE_KEYS} if traces else None,
                    trace_means=means[i] if means else None,
                    seconds=elapsed / len(prompts),
                    latency=elapsed,
                    ttft=ttft,
                    batch_size=len(prompts),
                    shortlist=None if head is None else shortlist_json(head, cuts[i]),
                )
            )
        return results

    def warmup(self) -> None:
        first = next(iter(self.plan.prompts.values()))

        ids = encode_prompts(self.tok, [first.text], raw=self.s.raw_mode)[0]
        opts = self.options(0, max_new_tokens=2)
        pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id
        with torch.inference_mode():
            self.model.generate(
                input_ids=torch.tensor([ids], device=next(self.model.parameters()).device),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=next(self.model.parameters()).device),
                pad_token_id=pad_id,
                **opts.generate_kwargs(),
            )

    def field_for(self, arm: str, prompt: EvalPrompt) -> Any:
        return field_from_profile(self.plan.profile_for(arm, prompt), self.tok, model=self.model)

    def processor(self, arm: str, prompt: EvalPrompt, chunk: _Chunk) -> Any:
        base = self.plan.arms[arm].baseline if arm != CONTROL else None
        if base is not None:
            kind, lam = base
            if kind == "ask":
                return None
            if kind == "cfg":
                return _Guidance(lam)
            if kind == "article":
                return ArticleGravityLogitsProcessor(self.tok, prompt.topic_words, gravity_strength=lam)
            return WeightedDecodingLogitsProcessor(self.tok, prompt.topic_words, lam)
        if arm != CONTROL:
            pull = self.pull_profile(arm, prompt)
            proc = processor_from_profile(
                pull, self.tok, max_new_tokens=self.s.max_new_tokens, trace=Trace(), model=self.model, inplace=True
            )
            proc.head_plan = profile_head_plan(self.model, self.tok, pull)  # the shortlist head (prune.head)
            return proc
        # Control measures with the field of the chunk's first profile that builds (narrative mass in the
        # trace); with none, a zero field still records entropy.

        for a in chunk.arms:
            try:
                fld = self.field_for(a, prompt)
                break
            except Exception:
                continue
        else:
            fld = NarrativeField(values=torch.zeros(len(self.tok)))
        return NarrativeGravityLogitsProcessor(
            fld, strength=0.0, max_new_tokens=self.s.max_new_tokens, trace=Trace(), measure_only=True
        )

    def lead(self, arm: str, prompt: EvalPrompt) -> str | None:
        """The arm's topic sentence for ``prompt`` (its profile's ``lead``; ``ask`` and ``cfg``: the topic
        named by its :data:`ASK_WORDS` most central words), or ``None``."""
        if arm == CONTROL:
            return None
        base = self.plan.arms[arm].baseline
        if base is not None and base[0] in ("ask", "cfg"):
            ask = Profile(core_semantics=list(prompt.topic_words), lead={"words": ASK_WORDS})
            return lead_sentence(ask, raw=self.s.raw_mode)
        if base is not None:
            return None
        return lead_sentence(self.plan.profile_for(arm, prompt), raw=self.s.raw_mode)

    def pull_profile(self, arm: str, prompt: EvalPrompt) -> Profile:
        """The profile an arm pulls with for ``prompt``: as its sentence (:meth:`lead`) is read."""
        return reading_profile(self.plan.profile_for(arm, prompt), raw=self.s.raw_mode)

    def judge_context(self, prompt: str) -> str:
        return prompt if self.s.raw_mode else prompt + "\n"

    def samples(self, arm: str, prompts: Sequence[EvalPrompt], gens: Sequence[_Generated]) -> list[Sample]:
        out = []
        for p, g in zip(prompts, gens, strict=True):
            try:
                prof = self.plan.profile_for(arm, p)
                fld = self.field_for(arm, p)
            except NarrativeGravityError:
                prof, fld = None, None
            words = p.score_words() or (tuple(prof.keywords()) if prof is not None else ())
            out.append(
                Sample(
                    prompt=p.text,
                    text=g.text,
                    new_tokens=len(g.token_ids),
                    token_ids=g.token_ids,
                    prompt_ids=g.prompt_ids,
                    seconds=g.seconds,
                    latency=g.latency,
                    ttft=g.ttft,
                    trace_means=g.trace_means,
                    score_words=words,
                    field=fld,
                    penalized=tuple(prof.penalized()) if prof is not None else (),
                    tokenizer=self.tok,
                    judge_context=self.judge_context(p.text),
                    required=p.required,
                    description=p.description,
                )
            )
        return out

    def score(self, samples: list[Sample]) -> list[dict[str, float]]:
        out: list[dict[str, float]] = [{} for _ in samples]
        for m in self.metrics:
            for row, v in zip(out, m.compute(samples, self.ctx)):
                row[m.name] = round(v, 6) if v == v else None
        return out

    def rows(self, arm: str, chunk: _Chunk, prompts: list[EvalPrompt], seed: int, gens: list[_Generated]) -> list[dict]:
        t0 = time.perf_counter()
        if arm == CONTROL:
            per_arm = {a: self.score(self.samples(a, prompts, gens)) for a in chunk.arms}
        else:
            per_arm = {arm: self.score(self.samples(arm, prompts, gens))}
        metric_s = (time.perf_counter() - t0) / max(1, len(prompts))
        rows = []
        for j, (p, g) in enumerate(zip(prompts, gens, strict=True)):
            row: dict[str, Any] = {
                "profile": arm,
                "prompt_index": p.index,
                "seed": seed,
                "topic": p.topic_name,
                "prompt": p.text,
                "text": g.text,
                "new_tokens": len(g.token_ids),
                "token_ids": g.token_ids,
                "batch_size": g.batch_size,
                "batch_s": round(g.latency, 4),
                "metric_s": round(metric_s, 4),
            }
            if self.plain_frame:
                row["frame"] = "plain"
            if arm == CONTROL:
                row["metrics"] = per_arm[chunk.arms[0]][j]
                row["metrics_vs"] = {a: v[j] for a, v in per_arm.items()}
            else:
                row["profile_used"] = self.plan.profile_for(arm, p).name
                lead = self.lead(arm, p)
                if lead is not None:
                    row["lead"] = lead  # what the model read before the prompt (the judge never sees it)
                row["metrics"] = per_arm[arm][j]
            if g.shortlist is not None:
                row["shortlist"] = g.shortlist
            row["trace"] = g.trace
            rows.append(row)
        return rows


class _VLLMRunner(_Runner):
    """:class:`_Runner` on an in-process vLLM engine (``engine="vllm"``; see the module doc).

    A profile arm's "processor" is its profile, sent as every request's ``extra_args``; control is ``None``
    (no gravity). Generation, the warm-up and fields that read the model's embeddings use ``generator`` (a
    :class:`~narrative_gravity.engines.vllm_generate.VLLMGenerator`); scoring is the transformers runner's.
    """

    def __init__(
        self,
        settings: EvalSettings,
        plan: _Plan,
        generator: Any,
        ctx: MetricContext,
        metrics: list[Metric],
        report: Callable[[str], None],
    ) -> None:
        super().__init__(settings, plan, None, generator.tokenizer, ctx, metrics, report)
        self.gen = generator

    def _model_for(self, profile: Profile) -> Any:
        """What a field of ``profile`` reads the LM's embeddings from (only ``semantic_source: lm`` does)."""
        reads_lm = profile.field.mode != "lexical" and profile.field.semantic_source == "lm"
        return self.gen.embeddings if reads_lm else None

    def field_for(self, arm: str, prompt: EvalPrompt) -> Any:
        profile = self.plan.profile_for(arm, prompt)
        return field_from_profile(profile, self.tok, model=self._model_for(profile))

    def processor(self, arm: str, prompt: EvalPrompt, chunk: _Chunk) -> Profile | None:
        if arm == CONTROL:
            return None
        base = self.plan.arms[arm].baseline
        if base is not None and base[0] == "ask":
            return None
        if base is not None:  # check_engine_arms refuses these before the run
            raise ConfigurationError(f"arm `{arm}` runs on transformers only; run it with --engine hf")
        profile = self.pull_profile(arm, prompt)
        # Build its program here, as the engine will: a profile that does not fit the tokenizer fails this
        # batch now, where the engine would run the request without gravity and only log why.
        program_from_profile(profile, self.tok, model=self._model_for(profile))
        return profile

    def generate(self, prompts: Sequence[str], seed: int, processor: Any, lead: str | None = None) -> list[_Generated]:
        encoded = encode_prompts(self.tok, prompts, raw=self.s.raw_mode, lead=lead)
        t0 = time.perf_counter()
        outs = self.gen.generate(encoded, self.options(seed).replace(trace=True), processor)
        elapsed = time.perf_counter() - t0
        return [
            _Generated(
                prompt_ids=out.prompt_ids,
                token_ids=self.answer(out.token_ids),
                text=self.gen.decode(self.answer(out.token_ids)),
                trace=out.trace,
                trace_means=out.trace_means(),
                seconds=elapsed / len(prompts),
                latency=out.latency,
                ttft=out.ttft,
                batch_size=len(prompts),
            )
            for out in outs
        ]

    def warmup(self) -> None:
        first = next(iter(self.plan.prompts.values()))
        ids = encode_prompts(self.tok, [first.text], raw=self.s.raw_mode)
        self.gen.generate(ids, self.options(0, max_new_tokens=2))


def _failure(arm: str, p: EvalPrompt, seed: int, exc: BaseException) -> dict[str, Any]:
    return {
        "profile": arm,
        "prompt_index": p.index,
        "seed": seed,
        "prompt": p.text,
        "error": f"{type(exc).__name__}: {exc}",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def run_eval(
    settings: EvalSettings,
    out_dir: str | os.PathLike[str],
    *,
    resume: bool = False,
    model: Any = None,
    tokenizer: Any = None,
    ctx: MetricContext | None = None,
    prompts: Sequence[EvalPrompt] | None = None,
    progress: bool = True,
    write_report: bool = True,
    console: Any = None,
    generator: Any = None,
) -> dict[str, Any]:
    """Run (or resume) an eval into ``out_dir`` and write the reports; returns the summary.

    ``model``/``tokenizer`` default to :func:`~narrative_gravity.models.load_model` of ``settings.model``;
    ``ctx`` to a :class:`MetricContext` with MiniLM and ``settings.judge``. With ``settings.engine == "vllm"``,
    ``generator`` (a :class:`~narrative_gravity.engines.vllm_generate.VLLMGenerator`) replaces ``model`` and
    ``tokenizer``; by default one is started on ``settings.model``, sized for the prompts and ``batch_size``.
    """

    console = console if console is not None else Console(stderr=True, soft_wrap=True)
    out = Path(out_dir)
    store = ResultStore(out / RESULTS)
    metrics = settings.metric_list()
    plan = make_plan(settings, prompts)
    vllm_generate = None
    if settings.engine == "vllm" and generator is None:
        from ..engines import vllm_generate  # imports vLLM, which lives in its own venv: only for engine="vllm"

        vllm_generate.require_vllm()
    manifest = run_manifest(settings, plan)
    run_file = out / RUN_FILE
    if resume and run_file.exists():
        _check_resume(json.loads(run_file.read_text(encoding="utf-8")), manifest, run_file)
    elif store.path.exists() and store.load():
        raise ConfigurationError(
            f"{out} already holds results; pass --resume to continue that run, or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    done = {row_key(r) for r in store.load(repair=True)}
    run_file.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    all_keys = plan.keys(settings.seeds)
    todo_n = sum(1 for k in all_keys if k not in done)
    console.print(
        f"eval: {len(plan.prompts)} prompts × {len(settings.seeds)} seeds × {len(plan.arms) + 1} arms "
        f"(control, {', '.join(plan.arms)}) = {len(all_keys)} generations; {len(all_keys) - todo_n} already done, "
        f"{todo_n} to go → {out}",
        highlight=False,
    )
    if todo_n:
        if vllm_generate is not None:
            generator = _start_vllm(vllm_generate, settings, plan, console)
        elif settings.engine == "hf" and (model is None or tokenizer is None):
            with console.status(f"loading {settings.model or 'smollm2'}"):
                model, tokenizer = load_model(settings.model)
        if ctx is None:
            ctx = MetricContext(judge=settings.judge if settings.judge_on else None)
        needs = set().union(*(m.needs for m in metrics))
        if needs:
            # Load the scoring models now: a missing package should fail before the first generation.
            with console.status(f"loading scoring models ({', '.join(sorted(needs))})"):
                if "encoder" in needs:
                    _ = ctx.encoder
                if "judge" in needs:
                    _ = ctx.judge

        def say(message: str) -> None:
            console.print(message, highlight=False)

        runner = (
            _VLLMRunner(settings, plan, generator, ctx, metrics, say)
            if settings.engine == "vllm"
            else _Runner(settings, plan, model, tokenizer, ctx, metrics, say)
        )
        runner.warmup()
        _loop(runner, plan, settings, store, done, todo_n, out, progress, console)
    summary: dict[str, Any] = {}
    if write_report:
        summary = write_reports(out)
    return summary


def _start_vllm(vllm_generate: Any, settings: EvalSettings, plan: _Plan, console: Any) -> Any:
    """A vLLM engine on ``settings.model`` for ``batch_size`` requests at once, long enough for every prompt."""

    tok = load_tokenizer(settings.model)
    encoded = encode_prompts(tok, [p.text for p in plan.prompts.values()], raw=settings.raw_mode)
    longest = max(len(ids) for ids in encoded) + settings.max_new_tokens
    with console.status(f"starting vLLM on {settings.model or 'smollm2'} (~30 s on a CPU)"):
        return vllm_generate.VLLMGenerator.load(
            settings.model, max_num_seqs=settings.batch_size, longest=longest, tokenizer=tok
        )


def _loop(
    runner: _Runner,
    plan: _Plan,
    settings: EvalSettings,
    store: ResultStore,
    done: set[tuple[str, int, int]],
    total: int,
    out: Path,
    progress: bool,
    console: Any,
) -> None:
    failures = ResultStore(out / FAILURES)
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not progress,
    )
    with bar:
        task = bar.add_task("generating", total=total)
        for chunk in plan.chunks:
            for seed in settings.seeds:
                for arm in (CONTROL, *chunk.arms):
                    todo = [plan.prompts[i] for i in chunk.indices if (arm, i, seed) not in done]
                    if not todo:
                        continue
                    bar.update(task, description=f"{arm} · prompt {todo[0].index} · seed {seed}")
                    rows, failed = _run_unit(runner, arm, chunk, todo, seed)
                    store.append(rows)
                    failures.append(failed)
                    for f in failed:
                        console.print(
                            f"[yellow]skipped[/] {escape(f['profile'])} · prompt {f['prompt_index']} · seed "
                            f"{f['seed']}: {escape(f['error'])}",
                            highlight=False,
                        )
                    done.update(row_key(r) for r in rows)
                    bar.advance(task, len(todo))


def _run_unit(
    runner: _Runner, arm: str, chunk: _Chunk, todo: list[EvalPrompt], seed: int
) -> tuple[list[dict], list[dict]]:
    """Generate and score one batch; on an error, retry its prompts one by one and skip those that fail."""
    try:
        proc = runner.processor(arm, todo[0], chunk)
    except Exception as exc:  # a profile that does not fit the tokenizer fails every prompt of the batch
        return [], [_failure(arm, p, seed, exc) for p in todo]
    lead = runner.lead(arm, todo[0])  # the batch shares its profile, and so its topic sentence
    try:
        gens = runner.generate([p.text for p in todo], seed, proc, lead)
    except Exception as exc:
        if len(todo) == 1:
            return [], [_failure(arm, todo[0], seed, exc)]
    else:
        return runner.rows(arm, chunk, todo, seed, gens), []
    # Scoring errors are not caught: a broken metric or a missing model should stop the run, not skip prompts.
    rows: list[dict] = []
    failed: list[dict] = []
    for p in todo:
        try:
            gens = runner.generate([p.text], seed, runner.processor(arm, p, chunk), runner.lead(arm, p))
        except Exception as exc:
            failed.append(_failure(arm, p, seed, exc))
            continue
        rows.extend(runner.rows(arm, chunk, [p], seed, gens))
    return rows, failed

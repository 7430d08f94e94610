"""One batch of one arm, on transformers (:class:`_Runner`) or an in-process vLLM engine (:class:`_VLLMRunner`):
the arm's processor, the generation, the scores, and the rows that :mod:`narrative_gravity.eval.runner` appends.
A batch that fails is retried prompt by prompt (:func:`_run_unit`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor

from ..engines.baselines import ArticleGravityLogitsProcessor, WeightedDecodingLogitsProcessor
from ..engines.hf import NarrativeGravityLogitsProcessor, processor_from_profile
from ..engines.hf_generate import profile_head_plan, sample_ids, shortlist_json
from ..engines.options import GenerationOptions
from ..engines.prompts import encode_prompts, left_pad, plain_frame, until_next_turn
from ..engines.shortlist import shortlist_head
from ..errors import ConfigurationError, NarrativeGravityError
from ..fields import NarrativeField
from ..gravity.thermo import Trace
from ..lead import lead_sentence, reading_profile
from ..profiles.build import field_from_profile, program_from_profile
from ..profiles.schema import Profile
from .metrics import Metric, MetricContext, Sample
from .prompts import EvalPrompt
from .settings import ASK_WORDS, EvalSettings, _Chunk, _Plan
from .store import CONTROL

__all__ = ["TRACE_KEYS"]

TRACE_KEYS = ("entropy", "mass", "mass_after", "kl", "strength")


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
        """What a field of ``profile`` reads of the LM (:meth:`VLLMGenerator.field_model`), else nothing."""
        return self.gen.field_model(profile)

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

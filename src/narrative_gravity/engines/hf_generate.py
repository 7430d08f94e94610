"""Batched generation on the transformers engine: left padding, chat templates, seeds, timing and traces.

This is the loop behind ``ngrav generate``, ``ngrav compare`` and :func:`narrative_gravity.generate`; gravity
itself stays in the logits processor (:mod:`.hf`). The vLLM engine's counterpart is :mod:`.vllm_generate`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ConfigurationError
from ..gravity.thermo import Trace
from ..lead import lead_sentence, reading_profile
from ..profiles.build import program_from_profile
from ..profiles.schema import Profile
from .hf import processor_from_profile
from .options import GenerationOptions
from .prompts import encode_prompts, eos_token_ids, generated_length, left_pad
from .results import GenerationResult
from .shortlist import HeadPlan, cut_summary, head_plan, narrative_support, shortlist_head

__all__ = ["ProcessorFactory", "generate", "generate_with_profile", "profile_head_plan", "sample_ids", "shortlist_json"]

ProcessorFactory = Callable[[int, Trace | None], Any]
"""``factory(max_new_tokens, trace)``: the logits processor of one batch, or ``None`` for plain decoding."""


def generate(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    options: GenerationOptions = GenerationOptions(),
    *,
    processor_factory: ProcessorFactory | None = None,
    progress: Callable[[int], None] | None = None,
    lead: str | None = None,
    head: HeadPlan | None = None,
) -> list[GenerationResult]:
    """Generate a continuation for every prompt, ``options.batch_size`` prompts at a time (left-padded).

    ``processor_factory(max_new_tokens, trace)`` returns a logits processor for one batch, or ``None`` for
    plain decoding. Each batch is seeded with ``options.seed`` so a run is reproducible; ``options.trace``
    records each batch's measurements. ``lead``: a topic sentence the model reads before every prompt
    (:func:`narrative_gravity.lead.lead_sentence`). ``head``: compute the output head only for its shortlist
    (:mod:`.shortlist`); each result's ``extra["shortlist"]`` then says the shortlist's size and, with its audit,
    the probability mass outside it (``cut_masses`` per audited step, their mean and 99th percentile).
    """
    if not prompts:
        return []
    batch_size = options.batch_size
    encoded = encode_prompts(tokenizer, prompts, raw=not options.chat_template(tokenizer), lead=lead)
    results: list[GenerationResult] = []
    for start in range(0, len(prompts), batch_size):
        chunk = encoded[start : start + batch_size]
        trace = Trace() if options.trace else None
        processor = processor_factory(options.max_new_tokens, trace) if processor_factory else None
        t0 = time.perf_counter()
        with shortlist_head(model, head) as short:
            rows = sample_ids(model, tokenizer, chunk, options, [processor] if processor is not None else [])
        elapsed = time.perf_counter() - t0
        lengths = [len(row) for row in rows]
        cuts = short.cut_masses(lengths) if short is not None else None
        traces = trace.to_numpy() if trace is not None and len(trace) else None
        means = trace.means(lengths) if trace is not None and len(trace) else None
        for i, (toks, n) in enumerate(zip(rows, lengths, strict=True)):
            results.append(
                GenerationResult(
                    prompt=prompts[start + i],
                    text=tokenizer.decode(toks, skip_special_tokens=True),
                    new_tokens=n,
                    seconds=elapsed / len(chunk),
                    token_ids=toks,
                    seed=options.seed,
                    batch_seconds=elapsed,
                    trace={k: v[i, :n].tolist() for k, v in traces.items()} if traces else None,
                    trace_means=means[i] if means else None,
                    extra={} if head is None else {"shortlist": shortlist_json(head, cuts[i])},
                )
            )
        if progress is not None:
            progress(len(chunk))
    return results


def generate_with_profile(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    profile: Profile | None,
    options: GenerationOptions = GenerationOptions(),
    *,
    measure_only: bool = False,
    progress: Callable[[int], None] | None = None,
) -> list[GenerationResult]:
    """:func:`generate` with ``profile``'s pull, as ``ngrav generate`` runs it: the profile's topic sentence
    (``lead``) is read before every prompt, and pulled as read (:func:`~narrative_gravity.lead.reading_profile`).

    ``measure_only`` (``--no-gravity`` with a profile) reads no sentence and only measures against the profile's
    field; ``profile=None`` is plain decoding.
    """
    raw = not options.chat_template(tokenizer)
    lead = None if measure_only else lead_sentence(profile, raw=raw)
    pull = profile if lead is None else reading_profile(profile, raw=raw)

    def factory(budget: int, trace: Trace | None) -> Any:
        if pull is None:
            return None
        return processor_from_profile(
            pull, tokenizer, max_new_tokens=budget, trace=trace, measure_only=measure_only, model=model, inplace=True
        )

    head = profile_head_plan(model, tokenizer, pull) if pull is not None else None
    return generate(
        model, tokenizer, prompts, options, processor_factory=factory, progress=progress, lead=lead, head=head
    )


def profile_head_plan(model: Any, tokenizer: Any, profiles: Profile | Sequence[Profile]) -> HeadPlan | None:
    """The shortlist head of one ``generate`` call whose rows pull with ``profiles``: ``None`` unless every one
    of them asks for ``prune.head`` (a row without it needs the full head); else the largest ``shortlist`` of
    them, the narrative support of every profile, the special and stop tokens, and the largest ``audit``."""
    profiles = [profiles] if isinstance(profiles, Profile) else list(profiles)
    heads = [p.prune.head if p.prune is not None else None for p in profiles]
    if not heads or any(h is None for h in heads):
        return None
    files = {h.file for h in heads}
    if len(files) > 1:
        raise ConfigurationError(
            f"the rows of one batch name different shortlist files ({sorted(str(f) for f in files)}); "
            "use one list per model"
        )
    supports = [narrative_support(program_from_profile(p, tokenizer, model=model)) for p in profiles]
    return head_plan(
        model,
        tokenizer,
        shortlist=max(h.shortlist for h in heads),
        supports=supports,
        special=sorted(eos_token_ids(model, tokenizer)),
        audit=max(h.audit for h in heads),
        file=heads[0].file,
    )


def shortlist_json(head: HeadPlan, cuts: list[float] | None) -> dict[str, Any]:
    """What a result says of its shortlist: ``size``, and with the audit the masses outside it per audited step
    (``cut_masses``), their mean and 99th percentile."""
    out: dict[str, Any] = {"size": head.size}
    if head.audit > 0 and cuts is not None:
        out.update(cut_summary(cuts))
        out["cut_masses"] = [round(c, 6) for c in cuts]
    return out


def sample_ids(
    model: Any, tokenizer: Any, batch: list[list[int]], options: GenerationOptions, processors: Sequence[Any] = ()
) -> list[list[int]]:
    """Continue token-id prompts in one left-padded ``model.generate`` call, seeded with ``options.seed``.

    Returns each row's new tokens, cut after its first end-of-sequence token (:func:`generated_length`).
    ``processors`` are the batch's logits processors, in order; none for plain decoding.
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = eos_token_ids(model, tokenizer)
    device = next(model.parameters()).device
    ids, mask = left_pad(batch, pad_id)
    torch.manual_seed(options.seed)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            logits_processor=list(processors) or None,
            pad_token_id=pad_id,
            **options.generate_kwargs(),
        )
    rows = out[:, ids.shape[1] :].cpu().tolist()
    return [row[: generated_length(row, eos_ids)] for row in rows]

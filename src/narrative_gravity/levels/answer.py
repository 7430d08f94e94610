"""The pipeline as a library call: :func:`answer` runs every level of :mod:`narrative_gravity.levels.pipeline` and
decodes on the transformers engine (``model``, ``tokenizer``) or on vLLM (a
:class:`~narrative_gravity.engines.vllm_generate.VLLMGenerator`), the same way ``ngrav serve`` does per request.

Example (SmolLM2, offline)::

    from narrative_gravity.levels.answer import answer
    from narrative_gravity.models import load_model
    from narrative_gravity.profiles.schema import Profile

    model, tok = load_model()
    profile = Profile.from_mapping({"core_semantics": ["telescope"], "context": {}, "conversation": {}})
    res = answer([{"role": "user", "content": "How did telescopes change astronomy?"}],
                 documents=["Galileo turned a telescope to Jupiter in 1610 ...", "A recipe for bread ..."],
                 profile=profile, model=model, tokenizer=tok)
    res.text, res.report["context"]["dropped"]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engines.hf import processor_from_profile
from ..engines.hf_generate import sample_ids
from ..engines.options import GenerationOptions
from ..engines.prompts import chat_ids
from ..errors import ConfigurationError
from ..lead import lead_messages, lead_sentence, reading_profile
from ..profiles.schema import Profile
from .pipeline import Prepared, parse_documents, prepare, split_documents, stage_report
from .plan import DRAFT_OPTIONS

__all__ = ["ANSWER_OPTIONS", "Answer", "answer"]

ANSWER_OPTIONS = GenerationOptions(max_new_tokens=64, temperature=0.0)
"""How :func:`answer` decodes unless told otherwise: greedy, up to 64 tokens."""


@dataclass
class Answer:
    """The answer, what the model read, and what each level did (``report``, JSON-ready)."""

    text: str
    token_ids: list[int]
    prepared: Prepared
    report: dict[str, Any] = field(default_factory=dict)


def answer(
    messages: Sequence[Mapping[str, str]],
    *,
    documents: Any = None,
    profile: Profile | None = None,
    model: Any = None,
    tokenizer: Any = None,
    vllm: Any = None,
    options: GenerationOptions = ANSWER_OPTIONS,
    encoder: Any = None,
) -> Answer:
    """Answer the conversation's last user message with every level the profile switches on.

    Args:
        messages: ``{"role", "content"}`` turns; ``<document id="...">`` blocks in them are passages too.
        documents: retrieved passages: strings or ``{"id", "text"}`` objects.
        profile: the narrative profile (``None``: plain decoding, passages kept whole).
        model, tokenizer: the transformers engine; or ``vllm``: a ``VLLMGenerator`` (its tokenizer is used).
        options: how the answer is sampled (default greedy, 64 tokens).
        encoder: MiniLM by default, for pruning and outline scores.
    """
    if vllm is None and (model is None or tokenizer is None):
        raise ConfigurationError("answer() needs model= and tokenizer= (transformers) or vllm= (a VLLMGenerator)")
    tok = vllm.tokenizer if vllm is not None else tokenizer
    msgs, inline = split_documents(messages)
    passages = [*parse_documents(documents), *inline]

    def write(prompt_ids: list[list[int]], opts: GenerationOptions, prof: Profile | None) -> list[list[int]]:
        if vllm is not None:
            return [list(o.token_ids) for o in vllm.generate(prompt_ids, opts, prof)]
        procs = (
            [] if prof is None else [processor_from_profile(prof, tok, max_new_tokens=opts.max_new_tokens, model=model)]
        )
        return sample_ids(model, tok, prompt_ids, opts, procs)

    def draft(prompts: list[str], max_tokens: int) -> list[str]:
        ids = [chat_ids(tok, [{"role": "user", "content": p}]) for p in prompts]
        opts = DRAFT_OPTIONS.replace(max_new_tokens=max_tokens, seed=options.seed)
        return [tok.decode(row, skip_special_tokens=True) for row in write(ids, opts, None)]

    prepared = prepare(msgs, passages, profile, tokenizer=tok, encoder=encoder, draft=draft)
    lead = lead_sentence(prepared.profile, raw=False)  # the profile's topic sentence, as a system message
    pull = reading_profile(prepared.profile, raw=False)  # the pull while the sentence is read (its KL budget)
    ids = write([chat_ids(tok, lead_messages(prepared.messages, lead))], options, pull)[0]
    text = tok.decode(ids, skip_special_tokens=True)
    report = dict(prepared.report)
    if prepared.stages:
        report["stages"] = stage_report(prepared.stages, text)
    return Answer(text, ids, prepared, report)

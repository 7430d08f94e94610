"""The embedded transformers backend: one ``model.generate`` call per batch of rows.

A batch may mix profiles, token budgets and sampling settings, and still runs as one left-padded call:

- :class:`GroupedGravityLogitsProcessor` groups the rows by (profile, budget) and hands each group's rows to
  that profile's own :class:`~narrative_gravity.engines.hf.NarrativeGravityLogitsProcessor` (so controllers,
  continuations, pruning and traces work exactly as in ``ngrav generate``, and the math stays in
  :func:`~narrative_gravity.gravity.tilt.apply_gravity`). One loop iteration per *group*, not per row.
- Rows with a ``response_format`` are constrained first by
  :class:`~narrative_gravity.server.grammar.GrammarLogitsProcessor` (a JSON-schema grammar per row, llguidance),
  so that gravity pulls, and its thermostat measures, the distribution the grammar allows.
- :class:`RowSamplerLogitsProcessor` samples each row with its own temperature, top-k, top-p and seeded
  generator, and leaves a single finite logit, so ``generate`` runs greedily and picks exactly that token. A
  request's sample therefore does not depend on which other requests share its batch.
- :class:`RowStoppingCriteria` stops each row at its own budget, or once the server cancels it (client gone,
  stop string seen).
- :class:`StepStreamer` hands every step's new token ids to the scheduler, and, for rows that asked for them
  (``row.trace``), each step's λ, entropy, narrative mass before and after the pull and KL, read from a
  :class:`StreamedTrace` (one small host copy per step, only while such a row runs).

>>> import torch
>>> from narrative_gravity.engines.options import GenerationOptions
>>> sampler = RowSamplerLogitsProcessor([GenerationOptions(temperature=0.0), GenerationOptions(top_k=0, seed=1)])
>>> out = sampler(torch.zeros(2, 1, dtype=torch.long), torch.tensor([[0.0, 3.0, 1.0], [0.0, 0.0, 0.0]]))
>>> out[0].tolist(), int(torch.isfinite(out[1]).sum())
([0.0, 3.0, 1.0], 1)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ...engines.hf import processor_from_profile
from ...engines.hf_generate import profile_head_plan, shortlist_json
from ...engines.options import GenerationOptions
from ...engines.prompts import eos_token_ids, left_pad
from ...engines.shortlist import shortlist_head
from ...errors import ConfigurationError
from ...gravity.thermo import METRICS, Measurement, Trace
from ...models import DEFAULT_MODEL, load_model
from ...profiles.build import field_from_profile
from ...profiles.schema import Profile
from ..grammar import GrammarLogitsProcessor, GuidanceGrammars
from ..structured import ResponseFormat
from .base import GenerationRow, RowStats, TokenCallback, TokenizerText, TokenStats

__all__ = [
    "GroupedGravityLogitsProcessor",
    "HFBackend",
    "RowSamplerLogitsProcessor",
    "RowStoppingCriteria",
    "StepStreamer",
    "StreamedTrace",
]

log = logging.getLogger("narrative_gravity.server")

_PREPARE_TOKENS = 64  # the token budget of the trial processor that prepare() builds


class GroupedGravityLogitsProcessor(LogitsProcessor):
    """Apply a different gravity processor to each group of rows of one batch.

    Args:
        groups: ``(rows, processor)`` pairs; ``rows`` is a ``LongTensor`` of batch row indices. Rows in no group
            are returned unchanged.
    """

    def __init__(self, groups: Sequence[tuple[torch.Tensor, Any]]) -> None:
        self.groups = list(groups)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.groups:
            return scores
        if len(self.groups) == 1 and self.groups[0][0].numel() == scores.shape[0]:
            return self.groups[0][1](input_ids, scores)  # the whole batch shares one profile
        out = scores.clone()
        for rows, processor in self.groups:
            if rows.device != scores.device:
                rows = rows.to(scores.device)
            out[rows] = processor(input_ids[rows], scores[rows])
        return out


class RowSamplerLogitsProcessor(LogitsProcessor):
    """Sample each row with its own settings; greedy rows pass through untouched.

    A sampled row comes back as ``-inf`` everywhere but its chosen token (``0``), so ``generate`` must run
    with ``do_sample=False``. Top-k, top-p and temperature are applied in that order, as transformers does.
    """

    def __init__(self, samplings: Sequence[GenerationOptions], device: torch.device | str = "cpu") -> None:
        self.rows = [i for i, s in enumerate(samplings) if not s.greedy]
        picked = [samplings[i] for i in self.rows]
        self.temperature = torch.tensor([s.temperature for s in picked], dtype=torch.float32, device=device)
        self.top_p = torch.tensor([s.top_p for s in picked], dtype=torch.float32, device=device)
        self.top_k = [s.top_k for s in picked]
        self.generators = [torch.Generator(device=device).manual_seed(s.seed) for s in picked]
        self.index = torch.tensor(self.rows, dtype=torch.long, device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.rows:
            return scores
        s = scores[self.index].float() / self.temperature[:, None]
        vocab = s.shape[-1]
        if any(self.top_k):
            k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in self.top_k], device=s.device)
            top = torch.topk(s, int(k.max()), dim=-1).values
            kth = top.gather(1, (k - 1)[:, None])
            s = s.masked_fill(s < kth, float("-inf"))
        if bool((self.top_p < 1.0).any()):
            sorted_s, order = torch.sort(s, descending=True, dim=-1)
            probs = sorted_s.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the better tokens; the first is always kept
            drop_sorted = before > self.top_p[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            s = s.masked_fill(drop, float("-inf"))
        probs = s.softmax(dim=-1)
        picks = torch.stack(
            [torch.multinomial(probs[j], 1, generator=g) for j, g in enumerate(self.generators)]
        ).reshape(-1)
        out = scores.clone()
        out[self.index] = float("-inf")
        out[self.index, picks] = 0.0
        return out


class RowStoppingCriteria(StoppingCriteria):
    """Stop each row after its own number of new tokens, or once ``row.cancelled`` turns true."""

    def __init__(self, rows: Sequence[GenerationRow], prompt_width: int, device: torch.device | str = "cpu") -> None:
        self.rows = list(rows)
        self.prompt_width = prompt_width
        self.budget = torch.tensor([r.max_tokens for r in rows], dtype=torch.long, device=device)
        self.stopped_at = [0] * len(rows)

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        step = input_ids.shape[-1] - self.prompt_width
        cancelled = [r.cancelled for r in self.rows]
        for i, c in enumerate(cancelled):
            if c and not self.stopped_at[i]:
                self.stopped_at[i] = step
        done = self.budget <= step
        if any(cancelled):
            done = done | torch.tensor(cancelled, dtype=torch.bool, device=done.device)
        return done


@dataclass
class StreamedTrace(Trace):
    """A :class:`~narrative_gravity.gravity.thermo.Trace` that also keeps its latest step (``[rows, 5]``) for streaming.

    >>> from narrative_gravity.gravity.thermo import measure
    >>> t = StreamedTrace()
    >>> t.record(measure(torch.zeros(1, 3), torch.tensor([1.0, 0, 0]), torch.tensor([2.0])))
    >>> len(t), t.latest.shape
    (1, torch.Size([1, 5]))
    """

    latest: torch.Tensor | None = None

    def record(self, m: Measurement) -> None:
        super().record(m)
        self.latest = m.stack().detach()

    def reset(self) -> None:
        super().reset()
        self.latest = None


class StepStreamer(BaseStreamer):
    """A ``generate`` streamer that passes each step's new token ids (one per row) to ``on_tokens``.

    With ``stats``, each call also passes what ``stats()`` returns: one :data:`TokenStats` or ``None`` per row.
    """

    def __init__(self, on_tokens: TokenCallback, stats: Callable[[], list[TokenStats | None]] | None = None) -> None:
        self.on_tokens = on_tokens
        self.stats = stats
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first puts the prompt ids
            self._prompt_seen = True
            return
        tokens = value.reshape(-1).tolist()
        if self.stats is None:
            self.on_tokens(tokens)
        else:
            self.on_tokens(tokens, self.stats())

    def end(self) -> None:
        pass


class HFBackend(TokenizerText):
    """The embedded transformers engine on one model (see the module doc for how a batch is run)."""

    name = "hf"
    token_stats = True  # streams per-token λ, entropy, mass and KL for rows that ask (see StepStreamer)

    def __init__(self, model: Any, tokenizer: Any, *, model_id: str, max_context: int | None = None) -> None:
        if not model_id:
            raise ConfigurationError("`model_id` is empty; give the name clients send as `model`")
        self.model = model
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.device = next(model.parameters()).device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_id is None:
            raise ConfigurationError("the tokenizer has neither a pad nor an end-of-sequence token; set one")
        self.eos_ids = frozenset(eos_token_ids(model, tokenizer))
        positions = getattr(model.config, "max_position_embeddings", None)
        self.max_context = int(max_context or positions or 2048)
        self.vocab_size = int(getattr(model.config, "vocab_size", None) or len(tokenizer))
        self._prepare_lock = threading.Lock()
        self._grammars: GuidanceGrammars | None = None
        self._grammars_lock = threading.Lock()

    @classmethod
    def load(cls, name: str | os.PathLike[str] | None = None, *, device: str = "cpu") -> HFBackend:
        """Load a model the way the other commands do (``--model``: a name, a HF folder or a ``.gguf`` file)."""
        model, tokenizer = load_model(name, device=device)
        return cls(model, tokenizer, model_id=str(name) if name is not None else DEFAULT_MODEL)

    # ------------------------------------------------------------------------------------------- gravity

    def prepare(self, profile: Profile) -> None:
        """Build the profile's field (cached) and a processor on it, so that whatever a batch would build for
        this profile has been built once already and any error surfaces here, before the rows are queued."""
        # One build at a time: requests that bring the same new profile together wait for one build, not N.
        with self._prepare_lock:
            field_from_profile(profile, self.tokenizer, model=self.model)
            processor_from_profile(profile, self.tokenizer, max_new_tokens=_PREPARE_TOKENS, model=self.model)
            profile_head_plan(self.model, self.tokenizer, profile)  # a bad shortlist file fails here

    def prepare_format(self, fmt: ResponseFormat) -> None:
        """Compile ``fmt``'s grammar (cached), so that a schema llguidance cannot compile fails its request here."""
        self.grammars().grammar(fmt)

    def grammars(self) -> GuidanceGrammars:
        """The llguidance grammars of this model's tokenizer (built on the first structured request)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GuidanceGrammars(self.tokenizer, vocab_size=self.vocab_size, eos_ids=self.eos_ids)
            return self._grammars

    # ------------------------------------------------------------------------------------------- generation

    def generate(self, rows: Sequence[GenerationRow], on_tokens: TokenCallback) -> list[RowStats]:
        if not rows:
            return []
        ids, mask = left_pad([r.prompt_ids for r in rows], self.pad_id)
        width = ids.shape[1]
        groups: dict[tuple[str, int], list[int]] = {}
        for i, row in enumerate(rows):
            if row.gravity is not None:
                groups.setdefault((row.gravity.key, row.max_tokens), []).append(i)
        traced: list[tuple[list[int], StreamedTrace]] = []
        pairs = []
        for (_, budget), members in groups.items():
            trace = StreamedTrace()
            processor = processor_from_profile(
                rows[members[0]].gravity.profile,
                self.tokenizer,
                max_new_tokens=budget,
                trace=trace,
                model=self.model,
                inplace=True,  # generate's own copy, or the group's gathered rows
            )
            pairs.append((torch.tensor(members, dtype=torch.long, device=self.device), processor))
            traced.append((members, trace))
        processors = LogitsProcessorList()
        formats = [getattr(r, "response_format", None) for r in rows]
        if any(f is not None for f in formats):  # the grammar first: gravity pulls what it allows
            processors.append(GrammarLogitsProcessor(self.grammars(), formats, width))
        if pairs:
            processors.append(GroupedGravityLogitsProcessor(pairs))
        if any(not r.options.greedy for r in rows):
            processors.append(RowSamplerLogitsProcessor([r.options for r in rows], device=self.device))
        stops = RowStoppingCriteria(rows, width, device=self.device)
        # The shortlist head, when every row's profile asks for it (a row without one needs the full head).
        head = None
        if all(r.gravity is not None for r in rows):
            head = profile_head_plan(self.model, self.tokenizer, [r.gravity.profile for r in rows])
        t0 = time.perf_counter()
        with torch.inference_mode(), shortlist_head(self.model, head) as short:
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([stops]),
                streamer=StepStreamer(on_tokens, self._step_stats(rows, traced)),
                max_new_tokens=max(r.max_tokens for r in rows),
                do_sample=False,
                top_k=None,
                top_p=None,
                temperature=None,
                pad_token_id=self.pad_id,
            )
        gen = out[:, width:].cpu().tolist()
        lengths = [self._length(row, r.max_tokens, s) for row, r, s in zip(gen, rows, stops.stopped_at)]
        log.debug("batch of %d rows: %d steps in %.3f s", len(rows), len(gen[0]), time.perf_counter() - t0)
        cuts = short.cut_masses(lengths) if short is not None else None
        heads = [None if head is None else shortlist_json(head, cuts[i]) for i in range(len(rows))]
        stats = [RowStats(new_tokens=n, shortlist=h) for n, h in zip(lengths, heads)]
        for members, trace in traced:
            if not len(trace):
                continue
            for i, means in zip(members, trace.means([lengths[i] for i in members])):
                stats[i] = RowStats(
                    new_tokens=lengths[i],
                    narrative_mass=means["mass_after"],
                    narrative_mass_before=means["mass"],
                    kl=means["kl"],
                    strength=means["strength"],
                    entropy=means["entropy"],
                    shortlist=heads[i],
                )
        return stats

    @staticmethod
    def _step_stats(
        rows: Sequence[GenerationRow], traced: list[tuple[list[int], StreamedTrace]]
    ) -> Callable[[], list[TokenStats | None]] | None:
        """Reads each step's measurements for the rows that asked for them; ``None`` when no row did."""
        wanted = [
            (members, trace) for members, trace in traced if any(getattr(rows[i], "trace", False) for i in members)
        ]
        if not wanted:
            return None

        def read() -> list[TokenStats | None]:
            out: list[TokenStats | None] = [None] * len(rows)
            for members, trace in wanted:
                if trace.latest is None:
                    continue
                values = trace.latest.float().cpu().tolist()
                for j, i in enumerate(members):
                    if getattr(rows[i], "trace", False) and j < len(values):
                        out[i] = {name: round(v, 5) for name, v in zip(METRICS, values[j])}
            return out

        return read

    def _length(self, row: list[int], budget: int, stopped_at: int) -> int:
        n = min(len(row), budget, stopped_at or len(row))
        for i, tok in enumerate(row[:n]):
            if tok in self.eos_ids:
                return i + 1
        return n

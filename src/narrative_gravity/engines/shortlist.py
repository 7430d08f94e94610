"""A shortlist head for the transformers engine: logits only for the tokens a request may write.

For a large vocabulary the output head is most of a decode step (Gemma 3 270M: 262,144 rows of 640 numbers, next
to a body of about 100M multiply-adds). A profile with ``prune: {head: {shortlist: N}}`` computes the head only
for a shortlist of its rows:

- the ``N`` most frequent tokens of the model's frequency list (:class:`FrequencyList`: the tokens the model itself
  samples on a broad prompt set, ``ngrav shortlist build``; packaged for the shipped models), gathered once per
  model and kept (:func:`frequent_rows`);
- the request's narrative support (:func:`narrative_support`): the tokens its field pulls toward, its required
  words and its stage words;
- the special and stop tokens.

Every other logit is ``-inf`` (:class:`ShortlistHead`), so the sampler, the kernel and a user's own processors see
a normal ``[B, V]`` tensor and nothing else changes; those tokens are never written. With ``audit`` the full head
runs too on that share of the steps and records the probability mass outside the shortlist
(:attr:`ShortlistHead.audits`).

>>> import torch
>>> head = torch.nn.Linear(4, 6, bias=False)
>>> short = ShortlistHead(head, torch.tensor([0, 2, 5]))
>>> out = short(torch.randn(1, 1, 4))
>>> torch.isfinite(out).flatten().tolist()
[True, False, True, False, False, True]
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import math
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ConfigurationError, NarrativeGravityError, VocabularyError
from ..gravity.kernel import Program

__all__ = [
    "FORMAT",
    "PACKAGED_LISTS",
    "FrequencyList",
    "HeadPlan",
    "ShortlistHead",
    "frequent_rows",
    "head_plan",
    "load_frequency_list",
    "narrative_support",
    "packaged_list",
    "shortlist_head",
    "tokenizer_fingerprint",
]

FORMAT = "narrative-gravity shortlist 1"
PACKAGED_LISTS = {"smollm2": "smollm2.json.gz", "gemma3-270m": "gemma3-270m.json.gz"}
"""The frequency lists shipped in ``narrative_gravity/data/shortlists/``, by model name."""


# ------------------------------------------------------------------------------------------------ the list


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary (its size and every ``V // 4096``-th token), to tell lists apart."""
    size = len(tokenizer)
    ids = list(range(0, size, max(1, size // 4096)))
    tokens = tokenizer.convert_ids_to_tokens(ids)
    text = f"{size}\n" + "\n".join(str(t) for t in tokens)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class FrequencyList:
    """Token ids of one model, most frequent first, with what they were counted from.

    Args:
        ids: the ranked token ids (unique, in ``[0, vocab_size)``); at most the whole vocabulary.
        vocab_size: the size of the model's output head.
        fingerprint: :func:`tokenizer_fingerprint` of the tokenizer the ids belong to.
        model: the model's name, as ``--model`` gives it.
        counts: how often the model sampled each ranked token while the list was built (same order as ``ids``).
        meta: how the list was built (prompts, tokens, settings).
    """

    ids: np.ndarray
    vocab_size: int
    fingerprint: str
    model: str = ""
    counts: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"

    def __post_init__(self) -> None:
        ids = np.asarray(self.ids)
        where = f"shortlist file {self.source}"
        if ids.ndim != 1 or not ids.size or not np.issubdtype(ids.dtype, np.integer):
            raise ConfigurationError(f"{where}: `ids` has to be a non-empty list of token ids")
        if self.vocab_size < 1:
            raise ConfigurationError(f"{where}: `vocab_size` has to be a positive whole number, not {self.vocab_size}")
        bad = ids[(ids < 0) | (ids >= self.vocab_size)]
        if bad.size:
            raise VocabularyError(
                f"{where}: token ids {sorted(set(bad.tolist()))[:10]} are outside its vocabulary [0, {self.vocab_size}); "
                "the file is damaged or was edited by hand; build it again with `ngrav shortlist build`"
            )
        if np.unique(ids).size != ids.size:
            raise ConfigurationError(f"{where}: `ids` repeats token ids; build it again with `ngrav shortlist build`")
        object.__setattr__(self, "ids", ids.astype(np.int64))

    def check(self, tokenizer: Any, vocab_size: int) -> None:
        """Refuse a list made for another vocabulary than ``tokenizer``'s with a head of ``vocab_size`` rows."""
        fp = tokenizer_fingerprint(tokenizer)
        if self.vocab_size != vocab_size or self.fingerprint != fp:
            raise VocabularyError(
                f"shortlist file {self.source} was built for another vocabulary (model {self.model or '?'}, "
                f"{self.vocab_size} tokens, tokenizer {self.fingerprint}) than this model's ({vocab_size} tokens, "
                f"tokenizer {fp}); build one for it with `ngrav shortlist build --model ...` and name it in "
                "prune.head.file"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "vocab_size": self.vocab_size,
            "fingerprint": self.fingerprint,
            "meta": self.meta,
            "ids": self.ids.tolist(),
            "counts": None if self.counts is None else [int(c) for c in self.counts],
        }

    def save(self, path: str | Path) -> Path:
        """Write the list as JSON (gzip-compressed when the name ends in ``.gz``)."""
        p = Path(path)
        text = json.dumps(self.to_json(), separators=(",", ":"))
        if p.suffix == ".gz":
            p.write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
        else:
            p.write_text(text, encoding="utf-8")
        return p


_LIST_CACHE: dict[str, FrequencyList] = {}


def load_frequency_list(path: str | Path) -> FrequencyList:
    """Read a list written by :meth:`FrequencyList.save`; every problem is a clear error (cached per path)."""
    p = Path(path)
    key = str(p.resolve())
    if key in _LIST_CACHE:
        return _LIST_CACHE[key]
    if not p.is_file():
        raise ConfigurationError(
            f"shortlist file {str(p)!r} does not exist; build one with `ngrav shortlist build --model ... --output {p}`"
        )
    try:
        raw = p.read_bytes()
        data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"shortlist file {str(p)!r} is not a readable shortlist (JSON): {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigurationError(
            f"shortlist file {str(p)!r} is not a `{FORMAT}` file; build one with `ngrav shortlist build`"
        )
    try:
        ids = np.asarray(data["ids"])
        counts = data.get("counts")
        out = FrequencyList(
            ids=ids if ids.size else np.zeros(0, dtype=np.int64),
            vocab_size=int(data["vocab_size"]),
            fingerprint=str(data["fingerprint"]),
            model=str(data.get("model") or ""),
            counts=None if counts is None else np.asarray(counts, dtype=np.int64),
            meta=dict(data.get("meta") or {}),
            source=str(p),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, NarrativeGravityError):
            raise
        raise ConfigurationError(f"shortlist file {str(p)!r} lacks or garbles a key: {exc}") from None
    _LIST_CACHE[key] = out
    return out


def packaged_list(model: str) -> Path | None:
    """The frequency list shipped for a model name (``smollm2``, ``gemma3-270m``), else ``None``."""
    name = PACKAGED_LISTS.get(model)
    if name is None:
        return None
    return Path(str(resources.files("narrative_gravity") / "data" / "shortlists" / name))


def _list_for(tokenizer: Any, vocab_size: int, file: str | None) -> FrequencyList:
    if file is not None:
        freq = load_frequency_list(file)
        freq.check(tokenizer, vocab_size)
        return freq
    fp = tokenizer_fingerprint(tokenizer)
    for name in PACKAGED_LISTS:
        path = packaged_list(name)
        if path is not None and path.is_file():
            freq = load_frequency_list(path)
            if freq.fingerprint == fp and freq.vocab_size == vocab_size:
                return freq
    raise ConfigurationError(
        f"no packaged frequency list fits this model's vocabulary ({vocab_size} tokens, tokenizer {fp}); packaged "
        f"are {', '.join(PACKAGED_LISTS)}. Build one with `ngrav shortlist build --model ... --output LIST.json.gz` "
        "and name it in prune.head.file"
    )


# ------------------------------------------------------------------------------------------------ the rows


def narrative_support(program: Program) -> torch.Tensor:
    """The token ids a program pulls toward or requires: its field's positive tokens and continuations, its
    stages' fields and words, its required words' forms and stop tokens (sorted, unique, on the CPU)."""
    parts: list[torch.Tensor] = []
    fields = [program.field] if program.field is not None else []
    if program.stages is not None:
        fields += list(program.stages.fields)
        words = [t for stage in program.stages.words or () for forms in stage for f in forms for t in f]
        parts.append(torch.tensor(words, dtype=torch.long))
    for f in fields:
        parts.append(torch.nonzero(f.values.detach().cpu() > 0).flatten())
        if f.next_ids is not None:
            parts.append(f.next_ids.detach().cpu().long().flatten())
    req = program.requirement
    if req is not None:
        parts.append(torch.tensor([t for forms in req.forms for f in forms for t in f], dtype=torch.long))
        parts.append(torch.tensor(list(req.stops), dtype=torch.long))
    if not parts:
        return torch.zeros(0, dtype=torch.long)
    return torch.unique(torch.cat([p.long() for p in parts]))


def _head_of(model: Any) -> nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, ShortlistHead):
        head = head.head
    if not isinstance(head, nn.Linear):
        raise ConfigurationError(
            f"the shortlist head needs a model whose output head is a torch Linear layer, but "
            f"{type(model).__name__}'s is {type(head).__name__}; leave prune.head out for this model"
        )
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if cap is not None:
        raise ConfigurationError(
            f"{type(model).__name__} caps its logits (final_logit_softcapping={cap}), which would turn the "
            "shortlist's -inf into a finite value; leave prune.head out for this model"
        )
    return head


_ROWS_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)


def frequent_rows(head: nn.Module, freq: FrequencyList, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent ids of ``freq`` (sorted) and their rows of ``head``'s weight, gathered once per
    head and size and kept (a copy: ``size × hidden`` numbers)."""
    if size > freq.ids.size:
        raise ConfigurationError(
            f"prune.head.shortlist is {size}, but the frequency list {freq.source} ranks only {freq.ids.size} tokens; "
            f"lower it, or build a longer list with `ngrav shortlist build --keep {size}`"
        )
    per_head = _ROWS_CACHE.setdefault(head, {})
    key = (freq.source + freq.fingerprint, size)
    hit = per_head.get(key)
    if hit is None:
        weight = head.weight
        ids = torch.from_numpy(np.sort(freq.ids[:size])).to(weight.device)
        with torch.no_grad():
            hit = (ids, weight.detach().index_select(0, ids).contiguous())
        per_head[key] = hit
    return hit


@dataclass(frozen=True)
class HeadPlan:
    """What one ``generate`` call's head computes: the frequent part (shared), the extra ids of the requests.

    Args:
        frequent: the frequent ids (sorted) and their weight rows, from :func:`frequent_rows`.
        extra: the request's ids not among the frequent ones (support, special and stop tokens), sorted.
        audit: the share of steps on which the full head runs too (``0`` = never).
    """

    frequent: tuple[torch.Tensor, torch.Tensor]
    extra: torch.Tensor
    audit: float = 0.0

    @property
    def size(self) -> int:
        """How many tokens the head computes."""
        return int(self.frequent[0].numel() + self.extra.numel())

    def ids(self) -> torch.Tensor:
        """Every shortlisted id (sorted)."""
        return torch.sort(torch.cat([self.frequent[0], self.extra.to(self.frequent[0].device)])).values


def head_plan(
    model: Any,
    tokenizer: Any,
    *,
    shortlist: int,
    supports: Sequence[torch.Tensor] = (),
    special: Sequence[int] = (),
    audit: float = 0.0,
    file: str | None = None,
) -> HeadPlan:
    """The :class:`HeadPlan` of ``shortlist`` frequent tokens plus ``supports`` (one per request, from
    :func:`narrative_support`), ``special`` ids and the tokenizer's special tokens; ``file``: a frequency list
    (else the packaged list whose vocabulary fits the model)."""
    head = _head_of(model)
    vocab = head.weight.shape[0]
    freq = _list_for(tokenizer, vocab, file)
    frequent = frequent_rows(head, freq, shortlist)
    specials = {int(t) for t in [*special, *getattr(tokenizer, "all_special_ids", ())] if 0 <= int(t) < vocab}
    parts = [torch.tensor(sorted(specials), dtype=torch.long), *(s.cpu().long() for s in supports)]
    wanted = torch.unique(torch.cat(parts))
    wanted = wanted[(wanted >= 0) & (wanted < vocab)].to(frequent[0].device)
    extra = wanted[~torch.isin(wanted, frequent[0])]
    return HeadPlan(frequent=frequent, extra=extra, audit=float(audit))


# ------------------------------------------------------------------------------------------------ the head


class ShortlistHead(nn.Module):
    """An output head that computes only the rows ``ids`` of ``head`` and fills every other logit with ``-inf``.

    Args:
        head: the model's own head (a ``Linear``, tied to the embeddings or not); it is read, never changed.
        ids: the shortlisted ids; or give ``plan`` (a :class:`HeadPlan`) to reuse gathered weights.
        audit: the share of steps (calls) on which the full head runs too; each such step appends
            ``(step, mass outside the shortlist per row)`` to :attr:`audits`. Audited steps are spread evenly
            (the first, then every ``1 / audit``-th), so sampling is not disturbed.
    """

    def __init__(
        self, head: nn.Linear, ids: torch.Tensor | None = None, *, plan: HeadPlan | None = None, audit: float = 0.0
    ) -> None:
        super().__init__()
        self.head = head
        weight = head.weight
        if plan is None:
            if ids is None:
                raise ConfigurationError("give ShortlistHead either `ids` or `plan`")
            ids = torch.unique(ids.long()).to(weight.device)
            plan = HeadPlan(frequent=(ids, weight.detach().index_select(0, ids)), extra=ids[:0], audit=audit)
        self.plan = plan
        self.audit = float(plan.audit or audit)
        self.vocab_size = weight.shape[0]
        self.freq_ids, self.freq_weight = plan.frequent
        self.extra_ids = plan.extra.to(weight.device)
        self.extra_weight = weight.detach().index_select(0, self.extra_ids) if self.extra_ids.numel() else None
        bias = head.bias
        self.freq_bias = None if bias is None else bias.detach()[self.freq_ids]
        self.extra_bias = None if bias is None or self.extra_weight is None else bias.detach()[self.extra_ids]
        self.ids = plan.ids().to(weight.device)
        self.steps = 0
        self.audits: list[tuple[int, torch.Tensor]] = []

    @property
    def weight(self) -> torch.Tensor:  # code that reads ``get_output_embeddings().weight`` sees the full matrix
        return self.head.weight

    def _audited(self, step: int) -> bool:
        a = self.audit
        return a > 0 and math.floor(step * a + 1e-9) != math.floor((step - 1) * a + 1e-9)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden.new_full((*hidden.shape[:-1], self.vocab_size), float("-inf"))
        out.index_copy_(-1, self.freq_ids, nn.functional.linear(hidden, self.freq_weight, self.freq_bias))
        if self.extra_weight is not None:
            out.index_copy_(-1, self.extra_ids, nn.functional.linear(hidden, self.extra_weight, self.extra_bias))
        step = self.steps
        self.steps += 1
        if self._audited(step):
            full = self.head(hidden[..., -1, :]).float()
            total = torch.logsumexp(full, dim=-1)
            inside = torch.logsumexp(full.index_select(-1, self.ids), dim=-1)
            self.audits.append((step, (-torch.expm1(inside - total)).clamp_min(0).cpu()))
        return out

    def cut_masses(self, lengths: Sequence[int]) -> list[list[float]]:
        """Per row, the audited masses outside the shortlist over the steps that wrote one of its ``lengths``
        tokens (steps past a row's end are left out)."""
        out: list[list[float]] = [[] for _ in lengths]
        for step, masses in self.audits:
            for i, n in enumerate(lengths):
                if step < n and i < masses.shape[0]:
                    out[i].append(float(masses[i]))
        return out


@contextlib.contextmanager
def shortlist_head(model: Any, plan: HeadPlan | None) -> Iterator[ShortlistHead | None]:
    """Run ``model`` with a :class:`ShortlistHead` of ``plan`` in place of its output head, and put the head back
    afterwards; ``plan=None`` changes nothing (yields ``None``)."""
    if plan is None:
        yield None
        return
    head = _head_of(model)
    short = ShortlistHead(head, plan=plan)
    model.set_output_embeddings(short)
    try:
        yield short
    finally:
        model.set_output_embeddings(head)


def cut_summary(masses: Sequence[float]) -> dict[str, float]:
    """The mean and the 99th percentile of audited masses outside the shortlist (``{}`` without any).

    >>> cut_summary([0.0, 0.01, 0.02])["cut_mass_mean"]
    0.01
    """
    if not masses:
        return {}
    arr = np.asarray(masses, dtype=np.float64)
    return {
        "cut_mass_mean": round(float(arr.mean()), 6),
        "cut_mass_p99": round(float(np.percentile(arr, 99)), 6),
        "audited_steps": int(arr.size),
    }

"""Words that must appear: a pull that rises as the budget runs out, and a forced word when time is up.

A :class:`Requirement` holds, for one tokenizer, the words a text must contain before it ends: every
surface form of each word (to see when the text has written it), the forms written after a space (what
is pulled, and what is forced), and three small vocabulary tables: which tokens continue a word (*glue*),
which end a clause (*breaks*), and which end the text (*stops*). :class:`RequireTables` stacks the
requirements of every live program into tensors, and two functions do the per-step work for all rows at
once, each row at its own step, with its own budget and its own words:

- :func:`advance_required` marks the words a row has just finished writing. A word counts once its last
  piece is followed by a token that does not continue it (so ``planets`` is not ``planet``), and a form
  written without its space counts only where the token before it does not end inside a word (so
  ``delegitimacy`` is not ``legitimacy``); a word of a script written without spaces counts at once.
- :func:`pull_required` adds the rising pull ``strength · progress^curve`` to the first pieces of the words
  still missing (and ``strength`` to the next piece of a word being written), keeps the text from ending
  while a word is missing, and, once a row's remaining budget only just fits its missing words, forces
  them: every other token is masked. Forcing waits for a good moment while it can: within ``window``
  tokens of the deadline it starts right after a clause ends (``.``, ``,``, ``:``, a newline), within
  ``slack`` tokens when the model itself is about to start a new word, and at the last moment anyway.
  After a required word near the deadline, a token that would glue onto it (``planet`` + ``s``) is
  masked, so the word stands whole.

Nothing here synchronizes with the host: every decision is a tensor of booleans per row.

>>> import torch
>>> glue = torch.tensor([False, False, True, False, False])  # token 2 continues a word
>>> req = Requirement(words=("orbit",), forms=(((3,),),), starts=(((3,),),), boundary=(True,),
...                   glue=glue, breaks=torch.zeros(5, dtype=torch.bool), stops=(4,))
>>> tables = RequireTables.build([req], vocab=5)
>>> q, done = torch.tensor([0]), torch.zeros(1, 1, dtype=torch.bool)
>>> out = torch.zeros(1, 5)
>>> pull_required(out, tables, q, done, torch.tensor([[0]]), torch.tensor([9]), torch.tensor([10]))
>>> out.tolist()  # one token left: "orbit" is forced, and the text may not end (token 4)
[[-inf, -inf, -inf, 4.0, -inf]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import ConfigurationError
from .field import match_suffixes

__all__ = ["RequireTables", "Requirement", "advance_required", "pull_required"]


@dataclass(frozen=True)
class Requirement:
    """The words one profile requires, for one tokenizer (build it with
    :func:`narrative_gravity.fields.required.build_requirement`).

    Args:
        words: the words, as the profile gives them.
        forms: per word, every token-id sequence that writes it (after a space, glued, case variants).
        starts: per word, the forms that are pulled and forced (written after a space; every form for a
            script without spaces).
        boundary: per word, whether it counts only when the next token does not continue it.
        glue: ``[V]`` bool, tokens that continue the word before them.
        joins: ``[V]`` bool, tokens that end inside a word (their last character a letter or digit): a form
            that starts without a space does not count right after one; ``None``: no such check.
        breaks: ``[V]`` bool, tokens that end a clause or a line.
        sentence: ``[V]`` bool, tokens that end a sentence or a line (after them a word starts with a capital
            where it has a capitalized form); ``None``: none known.
        capital: per word, per start form, whether it starts with a capital letter; ``None``: none does.
        stops: ids that end the text (end of sequence, special tokens); masked while a word is missing.
        strength: the pull on a missing word's first piece at the deadline (λ, as for the field).
        curve: the pull is ``strength · progress^curve``, progress running from 0 to 1 at the deadline.
        force: force the missing words when the budget only just fits them (else only the pull).
        slack: tokens before the deadline from which a word is forced where the model starts a new word.
        window: tokens before the deadline from which a word is forced right after a clause ends.
        spread: spread the words over the budget: the ``k``-th of ``n`` words is due at ``(k + 1) / (n + 1)``
            of it (the pull rises toward that point, and from ``window`` tokens before it the word may be
            forced right after a clause ends), so that the text has room to follow each word; the last
            moment of the whole budget stays the hard deadline.
    """

    words: tuple[str, ...]
    forms: tuple[tuple[tuple[int, ...], ...], ...]
    starts: tuple[tuple[tuple[int, ...], ...], ...]
    boundary: tuple[bool, ...]
    glue: torch.Tensor
    breaks: torch.Tensor
    stops: tuple[int, ...] = ()
    sentence: torch.Tensor | None = None
    capital: tuple[tuple[bool, ...], ...] | None = None
    joins: torch.Tensor | None = None
    strength: float = 4.0
    curve: float = 2.0
    force: bool = True
    slack: int = 6
    window: int = 24
    spread: bool = False

    def __post_init__(self) -> None:
        n = len(self.words)
        if not n or len(self.forms) != n or len(self.starts) != n or len(self.boundary) != n:
            raise ConfigurationError("a Requirement needs at least one word, with forms, starts and boundary for each")
        for word, starts in zip(self.words, self.starts):
            if not starts or not all(starts):
                raise ConfigurationError(f"required word {word!r} has no token sequence that writes it")
        if self.glue.dim() != 1 or self.glue.shape != self.breaks.shape:
            raise ConfigurationError("`glue` and `breaks` have to be [V] bool tensors of the same vocabulary")
        if self.sentence is not None and self.sentence.shape != self.glue.shape:
            raise ConfigurationError("`sentence` has to be a [V] bool tensor of the same vocabulary as `glue`")
        if self.joins is not None and self.joins.shape != self.glue.shape:
            raise ConfigurationError("`joins` has to be a [V] bool tensor of the same vocabulary as `glue`")
        if self.capital is not None and [len(c) for c in self.capital] != [len(s) for s in self.starts]:
            raise ConfigurationError("`capital` needs one flag per start form of each word")
        if not (math.isfinite(self.strength) and 0.0 <= self.strength <= 50.0):
            raise ConfigurationError(f"`strength` has to be in [0, 50], but is {self.strength!r}")
        if not (math.isfinite(self.curve) and self.curve > 0.0):
            raise ConfigurationError(f"`curve` has to be a positive number, but is {self.curve!r}")
        if self.slack < 0 or self.window < self.slack:
            raise ConfigurationError(
                f"need 0 <= slack <= window (tokens before the deadline), but slack={self.slack}, window={self.window}"
            )

    @property
    def n_words(self) -> int:
        return len(self.words)

    @property
    def history(self) -> int:
        """How many of a row's last tokens the requirement reads (a form, the token before it and the one after)."""
        return max(len(f) for fs in self.forms for f in fs) + 2

    def lengths(self) -> list[int]:
        """Per word, the fewest tokens that write it (what forcing must leave room for)."""
        return [min(len(f) for f in s) for s in self.starts]


def _cat(parts: list[torch.Tensor], dtype: torch.dtype, device: torch.device, width: int = 0) -> torch.Tensor:
    if parts:
        return torch.cat(parts).to(device)
    return torch.zeros((0, width) if width else 0, dtype=dtype, device=device)


@dataclass
class RequireTables:
    """Every live requirement's words as tensors (row ``len(requirements)`` is "no requirement").

    Built by :meth:`build` when the set of programs changes; a step reads them with each row's
    requirement index ``q``.
    """

    has: torch.Tensor  # [Q + 1, W] bool: the word exists
    length: torch.Tensor  # [Q + 1, W] long: fewest tokens that write it
    boundary: torch.Tensor  # [Q + 1, W] bool: it counts only when the next token does not continue it
    det: torch.Tensor  # [P, L] every form, right-aligned, -1 padded
    det_q: torch.Tensor  # [P]
    det_w: torch.Tensor  # [P]
    det_len: torch.Tensor  # [P] tokens in each form
    det_glued: torch.Tensor  # [P] bool: the form starts without a space, so the token before it must end a word
    ids: torch.Tensor  # [U] the distinct ids pulled or forced
    st_pos: torch.Tensor  # [S] first pieces of the start forms, as positions in `ids`
    st_q: torch.Tensor
    st_w: torch.Tensor
    st_short: torch.Tensor  # [S] bool: the form is one of the word's shortest
    st_len: torch.Tensor  # [S] tokens in the form
    ct: torch.Tensor | None  # [E, L] prefixes of multi-token start forms
    ct_pos: torch.Tensor | None  # [E] the piece that continues each prefix, as a position in `ids`
    ct_q: torch.Tensor | None
    ct_w: torch.Tensor | None
    ct_rest: torch.Tensor | None  # [E] pieces left of the form once the prefix is written, the next included
    ct_len: torch.Tensor | None  # [E] tokens in each prefix
    glue: torch.Tensor  # [V + 1] bool; the last entry (no token) is False
    joins: torch.Tensor  # [V + 1] bool: tokens that end inside a word
    breaks: torch.Tensor  # [V + 1] bool
    sentence: torch.Tensor  # [V + 1] bool
    st_cap: torch.Tensor  # [S] bool: the start form begins with a capital
    has_cap: torch.Tensor  # [Q + 1, W] bool: the word has a start form with a capital
    stops: torch.Tensor  # [n] long
    strength: torch.Tensor  # [Q + 1] float32
    curve: torch.Tensor
    force: torch.Tensor  # [Q + 1] bool
    slack: torch.Tensor  # [Q + 1] long
    window: torch.Tensor
    spread: torch.Tensor  # [Q + 1] bool
    any_force: bool
    n_words: int

    @classmethod
    def build(
        cls, requirements: Sequence[Requirement], vocab: int, device: torch.device | str = "cpu"
    ) -> RequireTables:
        """Stack ``requirements`` for logits ``vocab`` wide (ids at or beyond it are left out)."""
        dev = torch.device(device)
        q_n = len(requirements)
        w_n = max([1, *(r.n_words for r in requirements)])
        has = torch.zeros(q_n + 1, w_n, dtype=torch.bool)
        length = torch.zeros(q_n + 1, w_n, dtype=torch.long)
        boundary = torch.zeros(q_n + 1, w_n, dtype=torch.bool)
        det: list[tuple[int, int, tuple[int, ...]]] = []
        det_glued: list[bool] = []
        starts: list[tuple[int, int, bool, int, int, bool]] = []
        has_cap = torch.zeros(q_n + 1, w_n, dtype=torch.bool)
        conts: list[tuple[int, int, tuple[int, ...], int, int]] = []
        for q, req in enumerate(requirements):
            for w, (forms, st) in enumerate(zip(req.forms, req.starts)):
                caps = dict(zip(st, req.capital[w] if req.capital is not None else [False] * len(st)))
                st = [f for f in st if all(0 <= t < vocab for t in f)]
                if not st:
                    continue  # the logits cannot write it: the word is not asked for here
                has[q, w] = True
                length[q, w] = min(len(f) for f in st)
                boundary[q, w] = req.boundary[w]
                kept = [f for f in forms if all(0 <= t < vocab for t in f)]
                det += [(q, w, f) for f in kept]
                # a boundary word's form that starts mid-word (no space) is checked on its left too
                det_glued += [req.boundary[w] and req.joins is not None and bool(req.glue[f[0]]) for f in kept]
                has_cap[q, w] = any(caps[f] for f in st)
                for f in dict.fromkeys(st):
                    starts.append((q, w, len(f) == int(length[q, w]), f[0], len(f), caps[f]))
                    conts += [(q, w, f[:k], f[k], len(f) - k) for k in range(1, len(f))]
        ids = sorted({st[3] for st in starts} | {c[3] for c in conts})
        pos = {t: i for i, t in enumerate(ids)}

        def right_aligned(seqs: list[tuple[int, ...]]) -> torch.Tensor:
            width = max(len(s) for s in seqs)
            return torch.tensor([[-1] * (width - len(s)) + list(s) for s in seqs], dtype=torch.long, device=dev)

        def col(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        glue = torch.zeros(vocab + 1, dtype=torch.bool)
        joins = torch.zeros(vocab + 1, dtype=torch.bool)
        breaks = torch.zeros(vocab + 1, dtype=torch.bool)
        sentence = torch.zeros(vocab + 1, dtype=torch.bool)
        stops: set[int] = set()
        for req in requirements:
            n = min(vocab, req.glue.shape[0])
            glue[:n] |= req.glue[:n].cpu()
            if req.joins is not None:
                joins[:n] |= req.joins[:n].cpu()
            breaks[:n] |= req.breaks[:n].cpu()
            if req.sentence is not None:
                sentence[:n] |= req.sentence[:n].cpu()
            stops.update(t for t in req.stops if 0 <= t < vocab)

        def per_q(values: list[float], dtype: torch.dtype, fill: float) -> torch.Tensor:
            return torch.tensor([*values, fill], dtype=dtype, device=dev)

        return cls(
            has=has.to(dev),
            length=length.to(dev),
            boundary=boundary.to(dev),
            det=right_aligned([f for *_, f in det]) if det else torch.zeros(0, 1, dtype=torch.long, device=dev),
            det_q=col([q for q, _, _ in det]),
            det_w=col([w for _, w, _ in det]),
            det_len=col([len(f) for *_, f in det]),
            det_glued=torch.tensor(det_glued, dtype=torch.bool, device=dev),
            ids=col(ids),
            st_pos=col([pos[st[3]] for st in starts]),
            st_q=col([s[0] for s in starts]),
            st_w=col([s[1] for s in starts]),
            st_short=torch.tensor([s[2] for s in starts], dtype=torch.bool, device=dev),
            st_len=col([s[4] for s in starts]),
            ct=right_aligned([c[2] for c in conts]) if conts else None,
            ct_pos=col([pos[c[3]] for c in conts]) if conts else None,
            ct_q=col([c[0] for c in conts]) if conts else None,
            ct_w=col([c[1] for c in conts]) if conts else None,
            ct_rest=col([c[4] for c in conts]) if conts else None,
            ct_len=col([len(c[2]) for c in conts]) if conts else None,
            glue=glue.to(dev),
            joins=joins.to(dev),
            breaks=breaks.to(dev),
            sentence=sentence.to(dev),
            st_cap=torch.tensor([s[5] for s in starts], dtype=torch.bool, device=dev),
            has_cap=has_cap.to(dev),
            stops=col(sorted(stops)),
            strength=per_q([r.strength for r in requirements], torch.float32, 0.0),
            curve=per_q([r.curve for r in requirements], torch.float32, 1.0),
            force=per_q([r.force for r in requirements], torch.bool, False),
            slack=per_q([r.slack for r in requirements], torch.long, 0),
            window=per_q([r.window for r in requirements], torch.long, 0),
            spread=per_q([r.spread for r in requirements], torch.bool, False),
            any_force=any(r.force for r in requirements),
            n_words=w_n,
        )

    def hits(self, recent: torch.Tensor, q: torch.Tensor, generated: torch.Tensor) -> torch.Tensor:
        """``[B, W]``: the words of each row's requirement that its last tokens ``recent [B, L]`` end with, in
        its generated text (the last ``generated [B]`` of them; a word in the prompt does not count)."""
        b = recent.shape[0]
        out = torch.zeros(b, self.n_words, dtype=torch.float32, device=recent.device)
        if self.det_q.numel():
            match = match_suffixes(recent, self.det) & (self.det_q[None] == q[:, None])  # [B, P]
            match &= self.det_len[None] <= generated[:, None]
            # the token before each form (none when the form fills ``recent``): inside a word, a glued form
            # is the end of a longer word
            if recent.shape[1]:
                before = recent.shape[1] - 1 - self.det_len  # [P]
                prev = recent[:, before.clamp(min=0)]  # [B, P]
                inside = self.token_flags(self.joins, prev) & (before >= 0)[None]
                match &= ~(inside & self.det_glued[None])
            out.scatter_add_(1, self.det_w[None].expand(b, -1), match.float())
        return out > 0

    def token_flags(self, table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``table`` read at ``tokens`` (``NO_TOKEN`` and ids outside the vocabulary read False)."""
        # two operations: a negative id (NO_TOKEN) is clamped to -1 and an id past the vocabulary to the last
        # index, so both read the last entry, the table's False pad
        return table[tokens.clamp(-1, table.shape[0] - 1)]


def advance_required(
    done: torch.Tensor, tables: RequireTables, q: torch.Tensor, recent: torch.Tensor, step: torch.Tensor
) -> torch.Tensor:
    """The words each row has written once its newest token (the last column of ``recent [B, L]``) is in.

    ``done [B, W]`` is what the rows had written before, ``step [B]`` how many tokens they have generated
    (the newest included); returns the new ``done``.
    """
    newest = recent[:, -1]
    before = tables.hits(recent[:, :-1], q, step - 1)  # a form ended just before the newest token
    now = tables.hits(recent, q, step)
    bounded = tables.boundary[q]
    ends = ~tables.token_flags(tables.glue, newest)
    return done | (before & bounded & ends[:, None]) | (now & ~bounded)


def pull_required(
    out: torch.Tensor,
    tables: RequireTables,
    q: torch.Tensor,
    done: torch.Tensor,
    recent: torch.Tensor,
    step: torch.Tensor,
    budget: torch.Tensor,
) -> None:
    """Pull, guard and (when due) force the missing words of every row, in place on ``out [B, V]``.

    ``q [B]`` is each row's requirement (``len(requirements)`` for none), ``done [B, W]`` the words it has
    written, ``recent [B, L]`` its last tokens, ``step [B]`` the tokens it has generated and ``budget [B]``
    its token budget (0: unknown, so nothing is forced and the pull stays at half strength).
    """
    b, vocab = out.shape
    neg = float("-inf")
    # a word just written whose next token decides whether it counts
    just = tables.hits(recent, q, step) & tables.boundary[q] & ~done
    alive = tables.has[q] & ~done & ~just
    missing = alive.any(dim=-1)
    has_budget = budget > 0
    left = torch.where(has_budget, budget - step, 2**40)  # tokens left, this one included
    st_w = tables.st_w[None].expand(b, -1)
    st_on = (tables.st_q[None] == q[:, None]) & alive.gather(1, st_w)  # [B, S]
    length = tables.length[q]  # [B, W] tokens a missing word still needs
    ct_on = ct_fit = None
    if tables.ct is not None:
        ct_w = tables.ct_w[None].expand(b, -1)
        ct_on = match_suffixes(recent, tables.ct) & (tables.ct_q[None] == q[:, None])
        ct_on &= tables.ct_len[None] <= step[:, None]  # the prefix was generated, not read in the prompt
        ct_on &= alive.gather(1, ct_w)  # [B, E]: the next piece of a word in writing
        far = 2**40
        rest = torch.full_like(length, far).scatter_reduce_(
            1, ct_w, torch.where(ct_on, tables.ct_rest[None], far), "amin"
        )
        length = torch.minimum(length, rest)
    need = (alive * length).sum(dim=-1)
    lead = left - need  # tokens to spare once the missing words are written
    # a form fits when it, and the shortest forms of the other missing words, fit in what is left
    # after a sentence ends, a word that has a capitalized form starts with it
    after_sentence = tables.token_flags(tables.sentence, recent[:, -1])
    lower_after_end = after_sentence[:, None] & tables.has_cap[q].gather(1, st_w) & ~tables.st_cap[None]
    st_on = st_on & ~lower_after_end
    st_fit = st_on & (tables.st_len[None] + need[:, None] - length.gather(1, st_w) <= left[:, None])
    fallback = st_on & tables.st_short[None]  # nothing fits any more: the shortest forms
    st_use = torch.where(st_fit.any(dim=-1, keepdim=True), st_fit, fallback)
    mid = torch.zeros(b, dtype=torch.bool, device=out.device)
    if ct_on is not None:
        ct_fit = ct_on & (tables.ct_rest[None] + need[:, None] - length.gather(1, ct_w) <= left[:, None])
        mid = ct_fit.any(dim=-1)
    # spread: the k-th of n words is due at (k + 1) / (n + 1) of the budget, and the pull rises toward that point
    asked = tables.has[q]
    n_words = asked.sum(dim=-1)
    written = (asked & (done | just)).sum(dim=-1)
    soft_end = torch.div(budget * (written + 1), n_words + 1, rounding_mode="floor")
    shortest = torch.where(alive, length, 2**40).min(dim=-1).values
    spread = tables.spread[q]
    soft_lead = torch.where(spread & missing, soft_end - step - shortest, 2**40)
    end = torch.where(spread, soft_end - shortest, budget - need) - tables.slack[q]
    progress = torch.where(has_budget, (step.to(torch.float32) / end.clamp_min(1)).clamp(0.0, 1.0), 0.5)
    lam = tables.strength[q] * progress.pow(tables.curve[q])  # [B]

    n_ids = tables.ids.numel()
    pull = torch.zeros(b, n_ids, dtype=out.dtype, device=out.device)
    pull.index_add_(1, tables.st_pos, (st_use * lam[:, None]).to(out.dtype))
    if ct_fit is not None:
        pull.index_add_(1, tables.ct_pos, (ct_fit * tables.strength[q][:, None]).to(out.dtype))
    values = out.index_select(1, tables.ids)  # [B, U]
    pulled = values + pull

    if tables.any_force:
        force = tables.force[q] & has_budget
        top = out.argmax(dim=-1)
        starts_word = ~tables.token_flags(tables.glue, top)
        after_break = tables.token_flags(tables.breaks, recent[:, -1])
        window = tables.window[q]
        near = torch.minimum(lead, soft_lead) <= window
        due = missing & force & ((lead <= 1) | ((lead <= tables.slack[q]) & starts_word) | (near & after_break))
        allow = torch.zeros(b, n_ids, dtype=torch.float32, device=out.device)
        allow.index_add_(1, tables.st_pos, (st_use & ~mid[:, None]).float())
        if ct_fit is not None:
            due = due | (mid & force & near)
            allow.index_add_(1, tables.ct_pos, ct_fit.float())
        allowed = allow > 0
        due = due & (allowed & torch.isfinite(values)).any(dim=-1)  # never force a row into nothing
        out.masked_fill_(due[:, None], neg)
        pulled = torch.where(due[:, None] & ~allowed, neg, pulled)
        # a required word near its deadline stands whole: no token may glue onto it
        seal = just.any(dim=-1) & force & near
        glue = tables.glue[:vocab]
        sealed = seal[:, None] & glue[None]
        keeps = (torch.isfinite(out) & ~sealed).any(dim=-1, keepdim=True)
        out.masked_fill_(sealed & keeps, neg)
        pulled = torch.where(sealed.index_select(1, tables.ids) & keeps, neg, pulled)
    out.index_copy_(1, tables.ids, pulled)
    if tables.stops.numel():
        stop_vals = out.index_select(1, tables.stops)
        others = torch.isfinite(out).sum(dim=-1) > torch.isfinite(stop_vals).sum(dim=-1)
        block = missing & others
        out.index_copy_(1, tables.stops, torch.where(block[:, None], neg, stop_vals))

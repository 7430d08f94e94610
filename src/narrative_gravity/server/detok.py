"""Incremental detokenization with stop strings: the text of one choice, released piece by piece.

Streamed and non-streamed responses both go through :class:`ChoiceText`, so their texts are equal by
construction. Each new token decodes a short window (the previous piece plus the new tokens); text that ends
in an incomplete UTF-8 character waits for the next token, and with stop strings the last ``len(stop) - 1``
characters are held back until it is clear they do not start a stop string.

>>> pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 9: ""}
>>> text = ChoiceText(lambda ids: "".join(pieces[i] for i in ids), eos_ids={9}, max_tokens=10, stop=("wor",))
>>> [text.push(t) for t in (1, 2, 3)], text.finish_reason, text.text
(['H', 'el', 'lo '], 'stop', 'Hello ')
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

__all__ = ["ChoiceText"]


class ChoiceText:
    """The text of one choice as tokens arrive.

    Args:
        decode: token ids to text (special tokens skipped).
        eos_ids: end-of-sequence ids; one ends the choice with ``finish_reason="stop"`` and adds no text.
        max_tokens: the choice ends with ``"length"`` after this many tokens.
        stop: stop strings; the first one seen ends the choice with ``"stop"`` and is not part of the text.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        *,
        eos_ids: Collection[int],
        max_tokens: int,
        stop: Sequence[str] = (),
    ) -> None:
        self._decode = decode
        self._eos = eos_ids
        self._max_tokens = max_tokens
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # window start: one piece of context before the unread tokens
        self._read = 0  # tokens already turned into text
        self._pending = ""  # decoded but not yet released (may be the start of a stop string)
        self.text = ""  # released so far
        self.n_tokens = 0
        self.finish_reason: str | None = None

    def push(self, token: int) -> str:
        """Add one generated token; returns the text released by it (often ``""``)."""
        if self.finish_reason is not None:
            return ""
        self.n_tokens += 1
        if token in self._eos:
            return self._finish("stop")
        self._ids.append(token)
        self._pending += self._step(force=False)
        released = self._release()
        if self.finish_reason is None and self.n_tokens >= self._max_tokens:
            released += self._finish("length")
        return released

    def end(self) -> str:
        """Generation ended without an end-of-sequence token: flush what is held back (``"length"``)."""
        if self.finish_reason is not None:
            return ""
        return self._finish("length")

    def _step(self, *, force: bool) -> str:
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if not force and (len(after) <= len(before) or after.endswith("\ufffd")):
            return ""  # an incomplete character, or a token that adds no text yet
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _release(self, *, final: bool = False) -> str:
        if self._stop:
            cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
            if cut >= 0:
                released = self._pending[:cut]
                self._pending = ""
                self.text += released
                self.finish_reason = "stop"
                return released
        keep = 0 if final else self._hold
        n = max(0, len(self._pending) - keep)
        released, self._pending = self._pending[:n], self._pending[n:]
        self.text += released
        return released

    def _finish(self, reason: str) -> str:
        self._pending += self._step(force=True)
        released = self._release(final=True)
        if self.finish_reason is None:
            self.finish_reason = reason
        return released

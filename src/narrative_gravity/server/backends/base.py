"""The engine interface of the server: what a backend must do so that the scheduler can batch on it.

A backend turns text into token ids and back, prepares a profile's field ahead of time, and runs a *batch* of
rows in one blocking call, reporting every decoding step's new token ids through a callback. The embedded
transformers backend is :class:`~narrative_gravity.server.backends.hf.HFBackend`; the vLLM backend is
:class:`~narrative_gravity.server.backends.vllm.VLLMBackend`.

A backend whose engine admits rows into its running batch at any step is also a :class:`ContinuousBackend`:
the server then submits each request's rows to it as they arrive instead of collecting batches
(:class:`~narrative_gravity.server.continuous.ContinuousScheduler`).

A row's budget and sampling are a :class:`~narrative_gravity.engines.options.GenerationOptions` (``row.options``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...engines.prompts import chat_ids
from ...errors import ConfigurationError, VocabularyError

if TYPE_CHECKING:
    from ...engines.options import GenerationOptions
    from ...profiles.schema import Profile

__all__ = [
    "ENGINES",
    "Backend",
    "ContinuousBackend",
    "EventCallback",
    "GenerationRow",
    "ResolvedGravity",
    "RowStats",
    "TokenStats",
    "TokenizerText",
    "field_model_of",
]

ENGINES = ("hf", "vllm")
MEASURE_ONLY_SUFFIX = ":measure_only"


@dataclass(frozen=True)
class ResolvedGravity:
    """A request's gravity after resolution: the profile, where it came from, and a key that groups equal ones.

    ``label`` names it in metrics: the store name for named profiles, ``"inline"`` for inline mappings, with
    ``":measure_only"`` added for a profile that is measured but does not pull (``measure_only``).

    A named profile also has its ``arm`` (see :mod:`~narrative_gravity.profiles.rollout`: ``live``, ``pinned``,
    ``split:a``, ``split:b``, ``shadow``), and ``shadow`` says whether the request gets a shadow run too.
    """

    profile: Profile
    label: str
    key: str
    name: str | None = None
    version: int | None = None
    measure_only: bool = False
    arm: str | None = None
    shadow: bool = False

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"profile": self.label.removesuffix(MEASURE_ONLY_SUFFIX)}
        if self.version is not None:
            out["version"] = self.version
        if self.arm is not None:
            out["arm"] = self.arm
        if self.measure_only:
            out["measure_only"] = True
        return out


@dataclass(frozen=True)
class RowStats:
    """What a backend reports for a finished row: tokens generated and, with gravity, the trace means."""

    new_tokens: int
    narrative_mass: float | None = None
    narrative_mass_before: float | None = None
    kl: float | None = None
    strength: float | None = None
    entropy: float | None = None
    shortlist: dict[str, Any] | None = None  # the shortlist head's size and audited cut masses (prune.head)

    def gravity_json(self) -> dict[str, float]:
        if self.narrative_mass is None:
            return {}
        return {
            "narrative_mass": round(self.narrative_mass, 5),
            "narrative_mass_before": round(self.narrative_mass_before or 0.0, 5),
            "kl": round(self.kl or 0.0, 5),
            "strength": round(self.strength or 0.0, 5),
        }


class GenerationRow(Protocol):
    """One sequence of a batch, as a backend sees it. ``cancelled`` may turn true while the batch runs.

    ``trace`` (read with ``getattr(row, "trace", False)``): the request asked for per-token stats.
    ``response_format`` (read with ``getattr(row, "response_format", None)``): a
    :class:`~narrative_gravity.server.structured.ResponseFormat` the reply must match; a backend that can
    constrain replies also has ``prepare_format(fmt)``, which compiles it (and raises on a bad schema) before
    the row is queued.
    """

    prompt_ids: list[int]
    options: GenerationOptions
    gravity: ResolvedGravity | None
    cancelled: bool

    @property
    def max_tokens(self) -> int:
        """The row's budget, ``options.max_new_tokens``."""
        ...


TokenCallback = Callable[..., None]
"""Called from the generating thread once per decoding step with one new token id per row, in row order;
``None`` for a row that produced no token in that step (an engine that schedules rows unevenly, like vLLM).

A backend that measures each step may pass a second argument: one :data:`TokenStats` (or ``None``) per row,
in the same order. It should do so only for rows whose ``trace`` is true (a request that asked for per-token
stats); the stats are optional, and a backend without them calls ``on_tokens(tokens)`` alone."""

TokenStats = dict[str, float]
"""One step of one row, as measured by :mod:`narrative_gravity.gravity.thermo`: ``strength`` (λ), ``entropy``,
``mass``, ``mass_after`` and ``kl``."""


@runtime_checkable
class Backend(Protocol):
    """What the server needs from an engine."""

    name: str
    model_id: str
    max_context: int
    eos_ids: frozenset[int]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain prompt (with the tokenizer's special tokens, as for ``--raw``)."""
        ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a conversation through the chat template, ending with the assistant's turn."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids, special tokens skipped."""
        ...

    def check_ids(self, ids: Sequence[int]) -> None:
        """Raise ``ValueError`` naming ids outside the vocabulary."""
        ...

    def prepare(self, profile: Profile) -> None:
        """Build (and cache) whatever the profile needs before its first batch; may block, raises on bad profiles."""
        ...

    def generate(self, rows: Sequence[GenerationRow], on_tokens: TokenCallback) -> list[RowStats]:
        """Run all rows in one batch (blocking; called in a worker thread) and return one :class:`RowStats` each.

        A row stops at end-of-sequence, after ``max_tokens`` tokens, or soon after ``cancelled`` turns true.
        """
        ...


EventCallback = Callable[[list[tuple[GenerationRow, str, Any]]], None]
"""Called from the engine's thread once per engine step with that step's events for the rows of one submission,
in order: ``(row, "token", id)``, then ``(row, "end", RowStats)`` when the row finished (end of sequence,
``max_tokens``, or aborted after ``cancelled``), or ``(row, "error", exception)`` when it failed. Every row gets
exactly one ``end`` or ``error``."""


@runtime_checkable
class ContinuousBackend(Backend, Protocol):
    """A :class:`Backend` whose engine admits rows into its running batch between any two steps (vLLM).

    Its engine runs in a thread of its own; ``generate`` still works (it submits and waits).
    """

    def submit(self, rows: Sequence[GenerationRow], on_events: EventCallback) -> None:
        """Hand rows to the engine; they join the running batch at its next step. Thread-safe, returns at once.

        A row whose request the engine refuses gets an ``error`` event of its own; the other rows run on.
        """
        ...

    def in_flight(self) -> tuple[int, int]:
        """``(waiting, running)``: submitted rows not yet decoding, and rows in the running batch."""
        ...

    def collectors(self) -> list[Any]:
        """``prometheus_client`` collectors of the engine's own metrics, for ``/metrics``."""
        ...

    def close(self) -> None:
        """Abort every row (each gets its ``end``), stop the engine's thread and wait for it."""
        ...


class TokenizerText:
    """The text half of :class:`Backend` for engines with a Hugging Face tokenizer.

    Needs ``tokenizer``, ``model_id`` and ``vocab_size`` attributes.
    """

    tokenizer: Any
    model_id: str
    vocab_size: int

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigurationError(
                f"model {self.model_id!r} has no chat template; use /v1/completions for plain continuation"
            )

        return chat_ids(self.tokenizer, messages)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def check_ids(self, ids: Sequence[int]) -> None:
        bad = sorted({i for i in ids if not 0 <= i < self.vocab_size})
        if bad:
            raise VocabularyError(f"token ids {bad[:10]} are outside the vocabulary [0, {self.vocab_size})")


def field_model_of(backend: Any, profile: Profile) -> Any:
    """What ``profile``'s field reads of ``backend``'s model: the backend's ``model_for(profile)`` where it has one
    (vLLM: a copy from the checkpoint, loaded only for fields that read the model), else its ``model``."""
    model_for = getattr(backend, "model_for", None)
    return model_for(profile) if model_for is not None else getattr(backend, "model", None)

"""What generating one prompt gives back, on either engine.

>>> GenerationResult("Hi", " there", 1, 0.5, [42], seed=0, batch_seconds=1.0).to_json()["new_tokens"]
1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["GenerationResult"]


@dataclass
class GenerationResult:
    """One prompt's continuation. ``seconds`` is this prompt's share of its batch's wall time."""

    prompt: str
    text: str
    new_tokens: int
    seconds: float
    token_ids: list[int]
    seed: int
    batch_seconds: float
    trace: dict[str, list[float]] | None = None
    trace_means: dict[str, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt": self.prompt,
            "text": self.text,
            "new_tokens": self.new_tokens,
            "seconds": round(self.seconds, 4),
            "batch_seconds": round(self.batch_seconds, 4),
            "seed": self.seed,
        }
        if self.trace_means is not None:
            out["thermo"] = {k: round(v, 5) for k, v in self.trace_means.items()}
        out.update(self.extra)
        return out

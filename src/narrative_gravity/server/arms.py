"""Record what each arm of a stored profile did: one :class:`ArmRecord` per finished request or shadow run (a
client's own ``measure_only`` request is no arm of the profile and is not recorded), to
``/metrics`` (per profile and arm) and to the profile's arm log in the store (:mod:`~narrative_gravity.profiles.armlog`),
which ``ngrav profile report`` and ``GET /v1/profiles/NAME/report`` read.

What a record holds, per request (means over its rows, each row's trace means over its own tokens):

- ``narrative_mass``, ``narrative_mass_before``: the probability mass on tokens with a positive field value, after
  and before the pull (equal for a shadow, which does not pull); ``kl``: KL(p'‖p) per token, in nats;
- ``off_topic_rate``: the share of generated tokens (end-of-sequence tokens left out) whose field value was ≤ 0
  when chosen, against the profile's own field (the shadow: against the field of the version it shadows); that is
  1 − the narrative-token rate of :func:`~narrative_gravity.eval.text_metrics.narrative_token_rate`;
- ``completion_tokens``, ``latency_s`` (request to last token; a shadow: from its start), ``ttft_s``;
- ``of``: for a shadow, the id of the request it shadows (the pair the report compares).

>>> rec = ArmRecord(request="cmpl-1", profile="space", version=3, arm="live", completion_tokens=4, latency_s=0.2)
>>> rec.to_json()["arm"], "of" in rec.to_json()
('live', False)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from ..eval.text_metrics import token_field_values
from ..profiles.build import field_from_profile
from ..profiles.store import ProfileStore
from .backends.base import Backend, ResolvedGravity, RowStats, field_model_of
from .telemetry import Metrics

__all__ = ["ArmRecord", "ArmRecorder", "mean_stats"]

log = logging.getLogger("narrative_gravity.server")


@dataclass(frozen=True)
class ArmRecord:
    """One finished request (or shadow run) of one arm of a stored profile."""

    request: str
    profile: str
    version: int
    arm: str
    completion_tokens: int
    latency_s: float
    prompt_tokens: int = 0
    ttft_s: float | None = None
    narrative_mass: float | None = None
    narrative_mass_before: float | None = None
    kl: float | None = None
    entropy: float | None = None
    strength: float | None = None
    off_topic_rate: float | None = None
    endpoint: str | None = None
    of: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
        for key, value in asdict(self).items():
            if value is None:
                continue
            out[key] = round(value, 6) if isinstance(value, float) else value
        return out


def mean_stats(stats: Sequence[RowStats]) -> dict[str, float | None]:
    """Means over rows of the trace means (``None`` where no row was traced).

    >>> mean_stats([RowStats(3, 0.2, 0.1, 0.5, 1.0, 2.0), RowStats(2, 0.4, 0.3, 0.1, 1.0, 1.0)])["narrative_mass"]
    0.30000000000000004
    >>> mean_stats([RowStats(3)])["kl"] is None
    True
    """
    traced = [s for s in stats if s.narrative_mass is not None]
    out: dict[str, float | None] = {}
    for key in ("narrative_mass", "narrative_mass_before", "kl", "entropy", "strength"):
        values = [getattr(s, key) for s in traced if getattr(s, key) is not None]
        out[key] = sum(values) / len(values) if values else None
    return out


class ArmRecorder:
    """Writes :class:`ArmRecord` s to ``/metrics`` and to the store's arm logs. Blocking: call it in a thread."""

    def __init__(self, store: ProfileStore, metrics: Metrics, backend: Backend) -> None:
        self.store = store
        self.metrics = metrics
        self.backend = backend
        self._warned: set[str] = set()  # profiles whose arm log could not be written (said once each)

    def off_topic_rate(self, gravity: ResolvedGravity, rows: Sequence[tuple[list[int], list[int]]]) -> float | None:
        """Share of the rows' generated tokens (``(prompt ids, token ids)`` each) with a field value ≤ 0 under
        ``gravity``'s field; ``None`` when there are no tokens or the field cannot be built here."""

        eos = self.backend.eos_ids
        rows = [(p, [t for t in toks if t not in eos]) for p, toks in rows]
        if not any(toks for _, toks in rows):
            return None
        try:
            field = field_from_profile(
                gravity.profile,
                self.backend.tokenizer,  # type: ignore[attr-defined]
                model=field_model_of(self.backend, gravity.profile),
            )
        except Exception as exc:  # measured where possible; a request never fails for it
            log.debug("off-topic rate of %s not measured: %s", gravity.label, exc)
            return None
        off = total = 0
        for prompt_ids, token_ids in rows:
            if token_ids:
                values = token_field_values(field, prompt_ids, token_ids)
                off += int((values <= 0).sum())
                total += len(token_ids)
        return off / total

    def record(self, rec: ArmRecord) -> None:
        """Count ``rec`` in ``/metrics`` and append it to its profile's arm log (a write error is logged)."""
        self.metrics.arm_done(
            rec.profile,
            rec.arm,
            tokens=rec.completion_tokens,
            seconds=rec.latency_s,
            mass=rec.narrative_mass,
            mass_before=rec.narrative_mass_before,
            kl=rec.kl,
            off_topic=rec.off_topic_rate,
        )
        doc = {k: v for k, v in rec.to_json().items() if not (isinstance(v, float) and not math.isfinite(v))}
        try:
            self.store.arms_log(rec.profile).append(doc)
        except Exception as exc:  # telemetry must never fail or slow a request
            if rec.profile not in self._warned:
                self._warned.add(rec.profile)
                log.warning("cannot append to the arm log of %r (said once): %s", rec.profile, exc)

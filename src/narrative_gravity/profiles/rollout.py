"""Rollout settings of a stored profile, and which arm serves a request.

A profile name may carry a small rollout config next to its snapshots (see :mod:`~narrative_gravity.profiles.store`):

- ``shadow``: the share of the profile's requests that are *also* run without gravity, in the background, for
  comparison (``measure_only``: the same prompt and seed, the profile's field still measured). The client is
  answered by the normal arm; the shadow's text is never returned.
- ``split``: ``{"version": V, "share": s}`` sends the share ``s`` of the profile's requests to version ``V``
  (arm ``split:b``), the rest to the live version (arm ``split:a``). A split whose version has become the live
  version is inactive.

Arms: ``live`` (the live version, no split), ``split:a`` / ``split:b``, ``pinned`` (the request named a version,
which bypasses the split), and ``shadow``.

The choice is deterministic when a request has a routing key (its ``user``, else its ``seed``): a hash of the
profile name and the key, uniform in [0, 1), is compared with the share. Raising a share keeps every key that
was already on arm ``b`` there. Without a key the choice is random.

>>> cfg = RolloutConfig.from_mapping({"shadow": 0.05, "split": {"version": 4, "share": 0.1}})
>>> cfg.split.version, cfg.shadow
(4, 0.05)
>>> route(cfg, name="space", live=3, key="user:ada").arm in ("split:a", "split:b")
True
>>> route(cfg, name="space", live=3, key="user:ada") == route(cfg, name="space", live=3, key="user:ada")
True
>>> route(cfg, name="space", live=4, key="user:ada").arm   # version 4 is live now: the split is inactive
'live'
>>> RolloutConfig.from_mapping({"shadow": 5})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
narrative_gravity.profiles.rollout.RolloutError: rollout `shadow` (got 5): ... a share of requests, e.g. 0.05 for 5%
"""

from __future__ import annotations

import difflib
import hashlib
import random
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import ConfigurationError

__all__ = [
    "ARMS",
    "LIVE",
    "PINNED",
    "SHADOW",
    "SPLIT_A",
    "SPLIT_B",
    "RolloutConfig",
    "RolloutError",
    "Route",
    "SplitConfig",
    "route",
    "route_key",
    "unit_hash",
]

LIVE, PINNED, SPLIT_A, SPLIT_B, SHADOW = "live", "pinned", "split:a", "split:b", "shadow"
ARMS = (LIVE, PINNED, SPLIT_A, SPLIT_B, SHADOW)
"""Every arm name; metrics label only these, so the label set stays small."""

_SHARE_HINT = "a share of requests, e.g. 0.05 for 5%"


class RolloutError(ConfigurationError):
    """A rollout config is invalid, or does not fit the profile's versions."""


def _share(v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"write a number ({_SHARE_HINT})")
    return v


class SplitConfig(BaseModel):
    """Send ``share`` of the requests to ``version`` (arm ``split:b``); the rest get the live version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = Field(ge=1, description="the version arm b serves: usually a staged one")
    share: float = Field(gt=0.0, le=1.0, description="share of requests on arm b, in (0, 1]")

    @field_validator("version", mode="before")
    @classmethod
    def _whole(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("write a whole version number, e.g. 4")
        return v

    @field_validator("share", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        return _share(v)


class RolloutConfig(BaseModel):
    """The rollout of one profile name. The default (no shadow, no split) is the plain live version."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shadow: float = Field(0.0, ge=0.0, le=1.0, description="share of requests also run without gravity, in [0, 1]")
    split: SplitConfig | None = None

    @field_validator("shadow", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        return _share(v)

    @classmethod
    def from_mapping(cls, data: Any) -> RolloutConfig:
        """Validate a mapping; errors name the key, the value and the fix."""
        if not isinstance(data, dict):
            raise RolloutError(
                f"a rollout config must be a mapping, but is {type(data).__name__}; "
                'write e.g. {"shadow": 0.05} or {"split": {"version": 4, "share": 0.1}}'
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise RolloutError(_explain(exc)) from None

    @property
    def empty(self) -> bool:
        return self.shadow == 0.0 and self.split is None

    def check_versions(self, name: str, versions: list[int], live: int) -> None:
        """Raise :class:`RolloutError` when the split names a version ``name`` lacks, or its live version."""
        if self.split is None:
            return
        v = self.split.version
        if v not in versions:
            raise RolloutError(
                f"rollout `split.version` is {v}, but profile {name!r} has versions {versions[0]}-{versions[-1]}; "
                f"stage it first with `ngrav profile stage {name} FILE`"
            )
        if v == live:
            raise RolloutError(
                f"rollout `split.version` is {v}, the live version of {name!r}: both arms would serve it; "
                "split against a staged version"
            )


def _explain(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc) or "(root)"
        if err["type"] == "extra_forbidden":
            allowed = list(SplitConfig.model_fields if loc[:1] == ("split",) else RolloutConfig.model_fields)
            guess = difflib.get_close_matches(loc[-1], allowed, n=1, cutoff=0.6)
            hint = f"did you mean `{guess[0]}`?" if guess else f"allowed keys are: {', '.join(allowed)}"
            parts.append(f"unknown rollout key `{key}`; {hint}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        if key in ("shadow", "split.share") and _SHARE_HINT not in msg:
            msg += f"; {_SHARE_HINT}"
        if err["type"] == "missing":
            parts.append(
                f"rollout `{key}` is missing; add it ({'a version number' if key == 'split.version' else _SHARE_HINT})"
            )
        else:
            parts.append(f"rollout `{key}` (got {err.get('input')!r}): {msg}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------------------------- arm choice


def route_key(*, user: str | None = None, seed: int | None = None) -> str | None:
    """The key that makes a request's arm deterministic: its ``user``, else its ``seed``, else ``None``.

    >>> route_key(user="ada", seed=3), route_key(seed=3), route_key()
    ('user:ada', 'seed:3', None)
    """
    if user:
        return f"user:{user}"
    if seed is not None:
        return f"seed:{seed}"
    return None


def unit_hash(*parts: str) -> float:
    """A number in [0, 1) from a SHA-256 of the parts: the same parts always give the same number.

    >>> unit_hash("space", "split", "user:ada") == unit_hash("space", "split", "user:ada")
    True
    >>> 0.0 <= unit_hash("x") < 1.0
    True
    """
    digest = hashlib.sha256("\x00".join(parts).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


_random = random.Random()


@dataclass(frozen=True)
class Route:
    """Where one request goes: the version and arm that answer it, and whether a shadow runs too."""

    version: int
    arm: str
    shadow: bool = False


def route(
    config: RolloutConfig | None,
    *,
    name: str,
    live: int,
    key: str | None,
    pinned: int | None = None,
) -> Route:
    """The arm of one request for profile ``name`` whose live version is ``live``.

    ``pinned`` (a version the request named) bypasses the split; the shadow draw applies to every arm.
    """
    if config is None or config.empty:
        return Route(pinned if pinned is not None else live, PINNED if pinned is not None else LIVE)

    def draw(salt: str) -> float:
        return unit_hash(name, salt, key) if key is not None else _random.random()

    shadow = config.shadow > 0.0 and draw("shadow") < config.shadow
    if pinned is not None:
        return Route(pinned, PINNED, shadow)
    split = config.split
    if split is None or split.version == live:
        return Route(live, LIVE, shadow)
    if draw("split") < split.share:
        return Route(split.version, SPLIT_B, shadow)
    return Route(live, SPLIT_A, shadow)

"""Everything a request could fail on, checked before its rows join a batch.

:func:`check_gravity` is the one gate both engines' request paths pass through: it checks a resolved profile
against the server's limits (:func:`check_profile`), then lets the backend build what the profile needs
(``Backend.prepare``: the field and, on the transformers engine, the processor), so a profile that cannot be
built gets a ``400`` of its own instead of failing a batch that other requests share.

Each limit names the ``ngrav serve`` flag that raises it:

>>> from narrative_gravity.profiles.schema import Profile
>>> from narrative_gravity.server.config import ServerConfig
>>> many = Profile.from_mapping({"core_semantics": ["orbit"], "stages": [{"core_semantics": ["a"]}] * 20})
>>> check_profile(many, ServerConfig())  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
narrative_gravity.server.protocol.APIError: the profile has 20 stages, above this server's limit of 16 (--max-stages); ...
"""

from __future__ import annotations

import logging

from ..errors import NarrativeGravityError
from ..profiles.schema import Profile
from ..text import unencodable
from .backends.base import Backend, ResolvedGravity
from .config import ServerConfig
from .protocol import APIError

__all__ = ["check_gravity", "check_profile"]

log = logging.getLogger("narrative_gravity.server")


def check_profile(profile: Profile, config: ServerConfig, *, param: str = "gravity") -> None:
    """Raise a ``400`` :class:`~narrative_gravity.server.protocol.APIError` when ``profile`` asks for more than
    ``config`` allows (stages, words, semantic field size), or holds text that is not valid Unicode."""
    bad = unencodable(profile.model_dump(mode="python"), param)
    if bad is not None:
        raise APIError(
            400, f"`{bad}` holds text that cannot be encoded as UTF-8 (a lone surrogate?); fix it", param=bad
        )
    stages = profile.stages or []
    if len(stages) > config.max_stages:
        raise APIError(
            400,
            f"the profile has {len(stages)} stages, above this server's limit of {config.max_stages} (--max-stages); "
            "merge some stages",
            param=f"{param}.stages",
            code="profile_limit_exceeded",
        )
    lists: list[tuple[str, list[str]]] = [
        (f"{param}.core_semantics", profile.core_semantics),
        (f"{param}.penalize", profile.penalize),
    ]
    lists += [(f"{param}.stages.{i}.core_semantics", s.core_semantics) for i, s in enumerate(stages)]
    if profile.require is not None:
        lists.append((f"{param}.require.words", profile.require.words))
    for where, words in lists:
        if len(words) > config.max_words_per_list:
            raise APIError(
                400,
                f"`{where}` has {len(words)} words, above this server's limit of {config.max_words_per_list} "
                "(--max-words-per-list); keep the words that matter most",
                param=where,
                code="profile_limit_exceeded",
            )
    total = sum(len(words) for _, words in lists)
    if total > config.max_words:
        raise APIError(
            400,
            f"the profile has {total} words in all, above this server's limit of {config.max_words} (--max-words); "
            "use fewer words",
            param=param,
            code="profile_limit_exceeded",
        )
    checks = []  # only the settings the profile's field and schedule use
    if profile.field.mode != "lexical":
        checks.append((f"{param}.field.semantic_top_k", profile.field.semantic_top_k))
    if profile.schedule == "thermostat":
        checks.append((f"{param}.thermostat.candidates", profile.thermostat.candidates))
    for where, value in checks:
        if value > config.max_semantic_top_k:
            raise APIError(
                400,
                f"`{where}` is {value}, above this server's limit of {config.max_semantic_top_k} "
                "(--max-semantic-top-k); lower it",
                param=where,
                code="profile_limit_exceeded",
            )
    if profile.field.mode != "lexical" and profile.field.neighbours:
        _check_neighbours(profile, param, config)


def _check_neighbours(profile: Profile, param: str, config: ServerConfig) -> None:
    """``field.neighbours`` within ``max_neighbours``, and the word list it draws from the default one."""
    opts = profile.field
    if opts.neighbours > config.max_neighbours:
        raise APIError(
            400,
            f"`{param}.field.neighbours` is {opts.neighbours}, above this server's limit of {config.max_neighbours} "
            "(--max-neighbours); lower it",
            param=f"{param}.field.neighbours",
            code="profile_limit_exceeded",
        )
    default = type(opts).model_fields["neighbours_vocabulary"].default
    if opts.neighbours_vocabulary != default:
        raise APIError(
            400,
            f"`{param}.field.neighbours_vocabulary` is {opts.neighbours_vocabulary}; this server draws neighbour "
            f"words from the default {default} only (each other value embeds and caches a new word list); "
            "leave it out",
            param=f"{param}.field.neighbours_vocabulary",
            code="profile_limit_exceeded",
        )


def check_gravity(gravity: ResolvedGravity | None, backend: Backend, config: ServerConfig) -> None:
    """Check a request's profile and build what it needs, before its rows are queued (blocking: call it in a
    worker thread). Raises a ``400`` naming the problem; never lets a bad profile reach a batch."""
    if gravity is None:
        return
    check_profile(gravity.profile, config)
    try:
        backend.prepare(gravity.profile)
    except NarrativeGravityError as exc:
        raise APIError(400, f"gravity: {exc}", param="gravity", code="invalid_profile") from None
    except (ValueError, TypeError, UnicodeError) as exc:  # a builder choking on odd input is still the input
        log.info("profile refused while building it: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
        raise APIError(
            400, f"gravity: this profile cannot be built: {exc}", param="gravity", code="invalid_profile"
        ) from None

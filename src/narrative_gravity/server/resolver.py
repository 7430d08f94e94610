"""Turn a request's ``gravity`` object into a profile, with named profiles hot-reloaded from the store.

``gravity`` is either an inline profile mapping (``{"core_semantics": [...], ...}``) or a reference to the
store, ``{"profile": "space"}`` or ``{"profile": "space", "version": 2}``. Without a version every request
reads the profile's head with :meth:`~narrative_gravity.profiles.store.ProfileStore.head_version` (one folder listing),
so a new version set with ``ngrav profile set`` or ``PUT /v1/profiles/NAME`` is used by the next request,
with no restart. Snapshots are read once per version and kept in a small LRU cache.

**Rollout.** A request without a version gets the profile's *live* version (the store's live pointer; the head
when there is none), or, when the profile has a rollout config (:mod:`~narrative_gravity.profiles.rollout`), the version of
the arm its routing key picks: ``resolve(spec, route_key=...)``. The arm is in ``describe()``. A request that pins
``"version"`` bypasses the split (arm ``pinned``). The rollout config is read with the live pointer on every
request (two ``stat`` calls), so a change applies to the next request.

Either form may add ``"measure_only": true``: the text is generated without any pull (as with no ``gravity``),
while the profile's field is still measured, so a plain run reports the same entropy and narrative mass as a
steered one (what ``ngrav compare`` calls the control). The profile is turned into one whose λ is always 0,
so every engine runs it the same way.

>>> import tempfile
>>> from narrative_gravity.profiles.store import ProfileStore
>>> tmp = tempfile.TemporaryDirectory()
>>> store = ProfileStore(tmp.name)
>>> store.set("space", {"core_semantics": ["orbit"]})
1
>>> resolver = GravityResolver(store)
>>> resolver.resolve({"profile": "space"}).describe()
{'profile': 'space', 'version': 1, 'arm': 'live'}
>>> store.set("space", {"core_semantics": ["orbit"], "gravity_strength": 3.0})
2
>>> resolver.resolve({"profile": "space"}).profile.gravity_strength
3.0
>>> plain = resolver.resolve({"profile": "space", "measure_only": True})
>>> plain.profile.gravity_strength, plain.profile.schedule, plain.describe()
(0.0, 'constant', {'profile': 'space', 'version': 2, 'arm': 'live', 'measure_only': True})
>>> store.stage("space", {"core_semantics": ["orbit"], "gravity_strength": 9.0})
3
>>> resolver.resolve({"profile": "space"}).version  # staged: not served
2
>>> _ = store.set_rollout("space", {"split": {"version": 3, "share": 1.0}})
>>> resolver.resolve({"profile": "space"}, route_key="user:ada").describe()
{'profile': 'space', 'version': 3, 'arm': 'split:b'}
>>> resolver.resolve({"profile": "space", "version": 1}).describe()  # a pinned version bypasses the split
{'profile': 'space', 'version': 1, 'arm': 'pinned'}
>>> resolver.resolve({"profile": "spcae"})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
narrative_gravity.server.protocol.APIError: no profile named 'spcae'; did you mean 'space'? ...
>>> tmp.cleanup()
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from ..errors import NarrativeGravityError, ProfileError, StoreError
from ..lead import lead_messages, lead_sentence, lead_text, reading_profile
from ..profiles.rollout import SHADOW, route
from ..profiles.schema import Profile
from ..profiles.store import ProfileStore, StoreDamagedError
from .backends.base import MEASURE_ONLY_SUFFIX, ResolvedGravity
from .protocol import APIError

__all__ = ["GravityResolver", "measuring_profile", "public_message", "request_lead", "with_lead"]

_REFERENCE_KEYS = {"profile", "version", "measure_only"}


def measuring_profile(profile: Profile) -> Profile:
    """``profile`` with no pull: λ is 0 at every step, nothing is pruned, and stages give way to the base field
    (what ``measure_only`` measures against in :func:`~narrative_gravity.engines.hf.processor_from_profile`), and no
    topic sentence: plain decoding reads the prompt as it came."""
    return profile.model_copy(
        update={
            "gravity_strength": 0.0,
            "schedule": "constant",
            "decay_after_steps": None,
            "prune_threshold": None,
            "stages": None,
            "lead": False,
        }
    )


def request_lead(gravity: ResolvedGravity | None, *, chat: bool) -> str | None:
    """The topic sentence a request's rows read first (its profile's ``lead``), or ``None``.

    >>> request_lead(None, chat=True) is None
    True
    """
    if gravity is None or not gravity.profile.lead:
        return None
    try:
        return lead_sentence(gravity.profile, raw=not chat)
    except NarrativeGravityError as exc:  # the words' encoder is missing, say
        raise APIError(400, f"the profile's `lead` cannot be written: {exc}", param="gravity") from None


def with_lead(prompt: Any, lead: str | None, *, chat: bool) -> Any:
    """A request's prompt with its topic sentence: a system message for chat messages, text before a text
    prompt; a prompt of token ids is sent as it came (the sentence is text).

    >>> with_lead("The road", "The following is about cars.", chat=False)
    'The following is about cars. The road'
    >>> with_lead([5, 6], "The following is about cars.", chat=False)
    [5, 6]
    """
    if lead is None:
        return prompt
    if chat:
        return lead_messages(prompt, lead)
    return lead_text(prompt, lead) if isinstance(prompt, str) else prompt


log = logging.getLogger("narrative_gravity.server")


def public_message(exc: Exception, store: ProfileStore) -> str:
    """The error's message with the store's folder on the server replaced by ``<store>``."""
    return str(exc).replace(str(store.root), "<store>")


class GravityResolver:
    """Resolve ``gravity`` objects against ``store``; thread-safe (called from worker threads)."""

    def __init__(self, store: ProfileStore, *, cache_size: int = 256) -> None:
        self.store = store
        self._cache: OrderedDict[tuple[str, int], Profile] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def resolve(
        self, spec: Any, *, route_key: str | None = None, routed: bool = True, chat: bool | None = None
    ) -> ResolvedGravity | None:
        """``None`` for no gravity; raises :class:`~narrative_gravity.server.protocol.APIError` for bad specs.

        ``route_key`` makes the arm of a named profile deterministic (see :func:`~narrative_gravity.profiles.rollout.route`);
        ``routed=False`` ignores the rollout config (the live version, no shadow). ``chat``: the request is a chat
        (``True``) or a completion (``False``), whose rows read the profile's topic sentence (``lead``) where it
        has one for that kind, and so pull as it is read (:func:`~narrative_gravity.lead.reading_profile`);
        ``None``: the profile as it is.
        """
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise APIError(
                400,
                f"`gravity` must be an object, but is {type(spec).__name__}: an inline profile such as "
                '{"core_semantics": ["orbit", "planet"]}, or {"profile": "NAME"} from the store',
                param="gravity",
            )
        measure_only = spec.get("measure_only", False)
        if not isinstance(measure_only, bool):
            raise APIError(
                400,
                f"`gravity.measure_only` must be true or false, but is {measure_only!r}",
                param="gravity.measure_only",
            )
        if "profile" in spec:
            resolved = self._named(spec, route_key=route_key, routed=routed)
        else:
            inline = {k: v for k, v in spec.items() if k != "measure_only"}
            try:
                profile = Profile.from_mapping(inline, source="gravity")
            except ProfileError as exc:
                raise APIError(400, str(exc), param="gravity", code="invalid_profile") from None
            resolved = ResolvedGravity(profile=profile, label="inline", key=_key(profile))
        if not measure_only:  # text prompts read the profile's sentence (app.run_request), so it pulls as read
            reading = resolved.profile if chat is None else reading_profile(resolved.profile, raw=not chat)
            return resolved if reading is resolved.profile else replace(resolved, profile=reading, key=_key(reading))
        profile = measuring_profile(resolved.profile)
        label = resolved.label + MEASURE_ONLY_SUFFIX
        return replace(resolved, profile=profile, key=_key(profile), label=label, measure_only=True, shadow=False)

    def shadow_of(self, resolved: ResolvedGravity) -> ResolvedGravity:
        """The shadow of a request served with ``resolved``: the same version, measured, with no pull."""
        profile = measuring_profile(resolved.profile)
        label = resolved.label.removesuffix(MEASURE_ONLY_SUFFIX) + MEASURE_ONLY_SUFFIX
        return replace(
            resolved, profile=profile, key=_key(profile), label=label, measure_only=True, arm=SHADOW, shadow=False
        )

    def _named(self, spec: dict[str, Any], *, route_key: str | None, routed: bool) -> ResolvedGravity:
        extra = set(spec) - _REFERENCE_KEYS
        if extra:
            raise APIError(
                400,
                f"`gravity` names a stored profile, so it takes only `profile`, `version` and `measure_only`, but also has "
                f"{sorted(extra)}; put inline settings in a profile of their own",
                param="gravity",
            )
        name, version = spec["profile"], spec.get("version")
        if not isinstance(name, str):
            raise APIError(400, "`gravity.profile` must be a profile name (text)", param="gravity.profile")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 1):
            raise APIError(
                400, f"`gravity.version` must be a whole number >= 1, but is {version!r}", param="gravity.version"
            )
        info = self._route_info(name)  # a folder listing and two stats: the hot-reload check
        if info.head == 0:
            try:
                self.store.get(name)
            except StoreDamagedError:
                pass  # reported by _route_info below
            except StoreError as exc:  # the store's message lists the names and guesses the intended one
                raise APIError(
                    404, public_message(exc, self.store), param="gravity.profile", code="profile_not_found"
                ) from None
            info = self._route_info(name)  # it was stored a moment ago
        if version is not None and version > info.head:  # versions are contiguous, 1..head
            raise APIError(
                404,
                f"profile {name!r} has no version {version}; its newest is {info.head}",
                param="gravity.version",
                code="version_not_found",
            )
        picked = route(info.rollout if routed else None, name=name, live=info.live, key=route_key, pinned=version)
        version = picked.version
        try:
            profile = self._load(name, version)
        except StoreDamagedError as exc:  # our fault, not the client's
            log.error("profile %r version %d cannot be read: %s", name, version, exc)
            raise APIError(
                500,
                f"profile {name!r} version {version} cannot be read from the store; the server log has the details",
                param="gravity.profile",
                code="store_error",
            ) from None
        return ResolvedGravity(
            profile=profile,
            label=name,
            key=_key(profile),
            name=name,
            version=version,
            arm=picked.arm,
            shadow=picked.shadow,
        )

    def _route_info(self, name: str) -> Any:
        try:
            return self.store.route_info(name)
        except StoreDamagedError as exc:  # our fault, not the client's
            log.error("profile %r cannot be routed: %s", name, exc)
            raise APIError(
                500,
                f"profile {name!r} cannot be read from the store; the server log has the details",
                param="gravity.profile",
                code="store_error",
            ) from None
        except StoreError as exc:
            raise APIError(400, public_message(exc, self.store), param="gravity.profile", code="invalid_name") from None

    def _load(self, name: str, version: int) -> Profile:
        with self._lock:
            cached = self._cache.get((name, version))
            if cached is not None:
                self._cache.move_to_end((name, version))
                return cached
        profile = self.store.get(name, version)
        with self._lock:
            self._cache[(name, version)] = profile
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return profile


def _key(profile: Profile) -> str:
    """Equal profiles share a key (and a batch group)."""
    return json.dumps(profile.model_dump(mode="json"), sort_keys=True)

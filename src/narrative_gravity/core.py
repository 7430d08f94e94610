"""The one place the math lives: ``logits' = logits + λ·a``, then an optional pruning mask.

Adding ``λ·a`` to the logits is the exponential tilt ``p'(v) ∝ p(v)·exp(λ·a(v))`` of the next-token
distribution. Every engine (transformers, vLLM, numpy callbacks) calls :func:`apply_gravity`.

>>> import torch
>>> logits = torch.tensor([[0.0, 0.0, 0.0]])
>>> field = torch.tensor([1.0, 0.0, -1.0])
>>> apply_gravity(logits, field, torch.tensor([2.0])).tolist()
[[2.0, 0.0, -2.0]]
>>> apply_gravity(logits, field, 1.0, mask=prune_mask(field, -0.5)).tolist()
[[1.0, 0.0, -inf]]

A field that is zero outside a few ids (its *support*) can be given on those ids alone:

>>> apply_gravity_on_support(logits, torch.tensor([0, 2]), torch.tensor([1.0, -1.0]), 2.0).tolist()
[[2.0, 0.0, -2.0]]
"""

from __future__ import annotations

import torch

__all__ = ["apply_gravity", "apply_gravity_on_support", "check_repeat_weight", "damp_repeats", "prune_mask"]


def _as_row_strength(strength: torch.Tensor | float, logits: torch.Tensor) -> torch.Tensor | float:
    if isinstance(strength, torch.Tensor):
        if strength.dim() == 0:
            return strength
        return strength.reshape(-1, 1).to(logits.dtype)
    return float(strength)


def apply_gravity(
    logits: torch.Tensor,
    field: torch.Tensor,
    strength: torch.Tensor | float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pull ``logits [B, V]`` toward ``field`` (``[V]`` or ``[B, V]``) with one strength per row.

    Args:
        logits: next-token scores ``[B, V]``; not modified.
        field: the narrative field, values in ``[-1, 1]``.
        strength: a float, a 0-d tensor, or a ``[B]`` tensor (one λ per row).
        mask: optional bool ``[V]`` or ``[B, V]``; ``True`` marks tokens to prune (set to ``-inf``). A row is
            never pruned to nothing: where the mask would remove every finite candidate, it is ignored.

    Returns:
        A new ``[B, V]`` tensor. ``-inf`` entries stay ``-inf``.
    """
    lam = _as_row_strength(strength, logits)
    field = field.to(logits.dtype)
    # One fused pass over [B, V]: no temporary λ·a.
    out = torch.add(logits, field, alpha=lam) if isinstance(lam, float) else torch.addcmul(logits, lam, field)
    if out.shape != logits.shape:
        raise ValueError(f"the field {tuple(field.shape)} does not broadcast to the logits {tuple(logits.shape)}")
    if mask is not None:
        finite = torch.isfinite(out)
        keeps_some = (finite & ~mask).any(dim=-1, keepdim=True)
        out = out.masked_fill(mask & keeps_some, float("-inf"))
    return out


def apply_gravity_on_support(
    logits: torch.Tensor,
    support: torch.Tensor,
    field: torch.Tensor,
    strength: torch.Tensor | float,
) -> torch.Tensor:
    """:func:`apply_gravity` for a field that is zero outside ``support``: the same result, less work.

    Args:
        logits: next-token scores ``[B, V]``; not modified.
        support: ``[S]`` distinct token ids where the field may be non-zero.
        field: the field on those ids, ``[S]`` or ``[B, S]``.
        strength: a float, a 0-d tensor, or a ``[B]`` tensor (one λ per row).

    One copy of the logits plus an ``index_add`` over ``B × S`` entries, instead of arithmetic over
    ``B × V``. No pruning here: a mask may reach tokens outside the support, so use :func:`apply_gravity`.
    """
    lam = _as_row_strength(strength, logits)
    delta = (lam * field.to(logits.dtype)).expand(logits.shape[0], -1)
    return logits.clone().index_add_(1, support, delta)


def prune_mask(field: torch.Tensor, threshold: float | None) -> torch.Tensor | None:
    """Tokens whose field value is at or below ``threshold`` (true branch pruning), or ``None``.

    >>> prune_mask(torch.tensor([0.5, -1.0]), -1.0).tolist()
    [False, True]
    """
    if threshold is None:
        return None
    return field <= threshold


def check_repeat_weight(weight: float) -> float:
    """``weight`` as a float, or a :class:`~narrative_gravity.errors.ConfigurationError` unless it is in [0, 1]."""
    from .errors import ConfigurationError

    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight <= 1.0:
        raise ConfigurationError(f"`repeat_weight` has to be a number in [0, 1], but is {weight!r}")
    return float(weight)


def damp_repeats(
    field: torch.Tensor,
    input_ids: torch.Tensor,
    generated: int,
    weight: float,
    width: int,
    support: torch.Tensor | None = None,
) -> torch.Tensor:
    """``field`` with the pull of every token a row has already generated scaled by ``weight``.

    Only positive values are scaled (penalties stay), and only the last ``generated`` ids of ``input_ids``
    count (the prompt does not). ``field`` is ``[V]`` or ``[B, V]`` (``width`` = V), or ``[S]``/``[B, S]``
    on the ids ``support``; the result is ``[B, ...]``, or ``field`` itself when ``weight`` is 1 or nothing
    has been generated yet.

    >>> a = torch.tensor([1.0, 0.5, -1.0, 0.0])
    >>> damp_repeats(a, torch.tensor([[0, 3, 2]]), 2, 0.0, 4).tolist()  # 0 is in the prompt, 2 is a penalty
    [[1.0, 0.5, -1.0, 0.0]]
    >>> damp_repeats(a, torch.tensor([[0, 3, 1]]), 2, 0.25, 4).tolist()
    [[1.0, 0.125, -1.0, 0.0]]
    """
    if weight == 1.0 or generated <= 0:
        return field
    said = torch.zeros(input_ids.shape[0], width, dtype=torch.bool, device=field.device)
    said.scatter_(1, input_ids[:, -generated:].clamp(0, width - 1), True)
    if support is not None:
        said = said[:, support]
    return torch.where(said & (field > 0), field * weight, field)

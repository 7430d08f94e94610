"""The one place the math lives: ``logits' = logits + λ·a``, then an optional pruning mask.

Adding ``λ·a`` to the logits is the exponential tilt ``p'(v) ∝ p(v)·exp(λ·a(v))`` of the next-token
distribution. Every engine (transformers, vLLM) reaches it through the kernel
(:class:`~narrative_gravity.gravity.kernel.GravityKernel`), which calls :func:`apply_gravity`.

>>> import torch
>>> logits = torch.tensor([[0.0, 0.0, 0.0]])
>>> field = torch.tensor([1.0, 0.0, -1.0])
>>> apply_gravity(logits, field, torch.tensor([2.0])).tolist()
[[2.0, 0.0, -2.0]]
>>> apply_gravity(logits, field, 1.0, mask=prune_mask(field, -0.5)).tolist()
[[1.0, 0.0, -inf]]

A field that is zero outside a few ids (its *support*) can be given on those ids alone:

>>> apply_gravity(logits, torch.tensor([1.0, -1.0]), 2.0, support=torch.tensor([0, 2])).tolist()
[[2.0, 0.0, -2.0]]
"""

from __future__ import annotations

import torch

from ..errors import ConfigurationError

__all__ = ["apply_gravity", "check_repeat_weight", "prune_mask"]


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
    support: torch.Tensor | None = None,
    *,
    inplace: bool = False,
) -> torch.Tensor:
    """Pull ``logits [B, V]`` toward ``field`` with one strength per row.

    Args:
        logits: next-token scores ``[B, V]``; not modified.
        field: the narrative field, values in ``[-1, 1]``: ``[V]`` or ``[B, V]``, or, with ``support``,
            ``[S]`` or ``[B, S]`` on those ids (zero elsewhere).
        strength: a float, a 0-d tensor, or a ``[B]`` tensor (one λ per row).
        mask: optional bool ``[V]`` or ``[B, V]``; ``True`` marks tokens to prune (set to ``-inf``). A row is
            never pruned to nothing: where the mask would remove every finite candidate, it is ignored.
        support: ``[S]`` distinct token ids where ``field`` is given. Then the work is one copy of the
            logits plus a gather and a scatter over ``B × S`` entries instead of arithmetic over ``B × V``.

        inplace: write into ``logits`` (an engine that hands its logits over, such as vLLM) instead of a copy.

    Returns:
        A new ``[B, V]`` tensor (``logits`` itself with ``inplace``). ``-inf`` entries stay ``-inf``.
    """
    lam = _as_row_strength(strength, logits)
    field = field.to(logits.dtype)
    if support is not None:
        pull = (lam * field).expand(logits.shape[0], -1)
        out = (logits if inplace else logits.clone()).index_add_(1, support, pull)  # the support's ids are distinct
    else:
        # One fused pass over [B, V]: no temporary λ·a.
        out = torch.add(logits, field, alpha=lam) if isinstance(lam, float) else torch.addcmul(logits, lam, field)
        if out.shape != logits.shape:
            raise ValueError(f"the field {tuple(field.shape)} does not broadcast to the logits {tuple(logits.shape)}")
        if inplace:
            out = logits.copy_(out)
    if mask is not None:
        finite = torch.isfinite(out)
        keeps_some = (finite & ~mask).any(dim=-1, keepdim=True)
        out = (
            out.masked_fill_(mask & keeps_some, float("-inf"))
            if inplace
            else out.masked_fill(mask & keeps_some, float("-inf"))
        )
    return out


def prune_mask(field: torch.Tensor, threshold: float | torch.Tensor | None) -> torch.Tensor | None:
    """Tokens whose field value is at or below ``threshold`` (true branch pruning), or ``None``.

    ``threshold`` may be a ``[B, 1]`` tensor (one per row; ``NaN`` = no pruning in that row).

    >>> prune_mask(torch.tensor([0.5, -1.0]), -1.0).tolist()
    [False, True]
    """
    if threshold is None:
        return None
    return field <= threshold


def check_repeat_weight(weight: float) -> float:
    """``weight`` as a float, or a :class:`~narrative_gravity.errors.ConfigurationError` unless it is in [0, 1]."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight <= 1.0:
        raise ConfigurationError(f"`repeat_weight` has to be a number in [0, 1], but is {weight!r}")
    return float(weight)

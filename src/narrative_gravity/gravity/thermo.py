"""Semantic thermodynamics: measure the disorder of each decoding step.

From one ``log_softmax`` of the model's logits (plus one ``logsumexp`` for the pulled distribution) we
get, per row:

- ``entropy``: ``H(p)`` of the model's own next-token distribution, in nats;
- ``mass``: narrative mass ``Σ p·[a>0]`` before the pull, and ``mass_after`` for ``p'``;
- ``kl``: ``KL(p'‖p)``, what the pull costs in nats;
- ``strength``: the λ used.

:class:`Trace` records them per row and step on the device (no host sync) and is off unless asked.

>>> import torch
>>> m = measure(torch.zeros(1, 4), torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0.0]))
>>> round(float(m.entropy[0]), 4), round(float(m.mass[0]), 2), float(m.kl[0])
(1.3863, 0.25, 0.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "Measurement",
    "Trace",
    "Workspace",
    "block_rows",
    "measure",
    "measure_from_probs",
    "measure_on_support",
    "narrative_mass",
    "probabilities",
]

METRICS = ("entropy", "mass", "mass_after", "kl", "strength")


@dataclass(frozen=True)
class Measurement:
    """One step's measurements, each a ``[B]`` tensor."""

    entropy: torch.Tensor
    mass: torch.Tensor
    mass_after: torch.Tensor
    kl: torch.Tensor
    strength: torch.Tensor

    def stack(self) -> torch.Tensor:
        return torch.stack([self.entropy, self.mass, self.mass_after, self.kl, self.strength], dim=-1)


def narrative_mass(logp: torch.Tensor, field: torch.Tensor) -> torch.Tensor:
    """``Σ p·[a>0]`` per row from log-probabilities ``[B, V]``; rows that are all ``-inf`` give 0."""
    on = (field > 0).to(logp.dtype)
    return torch.nan_to_num((logp.exp() * on).sum(dim=-1), nan=0.0)


def measure(
    logits: torch.Tensor,
    field: torch.Tensor,
    strength: torch.Tensor,
    pulled: torch.Tensor | None = None,
    support: torch.Tensor | None = None,
) -> Measurement:
    """Measure one step. ``pulled`` are the logits after gravity (defaults to ``logits + λ·a``).

    ``-inf`` logits are handled (``0·log 0 = 0``); a row that is entirely ``-inf`` measures as zeros.

    ``support`` (optional): the token ids where the field can be non-zero, with every pruned token among
    them. Then ``p'`` differs from ``p`` only there (``p' ∝ p·exp(λa)``), so the pulled quantities come
    from that slice and the whole-vocabulary work is one softmax pass with the entropy (:func:`probabilities`).

    >>> logits, field = torch.randn(2, 6), torch.tensor([1.0, 0, 0, -0.5, 0, 0])
    >>> dense = measure(logits, field, torch.tensor([2.0, 0.5]))
    >>> sparse = measure(logits, field, torch.tensor([2.0, 0.5]), support=torch.tensor([0, 3]))
    >>> bool(torch.allclose(dense.stack(), sparse.stack(), atol=1e-5))
    True
    """
    logits = logits.float()
    if support is not None:
        b = logits.shape[0]
        a_s = field[support] if field.dim() == 1 else field.gather(1, support[None].expand(b, -1))
        pruned = None
        if pulled is not None:
            idx = support[None].expand(b, -1)
            pruned = torch.isneginf(pulled.gather(1, idx)) & torch.isfinite(logits.gather(1, idx))
        return measure_on_support(logits, support, a_s, strength, pruned=pruned)
    lam = _row_strength(strength)
    logp = torch.log_softmax(logits, dim=-1)
    p = logp.exp()
    entropy = -(p * logp).nansum(-1)  # 0·log 0 is NaN here and dropped, as it should be
    on = (field > 0).to(p.dtype)
    mass = p @ on if on.dim() == 1 else (p * on).sum(-1)
    if pulled is None:
        pulled = logits + lam * field
    logq = torch.log_softmax(pulled.float(), dim=-1)
    q = logq.exp()
    # KL is >= 0; rounding can leave a tiny negative value when the pull is zero.
    kl = (q * (logq - logp)).nansum(-1).clamp_min(0.0)
    mass_after = q @ on if on.dim() == 1 else (q * on).sum(-1)
    return _measurement(entropy, mass, mass_after, kl, lam, logits.shape[0])


class Workspace:
    """Scratch ``[rows, V]`` float32 buffers kept from one step to the next, so that the whole-vocabulary pass
    allocates nothing (a fresh buffer of megabytes each step costs page faults). Not thread-safe: one per
    kernel."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A ``like``-shaped float32 buffer (``[R, V]``) on ``like``'s device; its contents are garbage."""
        r, v = like.shape
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < r or buf.shape[1] != v or buf.device != like.device:
            buf = torch.empty(max(r, 0 if buf is None else buf.shape[0]), v, device=like.device)
            self._buffers[name] = buf
        return buf[:r]

    def shaped(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """A contiguous float32 buffer of ``shape`` on ``device`` (any shape, from one flat buffer kept at its
        largest size); its contents are garbage."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = torch.empty(max(n, 0 if buf is None else buf.numel()), device=device)
            self._buffers[name] = buf
        return buf[:n].view(shape)


# On the CPU the whole-vocabulary pass runs over a few rows at a time: each block stays in the cores' caches
# across the pass's six element-wise operations, instead of every operation streaming all ``[R, V]``. A block
# holds about this many bytes of logits per torch thread (32 rows of SmolLM2's 49 152 logits, one thread:
# 5.7 ms for a kernel step at once, 4.9 ms in blocks; bench/results in docs/benchmarks.md).
CPU_BLOCK_BYTES = 512 * 1024


def block_rows(logits: torch.Tensor) -> int:
    """How many rows of ``logits [R, V]`` one block of the whole-vocabulary pass takes: all of them off the CPU
    (one kernel launch each), else :data:`CPU_BLOCK_BYTES` per torch thread (at least a row per thread)."""
    r, v = logits.shape
    if logits.device.type != "cpu" or torch.compiler.is_compiling():  # compiled: inductor fuses the pass
        return max(r, 1)
    per_thread = max(1, CPU_BLOCK_BYTES // max(4 * v, 1))
    return max(1, min(r, per_thread * torch.get_num_threads()))


def probabilities(
    logits: torch.Tensor, support: torch.Tensor | None = None, *, workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax, entropy)`` of ``logits [R, V]``, the softmax on ``support`` only when it is given (``[R, S]``).

    ``H = log Z − Σ e·(l − max) / Z`` with ``e = exp(l − max)``: one ``exp`` over the vocabulary, and no
    division of all of it. ``0·log 0`` counts as 0; a row that is all ``-inf`` gives NaN probabilities and
    entropy 0. ``workspace``: keeps the pass's two temporaries from one call to the next. On the CPU the
    pass runs block by block of rows (:func:`block_rows`); the numbers do not depend on the blocks.

    >>> p, h = probabilities(torch.zeros(1, 4), torch.tensor([0, 2]))
    >>> p.tolist(), round(float(h[0]), 4)  # uniform: log 4
    ([[0.25, 0.25]], 1.3863)
    """
    logits = logits.float()
    r, v = logits.shape
    rows = block_rows(logits)
    width = v if support is None else support.numel()
    p = torch.empty(r, width, device=logits.device)
    entropy = torch.empty(r, device=logits.device)
    block = logits[:rows]
    if workspace is None:
        shifted, e = torch.empty_like(block), torch.empty_like(block)
    else:
        shifted, e = workspace.get("shifted", block), workspace.get("exp", block)
    for start in range(0, r, rows):  # one block on accelerators; a handful on the CPU
        stop = min(start + rows, r)
        _block_pass(
            logits[start:stop], support, shifted[: stop - start], e[: stop - start], p[start:stop], entropy[start:stop]
        )
    return p, torch.nan_to_num(entropy, nan=0.0).clamp_min_(0.0)


def _block_pass(
    logits: torch.Tensor,
    support: torch.Tensor | None,
    shifted: torch.Tensor,
    e: torch.Tensor,
    p: torch.Tensor,
    entropy: torch.Tensor,
) -> None:
    """:func:`probabilities` of one block of rows, written into ``p`` and ``entropy``; ``shifted`` and ``e``
    are scratch buffers of the block's shape."""
    torch.sub(logits, logits.amax(dim=-1, keepdim=True), out=shifted)
    torch.exp(shifted, out=e)
    z = e.sum(dim=-1, keepdim=True)
    if support is None:
        torch.div(e, z, out=p)
    else:
        torch.index_select(e, 1, support, out=p).div_(z)
    zz = z[:, 0]
    # `shifted` is scratch: reuse it for e·(l − max) rather than use another buffer
    torch.sub(torch.log(zz), shifted.mul_(e).nansum(dim=-1) / zz, out=entropy)


def measure_on_support(
    logits: torch.Tensor,
    support: torch.Tensor,
    field: torch.Tensor,
    strength: torch.Tensor,
    pruned: torch.Tensor | None = None,
) -> Measurement:
    """:func:`measure` for a field given on its support alone (``field`` is ``[S]`` or ``[B, S]``).

    The pulled distribution is ``p' ∝ p·w`` with ``w = exp(λa)`` on the support (0 where ``pruned``, a
    ``[B, S]`` bool) and 1 elsewhere. With ``Z = 1 + Σ_S p·(w − 1)``: mass' = ``Σ_{S, a>0} p·w / Z`` and
    ``KL(p'‖p) = Σ_S p·w·log w / Z − log Z``. The whole-vocabulary work is one ``log_softmax`` and the entropy.

    >>> logits = torch.randn(2, 6)
    >>> dense = measure(logits, torch.tensor([1.0, 0, 0, -0.5, 0, 0]), torch.tensor([2.0, 0.5]))
    >>> sparse = measure_on_support(logits, torch.tensor([0, 3]), torch.tensor([1.0, -0.5]), torch.tensor([2.0, 0.5]))
    >>> bool(torch.allclose(dense.stack(), sparse.stack(), atol=1e-5))
    True
    """
    p_s, entropy = probabilities(logits, support)
    return measure_from_probs(p_s, entropy, None, field, strength, pruned=pruned)


def measure_from_probs(
    probs: torch.Tensor,
    entropy: torch.Tensor,
    support: torch.Tensor | None,
    field: torch.Tensor,
    strength: torch.Tensor,
    pruned: torch.Tensor | None = None,
) -> Measurement:
    """:func:`measure_on_support` from the model's probabilities ``[B, V]`` and entropy ``[B]``, already computed
    (``support=None``: ``probs`` are already the support's, ``[B, S]``).

    The thermostat hands its ``softmax`` over, so a step with the thermometer on needs no second pass over the
    vocabulary.
    """
    p = probs
    lam = _row_strength(strength)
    b = p.shape[0]
    p_s = p if support is None else p.gather(1, support[None].expand(b, -1))
    a_s = field.float()
    on = (a_s > 0).to(p.dtype)
    mass = (p_s * on).sum(-1)
    log_w = (lam * a_s).expand(b, -1)
    if pruned is not None:
        log_w = log_w.masked_fill(pruned, 0.0)
    w = log_w.exp()
    if pruned is not None:
        w = w.masked_fill(pruned, 0.0)
    pw = p_s * w
    z = 1.0 + (p_s * (w - 1.0)).sum(-1)
    mass_after = (pw * on).sum(-1) / z
    kl = ((pw * log_w).sum(-1) / z - torch.log(z)).clamp_min(0.0)
    return _measurement(entropy, mass, mass_after, kl, lam, b)


def _row_strength(strength: torch.Tensor) -> torch.Tensor:
    return strength.reshape(-1, 1).float() if strength.dim() else strength.float()


def _measurement(
    entropy: torch.Tensor, mass: torch.Tensor, mass_after: torch.Tensor, kl: torch.Tensor, lam: torch.Tensor, b: int
) -> Measurement:
    lam_row = lam.reshape(-1).expand(b) if lam.numel() in (1, b) else lam.reshape(-1)
    clean = [torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) for t in (entropy, mass, mass_after, kl)]
    return Measurement(*clean, strength=lam_row.to(entropy.dtype).clone())


@dataclass
class Trace:
    """Per-row, per-step measurements, kept on the device until :meth:`to_numpy`.

    >>> import torch
    >>> t = Trace()
    >>> t.record(measure(torch.zeros(2, 3), torch.tensor([1.0, 0, 0]), torch.tensor([0.0, 1.0])))
    >>> t.to_numpy()["strength"].tolist()
    [[0.0], [1.0]]
    """

    _steps: list[torch.Tensor] = field(default_factory=list)

    def record(self, m: Measurement) -> None:
        self._steps.append(m.stack().detach())

    def reset(self) -> None:
        self._steps.clear()

    def __len__(self) -> int:
        return len(self._steps)

    def tensor(self) -> torch.Tensor:
        """``[B, T, 5]`` with the metrics in the order of ``METRICS``."""
        if not self._steps:
            return torch.zeros(0, 0, len(METRICS))
        return torch.stack(self._steps, dim=1)

    def to_numpy(self) -> dict[str, object]:
        """Each metric as a ``[B, T]`` numpy array."""
        t = self.tensor().cpu().numpy()
        return {name: t[..., i] for i, name in enumerate(METRICS)}

    def means(self, lengths: list[int] | None = None) -> list[dict[str, float]]:
        """Per-row means over the steps each row actually generated (``lengths``, default all)."""
        t = self.tensor().cpu()
        out = []
        for row in range(t.shape[0]):
            n = t.shape[1] if lengths is None else max(1, min(lengths[row], t.shape[1]))
            vals = t[row, :n].mean(dim=0) if t.shape[1] else torch.zeros(len(METRICS))
            out.append({name: float(vals[i]) for i, name in enumerate(METRICS)})
        return out

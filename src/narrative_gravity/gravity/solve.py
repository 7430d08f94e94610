"""The thermostat's solver: the smallest pull λ per row that lifts the narrative mass to a target.

:class:`MassProblem` holds one step's problem on the field's candidate columns, and
:meth:`MassProblem.solve` finds the grid point in a fixed number of batched passes, with no host
synchronisation and no loop over rows; :func:`solve_strength` is the same on plain logits.

>>> import torch
>>> lam = solve_strength(torch.zeros(1, 4), torch.tensor([1.0, 0.0, 0.0, 0.0]), 0.5, 8.0)
>>> round(lam.item(), 2)  # ln 3 lifts a quarter to a half
1.1
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigurationError
from .thermo import Workspace, probabilities

__all__ = ["ACCELERATOR_GRID", "MAX_THERMOSTAT_STRENGTH", "MassProblem", "grid_bits", "solve_strength"]


class MassProblem:
    """Everything the solver needs for one step, for fields given on a support.

    Tokens with ``a = 0`` do not move when λ changes, so with ``p = softmax(l)`` the narrative mass of
    ``softmax(l + λ·a)`` is ``m(λ) = Σ_{a>0} p·e^{λa} / Σ_v p·e^{λa}``, and only the support changes from one
    λ to the next. Per row, ``candidates`` support columns take part (``columns``, or else the ones with the
    largest ``|a|``); the probability outside them enters as a constant (mass on pulled tokens outside the
    candidates is kept at its λ = 0 value, so λ then errs on the strong side).

    Args:
        probs: ``softmax(logits)`` on the field's columns, ``[R, S]`` (NaN rows where every logit is ``-inf``).
        entropy: ``[R]``.
        field: ``[R, S]`` (or ``[S]``).
        complete: the columns are the whole vocabulary (else the probability outside them is a constant).
        candidates: how many columns take part (the most any row asks for).
        row_candidates: optional ``[R]``: each row's own count (``≤ candidates``).
        columns: optional ``[R, candidates]`` positions in ``field`` to use, best first (the kernel picks
            them once per field, from its base values).
    """

    def __init__(
        self,
        probs: torch.Tensor,
        entropy: torch.Tensor,
        field: torch.Tensor,
        complete: bool,
        candidates: int,
        row_candidates: torch.Tensor | None = None,
        columns: torch.Tensor | None = None,
    ) -> None:
        self.p, self.entropy = probs, entropy
        b = probs.shape[0]
        a = field.to(device=probs.device, dtype=torch.float32).expand(b, -1)
        self.mass0 = (probs * (a > 0)).sum(-1)  # NaN for rows without a finite logit (or with a NaN one)
        width = a.shape[1]
        k_max = min(candidates, width)  # a host int: no device read to learn the widest row
        if k_max >= width and columns is None:
            q, a_c = probs, a
        else:
            idx = columns[:, :k_max] if columns is not None else torch.topk(a.abs(), k_max, dim=-1).indices
            q, a_c = probs.gather(1, idx), a.gather(1, idx)
            if row_candidates is not None:  # rows that asked for fewer candidates drop the rest
                q = q * (torch.arange(k_max, device=a.device)[None] < row_candidates.to(a.device)[:, None])
        self.num = torch.where(a_c > 0, q, 0.0)  # [R, K]: the weights of m(λ)'s numerator and denominator
        self.den = q
        self.a = a_c
        # the probability outside the candidates is a constant of the solver (a = 0 there)
        self.outside = not (k_max >= width and complete and columns is None)

    @property
    def alive(self) -> torch.Tensor:
        """``[R]`` bool: the row's softmax is finite (it has a finite logit, and no NaN or ``+inf``)."""
        return ~torch.isnan(self.mass0)

    def _outside(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The numerator's and the denominator's probability outside the candidates (``[R]`` each)."""
        if not self.outside:
            return torch.zeros_like(self.mass0), torch.zeros_like(self.mass0)
        return (self.mass0 - self.num.sum(-1)).clamp_min(0.0), (1.0 - self.den.sum(-1)).clamp_min(0.0)

    def mass(self, lam: torch.Tensor) -> torch.Tensor:
        """``m(λ)`` for one λ per row (``[R]``); 0 for rows without a finite logit."""
        w = torch.exp(lam[:, None] * self.a)  # [R, K]
        out_num, out_den = self._outside()
        num, den = (w * self.num).sum(-1) + out_num, (w * self.den).sum(-1) + out_den
        return torch.nan_to_num(num / den.clamp_min(1e-30), nan=0.0).clamp_max(1.0)

    def solve(
        self,
        target: torch.Tensor,
        max_strength: torch.Tensor,
        iterations: int,
        row_iterations: torch.Tensor | None = None,
        *,
        bits: int | None = None,
        workspace: Workspace | None = None,
        kl_budget: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The smallest λ on the grid ``λ_max · j / 2^iterations`` (``j = 1 … 2^iterations``) per row whose mass
        reaches ``target``: what ``iterations`` steps of bisection on ``[0, λ_max]`` return.

        ``m(λ) ≥ t`` is ``Σ (num − t·den)·e^{λa} ≥ 0``, one weighted sum per λ; ``m`` is non-decreasing, so
        a coarse grid of λ values, all evaluated in one batched product, finds the bracket, and finer grids
        inside it find the grid point. Each level reads a few bits of ``j`` at once: far fewer tensor
        operations than bisection's one bit per pass, with no host synchronisation and no loop over rows.
        Rows already at the target get 0; rows where λ_max falls short get λ_max; rows without a finite
        logit get 0. ``row_iterations`` (``[R]``, each ``≤ iterations``): a row's own, coarser grid.
        ``bits``: grid points per level are ``2^bits`` (default: by the problem's size); the answer does not
        depend on it. ``workspace``: keeps the ``[R, 2^bits, K]`` grid buffer from one step to the next (a fresh
        one of a megabyte each level can cost page faults).

        ``kl_budget`` (``[R]``, ``inf`` for no limit): the search also stops at the first grid λ whose pull costs
        at least this much, ``KL(p_λ ‖ p) = λ·E_{p_λ}[a] − log Z(λ)`` with ``Z(λ) = Σ p·e^{λa}``. KL grows
        with λ (its derivative is ``λ·Var_{p_λ}(a)``), so the bracket search is the same, on two sums more
        of the same products.
        """
        r, k = self.a.shape
        weights = torch.addcmul(self.num, target[:, None], self.den, value=-1.0)  # [R, K]
        # m(λ) ≥ t is Σ_K weights·e^{λa} ≥ −(the same sum outside the candidates, where a = 0), and that
        # is t·(1 − Σ_K den) − (m(0) − Σ_K num) = t − m(0) + Σ_K weights
        floor = (target - self.mass0 + weights.sum(-1)) if self.outside else torch.zeros_like(target)
        floor = floor[:, None]
        if kl_budget is None:
            weights = weights[:, :, None]
        else:  # Z(λ) and Σ p·a·e^{λa} on the candidates, in the same product
            weights = torch.stack([weights, self.den, self.den * self.a], dim=-1)  # [R, K, 3]
            z_outside = self._outside()[1][:, None]
            budget = kl_budget.to(device=self.a.device, dtype=torch.float32)[:, None]
        a = self.a[:, None, :]
        if bits is None:
            bits = grid_bits(r, k, self.a.device)
        dtype = torch.float32 if iterations <= 24 else torch.float64
        lam_max = max_strength.to(dtype)
        lo = torch.zeros(r, dtype=dtype, device=self.a.device)  # the largest grid point known to fall short
        done_bits = 0
        while done_bits < iterations:
            n = min(bits, iterations - done_bits)
            done_bits += n
            unit = lam_max * 0.5**done_bits
            lam = torch.addcmul(lo[:, None], unit[:, None], _steps(2**n, dtype, lo.device))  # [R, g]
            lam_a = lam[:, :, None].float()
            if torch.compiler.is_compiling():  # one fused reduction: no [R, g, K] grid is written
                s = (torch.exp(lam_a * a)[..., None] * weights[:, None]).sum(-2)  # [R, g, 1 or 3]
            else:
                if workspace is None:
                    grid = torch.exp(lam_a * a)
                else:  # the same numbers, in a kept buffer
                    grid = torch.mul(lam_a, a, out=workspace.shaped("solver", (r, 2**n, k), a.device)).exp_()
                s = torch.bmm(grid, weights)  # [R, g, 1 or 3]
            short = s[..., 0] < floor  # [R, g]
            if kl_budget is not None:
                z = (s[..., 1] + z_outside).clamp_min(1e-30)
                kl = lam.float() * s[..., 2] / z - torch.log(z)
                short = short & (kl < budget)
            # the bracket's top point reaches the target (it did on the level before); where even λ_max
            # falls short, every level stops below the top and λ ends at λ_max
            below = torch.sum(short, dim=1, dtype=dtype).clamp_max(2**n - 1)
            lo = torch.addcmul(lo, unit, below)
        unit = lam_max * 0.5**iterations
        lam = lo + unit
        if row_iterations is not None:  # a coarser grid: round up to a multiple of 2^(iterations − own) units
            d = torch.exp2((iterations - row_iterations.to(dtype)).clamp_min(0)) * unit
            lam = torch.ceil(lam / d) * d
        # rows already at the target, and rows without a finite logit (NaN mass), get 0
        return torch.where(self.mass0 < target, lam.float(), 0.0)


# Off the CPU, the most values a level of the solver's grid may hold (``R × 2^bits × K``; 32 MB in float32).
ACCELERATOR_GRID = 2**23


def grid_bits(rows: int, candidates: int, device: torch.device | str) -> int:
    """How many bits of the answer one level of :meth:`MassProblem.solve` reads: ``2^bits`` λ per level.

    On the CPU a level costs its arithmetic, so few λ per level once the problem is large. On an accelerator a
    level costs its kernel launches, not its arithmetic, so as many λ per level as :data:`ACCELERATOR_GRID`
    values allow (at most 7 bits): the default 14 iterations take 2 levels instead of 5.

    >>> grid_bits(8, 1024, "cpu"), grid_bits(8, 1024, "cuda"), grid_bits(512, 1024, "cuda")
    (3, 7, 4)
    """
    size = max(rows * candidates, 1)
    if torch.device(device).type == "cpu":
        return 7 if size <= 2048 else 3 if size <= 65536 else 2
    if size > ACCELERATOR_GRID // 4:
        return 2
    return min(7, int(math.log2(ACCELERATOR_GRID // size)))


_STEPS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _steps(g: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1, 2, …, g]`` (cached)."""
    if torch.compiler.is_compiling():  # an iota inside the compiled step, no cache
        return torch.arange(1, g + 1, dtype=dtype, device=device)
    key = (g, dtype, device)
    steps = _STEPS.get(key)
    if steps is None:
        steps = _STEPS[key] = torch.arange(1, g + 1, dtype=dtype, device=device)
    return steps


def _check_iterations(iterations: int) -> int:
    if isinstance(iterations, bool) or not isinstance(iterations, int) or not 1 <= iterations <= 64:
        raise ConfigurationError(f"`iterations` has to be an integer in [1, 64], but is {iterations!r}")
    return iterations


MAX_THERMOSTAT_STRENGTH = 50.0


def _check_max_strength(value: torch.Tensor | float) -> None:
    if isinstance(value, torch.Tensor):
        return  # per-row tensors come from the controller, which checked the floats
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= MAX_THERMOSTAT_STRENGTH:
        raise ConfigurationError(
            f"`max_strength` has to be a number in [0, {MAX_THERMOSTAT_STRENGTH:g}], but is {value!r}; "
            "e^50 already multiplies a token's odds by 5e21"
        )


def _check_candidates(candidates: int) -> int:
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise ConfigurationError(f"`candidates` has to be a positive integer, but is {candidates!r}")
    return candidates


def solve_strength(
    logits: torch.Tensor,
    field: torch.Tensor,
    target: torch.Tensor | float,
    max_strength: torch.Tensor | float,
    *,
    iterations: int = 14,
    candidates: int = 1024,
) -> torch.Tensor:
    """The smallest λ ∈ [0, λ_max] per row whose pulled distribution has narrative mass ≥ ``target``.

    ``m(λ) = Σ_v softmax(logits + λ·a)_v · [a_v > 0]`` is non-decreasing in λ (pulled tokens rise, pushed
    tokens sink), so a search over the grid ``λ_max · j / 2^iterations`` finds it: a fixed number of batched
    passes, no host synchronisation, no loop over rows (:class:`MassProblem`). Among all distributions with a given
    narrative mass, the exponential tilt with the smallest such λ is the cheapest in ``KL(p'‖p)`` along
    this family: the pull stops as soon as the mass is reached.

    Args:
        logits: ``[B, V]`` next-token scores (``-inf`` allowed).
        field: ``[V]`` or ``[B, V]`` field values.
        target: the mass to reach, a float or ``[B]``.
        max_strength: λ_max, a float or ``[B]``.
        iterations: bits of λ's grid (what as many bisection steps would resolve).
        candidates: how many field columns (largest ``|a|``, per row) take part in each iteration.

    >>> import torch
    >>> logits = torch.zeros(2, 4)
    >>> field = torch.tensor([1.0, 0.0, 0.0, 0.0])
    >>> lam = solve_strength(logits, field, torch.tensor([0.2, 0.5]), 8.0)
    >>> lam[0].item(), round(lam[1].item(), 2)  # mass 0.25 already reaches 0.2; ln 3 for 0.5
    (0.0, 1.1)
    """
    _check_iterations(iterations)
    _check_max_strength(max_strength)
    _check_candidates(candidates)
    b, device = logits.shape[0], logits.device
    p, entropy = probabilities(logits)
    prob = MassProblem(p, entropy, field, True, candidates)
    target_t = torch.as_tensor(target, dtype=torch.float32, device=device).expand(b)
    hi = torch.as_tensor(max_strength, dtype=torch.float32, device=device).expand(b)
    return prob.solve(target_t, hi, iterations)

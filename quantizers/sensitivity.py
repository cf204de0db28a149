"""Mixed precision from measured damage: the score, and an allocation under a bit budget.

Score (per decoder Linear and candidate width): the damage the tuned quantizer does when that
Linear alone is quantized at that width, on the block's real inputs, weighted by how much the
model's output cares about each channel of the block's output:

    score = mean over tokens of  sum_c F[c] * delta[t, c]^2,

delta = block output with the Linear tuned at the width minus the source block's output, and F the
diagonal Fisher of the model's output distributions at that block's output (mean squared gradient
of log-likelihoods of labels sampled from the model). To second order, half the score is the KL the
Linear's quantization adds to the model's outputs, so scores of different blocks add up.

Allocation: one width per unit (a fused group that must share one width, or a Linear alone), the
least total score within a budget of stored bits: a multiple-choice knapsack, solved exactly (its
costs are whole cells; see `allocate`). A Lagrangian walk along each unit's convex hull, as
llama.cpp's target-bpw does, stops up to one unit's step short of the budget, which on a model of
28 Linears is a tenth of a bit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .autoround import AutoRoundConfig
from .errors import QuantizerError
from .formats import gptq
from .rtn import SUPPORTED_BITS


def sig(x: float, digits: int = 6) -> float:
    """Round to significant digits: stable bytes in JSON, stable ties in sorting."""
    return float(f"{x:.{digits}g}")


def bits_per_weight(bits: int, group_size: int) -> float:
    """Stored bits per weight of one GPTQ-packed Linear, as the format counts them (one group of one row)."""
    return gptq.stored_bits(1, group_size, bits, group_size) / group_size


Grid = tuple[int, int]  # (bits, group_size): one candidate storage of a Linear


def grid_name(grid: Grid) -> str:
    return f"{grid[0]}g{grid[1]}"


def parse_grids(grids, where: str = "grids") -> list[Grid]:
    """[[bits, group_size], ...] from YAML -> sorted, checked grids the GPTQ packing stores."""
    out = []
    for item in grids:
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(v, int) for v in item)):
            raise ValueError(f"{where}: each entry is [bits, group_size], got {item!r}")
        b, g = item
        if b not in SUPPORTED_BITS:
            raise ValueError(f"{where}: unknown width {b} (allowed: {list(SUPPORTED_BITS)})")
        if g not in gptq.GROUP_SIZES:
            raise ValueError(f"{where}: group_size {g} is not one the GPTQ packing stores (allowed: {list(gptq.GROUP_SIZES)})")
        out.append((b, g))
    if len(set(out)) != len(out):
        raise ValueError(f"{where}: a grid is listed twice")
    return sorted(out, key=lambda grid: (bits_per_weight(*grid), grid))


@dataclass(frozen=True)
class SensitivityConfig(AutoRoundConfig):
    """auto-round's tuning (the inherited fields; bits/group_size are the nominal grid, the format's
    global one) at per-Linear grids chosen from `grids` to reach `target_bpw`."""

    grids: list[list[int]] = field(default_factory=lambda: [[2, 128], [3, 128], [4, 128], [8, 128]])
    target_bpw: float = 3.1485  # stored bits per backbone-Linear weight, scales and zeros included

    def validate(self):
        super().validate()
        if self.bits not in (2, 3):
            raise ValueError(f"bits: the nominal width must be 2 or 3, got {self.bits}")
        if not self.sym:
            raise ValueError("sym: mixed widths are stored symmetric (auto-round has no CPU kernel for asymmetric 3-bit)")
        grids = parse_grids(self.grids)
        if len(grids) < 2:
            raise ValueError(f"grids: needs at least two grids to allocate among, got {self.grids}")
        lo, hi = bits_per_weight(*grids[0]), bits_per_weight(*grids[-1])
        if not lo <= self.target_bpw <= hi:
            raise ValueError(f"target_bpw: {self.target_bpw} cannot be reached with these grids: every Linear at "
                             f"{grid_name(grids[0])} stores {lo:.4f}, every Linear at {grid_name(grids[-1])} {hi:.4f}")

    def candidates(self) -> list[Grid]:
        return parse_grids(self.grids)

    def tuning(self, grid: Grid | None = None) -> AutoRoundConfig:
        """auto-round's config for a block tuned uniformly at `grid` (default: the nominal grid)."""
        fields = {k: getattr(self, k) for k in AutoRoundConfig.__dataclass_fields__}
        return AutoRoundConfig(**(fields | ({"bits": grid[0], "group_size": grid[1]} if grid else {})))


def weighted_error(delta: torch.Tensor, fisher: torch.Tensor) -> float:
    """Mean over tokens of sum_c F[c] delta[t, c]^2 (float64)."""
    d = delta.reshape(-1, delta.shape[-1]).double()
    return float((d * d).sum(0) @ fisher.to(d.device) / d.shape[0])


def units(names, groups=()) -> list[tuple[str, ...]]:
    """The allocation's units: each fused group (runtimes fuse q/k/v and gate/up into one kernel and
    need one width for them) and every other tensor alone. Sorted, so the order is input-free."""
    names, out, seen = set(names), [], set()
    for g in groups:
        members = tuple(sorted(n for n in g if n in names))
        if len(members) != len(g):
            raise QuantizerError(f"fused group {list(g)}: {sorted(set(g) - names)[0]} has no measured score")
        if seen & set(members):
            raise QuantizerError(f"fused group {list(g)}: {sorted(seen & set(members))[0]} is in two groups")
        seen |= set(members)
        out.append(members)
    return sorted(out + [(n,) for n in names - seen])


@dataclass(frozen=True)
class Allocation:
    grids: dict[str, Grid]  # tensor -> its grid
    damage: float  # the sum of the chosen grids' measured scores (the knapsack's objective)
    stored_bits: int  # what the chosen grids store, scales and zeros included
    options: dict[tuple[str, ...], dict[Grid, tuple[int, float]]]  # unit -> grid -> (stored bits, damage)


MAX_CELLS = 1 << 20  # the knapsack's budget resolution: finer costs are rounded up to this many cells


def allocate(scores: dict[str, dict[Grid, float]], shapes: dict[str, tuple[int, int]], grids: list[Grid],
             target_bpw: float, groups=()) -> Allocation:
    """The least total damage at most `target_bpw` stored bits per weight can buy: one grid per unit
    (fused groups share one), solved as a multiple-choice knapsack by dynamic programming.

    Costs are the format's exact stored bits; above each unit's cheapest grid they are counted in cells
    of their greatest common divisor (rounded up to whole cells only if that would need more than
    MAX_CELLS, so the result never exceeds the target). Units go in name order and ties keep the
    cheaper grid, so the result is a pure function of the scores; more budget never raises the damage."""
    for name, s in scores.items():
        missing = [g for g in grids if g not in s]
        if missing:
            raise QuantizerError(f"{name}: no measured score at {grid_name(missing[0])} (measured: "
                                 f"{', '.join(grid_name(g) for g in sorted(s))})")
    unit_list = units(scores, groups)
    options = {}
    for u in unit_list:
        for n in u:
            for b, g in grids:
                if shapes[n][1] % g:
                    raise QuantizerError(f"{n}: input width {shapes[n][1]} is not a multiple of group_size {g}")
        options[u] = {grid: (sum(gptq.stored_bits(*shapes[n], *grid) for n in u), sum(scores[n][grid] for n in u))
                      for grid in grids}
    total = sum(o * i for o, i in shapes.values())
    base = {u: min(c for c, _ in opts.values()) for u, opts in options.items()}
    extra = {u: {grid: c - base[u] for grid, (c, _) in opts.items()} for u, opts in options.items()}
    slack = target_bpw * total - sum(base.values())
    if slack < -1e-6 * total:
        raise QuantizerError(f"target_bpw {target_bpw} is below {sum(base.values()) / total:.4f}, every Linear at "
                             f"its cheapest grid")
    cell = math.gcd(*(e for ex in extra.values() for e in ex.values())) or 1
    cell = max(cell, math.ceil(max(slack, 0) / MAX_CELLS))
    budget = max(0, math.floor(slack / cell + 1e-9))
    best = np.full(budget + 1, np.inf)
    best[0] = 0.0  # least damage with exactly c cells spent (units so far)
    picks = []
    for u in unit_list:
        order = sorted(options[u], key=lambda grid: (extra[u][grid], grid))  # cheaper first: ties keep it
        table = np.full((len(order), budget + 1), np.inf)
        for k, grid in enumerate(order):
            c = -(-extra[u][grid] // cell)
            if c <= budget:
                table[k, c:] = best[:budget + 1 - c] + options[u][grid][1]
        pick = table.argmin(0)
        best = table[pick, np.arange(budget + 1)]
        picks.append((order, pick))
    c = int(np.argmin(best))  # least damage, then fewest cells
    out = {}
    for u, (order, pick) in zip(reversed(unit_list), reversed(picks)):
        grid = order[pick[c]]
        out.update(dict.fromkeys(u, grid))
        c -= -(-extra[u][grid] // cell)
    chosen = {u: out[u[0]] for u in unit_list}
    return Allocation(out, sum(options[u][g][1] for u, g in chosen.items()),
                      sum(options[u][g][0] for u, g in chosen.items()), options)



"""Measured per-tensor sensitivity and a bit allocation that is a pure function of it.

Score: the relative output error of one Linear quantized alone (RTN, group-wise) on the
calibration activations X, ||X (W_q - W)^T||^2 / ||X W^T||^2, computed exactly from the
input Gram matrix H = X^T X as tr(dW H dW^T) / tr(W H W^T).

Allocation: every tensor starts at the base width; upgrades to a protect width are taken
greedily by score reduction per extra stored bit, a fused group (q/k/v, gate/up) as one unit.
The upgrade order does not depend on the budget and the allocation is its longest prefix that
fits, so more budget always protects a superset (and never lowers a width).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import QuantizerError
from .formats import gptq
from .rtn import SUPPORTED_BITS, RTNConfig, fake_quantize

KEEP_BF16 = 16  # a protect width of 16 means: store the source BF16 weight as is


def sig(x: float, digits: int = 6) -> float:
    """Round to significant digits: stable bytes in JSON, stable ties in sorting."""
    return float(f"{x:.{digits}g}")


def bits_per_weight(bits: int, group_size: int) -> float:
    """Stored bits per weight of one GPTQ-packed Linear, as the format counts them (one group of
    one row); 16 for a BF16 weight."""
    return 16.0 if bits == KEEP_BF16 else gptq.stored_bits(1, group_size, bits, group_size) / group_size


@dataclass
class SensitivityConfig:
    base_bits: int = 3  # the nominal width: every tensor not protected
    protect_bits: list[int] = field(default_factory=lambda: [4, 8, 16])  # widths a protected tensor may get
    target_bpw: float | None = None  # stored bits per backbone-Linear weight to reach, scales/zeros included
    protect_budget: float | None = None  # or: extra bits per backbone-Linear weight spent on protection

    def validate(self):
        if self.base_bits not in (2, 3):
            raise ValueError(f"base_bits: must be 2 or 3, got {self.base_bits}")
        for b in self.protect_bits:
            if b not in SUPPORTED_BITS + (KEEP_BF16,):
                raise ValueError(f"protect_bits: unknown width {b} (allowed: {list(SUPPORTED_BITS) + [KEEP_BF16]})")
            if b <= self.base_bits:
                raise ValueError(f"protect_bits: width {b} is not above base_bits={self.base_bits}")
        if not self.protect_bits:
            raise ValueError("protect_bits: needs at least one width above base_bits")
        if (self.target_bpw is None) == (self.protect_budget is None):
            raise ValueError("target_bpw: give exactly one of target_bpw and protect_budget")
        if self.protect_budget is not None and self.protect_budget < 0:
            raise ValueError(f"protect_budget: must be >= 0, got {self.protect_budget}")

    def budget(self, group_size: int) -> float:
        """Extra bits per backbone-Linear weight above all-base storage; refuses unreachable targets."""
        lo = bits_per_weight(self.base_bits, group_size)
        hi = bits_per_weight(max(self.protect_bits), group_size)
        extra = self.protect_budget if self.target_bpw is None else self.target_bpw - lo
        what = (f"target_bpw={self.target_bpw}" if self.target_bpw is not None
                else f"protect_budget={self.protect_budget} (-> {lo + extra:.4f} bpw)")
        if extra < 0:
            raise QuantizerError(f"{what} is below {lo:.4f}, the storage of base_bits={self.base_bits} "
                                 f"at group_size={group_size} (nothing protected)")
        if lo + extra > hi:
            raise QuantizerError(f"{what} is above {hi:.4f}, what protect_bits={self.protect_bits} allow "
                                 f"(every tensor at {max(self.protect_bits)} bits)")
        return extra


def gram(x: torch.Tensor) -> torch.Tensor:
    """X^T X over every token of a batch (float64: exact enough to be reproducible)."""
    x = x.reshape(-1, x.shape[-1]).double()
    return x.t() @ x


def output_errors(weight: torch.Tensor, h: torch.Tensor, widths, group_size: int, sym: bool) -> dict[int, float]:
    """{bits: ||X (W_q - W)^T||^2 / ||X W^T||^2} for W quantized alone by RTN at each width, via H = X^T X."""
    w = weight.float()
    wd = w.double()
    ref = ((wd @ h) * wd).sum().clamp(min=1e-30)
    out = {}
    for bits in widths:
        dw = (fake_quantize(w, RTNConfig(bits, group_size, sym)) - w).double()
        out[bits] = float(((dw @ h) * dw).sum() / ref)
    return out


@dataclass(frozen=True)
class Upgrade:
    tensors: tuple[str, ...]  # one tensor, or a fused group that must share one width
    from_bits: int
    to_bits: int
    gain_per_bit: float  # score reduction per extra stored bit (rounded)
    extra_bits: float


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


def upgrade_order(scores: dict[str, dict[int, float]], numel: dict[str, int], base_bits: int,
                  protect_bits: list[int], group_size: int, groups=()) -> list[Upgrade]:
    """The full greedy sequence of upgrades, independent of any budget.

    scores[name][bits] is the measured damage at each width (KEEP_BF16 scores 0); a fused group's
    damage is the sum of its members' and its cost their total. Ties break on the unit's names, then
    width, so the order is a pure function of its inputs.
    """
    widths = sorted(set(protect_bits))
    for name, s in scores.items():
        missing = [b for b in [base_bits, *widths] if b != KEEP_BF16 and b not in s]
        if missing:
            raise QuantizerError(f"{name}: no measured score at {missing[0]} bits (measured: {sorted(s)})")
    score = lambda unit, b: 0.0 if b == KEEP_BF16 else sum(scores[n][b] for n in unit)
    size = {u: sum(numel[n] for n in u) for u in units(scores, groups)}
    cost = {b: bits_per_weight(b, group_size) for b in [base_bits, *widths]}
    current = {u: base_bits for u in size}
    order = []
    while True:
        best = None
        for unit in sorted(current):
            cur = current[unit]
            for b in widths:
                if b <= cur:
                    continue
                extra = size[unit] * (cost[b] - cost[cur])
                gain = sig((score(unit, cur) - score(unit, b)) / extra)
                key = (-gain, unit, b)
                if best is None or key < best[0]:
                    best = (key, Upgrade(unit, cur, b, gain, extra))
        if best is None:
            return order
        order.append(best[1])
        current[best[1].tensors] = best[1].to_bits


def allocate(scores: dict[str, dict[int, float]], numel: dict[str, int], cfg: SensitivityConfig,
             group_size: int, groups=()) -> tuple[dict[str, int], list[Upgrade]]:
    """Widths per tensor under the config's budget (fused groups at one width), and the upgrades taken."""
    budget = cfg.budget(group_size) * sum(numel.values())
    taken, spent = [], 0.0
    for up in upgrade_order(scores, numel, cfg.base_bits, cfg.protect_bits, group_size, groups):
        if spent + up.extra_bits > budget + 1e-6:
            break  # a prefix, never a skip: keeps protection monotone in the budget
        taken.append(up)
        spent += up.extra_bits
    widths = {name: cfg.base_bits for name in scores}
    for up in taken:
        widths.update(dict.fromkeys(up.tensors, up.to_bits))
    return widths, taken


def estimated_bpw(widths: dict[str, int], numel: dict[str, int], group_size: int) -> float:
    total = sum(numel.values())
    return sum(numel[n] * bits_per_weight(b, group_size) for n, b in widths.items()) / total

"""Group-wise integer quantization: the grid every method shares, and round-to-nearest.

A weight W [out, in] is split along `in` into groups of `group_size`; each (row, group)
gets a scale s and an integer zero z so that W ~ (q - z) * s with q in [0, 2^bits - 1].
Symmetric grids fix z = 2^(bits-1) (the GPTQ/auto-round convention).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .errors import QuantizerError

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class RTNConfig:
    bits: int = 4
    group_size: int = 128
    sym: bool = False

    def validate(self):
        check_grid(self.bits, self.group_size)


@dataclass
class IntWeight:
    """An integer-quantized Linear weight, in natural [out, in] orientation."""

    q: torch.Tensor  # [out, in] int32 in [0, 2^bits)
    scales: torch.Tensor  # [out, in // group] float32
    zeros: torch.Tensor  # [out, in // group] int32
    bits: int
    group_size: int
    sym: bool

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize(self.q, self.scales, self.zeros, self.group_size).to(dtype)

    def to(self, device) -> "IntWeight":
        return replace(self, q=self.q.to(device), scales=self.scales.to(device), zeros=self.zeros.to(device))


GROUP_SIZES = (32, 64, 128, 256)


def check_grid(bits: int, group_size: int) -> None:
    """Schema-level check (raises ValueError "key: ..." for the profile validator)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits: {bits} is not supported (allowed: {list(SUPPORTED_BITS)})")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size: {group_size} is not supported (allowed: {list(GROUP_SIZES)})")


def check_shape(name: str, weight: torch.Tensor, bits: int, group_size: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise QuantizerError(f"{name}: bits={bits} is not supported (allowed: {list(SUPPORTED_BITS)})")
    if weight.dim() != 2:
        raise QuantizerError(f"{name}: expected a 2-D Linear weight, got shape {tuple(weight.shape)}")
    if weight.shape[1] % group_size:
        raise QuantizerError(
            f"{name}: group_size={group_size} does not divide the input width {weight.shape[1]}"
        )


def true_divide(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b, correctly rounded on every device. torch's CUDA kernel turns a division by a Python
    number into a multiplication by its reciprocal (other codes than the CPU's, measured on an H200);
    a 0-d tensor on the same device keeps it a true division."""
    return a / torch.tensor(b, dtype=a.dtype, device=a.device)


def grid_params(w: torch.Tensor, bits: int, group_size: int, sym: bool):
    """Scale and zero per (row, group) from the group's min/max (float32 math)."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    maxq = 2**bits - 1
    if sym:
        amax = g.abs().amax(-1).clamp(min=1e-8)
        scales = true_divide(amax, 2 ** (bits - 1) - 0.5)  # full use of both ends: +-(2^(b-1) - 1/2) steps
        zeros = torch.full_like(scales, 2 ** (bits - 1), dtype=torch.int32)
    else:
        gmin = g.amin(-1).clamp(max=0)
        gmax = g.amax(-1).clamp(min=0)
        scales = true_divide(gmax - gmin, maxq).clamp(min=1e-8)
        zeros = torch.round(-gmin / scales).clamp(0, maxq).to(torch.int32)
    # Scales are stored as float16 on disk: round now so quantization sees the stored grid.
    scales = scales.to(torch.float16).float()
    return scales, zeros


def quantize_to_grid(w, scales, zeros, bits: int, group_size: int) -> torch.Tensor:
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    q = torch.round(g / scales[..., None]) + zeros[..., None]
    return q.clamp(0, 2**bits - 1).to(torch.int32).reshape(out_f, in_f)


def dequantize(q, scales, zeros, group_size: int) -> torch.Tensor:
    out_f, in_f = q.shape
    g = q.reshape(out_f, in_f // group_size, group_size).float()
    return ((g - zeros[..., None].float()) * scales[..., None].float()).reshape(out_f, in_f)


def quantize_rtn(weight: torch.Tensor, cfg: RTNConfig, name: str = "weight") -> IntWeight:
    check_shape(name, weight, cfg.bits, cfg.group_size)
    scales, zeros = grid_params(weight, cfg.bits, cfg.group_size, cfg.sym)
    q = quantize_to_grid(weight, scales, zeros, cfg.bits, cfg.group_size)
    return IntWeight(q, scales, zeros, cfg.bits, cfg.group_size, cfg.sym)


def fake_quantize(weight: torch.Tensor, cfg: RTNConfig) -> torch.Tensor:
    """Quantize and dequantize in one step, in the weight's dtype (for error measurements)."""
    return quantize_rtn(weight, cfg).dequantize(weight.dtype)

"""FP8 (E4M3) weight quantization with per-output-channel scales.

A Linear weight W [out, in] becomes float8_e4m3fn codes and a float32 scale per row with
W ~ codes.float() * scale; scale = amax(|row|) / 448 (the largest finite E4M3 value), so each
row's largest entry lands on the top of the grid. Stored in compressed-tensors' float-quantized
layout (quantizers/formats/fp8_channel.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import QuantizerError
from .formats.fp8_channel import FP8_DTYPE, FP8Weight
from .rtn import true_divide

FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# All-zero rows would get a zero scale; compressed-tensors substitutes float32 eps the same way.
SCALE_EPS = float(torch.finfo(torch.float32).eps)


@dataclass(frozen=True)
class FP8Config:
    strategy: str = "channel"  # per output channel; the only strategy implemented
    # Linear modules kept BF16 (compressed-tensors `ignore`). The codec method also accepts the
    # roles `first_input_proj` / `last_output_proj` and resolves them to module names.
    keep_bf16: tuple[str, ...] = ()

    def validate(self):
        if self.strategy != "channel":
            raise ValueError(f"strategy: {self.strategy!r} is not supported (only 'channel')")


def quantize_fp8(weight: torch.Tensor, cfg: FP8Config = FP8Config(), name: str = "weight") -> FP8Weight:
    if cfg.strategy != "channel":
        raise QuantizerError(f"{name}: FP8 strategy {cfg.strategy!r} is not supported (only 'channel')")
    if weight.dim() != 2 or 0 in weight.shape:
        raise QuantizerError(f"{name}: expected a non-empty 2-D Linear weight, got shape {tuple(weight.shape)}")
    w = weight.float()
    if not torch.isfinite(w).all():
        raise QuantizerError(f"{name}: weight contains NaN or Inf")
    scale = true_divide(w.abs().amax(dim=1, keepdim=True), FP8_MAX)  # the same scale bits on CPU and GPU
    scale = torch.where(scale == 0, torch.full_like(scale, SCALE_EPS), scale)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # round-to-nearest-even cast
    return FP8Weight(q, scale)

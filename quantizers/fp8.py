"""FP8 (E4M3) weight quantization with per-output-channel scales, compressed-tensors layout.

A Linear weight W [out, in] is stored as `weight` (float8_e4m3fn) and `weight_scale`
(float32 [out, 1]) with W ~ weight.float() * weight_scale; scale = amax(|row|) / 448 (the
largest finite E4M3 value), so each row's largest entry lands on the top of the grid.
This is compressed-tensors' "float-quantized" format with a symmetric, channel-strategy
weight scheme; `quantization_config` writes the matching HF config entry so ecosystem
loaders (transformers + compressed-tensors, vLLM) recognise the tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import QuantizerError
from .rtn import true_divide

FP8_DTYPE = torch.float8_e4m3fn
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


@dataclass
class FP8Weight:
    weight: torch.Tensor  # [out, in] float8_e4m3fn
    weight_scale: torch.Tensor  # [out, 1] float32

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)


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


def dequantize_fp8(weight: torch.Tensor, weight_scale: torch.Tensor, dtype=torch.bfloat16, name: str = "weight") -> torch.Tensor:
    if weight.dtype != FP8_DTYPE:
        raise QuantizerError(f"{name}: dtype {weight.dtype}, expected {FP8_DTYPE}")
    if weight.dim() != 2 or tuple(weight_scale.shape) != (weight.shape[0], 1):
        raise QuantizerError(
            f"{name}_scale: shape {list(weight_scale.shape)}, expected [{weight.shape[0] if weight.dim() else '?'}, 1]"
        )
    return (weight.float() * weight_scale.float()).to(dtype)


def quantization_config(ignore: list[str], targets: tuple[str, ...] = ("Linear",)) -> dict:
    """The HF `quantization_config` for FP8 weight-only, per-channel, compressed-tensors format.

    `ignore` names modules matched by `targets` that stay unquantized (BF16).
    """
    weights = {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
        "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": list(targets), "weights": weights, "input_activations": None,
                        "output_activations": None, "format": "float-quantized"},
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
    }

"""compressed-tensors `float-quantized`, FP8 E4M3 weights with per-output-channel scales, what
compressed-tensors' decompressor and vLLM read:

  weight       [out, in] float8_e4m3fn, weight ~ weight.float() * weight_scale
  weight_scale [out, 1] float32
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QuantizerError

NAME = "fp8"
QUANT_METHOD = "compressed-tensors"
PARTS = ("weight", "weight_scale")
MARKER = "weight_scale"  # "weight" alone is also the name of an unquantized tensor
FP8_DTYPE = torch.float8_e4m3fn


@dataclass
class FP8Weight:
    weight: torch.Tensor  # [out, in] float8_e4m3fn
    weight_scale: torch.Tensor  # [out, 1] float32
    bits: int = 8
    group_size: int | None = None
    sym: bool = True

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, dtype)


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype=torch.bfloat16, name: str = "weight") -> torch.Tensor:
    if weight.dtype != FP8_DTYPE:
        raise QuantizerError(f"{name}: dtype {weight.dtype}, expected {FP8_DTYPE}")
    if weight.dim() != 2 or tuple(weight_scale.shape) != (weight.shape[0], 1):
        raise QuantizerError(
            f"{name}_scale: shape {list(weight_scale.shape)}, expected [{weight.shape[0] if weight.dim() else '?'}, 1]")
    return (weight.float() * weight_scale.float()).to(dtype)


def pack(w: FP8Weight) -> dict[str, torch.Tensor]:
    return {"weight": w.weight.cpu(), "weight_scale": w.weight_scale.cpu()}


def unpack(parts: dict[str, torch.Tensor], bits: int = 8, group_size=None, sym: bool = True) -> FP8Weight:
    return FP8Weight(parts["weight"], parts["weight_scale"])


def codes(w: FP8Weight) -> torch.Tensor:
    return w.weight.view(torch.uint8)


def quantization_config(ignore: list[str], targets: tuple[str, ...] = ("Linear",)) -> dict:
    """FP8 weight-only, per-channel, compressed-tensors format; `ignore` names the modules that
    `targets` match but that stay unquantized (BF16)."""
    weights = {
        "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
        "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
    }
    return {
        "quant_method": QUANT_METHOD,
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


def layer_grid(qc: dict, module: str) -> tuple[int, None, bool]:
    return 8, None, True


def layout_record(pw) -> dict:
    """What the manifest's per-tensor layout says beyond format and bits."""
    return {"scale": "per-output-channel float32 [out, 1]"}

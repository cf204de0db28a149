"""Assemble a generator bundle's tensors in auto-round's GPTQ-packed format (or AWQ GEMM).

Quantized decoder Linears become `<name>.qweight/.qzeros/.scales` (quantizers.packing);
every other tensor is stored BF16 and listed as protected with the reason. Per-layer widths
that differ from the default go into `extra_config`, as auto-round writes mixed precision.
"""
from __future__ import annotations

import torch

from quantizers.packing import PackedWeight, pack
from quantizers.rtn import IntWeight

from ..models.moss_tts_delay import BLOCK_PREFIX, component_of
from . import QuantResult

PROTECT_REASON = {
    "embeddings": "embedding table: not a Linear, kept BF16",
    "heads": "output head: kept BF16 (text and audio logits are the most fragile)",
    "norms": "norm gain: tiny and outlier-carrying, kept BF16",
    "other": "not a quantization target, kept BF16",
    "backbone_linears": "kept BF16 by the allocation",
}


def autoround_config(bits: int, group_size: int, sym: bool, extra_config: dict | None = None, **tuning) -> dict:
    cfg = {
        "quant_method": "auto-round",
        "packing_format": "auto_round:auto_gptq",
        "data_type": "int",
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "act_bits": 16,
        "block_name_to_quantize": BLOCK_PREFIX,
        **tuning,
    }
    if extra_config:
        cfg["extra_config"] = dict(sorted(extra_config.items()))
    return cfg


def gptq_result(ckpt, quantized: dict[str, IntWeight | PackedWeight], quantization_config: dict,
                extra: dict | None = None, reasons: dict[str, str] | None = None, fmt: str = "gptq",
                replaced: dict[str, torch.Tensor] | None = None) -> QuantResult:
    """`quantized` maps Linear module names (no `.weight`) to their integer weights, packed (in
    `fmt`: "gptq" or "awq") or not; every other source tensor is stored BF16, from `replaced`
    when the method changed it (AWQ's folded norms), with its reason from `reasons`."""
    tensors, layout, replaced = {}, {}, replaced or {}
    for name in ckpt.keys():
        module = name.removesuffix(".weight")
        if module in quantized:
            pw = quantized[module]
            pw = pw if isinstance(pw, PackedWeight) else pack(pw, fmt)
            for part, t in pw.parts.items():
                tensors[f"{module}.{part}"] = t
            layout[name] = {"format": fmt, "bits": pw.bits, "group_size": pw.group_size, "sym": pw.sym,
                            "stored": sorted(f"{module}.{p}" for p in pw.parts)}
        else:
            tensors[name] = (replaced[name] if name in replaced else ckpt.get(name)).to(torch.bfloat16)
            reason = (reasons or {}).get(name) or PROTECT_REASON[component_of(name)]
            layout[name] = {"format": "bf16", "bits": 16, "stored": [name], "reason": reason}
    return QuantResult(tensors=tensors, quantization_config=quantization_config, layout=layout, extra=extra or {})

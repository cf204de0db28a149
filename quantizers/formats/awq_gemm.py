"""AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`, 4-bit only), what transformers
(through gptqmodel) and vLLM's awq / awq_marlin loaders read:

  qweight [in, out / 8] int32, qzeros [in / group, out / 8] int32: 8 nibbles per word in
          AWQ_ORDER [0, 2, 4, 6, 1, 3, 5, 7]; zeros stored as they are (w = (q - z) * s);
  scales  [in / group, out] float16.
"""
from __future__ import annotations

import torch

from ..errors import QuantizerError
from ..rtn import IntWeight

NAME = "awq"
QUANT_METHOD = "awq"
PARTS = ("qweight", "qzeros", "scales")
MARKER = "qweight"  # the stored part that marks a packed Linear
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_cols(v: torch.Tensor) -> torch.Tensor:
    rows, cols = v.shape
    if cols % 8:
        raise QuantizerError(f"AWQ GEMM packing needs an output width divisible by 8, got {cols}")
    v = v.to(torch.int64).reshape(rows, cols // 8, 8)
    word = torch.zeros(rows, cols // 8, dtype=torch.int64, device=v.device)
    for slot, src in enumerate(AWQ_ORDER):
        word |= (v[..., src] & 0xF) << (4 * slot)
    return (word - ((word >> 31) << 32)).to(torch.int32)


def _unpack_cols(words: torch.Tensor) -> torch.Tensor:
    rows, c8 = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(rows, c8, 8, dtype=torch.int64, device=words.device)
    for slot, src in enumerate(AWQ_ORDER):
        out[..., src] = (w >> (4 * slot)) & 0xF
    return out.reshape(rows, c8 * 8).to(torch.int32)


def pack(iw: IntWeight) -> dict[str, torch.Tensor]:
    if iw.bits != 4:
        raise QuantizerError(f"AWQ GEMM packing is 4-bit only, got bits={iw.bits}")
    # packed where the integers are (integer ops: the same words on any device), stored on the host
    return {
        "qweight": _pack_cols(iw.q.t().contiguous()).cpu(),  # [in, out/8]
        "qzeros": _pack_cols(iw.zeros.t().contiguous()).cpu(),  # [groups, out/8]
        "scales": iw.scales.t().contiguous().to(torch.float16).cpu(),
    }


def unpack(parts: dict[str, torch.Tensor], bits: int = 4, group_size: int = 128, sym: bool = False) -> IntWeight:
    q = _unpack_cols(parts["qweight"]).t().contiguous()
    zeros = _unpack_cols(parts["qzeros"]).t().contiguous()
    scales = parts["scales"].float().t().contiguous()
    return IntWeight(q, scales, zeros, 4, group_size, sym)


def codes(iw: IntWeight) -> torch.Tensor:
    return iw.q


def quantization_config(group_size: int, modules_to_not_convert: list[str]) -> dict:
    return {"quant_method": QUANT_METHOD, "version": "gemm", "bits": 4, "group_size": group_size,
            "zero_point": True, "modules_to_not_convert": list(modules_to_not_convert)}


def layer_grid(qc: dict, module: str) -> tuple[int, int, bool]:
    return 4, int(qc["group_size"]), not qc.get("zero_point", True)


def layout_record(pw) -> dict:
    """What the manifest's per-tensor layout says beyond format and bits."""
    return {"group_size": pw.group_size, "sym": pw.sym}

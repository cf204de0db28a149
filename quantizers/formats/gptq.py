"""auto-round's `auto_round:auto_gptq` packing (GPTQ v1), what transformers' and vLLM's
auto-round/GPTQ loaders read:

  qweight [in * bits / 32, out] int32: the `in` axis packed as one little-endian bit stream per
          32 rows (3-bit values straddle words, as AutoGPTQ writes them);
  qzeros  [in / group, out * bits / 32] int32: zeros minus one (v1), packed along `out`;
  scales  [in / group, out] float16.
Per-layer widths other than the default go into `extra_config`, as auto-round writes mixed precision.
"""
from __future__ import annotations

import torch

from ..errors import QuantizerError
from ..rtn import IntWeight

NAME = "gptq"
QUANT_METHOD = "auto-round"
PACKING = "auto_round:auto_gptq"
PARTS = ("qweight", "qzeros", "scales")
MARKER = "qweight"  # the stored part that marks a packed Linear
BITS = (2, 3, 4, 8)  # widths auto-round's loaders and this packing share
GROUP_SIZES = (32, 64, 128, 256, 512, 1024)  # groups align with 32-row packing words


def _pack_stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int values [n, m] (n a multiple of 32) along dim 0 into [n*bits/32, m] int32."""
    n, m = values.shape
    if n % 32:
        raise QuantizerError(f"cannot pack {n} rows: needs a multiple of 32")
    v = values.to(torch.int64).reshape(n // 32, 32, m)
    words = torch.zeros(n // 32, bits, m, dtype=torch.int64, device=values.device)
    for j in range(32):
        w, s = divmod(j * bits, 32)
        words[:, w] |= (v[:, j] << s) & 0xFFFFFFFF
        if s + bits > 32:
            words[:, w + 1] |= v[:, j] >> (32 - s)
    words = words.reshape(n // 32 * bits, m)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed int32


def _unpack_stream(words: torch.Tensor, bits: int) -> torch.Tensor:
    rows, m = words.shape
    w = (words.to(torch.int64) & 0xFFFFFFFF).reshape(rows // bits, bits, m)
    out = torch.empty(rows // bits, 32, m, dtype=torch.int64, device=words.device)
    mask = (1 << bits) - 1
    for j in range(32):
        k, s = divmod(j * bits, 32)
        val = w[:, k] >> s
        if s + bits > 32:
            val = val | (w[:, k + 1] << (32 - s))
        out[:, j] = val & mask
    return out.reshape(rows // bits * 32, m).to(torch.int32)


def pack(iw: IntWeight) -> dict[str, torch.Tensor]:
    """Packed where the integers are (integer ops: the same words on any device), stored on the host."""
    zeros = (iw.zeros.to(torch.int64) - 1) & ((1 << iw.bits) - 1)  # v1 stores zeros minus one
    return {
        "qweight": _pack_stream(iw.q.t().contiguous(), iw.bits).cpu(),
        "qzeros": _pack_stream(zeros, iw.bits).t().contiguous().cpu(),  # packed along `out`
        "scales": iw.scales.t().contiguous().to(torch.float16).cpu(),
    }


def unpack(parts: dict[str, torch.Tensor], bits: int, group_size: int, sym: bool = False) -> IntWeight:
    q = _unpack_stream(parts["qweight"], bits).t().contiguous()  # [out, in]
    zeros = (_unpack_stream(parts["qzeros"].t().contiguous(), bits) + 1) & ((1 << bits) - 1)  # [out, groups]
    scales = parts["scales"].float().t().contiguous()
    return IntWeight(q, scales, zeros.to(torch.int32), bits, group_size, sym)


def codes(iw: IntWeight) -> torch.Tensor:
    return iw.q


def stored_bits(out_features: int, in_features: int, bits: int, group_size: int) -> int:
    """b-bit codes, plus per (group, output) an fp16 scale and a b-bit zero (stored for
    symmetric grids too)."""
    return out_features * in_features * bits + (in_features // group_size) * out_features * (16 + bits)


def quantization_config(bits: int, group_size: int, sym: bool, block_name: str,
                        extra_config: dict | None = None, **tuning) -> dict:
    cfg = {
        "quant_method": QUANT_METHOD,
        "packing_format": PACKING,
        "data_type": "int",
        "bits": bits,
        "group_size": group_size,
        "sym": sym,
        "act_bits": 16,
        "block_name_to_quantize": block_name,
        **tuning,
    }
    if extra_config:
        cfg["extra_config"] = dict(sorted(extra_config.items()))
    return cfg


def layer_grid(qc: dict, module: str) -> tuple[int, int, bool]:
    """(bits, group_size, sym) of one layer: its `extra_config` entry over the defaults."""
    layer = (qc.get("extra_config") or {}).get(module, {})
    return (int(layer.get("bits", qc["bits"])), int(layer.get("group_size", qc["group_size"])),
            bool(layer.get("sym", qc.get("sym", False))))


def layout_record(pw) -> dict:
    """What the manifest's per-tensor layout says beyond format and bits."""
    return {"group_size": pw.group_size, "sym": pw.sym}

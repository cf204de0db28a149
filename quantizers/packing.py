"""On-disk integer layouts read by the ecosystem's loaders.

GPTQ (auto-round's `auto_round:auto_gptq` packing, GPTQ v1):
  qweight [in * bits / 32, out] int32 — the `in` axis packed as one little-endian bit stream
          per 32 rows (so 3-bit values straddle words, as AutoGPTQ writes them);
  qzeros  [in / group, out * bits / 32] int32 — zeros minus one (v1), packed along `out`;
  scales  [in / group, out] float16.
AWQ GEMM (AutoAWQ `version: gemm`, 4-bit only):
  qweight [in, out / 8] int32, qzeros [in / group, out / 8] int32, 8 nibbles per word in
  AWQ_ORDER [0, 2, 4, 6, 1, 3, 5, 7]; scales [in / group, out] float16; zeros stored as is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import QuantizerError
from .rtn import IntWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack_stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack int values [n, m] (n a multiple of 32) along dim 0 into [n*bits/32, m] int32."""
    n, m = values.shape
    if n % 32:
        raise QuantizerError(f"cannot pack {n} rows: needs a multiple of 32")
    v = values.to(torch.int64).reshape(n // 32, 32, m)
    words = torch.zeros(n // 32, bits, m, dtype=torch.int64)
    for j in range(32):
        off = j * bits
        w, s = divmod(off, 32)
        words[:, w] |= (v[:, j] << s) & 0xFFFFFFFF
        if s + bits > 32:
            words[:, w + 1] |= v[:, j] >> (32 - s)
    words = words.reshape(n // 32 * bits, m)
    return (words - ((words >> 31) << 32)).to(torch.int32)  # reinterpret as signed int32


def _unpack_stream(words: torch.Tensor, bits: int) -> torch.Tensor:
    rows, m = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = w.reshape(rows // bits, bits, m)
    out = torch.empty(rows // bits, 32, m, dtype=torch.int64)
    mask = (1 << bits) - 1
    for j in range(32):
        off = j * bits
        k, s = divmod(off, 32)
        val = w[:, k] >> s
        if s + bits > 32:
            val = val | (w[:, k + 1] << (32 - s))
        out[:, j] = val & mask
    return out.reshape(rows // bits * 32, m).to(torch.int32)


def pack_gptq(iw: IntWeight) -> dict[str, torch.Tensor]:
    return {
        "qweight": _pack_stream(iw.q.t().contiguous(), iw.bits),
        "qzeros": _pack_zeros(iw.zeros - 1, iw.bits),
        "scales": iw.scales.t().contiguous().to(torch.float16),
    }


def _pack_zeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    # zeros [out, n_groups] -> pack along `out` -> [n_groups, out*bits/32]
    z = zeros.to(torch.int64) & ((1 << bits) - 1)
    return _pack_stream(z, bits).t().contiguous()


def unpack_gptq(tensors: dict[str, torch.Tensor], bits: int, group_size: int) -> IntWeight:
    q = _unpack_stream(tensors["qweight"], bits).t().contiguous()  # [out, in]
    zeros = (_unpack_stream(tensors["qzeros"].t().contiguous(), bits) + 1) & ((1 << bits) - 1)  # [out, groups]
    scales = tensors["scales"].float().t().contiguous()
    return IntWeight(q, scales, zeros.to(torch.int32), bits, group_size, sym=False)


def pack_awq(iw: IntWeight) -> dict[str, torch.Tensor]:
    if iw.bits != 4:
        raise QuantizerError(f"AWQ GEMM packing is 4-bit only, got bits={iw.bits}")
    return {
        "qweight": _pack_awq_cols(iw.q.t().contiguous()),  # [in, out/8]
        "qzeros": _pack_awq_cols(iw.zeros.t().contiguous()),  # [groups, out/8]
        "scales": iw.scales.t().contiguous().to(torch.float16),
    }


def _pack_awq_cols(v: torch.Tensor) -> torch.Tensor:
    rows, cols = v.shape
    if cols % 8:
        raise QuantizerError(f"AWQ GEMM packing needs an output width divisible by 8, got {cols}")
    v = v.to(torch.int64).reshape(rows, cols // 8, 8)
    word = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for slot, src in enumerate(AWQ_ORDER):
        word |= (v[..., src] & 0xF) << (4 * slot)
    return (word - ((word >> 31) << 32)).to(torch.int32)


def _unpack_awq_cols(words: torch.Tensor) -> torch.Tensor:
    rows, c8 = words.shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(rows, c8, 8, dtype=torch.int64)
    for slot, src in enumerate(AWQ_ORDER):
        out[..., src] = (w >> (4 * slot)) & 0xF
    return out.reshape(rows, c8 * 8).to(torch.int32)


def unpack_awq(tensors: dict[str, torch.Tensor], group_size: int) -> IntWeight:
    q = _unpack_awq_cols(tensors["qweight"]).t().contiguous()
    zeros = _unpack_awq_cols(tensors["qzeros"]).t().contiguous()
    scales = tensors["scales"].float().t().contiguous()
    return IntWeight(q, scales, zeros, 4, group_size, sym=False)


@dataclass(frozen=True)
class PackedWeight:
    """A Linear's stored parts (qweight, qzeros, scales) and its grid: what the bundle holds.
    Methods pack each Linear as soon as it is quantized, so a whole model's integers are never
    resident unpacked (int [out, in] is 2-8x the packed size)."""
    parts: dict[str, torch.Tensor]
    bits: int
    group_size: int
    sym: bool


def pack(iw: IntWeight, layout: str) -> PackedWeight:
    """`layout`: "gptq" (auto-round / GPTQ v1) or "awq" (AWQ GEMM)."""
    packer = {"gptq": pack_gptq, "awq": pack_awq}[layout]
    return PackedWeight(packer(iw.to_cpu()), iw.bits, iw.group_size, iw.sym)

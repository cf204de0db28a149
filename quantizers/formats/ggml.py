"""ggml's legacy block types, written from our integer weights without re-quantizing them.

Every type holds 32 consecutive input weights of one output row per block, in the layouts of
ggml-common.h (gguf-py's quants.py reads them back):

  Q4_0  d:f16, qs[16]           x = d * (c - 8),   c in [0, 15]      18 bytes (4.5 bpw)
  Q4_1  d:f16, m:f16, qs[16]    x = d * c + m,     c in [0, 15]      20 bytes (5.0 bpw)
  Q5_0  d:f16, qh:u32, qs[16]   x = d * (c - 16),  c in [0, 31]      22 bytes (5.5 bpw)
  Q8_0  d:f16, qs:i8[32]        x = d * c,         c in [-128, 127]  34 bytes (8.5 bpw)

qs[j] holds value j in its low nibble and value j + 16 in its high nibble; Q5_0's fifth bits are
the little-endian bits of qh. A group of our grid (w = s * (q - z), s an fp16 number) spans
group_size / 32 blocks sharing its scale, so:

  Q5_0: d = s, c = q - z + 16   exact for any grid of at most 4 bits (|q - z| <= 15)
  Q4_0: d = s, c = q - z + 8    exact where q - z stays in [-8, 7] (symmetric grids of <= 4 bits)
  Q8_0: d = s, c = q - z        exact where q - z stays in [-128, 127] (every grid of <= 7 bits, sym 8-bit)
  Q4_1: d = s, c = q, m = f16(-s * z)   not exact: m is rounded to float16

Exact means bit for bit: ggml computes d * float(c - k) in float32, as our dequantization
computes (q - z) * s.

It is also a bundle format for the embedding tables and heads (`NAME = "ggml"`): a table quantized
symmetric in groups of 32 is stored as the GGUF tensor's own bytes, `<module>.q8_0` or `<module>.q4_0`
(uint8 [rows, row bytes]; the part's name says the type, so no quantization_config entry is needed),
exactly 8.5 or 4.5 bits per weight, copied unchanged into a GGUF and read there by llama.cpp.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import QuantizerError
from ..rtn import IntWeight

BLOCK = 32
TYPE_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34}
EXACT_ORDER = ("Q4_0", "Q5_0", "Q8_0")  # the smallest exact type wins when a profile asks for "exact"


def _codes(iw: IntWeight) -> tuple[np.ndarray, np.ndarray]:
    """(q - z per weight [out, in] int32, the fp16 scale of each 32-block [out, in/32])."""
    out_f, in_f = iw.q.shape
    if iw.group_size % BLOCK or in_f % BLOCK:
        raise QuantizerError(f"group_size {iw.group_size} / width {in_f}: ggml blocks are 32 weights, both must be multiples")
    zeros = iw.zeros.repeat_interleave(iw.group_size, dim=1)
    rel = (iw.q.to(torch.int64) - zeros.to(torch.int64)).numpy().astype(np.int32)
    scales = iw.scales.to(torch.float16).repeat_interleave(iw.group_size // BLOCK, dim=1).numpy()
    if not np.array_equal(scales.astype(np.float32), iw.scales.repeat_interleave(iw.group_size // BLOCK, dim=1).numpy()):
        raise QuantizerError("scales are not float16 numbers: no exact ggml block")
    return rel, scales


RANGES = {"Q4_0": (-8, 7), "Q5_0": (-16, 15), "Q8_0": (-128, 127)}  # q - z each type holds (Q4_1: none exactly)


def _span(iw: IntWeight) -> tuple[int, int]:
    rel = iw.q.to(torch.int64) - iw.zeros.repeat_interleave(iw.group_size, dim=1).to(torch.int64)
    return int(rel.min()), int(rel.max())


def fits(iw: IntWeight, ggml_type: str, span: tuple[int, int] | None = None) -> bool:
    """Whether `ggml_type` holds these integers exactly."""
    if ggml_type not in RANGES:
        return False
    (lo, hi), (mn, mx) = RANGES[ggml_type], span or _span(iw)
    return lo <= mn and mx <= hi


def exact_type(iw: IntWeight) -> str | None:
    span = _span(iw)
    return next((t for t in EXACT_ORDER if fits(iw, t, span)), None)


def _nibbles(c: np.ndarray) -> np.ndarray:
    """[n, 32] values in [0, 15] -> [n, 16] bytes: value j low, value j + 16 high."""
    c = c.astype(np.uint8)
    return c[:, :16] | (c[:, 16:] << np.uint8(4))


def pack(iw: IntWeight, ggml_type: str) -> np.ndarray:
    """[out, in/32 * type bytes] uint8: the rows of the tensor as ggml blocks."""
    out_f, in_f = iw.q.shape
    rel, d = _codes(iw)
    if ggml_type in RANGES and not fits(iw, ggml_type, (int(rel.min()), int(rel.max()))):
        raise QuantizerError(f"{ggml_type} cannot hold this {iw.bits}-bit grid exactly (sym={iw.sym})")
    n = out_f * in_f // BLOCK
    rel, d = rel.reshape(n, BLOCK), d.reshape(n, 1)
    dbytes = d.view(np.uint8).reshape(n, 2)
    if ggml_type == "Q4_0":
        body = [dbytes, _nibbles(rel + 8)]
    elif ggml_type == "Q5_0":
        c = (rel + 16).astype(np.uint8)
        qh = np.packbits((c >> np.uint8(4)) & np.uint8(1), axis=-1, bitorder="little").reshape(n, 4)
        body = [dbytes, qh, _nibbles(c & np.uint8(0xF))]
    elif ggml_type == "Q8_0":
        body = [dbytes, rel.astype(np.int8).view(np.uint8)]
    elif ggml_type == "Q4_1":
        q = iw.q.numpy().astype(np.int32).reshape(n, BLOCK)
        z = iw.zeros.repeat_interleave(iw.group_size // BLOCK, dim=1).numpy().reshape(n, 1).astype(np.float32)
        m = (-d.astype(np.float32) * z).astype(np.float16)
        body = [dbytes, m.view(np.uint8).reshape(n, 2), _nibbles(q)]
    else:
        raise QuantizerError(f"ggml type {ggml_type!r} is not written here (known: {', '.join(TYPE_BYTES)})")
    return np.concatenate(body, axis=1).reshape(out_f, in_f // BLOCK * TYPE_BYTES[ggml_type])


# ---- the table format: ggml blocks as a bundle's stored parts ------------------------------------

NAME = "ggml"
QUANT_METHOD = None  # never named by a quantization_config: the part name says the type
TABLE_TYPES = {8: "Q8_0", 4: "Q4_0"}  # width -> ggml type (symmetric groups of 32)
PARTS = tuple(t.lower() for t in TABLE_TYPES.values())


def part_of(bits: int) -> str:
    if bits not in TABLE_TYPES:
        raise QuantizerError(f"a table is stored at {sorted(TABLE_TYPES)} bits, not {bits}")
    return TABLE_TYPES[bits].lower()


def bits_of(part: str) -> int:
    return next(b for b, t in TABLE_TYPES.items() if t.lower() == part)


def pack_table(iw: IntWeight) -> dict[str, torch.Tensor]:
    """A symmetric g32 IntWeight of 4 or 8 bits -> {"q4_0" | "q8_0": uint8 [rows, row bytes]}."""
    if (iw.group_size, iw.sym) != (BLOCK, True):
        raise QuantizerError(f"a ggml table needs a symmetric grid in groups of {BLOCK}, got group_size "
                             f"{iw.group_size} sym={iw.sym}")
    part = part_of(iw.bits)
    return {part: torch.from_numpy(pack(iw, part.upper()))}


def unpack(parts: dict[str, torch.Tensor], bits: int, group_size: int = BLOCK, sym: bool = True) -> IntWeight:
    """The inverse of pack_table (ggml-common.h's layouts read back into our grid); the format protocol's
    unpack (a table's PackedWeight dequantizes through it). Its `pack` is the block writer above."""
    part = part_of(bits)
    raw = parts[part].numpy()
    rows, n = raw.shape[0], raw.shape[1] // TYPE_BYTES[part.upper()]
    blocks = raw.reshape(rows * n, TYPE_BYTES[part.upper()])
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, n)
    if part == "q8_0":
        rel = blocks[:, 2:].copy().view(np.int8).astype(np.int32)
    else:
        qs = blocks[:, 2:]
        rel = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int32) - 8
    zero = 2 ** (bits - 1)
    q = torch.from_numpy(rel.reshape(rows, n * BLOCK) + zero).to(torch.int32)
    return IntWeight(q, torch.from_numpy(d), torch.full((rows, n), zero, dtype=torch.int32), bits, BLOCK, True)


def codes(iw: IntWeight) -> torch.Tensor:
    return iw.q


def layout_record(pw) -> dict:
    return {"group_size": pw.group_size, "sym": pw.sym, "ggml_type": part_of(pw.bits).upper()}

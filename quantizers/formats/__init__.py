"""On-disk weight formats, one module each (gptq, awq_gemm, fp8_channel; ggml for tables). A format module owns
`pack` / `unpack`, its Hugging Face `quantization_config`, how to read one layer's grid back from
that config, and its stored-bits formula. A `PackedWeight` knows its format and dequantizes
itself: the loader, export, the bits count and the sensitivity cost model all ask the format.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QuantizerError
from . import awq_gemm, fp8_channel, ggml, gptq

FORMATS = {m.NAME: m for m in (gptq, awq_gemm, fp8_channel, ggml)}


@dataclass(frozen=True)
class PackedWeight:
    """One Linear as stored: its parts (on disk as `<module>.<suffix>`), its grid and its format.
    Methods pack each Linear as soon as it is quantized, so a whole model's integers are never
    resident unpacked (int [out, in] is 2-8x the packed size)."""

    format: str
    parts: dict[str, torch.Tensor]
    bits: int
    group_size: int | None
    sym: bool

    @property
    def spec(self):
        return FORMATS[self.format]

    def unpack(self):
        return self.spec.unpack(self.parts, self.bits, self.group_size, self.sym)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        return self.unpack().dequantize(dtype)

    def codes(self) -> torch.Tensor:
        """The integer codes (FP8: the bit patterns), [out, in]."""
        return self.spec.codes(self.unpack())


def format_module(name: str):
    if name not in FORMATS:
        raise QuantizerError(f"unknown weight format {name!r} (known: {', '.join(FORMATS)})")
    return FORMATS[name]


def pack(weight, fmt: str) -> PackedWeight:
    """An IntWeight (gptq, awq) or FP8Weight (fp8) in format `fmt`."""
    mod = format_module(fmt)
    return PackedWeight(fmt, mod.pack(weight), weight.bits, weight.group_size, weight.sym)


def for_config(quantization_config: dict | None):
    """The format module a config.json `quantization_config` describes (None: unquantized)."""
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    for mod in FORMATS.values():
        if mod.QUANT_METHOD is not None and mod.QUANT_METHOD == method:
            return mod
    raise QuantizerError(f"quantization_config.quant_method {method!r} is not a format this project reads "
                         f"(known: {', '.join(m.QUANT_METHOD for m in FORMATS.values() if m.QUANT_METHOD)})")


def table(module: str, part: str, get) -> PackedWeight:
    """An embedding table or head stored as ggml blocks (`<module>.q8_0` / `.q4_0`)."""
    return PackedWeight(ggml.NAME, {part: get(f"{module}.{part}")}, ggml.bits_of(part), ggml.BLOCK, True)


def stored(fmt, module: str, get, quantization_config: dict) -> PackedWeight:
    """Read one stored Linear back (`get(name)` returns a stored tensor)."""
    bits, group_size, sym = fmt.layer_grid(quantization_config, module)
    return PackedWeight(fmt.NAME, {p: get(f"{module}.{p}") for p in fmt.PARTS}, bits, group_size, sym)

"""Turn stored (packed) tensors back into source-named weights, and bundles into modules.

Works from `config.json`'s `quantization_config` alone, as ecosystem loaders do:
auto-round (GPTQ packing, per-layer `extra_config`), AWQ GEMM, compressed-tensors FP8.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from quantizers.packing import unpack_awq, unpack_gptq

from .checkpoint import Checkpoint
from .errors import PipelineError
from .models.moss_tts_delay import MossTTSDelay, MossTTSDelayConfig, build_empty, load_state

PACKED_PARTS = ("qweight", "qzeros", "scales")


class DequantizingView:
    """A getter over stored tensors that returns source-named, dequantized weights."""

    def __init__(self, get, keys, quantization_config: dict | None):
        self._get = get
        self.qc = quantization_config or {}
        self.method = self.qc.get("quant_method")
        keys = set(keys)
        self.packed = {k[: -len(".qweight")] for k in keys if k.endswith(".qweight")}
        self.fp8 = {k[: -len(".weight_scale")] for k in keys if k.endswith(".weight_scale")}
        self.plain = {k for k in keys if not k.endswith(tuple("." + p for p in PACKED_PARTS + ("weight_scale",)))}
        self.plain -= {m + ".weight" for m in self.fp8}

    def names(self) -> list[str]:
        return sorted(self.plain | {m + ".weight" for m in self.packed | self.fp8})

    def _unpack(self, module: str):
        parts = {p: self._get(f"{module}.{p}") for p in PACKED_PARTS}
        if self.method == "awq":
            return unpack_awq(parts, self.qc["group_size"])
        if self.method == "auto-round":
            layer = (self.qc.get("extra_config") or {}).get(module, {})
            return unpack_gptq(parts, layer.get("bits", self.qc["bits"]), layer.get("group_size", self.qc["group_size"]))
        raise PipelineError(f"tensor {module}.qweight: unsupported quant_method {self.method!r}")

    def __call__(self, name: str) -> torch.Tensor:
        module = name.removesuffix(".weight")
        if module in self.packed:
            return self._unpack(module).dequantize(torch.float32)
        if module in self.fp8:
            from quantizers.fp8 import dequantize_fp8

            return dequantize_fp8(self._get(name), self._get(module + ".weight_scale"))
        return self._get(name)

    def codes(self, name: str) -> torch.Tensor | None:
        """The stored integer codes of a quantized weight (FP8: its bit patterns); None if unquantized."""
        module = name.removesuffix(".weight")
        if module in self.packed:
            return self._unpack(module).q
        if module in self.fp8:
            return self._get(name).view(torch.uint8)
        return None


def bundle_view(path: Path) -> tuple[DequantizingView, dict]:
    path = Path(path)
    ckpt = Checkpoint(path)
    config = ckpt.config()
    return DequantizingView(lambda n: ckpt.get(n, check_finite=False), ckpt.keys(), config.get("quantization_config")), config


def load_bundle(path: Path, dtype=torch.bfloat16, device="cpu", verify: bool = True) -> MossTTSDelay:
    """A bundle folder -> runnable (dequantized) generator module."""
    if verify:
        from .bundle import verify_bundle

        verify_bundle(path)
    view, config = bundle_view(path)
    if config.get("model_type") != "moss_tts_delay":
        from .codec import load_codec_bundle  # the codec has its own module tree

        return load_codec_bundle(path, dtype=dtype)
    cfg = MossTTSDelayConfig.from_dict({k: v for k, v in config.items() if k != "quantization_config"})
    try:
        return load_state(build_empty(cfg), view, dtype=dtype, device=device)
    except ValueError as e:
        raise PipelineError(f"{path}: {e}") from None


def load_source(path: Path, dtype=torch.bfloat16, device="cpu") -> MossTTSDelay:
    ckpt = Checkpoint(path)
    cfg = MossTTSDelayConfig.from_dict(ckpt.config())
    return load_state(build_empty(cfg), ckpt.get, dtype=dtype, device=device)


def read_manifest(path: Path) -> dict:
    f = Path(path) / "manifest.json"
    try:
        return json.loads(f.read_text())
    except FileNotFoundError:
        raise PipelineError(f"{f}: missing (not a moss-quant bundle)") from None
    except ValueError as e:
        raise PipelineError(f"{f}: invalid JSON ({e})") from None

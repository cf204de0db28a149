"""Quantization methods as pipeline stages: each module orchestrates one method over the
generator or codec (streaming tensors/blocks, calibration activations) and returns a
`QuantResult`; the algorithms and packing themselves live in `quantizers/`.

A method module defines `CONFIG` (its params dataclass, usually from `quantizers`) and
`quantize(ctx, config) -> QuantResult`. `needs_calibration` says whether it reads the
calibrate stage.
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoint import canonical_json
from ..errors import PipelineError

# method name -> module under pipelines.methods
METHOD_MODULES = {
    "rtn": "rtn",
    "awq": "awq",
    "autoround": "autoround",
    "sensitivity": "sensitivity",
    "fp8": "fp8_codec",
}

QUANT_TENSORS = "tensors.safetensors"
QUANT_META = "quant.json"


@dataclass
class QuantizeStage:
    method: str
    device: str
    config: object  # the method's config dataclass


@dataclass
class QuantResult:
    tensors: dict[str, torch.Tensor]  # everything the bundle stores, final names
    quantization_config: dict  # Hugging Face-style, goes into config.json
    # per source tensor: {"format": "gptq"|"awq"|"bf16"|"fp8"|..., "bits": nominal, "group_size": ...,
    # "stored": [stored tensor names], "reason": why it is kept high precision (protected only)}
    layout: dict[str, dict]
    extra: dict = field(default_factory=dict)  # method-specific manifest section
    files: dict[str, bytes] = field(default_factory=dict)  # extra bundle files (e.g. measurement.json)
    config: dict = field(default_factory=dict)  # config.json keys the method changes (e.g. the dtype it loads as)


def method_module(name: str):
    if name not in METHOD_MODULES:
        raise PipelineError(f"unknown method {name!r} (allowed: {', '.join(METHOD_MODULES)})")
    return importlib.import_module(f"pipelines.methods.{METHOD_MODULES[name]}")


def parse_quantize(data: dict, where: str) -> QuantizeStage:
    from ..profile import build_params

    data = dict(data or {})
    method = data.pop("method", None)
    if not isinstance(method, str):
        raise PipelineError(f"{where}.method: required (allowed: {', '.join(METHOD_MODULES)})")
    if method not in METHOD_MODULES:
        raise PipelineError(f"{where}.method: unknown method {method!r} (allowed: {', '.join(METHOD_MODULES)})")
    device = data.pop("device", "auto")
    if not isinstance(device, str):
        raise PipelineError(f"{where}.device: expected str, got {device!r}")
    config = build_params(method_module(method).CONFIG, data, where)
    return QuantizeStage(method, device, config)


def run_quantize(ctx, params: QuantizeStage, out: Path) -> dict:
    from ..stages import resolve_device

    mod = method_module(params.method)
    if getattr(mod, "NEEDS_CALIBRATION", False) and "calibrate" not in ctx.results:
        raise PipelineError(f"{ctx.profile.path}: method {params.method!r} needs a calibrate stage before quantize")
    device = resolve_device(params.device)
    result: QuantResult = mod.quantize(ctx, params.config, device)
    save_file({k: v.contiguous() for k, v in sorted(result.tensors.items())}, str(out / QUANT_TENSORS))
    for name, data in result.files.items():
        (out / name).write_bytes(data)
    meta = {
        "method": params.method,
        "quantization_config": result.quantization_config,
        "layout": result.layout,
        "extra": result.extra,
        "files": sorted(result.files),
        "config": result.config,
    }
    (out / QUANT_META).write_text(canonical_json(meta, indent=2))
    return {"method": params.method, "device": device, "device_kind": device.split(":")[0], "tensors": len(result.tensors)}


def load_quant(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    import json

    return load_file(str(folder / QUANT_TENSORS)), json.loads((folder / QUANT_META).read_text())


def asdict(cfg) -> dict:
    return dataclasses.asdict(cfg)

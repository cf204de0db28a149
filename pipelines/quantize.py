"""The quantize stage: the method is chosen by the type of its config (torchao's `quantize_(model,
config)` dispatch); the method returns weights only, and this stage stores them.

A method returns `Weights`: each quantized Linear packed in its format (`PackedWeight`), the
source tensors it changed (AWQ's folded norms), why any tensor stays BF16 when the model
definition's reason is not the whole story, the format's `quantization_config`, and its own
record (`details`, the manifest's `method_details`). Every other source tensor is stored BF16.
Evaluation, baselines included, is the evaluate stage's business, not the method's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from quantizers.autoround import AutoRoundConfig
from quantizers.awq import AWQConfig
from quantizers.fp8 import FP8Config
from quantizers.rtn import RTNConfig
from quantizers.sensitivity import SensitivityConfig

from .checkpoint import canonical_json
from .errors import PipelineError
from .methods import autoround, awq, fp8, rtn, sensitivity
from .methods.weights import Weights
from .profile import build_params

# The YAML's `method:` name -> its config type -> the method. Dispatch is by config type.
CONFIGS = {"rtn": RTNConfig, "awq": AWQConfig, "autoround": AutoRoundConfig, "sensitivity": SensitivityConfig,
           "fp8": FP8Config}
METHODS = {RTNConfig: rtn.quantize, AWQConfig: awq.quantize, AutoRoundConfig: autoround.quantize,
           SensitivityConfig: sensitivity.quantize, FP8Config: fp8.quantize}
NEEDS_CALIBRATION = (AWQConfig, AutoRoundConfig, SensitivityConfig)

TENSORS = "tensors.safetensors"
META = "quant.json"


@dataclass
class QuantizeParams:
    method: str
    device: str
    config: object  # the method's config dataclass


def parse(data: dict, where: str) -> QuantizeParams:
    data = dict(data or {})
    method = data.pop("method", None)
    if not isinstance(method, str):
        raise PipelineError(f"{where}.method: required (allowed: {', '.join(CONFIGS)})")
    if method not in CONFIGS:
        raise PipelineError(f"{where}.method: unknown method {method!r} (allowed: {', '.join(CONFIGS)})")
    device = data.pop("device", "auto")
    if not isinstance(device, str):
        raise PipelineError(f"{where}.device: expected str, got {device!r}")
    return QuantizeParams(method, device, build_params(CONFIGS[method], data, where))


def run(ctx, params: QuantizeParams, out: Path) -> dict:
    from .stages import resolve_device

    if isinstance(params.config, NEEDS_CALIBRATION) and "calibrate" not in ctx.results:
        raise PipelineError(f"{ctx.profile.path}: method {params.method!r} needs a calibrate stage before quantize")
    device = resolve_device(params.device)
    weights: Weights = METHODS[type(params.config)](ctx, params.config, device)
    tensors, layout = assemble(ctx, weights)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / TENSORS))
    for name, data in weights.files.items():
        (out / name).write_bytes(data)
    meta = {"method": params.method, "quantization_config": weights.quantization_config, "layout": layout,
            "extra": weights.details, "files": sorted(weights.files), "config": weights.config,
            "kept": weights.kept, "source_params": weights.source_params}
    (out / META).write_text(canonical_json(meta, indent=2))
    return {"method": params.method, "device": device, "device_kind": device.split(":")[0], "tensors": len(tensors)}


def assemble(ctx, w: Weights) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Stored tensors and the per-source-tensor layout record: packed Linears as their parts,
    everything else BF16 with the reason it is kept."""
    ckpt, definition = ctx.checkpoint(), ctx.definition
    tensors, layout = {}, {}
    for name in (w.kept if w.kept is not None else ckpt.keys()):
        module = name.removesuffix(".weight")
        if module in w.packed:
            pw = w.packed[module]
            for part, t in pw.parts.items():
                tensors[f"{module}.{part}"] = t
            entry = {"format": pw.format, "bits": pw.bits, "stored": sorted(f"{module}.{p}" for p in pw.parts)}
            entry.update(pw.spec.layout_record(pw))
            layout[name] = entry
        else:
            tensors[name] = (w.replaced[name] if name in w.replaced else ckpt.get(name)).to(torch.bfloat16)
            layout[name] = {"format": "bf16", "bits": 16, "stored": [name],
                            "reason": w.reasons.get(name) or definition.reason(name)}
    return tensors, layout


def load(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_file(str(folder / TENSORS)), json.loads((folder / META).read_text())

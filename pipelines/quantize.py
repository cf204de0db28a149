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
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantizers.autoround import AutoRoundConfig
from quantizers.awq import AWQConfig
from quantizers.formats import PackedWeight, ggml
from quantizers.fp8 import FP8Config
from quantizers.rtn import RTNConfig, quantize_rtn
from quantizers.sensitivity import SensitivityConfig

from .checkpoint import Checkpoint, Lazy, canonical_json, write_safetensors
from .engine import release_host_cache
from .errors import PipelineError
from .methods import autoround, awq, fp8, rtn, sensitivity
from .methods.weights import Weights
from .models.moss_tts_delay import DEFINITION as GENERATOR
from .profile import build_params
from .progress import progress

# The YAML's `method:` name -> its config type -> the method. Dispatch is by config type.
CONFIGS = {"rtn": RTNConfig, "awq": AWQConfig, "autoround": AutoRoundConfig, "sensitivity": SensitivityConfig,
           "fp8": FP8Config}
METHODS = {RTNConfig: rtn.quantize, AWQConfig: awq.quantize, AutoRoundConfig: autoround.quantize,
           SensitivityConfig: sensitivity.quantize, FP8Config: fp8.quantize}
NEEDS_CALIBRATION = (AWQConfig, AutoRoundConfig, SensitivityConfig)

TENSORS = "tensors.safetensors"
META = "quant.json"


TABLE_ROWS = 16384  # rows of a table quantized at a time: a 155648-row table is never whole in float32


@dataclass
class QuantizeParams:
    method: str
    device: str
    config: object  # the method's config dataclass
    tables: dict[str, int] = field(default_factory=dict)  # embedding tables / heads stored as ggml blocks: key -> bits


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
    tables = data.pop("tables", None) or {}
    keys = [k for k, _ in GENERATOR.tables]
    if not isinstance(tables, dict):
        raise PipelineError(f"{where}.tables: expected a mapping of table -> bits (tables: {', '.join(keys)})")
    for key, bits in tables.items():
        if key not in keys:
            raise PipelineError(f"{where}.tables: unknown table {key!r} (allowed: {', '.join(keys)})")
        if bits not in ggml.TABLE_TYPES:
            raise PipelineError(f"{where}.tables.{key}: {bits!r} bits; a table is stored as ggml blocks of "
                                f"{' or '.join(str(b) for b in sorted(ggml.TABLE_TYPES))} bits")
    if tables and method == "fp8":
        raise PipelineError(f"{where}.tables: the codec has no embedding tables or heads")
    return QuantizeParams(method, device, build_params(CONFIGS[method], data, where), dict(sorted(tables.items())))


def run(ctx, params: QuantizeParams, out: Path) -> dict:
    from .stages import resolve_device

    if isinstance(params.config, NEEDS_CALIBRATION) and "calibrate" not in ctx.results:
        raise PipelineError(f"{ctx.profile.path}: method {params.method!r} needs a calibrate stage before quantize")
    device = resolve_device(params.device)
    weights: Weights = METHODS[type(params.config)](ctx, params.config, device)
    release_host_cache()  # the engine's streams, freed: out of memory before the output is written
    if params.tables:
        quantize_tables(ctx, weights, params.tables)
    tensors, layout = assemble(ctx, weights)
    write_safetensors(out / TENSORS, tensors)
    for name, data in weights.files.items():
        (out / name).write_bytes(data)
    meta = {"method": params.method, "quantization_config": weights.quantization_config, "layout": layout,
            "extra": weights.details, "files": sorted(weights.files), "config": weights.config,
            "kept": weights.kept, "source_params": weights.source_params}
    (out / META).write_text(canonical_json(meta, indent=2))
    return {"method": params.method, "device": device, "device_kind": device.split(":")[0], "tensors": len(tensors)}


def quantize_tables(ctx, w: Weights, tables: dict[str, int]) -> None:
    """The embedding tables and heads named in `tables` at their widths: round-to-nearest, symmetric,
    groups of 32 along the hidden axis (one ggml block each: Q8_0 / Q4_0, what llama.cpp reads), a
    slice of rows at a time."""
    ckpt = ctx.checkpoint()
    patterns = [(k, p) for k, p in ctx.definition.tables if k in tables]
    chosen = {n: k for n in ckpt.keys() for k, p in patterns if re.search(p, n)}
    for name in progress(sorted(chosen), desc="tables", unit="tensor"):
        bits, rows = tables[chosen[name]], []
        t = ckpt.get(name)
        for s in range(0, t.shape[0], TABLE_ROWS):
            iw = quantize_rtn(t[s:s + TABLE_ROWS].float(), RTNConfig(bits, ggml.BLOCK, True), name=name)
            rows.append(ggml.pack_table(iw)[ggml.part_of(bits)])
        module = name.removesuffix(".weight")
        w.packed[module] = PackedWeight(ggml.NAME, {ggml.part_of(bits): torch.cat(rows)}, bits, ggml.BLOCK, True)
    w.details["tables"] = {k: {"bits": b, "ggml_type": ggml.TABLE_TYPES[b], "group_size": ggml.BLOCK, "sym": True,
                               "quantizer": "rtn", "tensors": sorted(n for n, key in chosen.items() if key == k)}
                           for k, b in tables.items()}


def assemble(ctx, w: Weights) -> tuple[dict[str, Lazy], dict[str, dict]]:
    """Stored tensors and the per-source-tensor layout record: packed Linears as their parts,
    everything else BF16 with the reason it is kept (read from the source as it is written)."""
    ckpt, definition = ctx.checkpoint(), ctx.definition
    tensors, layout = {}, {}
    for name in (w.kept if w.kept is not None else ckpt.keys()):
        module = name.removesuffix(".weight")
        if module in w.packed:
            pw = w.packed[module]
            for part, t in pw.parts.items():
                tensors[f"{module}.{part}"] = t if isinstance(t, Lazy) else Lazy.of(t)
            entry = {"format": pw.format, "bits": pw.bits, "stored": sorted(f"{module}.{p}" for p in pw.parts)}
            entry.update(pw.spec.layout_record(pw))
            layout[name] = entry
        else:
            if name in w.replaced:
                tensors[name] = Lazy.of(w.replaced[name].to(torch.bfloat16))
            else:
                tensors[name] = Lazy(torch.bfloat16, tuple(ckpt.shape(name)),
                                     lambda name=name: ckpt.get(name).to(torch.bfloat16))
            layout[name] = {"format": "bf16", "bits": 16, "stored": [name],
                            "reason": w.reasons.get(name) or definition.reason(name)}
    return tensors, layout


def load(folder: Path) -> tuple[Checkpoint, dict]:
    """The stage's stored tensors (read one at a time, on demand) and its record."""
    return Checkpoint(folder, single=TENSORS), json.loads((folder / META).read_text())

"""Sensitivity profiles (sens-q2, sens-q3): measure, allocate, quantize at mixed widths.

`measure` (a stage of its own, so a changed budget reuses the cached scores): every decoder
Linear is quantized alone at each candidate width and scored on the calibration activations
of the BF16 stream (quantizers.sensitivity.output_errors), one block resident at a time. The
scores go to a versioned, canonical `measurement.json`, or a measurement file named in the
profile is reused after checking it was taken on this source and calibration set.

`quantize` (method `sensitivity`): allocates widths from the scores and stores every Linear
GPTQ-packed at its width (BF16 if protected at 16) in auto-round's mixed-bit format:
the base width globally, the others per layer in `extra_config`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantizers.errors import QuantizerError
from quantizers.formats import gptq, pack
from quantizers.rtn import SUPPORTED_BITS, RTNConfig, quantize_rtn
from quantizers.sensitivity import (KEEP_BF16, SensitivityConfig, allocate, bits_per_weight, estimated_bpw, gram,
                                    output_errors, sig)

from ..checkpoint import canonical_json, sha256_file
from ..engine import FP, Engine
from ..errors import PipelineError
from ..models.moss_tts_delay import BLOCK_LINEARS, BLOCK_PREFIX, DEFINITION, MossTTSDelayConfig, block_linear_names
from ..progress import progress
from ..source import ROOT, pins_digest
from .weights import Weights

MEASUREMENT = "measurement.json"
SCHEMA = "moss-quant/measurement/v1"
METRIC = "relative output error ||X(W_q-W)^T||^2 / ||XW^T||^2, W_q = RTN of this Linear alone, X = its calibration inputs"


@dataclass
class MeasureParams:
    candidate_bits: list[int] = field(default_factory=lambda: [2, 3, 4, 8])
    group_size: int = 128
    sym: bool = False
    batch_size: int = 8
    measurement: str | None = None  # reuse this file (path relative to the repo root) instead of measuring
    measurement_sha256: str | None = None  # the file's sha256: filled in when omitted, checked when given

    def validate(self):
        for b in self.candidate_bits:
            if b not in SUPPORTED_BITS:
                raise ValueError(f"candidate_bits: unknown width {b} (allowed: {list(SUPPORTED_BITS)})")
        if self.group_size < 32 or self.group_size % 32:
            raise ValueError(f"group_size: must be a positive multiple of 32, got {self.group_size}")
        if self.measurement is not None:
            path = self.path()
            if not path.is_file():
                raise ValueError(f"measurement: no such file {self.measurement}")
            got = sha256_file(path)  # the content, not the name, keys the stage cache
            if self.measurement_sha256 not in (None, got):
                raise ValueError(f"measurement_sha256: {self.measurement} has sha256 {got[:12]}..., "
                                 f"expected {self.measurement_sha256[:12]}...")
            self.measurement_sha256 = got
        elif self.measurement_sha256 is not None:
            raise ValueError("measurement_sha256: given without a measurement file")

    def path(self) -> Path:
        p = Path(self.measurement)
        return p if p.is_absolute() else ROOT / p


class MeasureHook:
    """Per block: the input Gram matrix of every Linear on the fp stream (accumulated per batch,
    float64), then each Linear's damage at every candidate width."""

    streams, capture, observed = (FP,), (), BLOCK_LINEARS

    def __init__(self, ckpt, params: MeasureParams, device: str):
        self.ckpt, self.params, self.device = ckpt, params, device
        self.grams, self.tensors = {}, {}

    def observe(self, name: str, x: torch.Tensor) -> None:
        g = gram(x)
        self.grams[name] = g if name not in self.grams else self.grams[name] + g

    def on_block(self, step) -> None:
        p = self.params
        for m in BLOCK_LINEARS:
            name = f"{BLOCK_PREFIX}.{step.index}.{m}"
            w = self.ckpt.get(name + ".weight").to(self.device)
            try:
                errs = output_errors(w, self.grams[m], sorted(p.candidate_bits), p.group_size, p.sym)
            except QuantizerError as e:
                raise PipelineError(str(e)) from None
            self.tensors[name] = {"shape": list(w.shape), "scores": {str(b): sig(e) for b, e in errs.items()}}
        self.grams = {}


def _measure(ctx, params: MeasureParams, device: str) -> dict:
    from ..calibration import load_ids

    ckpt = ctx.checkpoint()
    hook = MeasureHook(ckpt, params, device)
    Engine(MossTTSDelayConfig.from_dict(ckpt.config()), ckpt.get, device, torch.bfloat16, params.batch_size,
           desc="measure").run(hook, load_ids(ctx.dirs["calibrate"]))
    return hook.tensors


def run_measure(ctx, params: MeasureParams, out: Path) -> dict:
    cal = ctx.results.get("calibrate")
    if cal is None:
        raise PipelineError(f"{ctx.profile.path}: stage 'measure' needs a calibrate stage before it")
    from ..stages import resolve_device

    digest = pins_digest(ctx.spec)
    device = resolve_device("auto")
    if params.measurement is not None:
        data = load_measurement(params.path(), digest, cal["sha256"], params, params.measurement)
    else:
        data = {
            "schema": SCHEMA,
            "source": {"repo": ctx.spec.repo, "revision": ctx.spec.revision, "pins_digest": digest},
            "calibration": {"name": cal["name"], "sha256": cal["sha256"], "nsamples": cal["nsamples"],
                            "seqlen": cal["seqlen"]},
            "grid": {"method": "rtn", "group_size": params.group_size, "sym": params.sym},
            "candidate_bits": sorted(params.candidate_bits),
            "metric": METRIC,
            "device": device.split(":")[0],  # float64 sums: reproducible on one device kind, close across kinds
            "tensors": _measure(ctx, params, device),
        }
    text = canonical_json(data, indent=2)
    (out / MEASUREMENT).write_text(text)
    return {"file": MEASUREMENT, "reused": params.measurement is not None,
            "sha256": sha256_file(out / MEASUREMENT), "tensors": len(data["tensors"])}


def load_measurement(path: Path, digest: str, cal_sha: str, params: MeasureParams, shown: str) -> dict:
    """A measurement file offered for reuse: refused unless taken on this source, calibration and grid."""
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise PipelineError(f"{shown}: not a measurement file (invalid JSON: {e})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise PipelineError(f"{shown}: schema {data.get('schema') if isinstance(data, dict) else None!r}, expected {SCHEMA!r}")
    got_src = data.get("source", {}).get("pins_digest", "")
    if got_src != digest:
        raise PipelineError(f"{shown}: measured on source {got_src[:12]!r}, this build's source pins hash to "
                            f"{digest[:12]!r}; re-measure (drop measure.measurement)")
    got_cal = data.get("calibration", {}).get("sha256", "")
    if got_cal != cal_sha:
        raise PipelineError(f"{shown}: measured on calibration {got_cal[:12]!r}, this build's calibration is "
                            f"{cal_sha[:12]!r}; re-measure (drop measure.measurement)")
    grid = data.get("grid", {})
    if (grid.get("group_size"), grid.get("sym")) != (params.group_size, params.sym):
        raise PipelineError(f"{shown}: measured at group_size={grid.get('group_size')} sym={grid.get('sym')}, "
                            f"the profile asks group_size={params.group_size} sym={params.sym}")
    if sorted(data.get("candidate_bits", [])) != sorted(params.candidate_bits):
        raise PipelineError(f"{shown}: measured widths {data.get('candidate_bits')}, the profile asks "
                            f"{sorted(params.candidate_bits)}")
    return data


def quantize(ctx, cfg: SensitivityConfig, device: str) -> Weights:
    if "measure" not in ctx.dirs:
        raise PipelineError(f"{ctx.profile.path}: method 'sensitivity' needs a measure stage before quantize")
    raw = (ctx.dirs["measure"] / MEASUREMENT).read_bytes()
    meas = json.loads(raw)
    g, sym = meas["grid"]["group_size"], meas["grid"]["sym"]
    where = f"{ctx.profile.path.name}: stages.quantize"
    for b in [cfg.base_bits, *cfg.protect_bits]:
        if b != KEEP_BF16 and b not in meas["candidate_bits"]:
            raise PipelineError(f"{where}: width {b} was not measured (measure.candidate_bits: {meas['candidate_bits']})")
    ckpt = ctx.checkpoint()
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    names = block_linear_names(mcfg)
    if sorted(meas["tensors"]) != sorted(names):
        raise PipelineError(f"{MEASUREMENT}: its tensors do not match this model's {len(names)} decoder Linears")
    scores = {n: {int(b): s for b, s in meas["tensors"][n]["scores"].items()} for n in names}
    numel = {n: meas["tensors"][n]["shape"][0] * meas["tensors"][n]["shape"][1] for n in names}
    groups = [tuple(f"{BLOCK_PREFIX}.{i}.{m}" for m in group)
              for i in range(mcfg.num_layers) for group in DEFINITION.fused_groups]
    try:
        widths, taken = allocate(scores, numel, cfg, g, groups)
    except QuantizerError as e:
        raise PipelineError(f"{where}: {e}") from None

    first_step, rank = {}, {}  # tensor -> its unit's first upgrade; unit -> its rank among protected units
    for up in taken:
        rank.setdefault(up.tensors, len(rank) + 1)
        for name in up.tensors:
            first_step.setdefault(name, up)
    n_prot, n_units = len(rank), len(groups) + len(names) - sum(len(x) for x in groups)
    table, quantized, reasons, extra_config = {}, {}, {}, {}
    for name in progress(names, desc="sensitivity", unit="tensor"):
        b = widths[name]
        s = scores[name]
        entry = {"bits": b, "score_at_base": s[cfg.base_bits], "score": 0.0 if b == KEEP_BF16 else s[b]}
        if name in first_step:
            up = first_step[name]
            fused = f" with its fused group {'/'.join(n.rsplit('.', 1)[1] for n in up.tensors)}" if len(up.tensors) > 1 else ""
            entry["reason"] = (f"score {s[cfg.base_bits]:.3g} at {cfg.base_bits}-bit -> {entry['score']:.3g} at "
                               f"{'BF16' if b == KEEP_BF16 else f'{b}-bit'}; protected{fused} "
                               f"{rank_text(rank[up.tensors], n_prot, n_units)} "
                               f"by damage reduction per extra bit ({up.gain_per_bit:.3g}/bit)")
        table[name] = entry
        if b == KEEP_BF16:
            reasons[name + ".weight"] = entry["reason"]
            extra_config[name] = {"bits": 16, "data_type": "fp"}  # how auto-round marks a layer left unquantized
            continue
        if b != cfg.base_bits:
            extra_config[name] = {"bits": b}
        w = ckpt.get(name + ".weight").to(device)
        quantized[name] = pack(quantize_rtn(w, RTNConfig(b, g, sym), name=name + ".weight"), "gptq")

    target = cfg.target_bpw if cfg.target_bpw is not None else bits_per_weight(cfg.base_bits, g) + cfg.protect_budget
    details = {
        "nominal_bits": cfg.base_bits,
        "measurement": {"file": MEASUREMENT, "sha256": sha256_file(ctx.dirs["measure"] / MEASUREMENT)},
        "allocation": {
            "rule": "greedy by score reduction per extra stored bit; the longest prefix of the order within the budget",
            "fused_groups": [list(x) for x in DEFINITION.fused_groups],  # one width each (vLLM's fused qkv/gate_up)
            "target_backbone_bpw": sig(target),
            "estimated_backbone_bpw": sig(estimated_bpw(widths, numel, g)),
            "base_backbone_bpw": sig(bits_per_weight(cfg.base_bits, g)),
            "widths": {str(b): sum(1 for v in widths.values() if v == b) for b in sorted(set(widths.values()))},
            "tensors": table,
        },
    }
    qc = gptq.quantization_config(cfg.base_bits, g, sym, BLOCK_PREFIX, extra_config=extra_config, iters=0)
    return Weights(quantized, qc, reasons=reasons, details=details, files={MEASUREMENT: raw})


def rank_text(rank: int, n_protected: int, n_total: int) -> str:
    return f"#{rank} of {n_protected} protected ({100 * rank / n_total:.0f}% of {n_total} allocation units)"

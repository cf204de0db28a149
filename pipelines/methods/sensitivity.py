"""Sensitivity profiles (sens-q2, sens-q3): measure with the tuned quantizer, allocate, tune at mixed widths.

`measure` (a stage of its own, so a changed budget reuses the cached scores):
  1. the Fisher pass (engine.output_fisher): the diagonal Fisher of the model's output
     distributions at every block's output, from labels sampled from the source model itself
     (the text head everywhere and every audio head where audio is spoken: the KL of the model's
     whole next-step distribution is the sum of its heads');
  2. the measure pass (engine.run, fp and quant streams): per block, auto-round tunes a copy of the
     block at every candidate grid (bits, group size; the same block-level call the quantize stage
     makes, on the block's real inputs: the quantized stream); each Linear's tuned weights at each
     grid are put alone into the source block, and its score is the Fisher-weighted error of the
     block's output (quantizers.sensitivity). The block tuned at `stream_grid` feeds the next block.
The scores go to a versioned, canonical `measurement.json`, or a measurement file named in the
profile is reused after checking it was taken on this source, calibration set and quantizer.

`quantize` (method `sensitivity`): allocates grids from the scores under `target_bpw` (fused groups
at one grid) and tunes every block with auto-round at those per-Linear grids, in auto-round's
mixed-bit format: the nominal grid globally, the others per layer in `extra_config`.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantizers.autoround import AutoRoundConfig, block_seed, tune_block, tuning_record
from quantizers.errors import QuantizerError
from quantizers.formats import gptq
from quantizers.sensitivity import (Grid, SensitivityConfig, allocate, bits_per_weight, grid_name, parse_grids, sig,
                                    weighted_error)

from ..checkpoint import canonical_json, sha256_file
from ..engine import FP, QUANT, Engine, final_norm
from ..errors import PipelineError
from ..models.moss_tts_delay import (BLOCK_LINEARS, BLOCK_PREFIX, DEFINITION, MossTTSDelayConfig, audio_positions,
                                     block_linear_names)
from ..portable_random import uniform
from ..source import ROOT, pins_digest
from .autoround import AutoRoundHook, calibration_ids
from .weights import Weights

MEASUREMENT = "measurement.json"
SCHEMA = "moss-quant/measurement/v2"
METRIC = ("mean over tokens of sum_c F[c] (B_q(x) - B(x))[c]^2: B the source block, B_q the same block with this "
          "Linear alone tuned by auto-round at the width, x the block's inputs on the quantized stream, F the "
          "diagonal Fisher of the model's output distributions at the block's output (half the score ~ the KL added)")


@dataclass
class MeasureParams:
    # [bits, group_size] grids, each tuned by auto-round on every block and scored
    grids: list[list[int]] = field(default_factory=lambda: [[2, 128], [3, 128], [4, 128], [8, 128]])
    stream_grid: list[int] = field(default_factory=lambda: [3, 128])  # whose tuned blocks feed the next block
    # auto-round's tuning for the measurement (a lighter setting than the final quantize may use)
    iters: int = 200
    nsamples: int = 128
    seqlen: int = 2048
    batch_size: int = 8
    lr: float | None = None
    measurement: str | None = None  # reuse this file (path relative to the repo root) instead of measuring
    measurement_sha256: str | None = None  # the file's sha256: filled in when omitted, checked when given

    def validate(self):
        grids = parse_grids(self.grids)
        (stream,) = parse_grids([self.stream_grid], "stream_grid")
        if stream not in grids:
            raise ValueError(f"stream_grid: {self.stream_grid} is not one of the measured grids {self.grids}")
        self.tuning(stream).validate()
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

    def tuning(self, grid: Grid) -> AutoRoundConfig:
        return AutoRoundConfig(bits=grid[0], group_size=grid[1], sym=True, iters=self.iters, nsamples=self.nsamples,
                               seqlen=self.seqlen, batch_size=self.batch_size, lr=self.lr)

    def quantizer(self) -> dict:
        """What the scores depend on besides the data: a measurement offered for reuse must match it."""
        rec = tuning_record(self.tuning(tuple(self.stream_grid)))
        return {"method": "auto-round", "sym": True, "stream_grid": grid_name(tuple(self.stream_grid)),
                **{k: rec[k] for k in ("iters", "nsamples", "seqlen", "batch_size", "lr")}}

    def path(self) -> Path:
        p = Path(self.measurement)
        return p if p.is_absolute() else ROOT / p


def sampled_loglik_grad(cfg: MossTTSDelayConfig, config: dict, get, ids: torch.Tensor, device: str, dtype):
    """d/d(final hidden) of the log-likelihood of labels sampled from the model's own outputs (inverse
    CDF of portable uniforms: the same labels on every machine): the text head at every position plus
    every audio head where audio is spoken. Heads are read once; one sequence at a time."""
    audio = audio_positions(config, ids).to(device)
    heads = [get(f"lm_heads.{k}.weight").to(device, dtype) for k in range(cfg.n_vq + 1)]
    draws = uniform("sensitivity/fisher-labels", (cfg.n_vq + 1, *ids.shape[:2]), device=device).double()

    def grad(hidden: torch.Tensor, rows: slice) -> torch.Tensor:
        out = []
        for j in range(hidden.shape[0]):
            h = hidden[j:j + 1].detach().requires_grad_()
            r = rows.start + j
            with torch.enable_grad():
                hn = final_norm(cfg, get, h)
                loss = 0.0
                for k, w in enumerate(heads):
                    logits = (hn @ w.t()).float()
                    if k:
                        logits[..., cfg.audio_pad_code] = float("-inf")
                    logp = logits.log_softmax(-1)
                    cdf = logp.detach().double().exp().cumsum(-1)
                    y = torch.searchsorted(cdf, (draws[k, r] * cdf[0, :, -1])[None, :, None]).clamp(max=cdf.shape[-1] - 1)
                    ll = logp.gather(-1, y)[..., 0]
                    loss = loss + (ll.sum() if k == 0 else (ll * audio[r]).sum())
                loss.backward()
            out.append(h.grad)
        return torch.cat(out)

    return grad


class MeasureHook:
    """Per block: auto-round at every grid on a copy of the block, then every Linear's tuned weights
    alone in the source block, scored on the block output with the Fisher weights."""

    streams, capture = (FP, QUANT), ()
    reads_fp_in = False

    def __init__(self, params: MeasureParams, fisher: list[torch.Tensor], seed: int, device: str):
        self.params, self.fisher, self.seed, self.device = params, fisher, seed, device
        self.tensors = {}

    def on_block(self, step):
        p, i = self.params, step.index
        q_in = step.quant_in
        ref = step.run(step.layer, q_in)  # the source block on its real inputs
        scores, stream = {m: {} for m in BLOCK_LINEARS}, None
        for grid in parse_grids(p.grids):  # one grid's integers at a time (int32: 0.8 GB a grid at 8B widths)
            layer = copy.deepcopy(step.layer)
            tuned = self._tune(layer, step, grid)
            if grid == tuple(p.stream_grid):
                stream = layer  # the engine runs it on the quant stream
            for m in BLOCK_LINEARS:  # each Linear's tuned weights alone in the source block
                mod = step.layer.get_submodule(m)
                source = mod.weight
                mod.weight = nn.Parameter(tuned.pop(m).dequantize(source.dtype).to(source.device), requires_grad=False)
                out = step.run(step.layer, q_in)
                scores[m][grid_name(grid)] = sig(weighted_error(out.float() - ref.float(), self.fisher[i]))
                mod.weight = source
            del layer, tuned
        for m in BLOCK_LINEARS:
            shape = list(step.layer.get_submodule(m).weight.shape)
            self.tensors[f"{BLOCK_PREFIX}.{i}.{m}"] = {"shape": shape, "scores": scores[m]}
        return stream

    def _tune(self, layer, step, grid: Grid):
        try:
            return tune_block(layer, step.quant_in, step.fp_out, step.position_embeddings,
                              self.params.tuning(grid), block_seed(self.seed, step.index), self.device)
        except QuantizerError as e:
            raise PipelineError(str(e)) from None

    def block_state(self, i: int):
        pre = f"{BLOCK_PREFIX}.{i}."
        return {}, {"tensors": {n: t for n, t in self.tensors.items() if n.startswith(pre)}}

    def restore_block(self, i: int, tensors, meta) -> None:
        self.tensors.update(meta["tensors"])


def _measure(ctx, params: MeasureParams, device: str) -> tuple[dict, dict]:
    ckpt = ctx.checkpoint()
    config = ckpt.config()
    mcfg = MossTTSDelayConfig.from_dict(config)
    ids = calibration_ids(ctx, params.tuning(tuple(params.stream_grid)))
    engine = Engine(mcfg, ckpt.get, device, torch.bfloat16, params.batch_size, desc="measure", log=ctx.log,
                    block_lines=True)
    fisher = engine.output_fisher(ids, sampled_loglik_grad(mcfg, config, ckpt.get, ids, device, torch.bfloat16))
    hook = MeasureHook(params, fisher, ctx.seed, device)
    engine.run(hook, ids, resume=ctx.partial)
    record = {"labels": "sampled from the source model (portable uniforms, inverse CDF)",
              "loss": "text head log-likelihood at every position + every audio head's where audio is spoken",
              "trace_per_block": [sig(float(f.sum())) for f in fisher]}
    return hook.tensors, record


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
        tensors, fisher = _measure(ctx, params, device)
        data = {
            "schema": SCHEMA,
            "source": {"repo": ctx.spec.repo, "revision": ctx.spec.revision, "pins_digest": digest},
            "calibration": {"name": cal["name"], "sha256": cal["sha256"], "nsamples": params.nsamples,
                            "seqlen": params.seqlen},
            "quantizer": params.quantizer(),
            "grids": [grid_name(g) for g in parse_grids(params.grids)],
            "metric": METRIC,
            "fisher": fisher,
            "device": device.split(":")[0],  # float sums: reproducible on one device kind, close across kinds
            "tensors": tensors,
        }
    text = canonical_json(data, indent=2)
    (out / MEASUREMENT).write_text(text)
    return {"file": MEASUREMENT, "reused": params.measurement is not None,
            "sha256": sha256_file(out / MEASUREMENT), "tensors": len(data["tensors"])}


def load_measurement(path: Path, digest: str, cal_sha: str, params: MeasureParams, shown: str) -> dict:
    """A measurement file offered for reuse: refused unless taken on this source, calibration and quantizer."""
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
    got_q, want_q = data.get("quantizer", {}), params.quantizer()
    for key in sorted(want_q):
        if got_q.get(key) != want_q[key]:
            raise PipelineError(f"{shown}: measured with quantizer {key}={got_q.get(key)!r}, the profile asks "
                                f"{key}={want_q[key]!r}; re-measure (drop measure.measurement)")
    want = [grid_name(g) for g in parse_grids(params.grids)]
    if data.get("grids") != want:
        raise PipelineError(f"{shown}: measured grids {data.get('grids')}, the profile asks {want}")
    return data


def quantize(ctx, cfg: SensitivityConfig, device: str) -> Weights:
    if "measure" not in ctx.dirs:
        raise PipelineError(f"{ctx.profile.path}: method 'sensitivity' needs a measure stage before quantize")
    raw = (ctx.dirs["measure"] / MEASUREMENT).read_bytes()
    meas = json.loads(raw)
    where = f"{ctx.profile.path.name}: stages.quantize"
    grids = cfg.candidates()
    for grid in grids:
        if grid_name(grid) not in meas["grids"]:
            raise PipelineError(f"{where}.grids: {list(grid)} was not measured (measured: {meas['grids']})")
    ckpt = ctx.checkpoint()
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    names = block_linear_names(mcfg)
    if sorted(meas["tensors"]) != sorted(names):
        raise PipelineError(f"{MEASUREMENT}: its tensors do not match this model's {len(names)} decoder Linears")
    by_name = {grid_name(g): g for g in grids}
    scores = {n: {by_name[k]: v for k, v in meas["tensors"][n]["scores"].items() if k in by_name} for n in names}
    shapes = {n: tuple(meas["tensors"][n]["shape"]) for n in names}
    groups = [tuple(f"{BLOCK_PREFIX}.{i}.{m}" for m in group)
              for i in range(mcfg.num_layers) for group in DEFINITION.fused_groups]
    try:
        alloc = allocate(scores, shapes, grids, cfg.target_bpw, groups)
    except QuantizerError as e:
        raise PipelineError(f"{where}: {e}") from None

    ids = calibration_ids(ctx, cfg)
    ctx.log(f"sensitivity: auto-round at per-Linear grids {_count(alloc.grids)} "
            f"({cfg.iters} iters on {ids.shape[0]} x {ids.shape[1]} MOSS block inputs, device {device})")
    hook = AutoRoundHook(cfg.tuning(), ctx.seed, device, grids=alloc.grids)
    Engine(mcfg, ckpt.get, device, desc="sensitivity", batch_size=cfg.batch_size, log=ctx.log,
           block_lines=True).run(
        hook, ids, resume=ctx.partial)
    missing = sorted(set(names) - set(hook.packed))
    if missing:
        raise PipelineError(f"auto-round left {len(missing)} decoder Linears unquantized, e.g. {missing[0]}")
    total = sum(o * i for o, i in shapes.values())
    nominal = (cfg.bits, cfg.group_size)
    details = {
        "nominal_bits": cfg.bits,
        "measurement": {"file": MEASUREMENT, "sha256": sha256_file(ctx.dirs["measure"] / MEASUREMENT),
                        "quantizer": meas["quantizer"]},
        "allocation": {
            "rule": ("multiple-choice knapsack, solved exactly: one width per unit (fused groups share one), the "
                     "least total measured damage whose stored bits stay within the target"),
            "fused_groups": [list(x) for x in DEFINITION.fused_groups],  # one width each (vLLM's fused qkv/gate_up)
            "target_backbone_bpw": sig(cfg.target_bpw),
            "estimated_backbone_bpw": sig(alloc.stored_bits / total),
            "uniform_nominal_bpw": sig(bits_per_weight(*nominal)),
            "predicted_damage": sig(alloc.damage),
            "uniform_nominal_damage": sig(sum(s[nominal] for s in scores.values())) if nominal in grids else None,
            "grids": _count(alloc.grids),
            "tensors": decisions(alloc, nominal, total),
        },
        "tuning": tuning_record(cfg),
    }
    extra_config = {n: {"bits": b} | ({"group_size": g} if g != cfg.group_size else {})
                    for n, (b, g) in sorted(alloc.grids.items()) if (b, g) != nominal}
    qc = gptq.quantization_config(cfg.bits, cfg.group_size, True, BLOCK_PREFIX, extra_config=extra_config,
                                  **tuning_record(cfg))
    return Weights(hook.packed, qc, details=details, files={MEASUREMENT: raw})


def _count(grids: dict[str, Grid]) -> dict[str, int]:
    out = {}
    for grid in sorted(grids.values(), key=lambda x: bits_per_weight(*x)):
        out[grid_name(grid)] = out.get(grid_name(grid), 0) + 1
    return out


def decisions(alloc, nominal: Grid, total: int) -> dict[str, dict]:
    """Each Linear's grid and why: its unit's measured damage and stored bits at every grid, and what
    the chosen grid trades against the nominal one."""
    out = {}
    for unit, opts in alloc.options.items():
        grid = alloc.grids[unit[0]]
        fused = f" (with {'/'.join(n.rsplit('.', 1)[1] for n in unit)})" if len(unit) > 1 else ""
        if grid == nominal or nominal not in opts:
            why = f"{grid_name(grid)}{fused}" + (", the nominal grid" if grid == nominal else "")
        else:
            (bits_c, dmg_c), (bits_n, dmg_n) = opts[grid], opts[nominal]
            verb = "spends" if bits_c > bits_n else "saves"
            why = (f"{grid_name(grid)}{fused}: {'removes' if dmg_c < dmg_n else 'adds'} {abs(dmg_n - dmg_c):.3g} damage "
                   f"and {verb} {abs(bits_c - bits_n) / total:.4f} bit per backbone weight against {grid_name(nominal)}")
        for name in unit:
            out[name] = {"bits": grid[0], "group_size": grid[1], "reason": why,
                         "unit_damage": {grid_name(g): sig(d) for g, (_, d) in opts.items()},
                         "unit_bpw_share": {grid_name(g): sig(c / total) for g, (c, _) in opts.items()}}
    return dict(sorted(out.items()))

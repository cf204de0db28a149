"""auto-round (SignRound) on the generator's decoder blocks, calibrated on MOSS inputs.

The calibration set is multi-channel (text + n_vq codebooks), so auto-round is fed the block-0
inputs themselves: the summed 1 + n_vq embeddings (quantizers.autoround explains how). Only
`language_model.layers` is tuned; embeddings, heads and norms stay BF16. The tuned integers
are packed by our GPTQ packing under upstream MOSS names, in auto-round's own format.

Both figures the profile is judged by go into the manifest: the tuned weights' teacher-forced
error against BF16 and plain RTN's at the same grid (bits, group size, symmetry), measured on
the evaluate stage's held-out set.
"""
from __future__ import annotations

import torch

from quantizers.autoround import AutoRoundConfig, determinism_record, tune, tuning_record
from quantizers.errors import QuantizerError
from quantizers.rtn import RTNConfig, quantize_rtn

from .. import blocks
from ..calibration import CALIB_FILE, build, load_ids
from ..errors import PipelineError
from ..evaluate import EvaluateParams, compare
from ..models.moss_tts_delay import BLOCK_PREFIX, MossTTSDelayConfig, block_linear_names
from .gptq_layout import autoround_config, gptq_result

CONFIG = AutoRoundConfig
NEEDS_CALIBRATION = True


def calibration_ids(ctx, cfg: AutoRoundConfig) -> torch.Tensor:
    """The first `nsamples` calibration sequences cropped to `seqlen`; refuses what auto-round would skip."""
    where = ctx.dirs["calibrate"] / CALIB_FILE
    ids = load_ids(ctx.dirs["calibrate"])
    n, s = ids.shape[:2]
    usable = n if s >= cfg.seqlen else 0
    if usable < cfg.nsamples:
        raise PipelineError(
            f"{where.name}: {usable} of {n} calibration sequences are usable (length {s}, quantize.seqlen is "
            f"{cfg.seqlen}); quantize.nsamples needs {cfg.nsamples} (raise calibrate.nsamples/seqlen)")
    return ids[: cfg.nsamples, : cfg.seqlen]


def quantize(ctx, cfg: AutoRoundConfig, device: str):
    ckpt = ctx.checkpoint()
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    ids = calibration_ids(ctx, cfg)
    inputs = blocks.embed(mcfg, ckpt.get, ids)  # (N, S, H) BF16 block-0 inputs, kept on the CPU
    ctx.log(f"auto-round: {cfg.bits}-bit sym={cfg.sym} g{cfg.group_size}, {cfg.iters} iters on "
            f"{ids.shape[0]} x {ids.shape[1]} MOSS block inputs, device {device}")
    try:
        tuned = tune(mcfg.qwen3(), lambda n: ckpt.get("language_model." + n), inputs, cfg, ctx.seed, device)
    except QuantizerError as e:
        raise PipelineError(str(e)) from None
    quantized = {"language_model." + k: v for k, v in tuned.items()}
    missing = sorted(set(block_linear_names(mcfg)) - set(quantized))
    if missing:
        raise PipelineError(f"auto-round left {len(missing)} decoder Linears unquantized, e.g. {missing[0]}")
    qc = autoround_config(cfg.bits, cfg.group_size, cfg.sym, **tuning_record(cfg))
    extra = {
        "calibration_inputs": f"block-0 inputs: summed text + {mcfg.n_vq} audio embeddings",
        "tuned_blocks": BLOCK_PREFIX,
        "low_gpu_mem_usage": cfg.low_gpu_mem_usage and device.startswith("cuda"),
        "determinism": determinism_record(cfg),
        **fidelity(ctx, ckpt, quantized, cfg),
    }
    return gptq_result(ckpt, quantized, qc, extra=extra)


def fidelity(ctx, ckpt, quantized: dict, cfg: AutoRoundConfig) -> dict:
    """Teacher-forced error vs BF16 of the tuned weights and of plain RTN on the same grid."""
    from ..stages import resolve_device

    ev = ctx.profile.stages.get("evaluate") or EvaluateParams()
    config = ckpt.config()
    held = build(ev.dataset, config, ev.nsamples, ev.seqlen, ctx.snapshot)
    rtn_cfg = RTNConfig(cfg.bits, cfg.group_size, cfg.sym)

    def getter(weights: dict):
        return lambda name: (weights[name.removesuffix(".weight")].dequantize(torch.float32)
                             if name.removesuffix(".weight") in weights else ckpt.get(name))

    rtn = {m: quantize_rtn(ckpt.get(m + ".weight"), rtn_cfg, name=m + ".weight") for m in quantized}
    device = resolve_device("auto")
    run = lambda w: compare(config, ckpt.get, getter(w), held.ids, device=device, batch_size=ev.batch_size)
    return {
        "fidelity_dataset": {"name": held.name, "sha256": held.sha256, "nsamples": ev.nsamples, "seqlen": ev.seqlen},
        "autoround_metrics": run(quantized),
        "baseline_rtn": {"method": "rtn", "bits": cfg.bits, "group_size": cfg.group_size, "sym": cfg.sym,
                         "metrics": run(rtn)},
    }

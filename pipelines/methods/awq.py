"""AWQ4: activation-aware scales and clipping per decoder block, stored in the AWQ GEMM layout.

The search is autoawq's (quantizers/awq.py); this module feeds it MOSS activations one block
at a time: block 0 reads the summed text + n_vq audio embeddings of the multi-channel
calibration set, every later block the previous block's FP output (autoawq's order). Scales
fold into the preceding norm or Linear (the norms are stored BF16 with the folded values).
"""
from __future__ import annotations

from typing import Iterator

import torch

from quantizers.awq import N_GRID, AWQConfig, Group, autoawq_quantizer, awq_block, int_weight
from quantizers.errors import QuantizerError
from quantizers.packing import pack
from quantizers.rtn import RTNConfig, fake_quantize

from .. import blocks
from ..calibration import load_ids
from ..checkpoint import Checkpoint
from ..errors import PipelineError
from ..models.moss_tts_delay import BLOCK_LINEARS, BLOCK_PREFIX, INPUT_GROUPS, MossTTSDelayConfig
from ..progress import progress
from . import QuantResult
from .gptq_layout import gptq_result

CONFIG = AWQConfig
NEEDS_CALIBRATION = True
FOLDED_REASON = "norm gain carrying the folded AWQ input scales, kept BF16"
NOT_CONVERTED = ["lm_heads"]  # the only nn.Linear outside the decoder blocks (embeddings are not Linears)
MAPPINGS = "INPUT_GROUPS/BLOCK_LINEARS in pipelines/models/moss_tts_delay.py"


def plan_groups(ckpt: Checkpoint, mcfg: MossTTSDelayConfig, cfg: AWQConfig) -> tuple[list[list[Group]], list[str]]:
    """Per block, the input-sharing groups to scale; refuses a checkpoint the mappings do not fit.

    A Linear -> Linear group whose widths differ (v -> o under grouped-query attention) cannot
    fold a per-channel scale and is skipped, as autoawq's own Qwen3 mapping does.
    """
    keys = set(ckpt.keys())
    plan, skipped = [], set()
    for i in range(mcfg.num_layers):
        pre = f"{BLOCK_PREFIX}.{i}."

        def shape(rel: str) -> list[int]:
            if pre + rel + ".weight" not in keys:
                raise PipelineError(f"{ckpt.root}: tensor {pre}{rel}.weight missing; the AWQ mappings ({MAPPINGS}) "
                                    f"expect it in every block")
            return ckpt.shape(pre + rel + ".weight")

        unmapped = sorted(k for k in keys if k.startswith(pre) and len(ckpt.shape(k)) == 2
                          and k[len(pre):].removesuffix(".weight") not in BLOCK_LINEARS)
        if unmapped:
            raise PipelineError(f"{ckpt.root}: tensor {unmapped[0]} is a 2-D weight the AWQ mappings ({MAPPINGS}) "
                                f"do not cover; expected only {', '.join(BLOCK_LINEARS)}")
        for rel in BLOCK_LINEARS:
            out_f, in_f = shape(rel)
            if in_f % cfg.group_size:
                raise PipelineError(f"{pre}{rel}.weight: group_size={cfg.group_size} does not divide the input width {in_f}")
            if out_f % 64:
                raise PipelineError(f"{pre}{rel}.weight: output width {out_f} is not a multiple of 64 "
                                    f"(autoawq's clip search and the AWQ GEMM packing need it)")
        groups = []
        for prev, linears in INPUT_GROUPS:
            widths = {shape(rel)[1] for rel in linears}
            width, prev_shape = widths.pop(), shape(prev)
            if widths:
                raise PipelineError(f"{pre}{linears[0]}.weight: the Linears of group {', '.join(linears)} read different widths")
            if prev in BLOCK_LINEARS:
                if prev_shape[0] != width:
                    skipped.add(f"{prev} -> {', '.join(linears)}: {prev} gives {prev_shape[0]} channels, "
                                f"{linears[0]} reads {width} (grouped-query attention), as autoawq skips it")
                    continue
            elif prev_shape != [width]:
                raise PipelineError(f"{pre}{prev}.weight: shape {prev_shape}, but {', '.join(linears)} read "
                                    f"width {width}; the AWQ mappings ({MAPPINGS}) do not fit this model")
            parents = {rel.rsplit(".", 1)[0] for rel in linears}
            inspect = parents.pop() if len(linears) > 1 and len(parents) == 1 else None
            groups.append(Group(prev, tuple(linears), inspect))
        plan.append(groups)
    return plan, sorted(skipped)


def calibration_batch(ctx, cfg: AWQConfig) -> torch.Tensor:
    """(nsamples, seqlen, 1 + n_vq) ids: the calibration rows concatenated and cut, as autoawq cuts text."""
    ids = load_ids(ctx.dirs["calibrate"])
    n, s, c = ids.shape
    if cfg.nsamples * cfg.seqlen > n * s:
        name = ctx.results.get("calibrate", {}).get("name", "calibration")
        raise PipelineError(
            f"{ctx.profile.path.name}: stages.quantize needs nsamples={cfg.nsamples} x seqlen={cfg.seqlen} = "
            f"{cfg.nsamples * cfg.seqlen} calibration tokens, but {name} has {n} x {s} = {n * s} "
            f"({n * s // cfg.seqlen} samples of {cfg.seqlen}); raise stages.calibrate or lower stages.quantize.nsamples"
        )
    return ids.reshape(n * s, c)[: cfg.nsamples * cfg.seqlen].reshape(cfg.nsamples, cfg.seqlen, c)


def awq_layers(ckpt: Checkpoint, cfg: AWQConfig, ids: torch.Tensor, device: str,
               plan: list[list[Group]]) -> Iterator[tuple[int, torch.nn.Module, dict]]:
    """Yields (i, block i with AWQ scales folded and clipping applied, still FP, info); one block resident."""
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    q = autoawq_quantizer(cfg)
    dtype = cfg.torch_dtype(device)
    hidden = blocks.embed(mcfg, ckpt.get, ids, dtype, device)  # summed text + audio embeddings, not text alone
    kwargs = {"position_embeddings": blocks.rotary(mcfg, ids.shape[1], dtype, device), "attention_mask": None}
    for i in progress(range(mcfg.num_layers), desc="awq", unit="block"):
        layer = blocks.load_block(mcfg, i, ckpt.get, dtype, device)
        hidden, scales, clips = awq_block(q, layer, hidden, kwargs, list(BLOCK_LINEARS), plan[i])
        info = {
            "scaled": [{"prev": prev, "linears": list(lins), "scale_min": round(s.min().item(), 6),
                        "scale_max": round(s.max().item(), 6)} for prev, lins, s in scales],
            "clipped": sorted(name for name, _ in clips),
        }
        yield i, layer.to(device), info
        del layer


def quantize(ctx, cfg: AWQConfig, device: str) -> QuantResult:
    ckpt = ctx.checkpoint()
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    plan, skipped = plan_groups(ckpt, mcfg, cfg)  # everything refusable is refused before any compute
    ids = calibration_batch(ctx, cfg)
    q = autoawq_quantizer(cfg)
    quantized, folded, per_block = {}, {}, []
    for i, layer, info in awq_layers(ckpt, cfg, ids, device, plan):
        pre = f"{BLOCK_PREFIX}.{i}."
        for rel in BLOCK_LINEARS:
            try:
                quantized[pre + rel] = pack(int_weight(q, layer.get_submodule(rel).weight, pre + rel + ".weight"), "awq")
            except QuantizerError as e:
                raise PipelineError(str(e)) from None
        for g in plan[i]:
            if g.prev not in BLOCK_LINEARS:
                folded[pre + g.prev + ".weight"] = layer.get_submodule(g.prev).weight.detach().float().cpu()
        per_block.append(info)
        ctx.log(f"awq block {i}: scaled {len(info['scaled'])} groups, clipped {len(info['clipped'])} Linears")
    qc = {"quant_method": "awq", "version": cfg.version, "bits": cfg.bits, "group_size": cfg.group_size,
          "zero_point": cfg.zero_point, "modules_to_not_convert": NOT_CONVERTED}
    result = gptq_result(ckpt, quantized, qc, fmt="awq", replaced=folded,
                         reasons={name: FOLDED_REASON for name in folded})
    result.extra = {
        "library": "autoawq AwqQuantizer: _search_best_scale, apply_scale, _search_best_clip, apply_clip, pseudo_quantize_tensor",
        "n_grid": N_GRID,
        "search_dtype": str(cfg.torch_dtype(device)).removeprefix("torch."),
        "calibration_tokens": {"nsamples": cfg.nsamples, "seqlen": cfg.seqlen},
        "skipped_groups": skipped,
        "blocks": per_block,
    }
    if cfg.baseline_rtn:
        result.extra.update(baseline_comparison(ctx, cfg, result, device))
    return result


def baseline_comparison(ctx, cfg: AWQConfig, result: QuantResult, device: str) -> dict:
    """AWQ and group-wise RTN (rtn4's quantizer, same bits and group size) on the same held-out set."""
    from ..calibration import build
    from ..evaluate import compare
    from ..loader import DequantizingView

    ckpt = ctx.checkpoint()
    config = ckpt.config()
    held = build("moss-heldout-v1", config, cfg.heldout_nsamples, cfg.heldout_seqlen, ctx.snapshot)
    awq_get = DequantizingView(result.tensors.__getitem__, result.tensors.keys(), result.quantization_config)
    rtn_cfg = RTNConfig(bits=cfg.bits, group_size=cfg.group_size, sym=False)
    targets = {n for n, e in result.layout.items() if e["format"] == "awq"}
    rtn_get = lambda n: fake_quantize(ckpt.get(n).float(), rtn_cfg) if n in targets else ckpt.get(n)
    heldout = {"name": held.name, "sha256": held.sha256, "nsamples": cfg.heldout_nsamples, "seqlen": cfg.heldout_seqlen}
    return {
        "heldout": heldout,
        "awq": compare(config, ckpt.get, awq_get, held.ids, device=device),
        "baseline_rtn": {"quantizer": f"rtn bits={cfg.bits} group_size={cfg.group_size} zero point (as rtn4)",
                         **compare(config, ckpt.get, rtn_get, held.ids, device=device)},
    }

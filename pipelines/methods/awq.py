"""AWQ4: activation-aware scales and clipping per decoder block, stored in the AWQ GEMM layout.

The search is AWQ's (quantizers/awq.py: ours on the device by default, autoawq's own as the
reference); this module feeds it MOSS activations one block at a time: block 0 reads the summed text + n_vq audio embeddings of the multi-channel
calibration set, every later block the previous block's FP output (autoawq's order). Scales
fold into the preceding norm or Linear (the norms are stored BF16 with the folded values).
"""
from __future__ import annotations

import torch

from quantizers.awq import N_GRID, AWQConfig, Group, awq_block, int_weight
from quantizers.errors import QuantizerError
from quantizers.formats import awq_gemm, pack

from ..calibration import load_ids
from ..checkpoint import Checkpoint
from ..engine import FP, Engine, Step
from ..errors import PipelineError
from ..models.moss_tts_delay import BLOCK_LINEARS, BLOCK_PREFIX, DERIVED_INPUTS, INPUT_GROUPS, MossTTSDelayConfig
from .weights import Weights, packed_from_state, packed_state, spill_packed

FOLDED_REASON = "norm gain carrying the folded AWQ input scales, kept BF16"
NOT_CONVERTED = ["lm_heads"]  # the only nn.Linear outside the decoder blocks (embeddings are not Linears)
MAPPINGS = "INPUT_GROUPS/BLOCK_LINEARS in pipelines/models/moss_tts_delay.py"
# Linears reading one input share one captured tensor (q/k/v, gate/up): 3 of the 7 inputs are kept
# (down_proj's is recomputed: DERIVED_INPUTS).
SHARED_INPUT = {rel: lins[0] for _, lins in INPUT_GROUPS for rel in lins[1:]}
SEARCH_OURS = ("quantizers.awq.search_scale / search_clip: autoawq's objective and grids (20 ratios, 10 clip "
               "shrinks on 512 sampled tokens), chunked on the device")


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


class AWQHook:
    """Per block: AWQ's scale search over the input-sharing groups and its clip search, on the
    fp stream's Linear inputs (captured by the engine in its pass over the block); then each
    Linear is quantized on autoawq's zero-point grid and packed in the AWQ GEMM layout."""

    streams = (FP,)
    reads_fp_in = False  # the block's Linear inputs are captured: its input can go (0.5 GiB)

    def __init__(self, cfg: AWQConfig, plan: list[list[Group]], log):
        self.cfg, self.plan, self.log = cfg, plan, log
        # kept on the device, 1.5 GiB at 128 x 512 tokens: our search recomputes down_proj's input
        # (another 1.5 GiB) for its own group; autoawq's functions are handed every input
        self.derived = dict(DERIVED_INPUTS) if cfg.search == "ours" else {}
        self.capture = tuple(rel for rel in BLOCK_LINEARS if rel not in SHARED_INPUT and rel not in self.derived)
        self.packed, self.folded, self.blocks = {}, {}, []

    def on_block(self, step: Step) -> None:
        i, layer = step.index, step.layer
        kwargs = {"position_embeddings": step.position_embeddings, "attention_mask": None}
        feats = {rel: step.captured[SHARED_INPUT.get(rel, rel)] for rel in BLOCK_LINEARS if rel not in self.derived}
        scales, clips = awq_block(layer, feats, kwargs, list(BLOCK_LINEARS), self.plan[i], self.cfg, self.derived)
        pre = f"{BLOCK_PREFIX}.{i}."
        for rel in BLOCK_LINEARS:
            try:
                self.packed[pre + rel] = pack(int_weight(self.cfg, layer.get_submodule(rel).weight, pre + rel + ".weight"), "awq")
            except QuantizerError as e:
                raise PipelineError(str(e)) from None
        for g in self.plan[i]:
            if g.prev not in BLOCK_LINEARS:  # a norm carrying the folded scales
                self.folded[pre + g.prev + ".weight"] = layer.get_submodule(g.prev).weight.detach().float().cpu()
        self.blocks.append({
            "scaled": [{"prev": prev, "linears": list(lins), "scale_min": round(s.min().item(), 6),
                        "scale_max": round(s.max().item(), 6)} for prev, lins, s in scales],
            "clipped": sorted(name for name, _ in clips),
        })
        self.log(f"awq block {i}: scaled {len(scales)} groups, clipped {len(clips)} Linears")

    def block_state(self, i: int):
        pre = f"{BLOCK_PREFIX}.{i}."
        tensors, records = packed_state(self.packed, [pre + rel for rel in BLOCK_LINEARS])
        folded = {name: t for name, t in self.folded.items() if name.startswith(pre)}
        return {**tensors, **folded}, {"packed": records, "folded": list(folded), "record": self.blocks[i]}

    def spill_block(self, i: int, tensors) -> None:
        spill_packed(self.packed, tensors)

    def restore_block(self, i: int, tensors, meta) -> None:
        if len(self.blocks) != i:
            raise ValueError(f"awq: block {i} restored after {len(self.blocks)} blocks")
        self.packed.update(packed_from_state(tensors, meta["packed"]))
        self.folded.update({name: tensors[name].read() for name in meta["folded"]})  # norm weights: small
        self.blocks.append(meta["record"])


def quantize(ctx, cfg: AWQConfig, device: str) -> Weights:
    ckpt = ctx.checkpoint()
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    plan, skipped = plan_groups(ckpt, mcfg, cfg)  # everything refusable is refused before any compute
    ids = calibration_batch(ctx, cfg)
    hook = AWQHook(cfg, plan, ctx.log)
    Engine(mcfg, ckpt.get, device, cfg.torch_dtype(device), cfg.batch_size, desc="awq", log=ctx.log,
           block_lines=True, prefetch=device.startswith("cuda")).run(
        hook, ids, resume=ctx.partial)
    details = {
        "search": (SEARCH_OURS if cfg.search == "ours" else
                   "autoawq AwqQuantizer: _search_best_scale, apply_scale, _search_best_clip, apply_clip"),
        "grid": "autoawq AwqQuantizer.pseudo_quantize_tensor (zero point)",
        "n_grid": N_GRID,
        "search_dtype": str(cfg.torch_dtype(device)).removeprefix("torch."),
        "calibration_tokens": {"nsamples": cfg.nsamples, "seqlen": cfg.seqlen},
        "skipped_groups": skipped,
        "blocks": hook.blocks,
    }
    return Weights(hook.packed, awq_gemm.quantization_config(cfg.group_size, NOT_CONVERTED), replaced=hook.folded,
                   reasons={name: FOLDED_REASON for name in hook.folded}, details=details)

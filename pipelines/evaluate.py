"""The evaluate stage for the generator: teacher-forced fidelity against the BF16 source.

Both models run side by side through the engine over a held-out multi-channel set, one block of
each resident at a time: per-block relative output error ||h_q - h_ref|| / ||h_ref|| (errors
propagate, as in deployment), then per-head KL(ref || quant) and top-1 agreement. Audio heads
are scored on the audio segment (where the text channel holds gen/delay slots), the text head
everywhere. A baseline (RTN on each quantized tensor's own grid) is scored on the same set when
the profile asks: one implementation and one manifest shape for every method.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantizers.rtn import RTNConfig, fake_quantize

from .calibration import build
from .engine import FP, QUANT, Engine, final_norm, load_block
from .models.moss_tts_delay import MossTTSDelayConfig, audio_positions

BASELINES = ("rtn",)


@dataclass
class EvaluateParams:
    dataset: str = "moss-heldout-v1"  # the set the gate reads
    sets: list[str] = field(default_factory=list)  # more held-out sets scored the same way, reported each alone
    nsamples: int = 8
    seqlen: int = 256
    batch_size: int = 4
    # Also score this baseline on the same set: "rtn" = round-to-nearest on each quantized
    # tensor's own grid (bits, group size, symmetry), what a calibrated method must beat.
    baseline: str | None = None
    scorers: list[str] = field(default_factory=list)  # optional "module:Class" plug-ins (pipelines/scorers.py)

    def validate(self):
        from .scorers import check_entry

        if self.nsamples < 1:
            raise ValueError(f"nsamples: must be >= 1, got {self.nsamples}")
        if self.baseline is not None and self.baseline not in BASELINES:
            raise ValueError(f"baseline: {self.baseline!r} (allowed: {', '.join(BASELINES)} or null)")
        for entry in self.scorers:
            check_entry(entry)
        for name in self.sets:
            if name == self.dataset or self.sets.count(name) > 1:
                raise ValueError(f"sets: {name!r} is scored twice (dataset: {self.dataset!r})")


def _kl_top1(ref: torch.Tensor, q: torch.Tensor, mask: torch.Tensor):
    """Mean KL(ref||q) and top-1 agreement over masked positions; -inf logits handled."""
    lr, lq = ref.float().log_softmax(-1), q.float().log_softmax(-1)
    pr = lr.exp()
    kl = torch.where(pr > 0, pr * (lr - lq), torch.zeros_like(pr)).sum(-1)
    agree = (ref.argmax(-1) == q.argmax(-1)).float()
    m = mask.float()
    return (kl * m).sum().item(), (agree * m).sum().item(), m.sum().item()


class _SideBySide:
    """The candidate's block i on the quant stream beside the source's on the fp stream."""

    streams, capture = (FP, QUANT), ()

    def __init__(self, cfg, quant_get, dtype, device):
        self.cfg, self.get, self.dtype, self.device = cfg, quant_get, dtype, device
        self.block_err = []

    def on_block(self, step):
        q_out = step.run(load_block(self.cfg, step.index, self.get, self.dtype, self.device), step.quant_in)
        self.block_err.append(((q_out.float() - step.fp_out.float()).norm() / step.fp_out.float().norm()).item())
        return q_out


@torch.no_grad()
def compare(config: dict, ref_get, quant_get, ids: torch.Tensor, device="cpu", batch_size=4,
            dtype=torch.bfloat16, on_logits=None) -> dict:
    """`on_logits(head, start, ref_logits, quant_logits)`, when given, sees every head's logits
    per batch (the scorers' greedy tokens are collected this way)."""
    cfg = MossTTSDelayConfig.from_dict(config)
    audio_mask = audio_positions(config, ids).to(device)
    text_mask = torch.ones_like(audio_mask)
    engine = Engine(cfg, ref_get, device, dtype, batch_size, desc="evaluate")
    side = _SideBySide(cfg, quant_get, dtype, device)
    engine.run(side, ids, quant_get=quant_get)
    h_ref, h_q = engine.last[FP].to(device), engine.last[QUANT].to(device)
    n_heads = cfg.n_vq + 1
    sums = torch.zeros(n_heads, 3, dtype=torch.float64)
    for s in range(0, ids.shape[0], batch_size):
        fr = final_norm(cfg, ref_get, h_ref[s:s + batch_size])
        fq = final_norm(cfg, quant_get, h_q[s:s + batch_size])
        for k in range(n_heads):
            w_ref = ref_get(f"lm_heads.{k}.weight").to(device, dtype)
            w_q = quant_get(f"lm_heads.{k}.weight").to(device, dtype)
            lr, lq = fr @ w_ref.t(), fq @ w_q.t()
            if k:
                lr[..., cfg.audio_pad_code] = float("-inf")
                lq[..., cfg.audio_pad_code] = float("-inf")
            if on_logits:
                on_logits(k, s, lr, lq)
            mask = (audio_mask if k else text_mask)[s:s + batch_size]
            sums[k] += torch.tensor(_kl_top1(lr, lq, mask), dtype=torch.float64)
    kl = (sums[:, 0] / sums[:, 2].clamp(min=1)).tolist()
    top1 = (sums[:, 1] / sums[:, 2].clamp(min=1)).tolist()
    r = lambda x: float(f"{x:.6g}")  # stable, readable figures in the manifest  # noqa: E731
    return {
        "kl_text": r(kl[0]),
        "top1_text": r(top1[0]),
        "kl_audio": [r(x) for x in kl[1:]],
        "top1_audio": [r(x) for x in top1[1:]],
        "kl_audio_mean": r(sum(kl[1:]) / cfg.n_vq),
        "kl_audio_max": r(max(kl[1:])),
        "top1_audio_mean": r(sum(top1[1:]) / cfg.n_vq),
        "top1_audio_min": r(min(top1[1:])),
        "block_rel_error": [r(x) for x in side.block_err],
        "final_rel_error": r(side.block_err[-1]),
    }


def rtn_getter(get, layout: dict, device: str = "cpu"):
    """Source weights with every quantized tensor replaced by RTN on its own stored grid (computed on `device`)."""
    grids = {name: RTNConfig(e["bits"], e["group_size"], e["sym"]) for name, e in layout.items()
             if e["format"] in ("gptq", "awq")}
    return lambda name: fake_quantize(get(name).to(device).float(), grids[name]) if name in grids else get(name)


def run(ctx, params: EvaluateParams, out: Path) -> dict:
    from .loader import stage_view
    from .quantize import META
    from .scorers import GreedyTokens, load_scorers, run_scorers
    from .stages import resolve_device

    ckpt = ctx.checkpoint()
    config = ckpt.config()
    device = resolve_device("auto")
    view = stage_view(ctx.dirs["quantize"], device)
    scorers = load_scorers(params.scorers, f"{ctx.profile.path}: stages.evaluate.scorers")  # fail before the long part
    held = build(params.dataset, config, params.nsamples, params.seqlen, ctx.snapshot)
    tokens = GreedyTokens(held.ids) if scorers else None
    metrics = compare(config, ckpt.get, view, held.ids, device=device, batch_size=params.batch_size, on_logits=tokens)
    if scorers:
        context = {"modality": "generator-tokens", "ids": held.ids, "audio_mask": audio_positions(config, held.ids),
                   "config": config, "codec_model": ctx.spec.codec}
        metrics.update(run_scorers(scorers, tokens.reference, tokens.candidate, context))
    result = {"dataset": {"name": held.name, "sha256": held.sha256}, "metrics": metrics}
    if params.sets:
        result["sets"] = {}
        for name in params.sets:
            other = build(name, config, params.nsamples, params.seqlen, ctx.snapshot)
            result["sets"][name] = {"sha256": other.sha256, "metrics": compare(
                config, ckpt.get, view, other.ids, device=device, batch_size=params.batch_size)}
    if params.baseline == "rtn":
        meta = json.loads((ctx.dirs["quantize"] / META).read_text())  # the layout only: tensors are in `view`
        result["baseline"] = {
            "method": "rtn", "what": "round-to-nearest on each quantized tensor's own grid (bits, group size, symmetry)",
            "metrics": compare(config, ckpt.get, rtn_getter(ckpt.get, meta["layout"], device), held.ids, device=device,
                               batch_size=params.batch_size)}
    return result

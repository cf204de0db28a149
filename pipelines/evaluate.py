"""Teacher-forced fidelity against the BF16 source, block by block.

Both models run in lockstep over a held-out multi-channel set, one block of each resident at
a time: per-block relative output error ||h_q - h_ref|| / ||h_ref|| (errors propagate, as
in deployment), then per-head KL(ref || quant) and top-1 agreement. Audio heads are scored
on the audio segment (where the text channel holds gen/delay slots), the text head everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import blocks
from .calibration import UPSTREAM_IDS, build
from .models.moss_tts_delay import MossTTSDelayConfig
from .progress import progress


@dataclass
class EvaluateParams:
    dataset: str = "moss-heldout-v1"
    nsamples: int = 8
    seqlen: int = 256
    batch_size: int = 4
    scorers: list[str] = field(default_factory=list)  # optional "module:Class" plug-ins (pipelines/scorers.py)

    def validate(self):
        from .scorers import check_entry

        if self.nsamples < 1:
            raise ValueError(f"nsamples: must be >= 1, got {self.nsamples}")
        for entry in self.scorers:
            check_entry(entry)


def _kl_top1(ref: torch.Tensor, q: torch.Tensor, mask: torch.Tensor):
    """Mean KL(ref||q) and top-1 agreement over masked positions; -inf logits handled."""
    lr, lq = ref.float().log_softmax(-1), q.float().log_softmax(-1)
    pr = lr.exp()
    kl = torch.where(pr > 0, pr * (lr - lq), torch.zeros_like(pr)).sum(-1)
    agree = (ref.argmax(-1) == q.argmax(-1)).float()
    m = mask.float()
    return (kl * m).sum().item(), (agree * m).sum().item(), m.sum().item()


def audio_positions(config: dict, ids: torch.Tensor) -> torch.Tensor:
    """(N, S) bool: where the text channel holds an audio gen/delay slot (audio heads are scored there)."""
    slots = [config.get(k, UPSTREAM_IDS[k]) for k in
             ("audio_assistant_gen_slot_token_id", "audio_assistant_delay_slot_token_id")]
    return torch.isin(ids[..., 0], torch.tensor(slots))


@torch.no_grad()
def compare(config: dict, ref_get, quant_get, ids: torch.Tensor, device="cpu", batch_size=4,
            dtype=torch.bfloat16, on_logits=None) -> dict:
    """`on_logits(head, start, ref_logits, quant_logits)`, when given, sees every head's logits
    per batch (the scorers' greedy tokens are collected this way)."""
    cfg = MossTTSDelayConfig.from_dict(config)
    audio_mask = audio_positions(config, ids).to(device)
    text_mask = torch.ones_like(audio_mask)
    pos = blocks.rotary(cfg, ids.shape[1], dtype, device)
    h_ref = blocks.embed(cfg, ref_get, ids, dtype, device)
    h_q = blocks.embed(cfg, quant_get, ids, dtype, device)
    block_err = []
    for i in progress(range(cfg.num_layers), desc="evaluate", unit="block"):
        h_ref = blocks.run_block(blocks.load_block(cfg, i, ref_get, dtype, device), h_ref, pos, batch_size)
        h_q = blocks.run_block(blocks.load_block(cfg, i, quant_get, dtype, device), h_q, pos, batch_size)
        block_err.append(((h_q.float() - h_ref.float()).norm() / h_ref.float().norm()).item())
    n_heads = cfg.n_vq + 1
    sums = torch.zeros(n_heads, 3, dtype=torch.float64)
    for s in range(0, ids.shape[0], batch_size):
        fr = blocks.final_norm(cfg, ref_get, h_ref[s:s + batch_size])
        fq = blocks.final_norm(cfg, quant_get, h_q[s:s + batch_size])
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
    r = lambda x: float(f"{x:.6g}")  # stable, readable figures in the manifest
    return {
        "kl_text": r(kl[0]),
        "top1_text": r(top1[0]),
        "kl_audio": [r(x) for x in kl[1:]],
        "top1_audio": [r(x) for x in top1[1:]],
        "kl_audio_mean": r(sum(kl[1:]) / cfg.n_vq),
        "kl_audio_max": r(max(kl[1:])),
        "top1_audio_mean": r(sum(top1[1:]) / cfg.n_vq),
        "top1_audio_min": r(min(top1[1:])),
        "block_rel_error": [r(x) for x in block_err],
        "final_rel_error": r(block_err[-1]),
    }


def run_evaluate(ctx, params: EvaluateParams, out: Path) -> dict:
    from .loader import DequantizingView
    from .methods import load_quant
    from .scorers import GreedyTokens, load_scorers, run_scorers
    from .stages import resolve_device

    ckpt = ctx.checkpoint()
    config = ckpt.config()
    tensors, meta = load_quant(ctx.dirs["quantize"])
    view = DequantizingView(tensors.__getitem__, tensors.keys(), meta["quantization_config"])
    scorers = load_scorers(params.scorers, f"{ctx.profile.path}: stages.evaluate.scorers")  # fail before the long part
    held = build(params.dataset, config, params.nsamples, params.seqlen, ctx.snapshot)
    device = resolve_device("auto")
    tokens = GreedyTokens(held.ids) if scorers else None
    metrics = compare(config, ckpt.get, view, held.ids, device=device, batch_size=params.batch_size, on_logits=tokens)
    if scorers:
        context = {"modality": "generator-tokens", "ids": held.ids, "audio_mask": audio_positions(config, held.ids),
                   "config": config, "codec_model": ctx.spec.codec}
        metrics.update(run_scorers(scorers, tokens.reference, tokens.candidate, context))
    return {"dataset": {"name": held.name, "sha256": held.sha256}, "metrics": metrics}

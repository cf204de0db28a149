"""Layer-by-layer execution of the generator: one decoder block on the device at a time.

Everything that needs activations (AWQ, auto-round, sensitivity, evaluation) goes through
here, so the full model never has to be resident: tensors are pulled from a getter (a
Checkpoint read from disk on demand, or a dequantizing view of a quantized state) block by block.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from .models.moss_tts_delay import BLOCK_PREFIX, MossTTSDelayConfig

Getter = Callable[[str], torch.Tensor]


def embed(cfg: MossTTSDelayConfig, get: Getter, ids: torch.Tensor, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    """(N, S, 1 + n_vq) ids -> (N, S, H): text embedding plus the n_vq audio embeddings."""
    ids = ids.to(device)
    x = nn.functional.embedding(ids[..., 0], get("language_model.embed_tokens.weight").to(device, dtype))
    for k in range(cfg.n_vq):
        x = x + nn.functional.embedding(ids[..., k + 1], get(f"emb_ext.{k}.weight").to(device, dtype))
    return x


def load_block(cfg: MossTTSDelayConfig, i: int, get: Getter, dtype=torch.bfloat16, device="cpu") -> Qwen3DecoderLayer:
    qcfg = cfg.qwen3()
    with torch.device("meta"):
        layer = Qwen3DecoderLayer(qcfg, layer_idx=i)
    prefix = f"{BLOCK_PREFIX}.{i}."
    state = {name: get(prefix + name).to(device, dtype) for name, _ in layer.named_parameters()}
    layer.load_state_dict(state, assign=True)
    return layer.eval().requires_grad_(False)


def rotary(cfg: MossTTSDelayConfig, seqlen: int, dtype=torch.bfloat16, device="cpu"):
    with torch.device(device):
        rope = Qwen3RotaryEmbedding(config=cfg.qwen3())
    pos = torch.arange(seqlen, device=device)[None]
    x = torch.zeros(1, seqlen, 1, dtype=dtype, device=device)
    return rope(x, pos)


@torch.no_grad()
def run_block(layer: nn.Module, hidden: torch.Tensor, pos_emb, batch_size: int = 8) -> torch.Tensor:
    outs = []
    for s in range(0, hidden.shape[0], batch_size):
        h = hidden[s:s + batch_size]
        out = layer(h, attention_mask=None, position_embeddings=pos_emb, position_ids=None)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return torch.cat(outs)


def final_norm(cfg: MossTTSDelayConfig, get: Getter, hidden: torch.Tensor) -> torch.Tensor:
    norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.language_config.get("rms_norm_eps", 1e-6))
    norm.weight = nn.Parameter(get("language_model.norm.weight").to(hidden.device, hidden.dtype), requires_grad=False)
    return norm(hidden)


def head_logits(cfg: MossTTSDelayConfig, get: Getter, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Every head on the final hidden state; the audio pad code is masked as upstream does."""
    out = []
    for k in range(cfg.n_vq + 1):
        logits = hidden @ get(f"lm_heads.{k}.weight").to(hidden.device, hidden.dtype).t()
        if k:
            logits[..., cfg.audio_pad_code] = float("-inf")
        out.append(logits)
    return out


def stream_blocks(cfg: MossTTSDelayConfig, get: Getter, ids: torch.Tensor, dtype=torch.bfloat16, device="cpu",
                  batch_size: int = 8) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yields (block index, block input, block output) for every block, one block resident at a time."""
    hidden = embed(cfg, get, ids, dtype, device)
    pos = rotary(cfg, ids.shape[1], dtype, device)
    for i in range(cfg.num_layers):
        layer = load_block(cfg, i, get, dtype, device)
        out = run_block(layer, hidden, pos, batch_size)
        yield i, hidden, out
        hidden = out
        del layer

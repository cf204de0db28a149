"""Deterministic MossTTSDelay checkpoints in the upstream on-disk layout.

`tiny` is small enough for CI but hard the way trained LLMs are: heavy-tailed weights
(Student-t, 8 degrees of freedom), a few hidden channels with RMSNorm gains x20-50 (the
outlier channels that make activation-aware methods matter), a few "massive activation"
channels in the embeddings, and heads scaled so the output distributions are peaked.
`full-shape` has the real 8B shapes (random init) and is written shard by shard.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import portable_random as rnd
from .atomic import atomic_folder
from .checkpoint import INDEX, canonical_json, shard_names, shard_plan
from .errors import PipelineError
from .models.moss_tts_delay import SPECIAL_IDS


SHAPES = {
    # hidden, ffn, layers, heads, kv heads, head_dim, vocab, n_vq, audio codes, shard bytes
    "tiny": dict(hidden=256, ffn=768, layers=4, heads=4, kv=2, head_dim=64, vocab=1024, n_vq=32, audio=64,
                 shard=4 << 20),
    # tiny with MOSS's real text vocabulary: the upstream special token ids are real ids (what MOSS's
    # llama.cpp runtime assumes), for the GGUF runtime check (scripts/llama_moss_parity.py)
    "tiny-vocab": dict(hidden=256, ffn=768, layers=4, heads=4, kv=2, head_dim=64, vocab=155648, n_vq=32, audio=1024,
                       shard=64 << 20),
    "full-shape": dict(hidden=4096, ffn=12288, layers=36, heads=32, kv=8, head_dim=128, vocab=155648, n_vq=32,
                       audio=1024, shard=5 << 30),
}


def fixture_config(name: str) -> dict:
    s = SHAPES[name]
    special = (
        SPECIAL_IDS
        if s["vocab"] > 151662
        else {k: s["vocab"] - 8 + i for i, k in enumerate(SPECIAL_IDS)}  # remapped into a small vocab
    )
    language = {
        "model_type": "qwen3",
        "hidden_size": s["hidden"],
        "intermediate_size": s["ffn"],
        "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv"],
        "head_dim": s["head_dim"],
        "vocab_size": s["vocab"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    return {
        "architectures": ["MossTTSDelayModel"],
        "model_type": "moss_tts_delay",
        "dtype": "bfloat16",
        "language_config": language,
        "n_vq": s["n_vq"],
        "audio_vocab_size": s["audio"],
        "audio_pad_code": s["audio"],
        "sampling_rate": 24000,
        **special,
    }


def tensor_specs(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a MossTTSDelay checkpoint and its shape, from config.json alone."""
    lc = cfg["language_config"]
    h, f, v = lc["hidden_size"], lc["intermediate_size"], lc["vocab_size"]
    nq, nkv, hd = lc["num_attention_heads"], lc["num_key_value_heads"], lc["head_dim"]
    a = cfg["audio_vocab_size"] + 1
    specs = {"language_model.embed_tokens.weight": (v, h), "language_model.norm.weight": (h,)}
    for i in range(lc["num_hidden_layers"]):
        p = f"language_model.layers.{i}."
        specs.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq * hd, h),
            p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h),
            p + "self_attn.o_proj.weight": (h, nq * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
    for k in range(cfg["n_vq"]):
        specs[f"emb_ext.{k}.weight"] = (a, h)
    specs["lm_heads.0.weight"] = (v, h)
    for k in range(1, cfg["n_vq"] + 1):
        specs[f"lm_heads.{k}.weight"] = (a, h)
    return specs


def make_tensor(name: str, shape, cfg: dict, seed: int, device: str = "cpu") -> torch.Tensor:
    """One tensor, drawn from its own stream (keyed by the seed and its full name), so shards can be
    generated in any order, and the same bytes come out on every machine and device
    (pipelines/portable_random.py)."""
    key = f"moss-quant/fixture/{seed}/{name}"
    h = cfg["language_config"]["hidden_size"]
    # The same outlier channels everywhere: about 1.5% of the hidden width.
    outliers = rnd.permutation(f"moss-quant/fixture/{seed}/outlier-channels", h, device)[: max(2, round(0.015 * h))]
    if name.endswith(("layernorm.weight", "language_model.norm.weight")):
        g = 1.0 + 0.1 * rnd.normal(key, shape, device)
        gains = 20.0 + 30.0 * rnd.uniform(key + "/gains", (len(outliers),), device)  # x20-50
        if "input_layernorm" in name or "post_attention_layernorm" in name:
            g[outliers] = g[outliers] * gains
        else:  # the final norm damps the massive channels, as trained models' final norms do
            g[outliers[:2]] = g[outliers[:2]] * 0.02
        return rnd.to_bfloat16(g).cpu()
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return rnd.to_bfloat16(1.0 + 0.1 * rnd.normal(key, shape, device)).cpu()
    rows, fan_in = shape
    out = torch.empty(shape, dtype=torch.bfloat16)
    step = max(1, ROW_BLOCK_ELEMENTS // fan_in)
    for r0 in range(0, rows, step):  # a slice of rows at a time: element j of the stream is element j here
        r1 = min(rows, r0 + step)
        w = rnd.student_t(key, (r1 - r0, fan_in), df=8, device=device, start=r0 * fan_in) / math.sqrt(fan_in)
        if name.startswith(("language_model.embed_tokens", "emb_ext.")):
            w = w * (math.sqrt(fan_in) * (1.0 if name.startswith("language_model") else 0.3))  # O(1) entries
            w[:, outliers[:2]] = w[:, outliers[:2]] + 0.5  # massive-activation channels in the residual stream
        elif name.startswith("lm_heads."):
            w = w * 5.0  # peaked output distributions, like a trained model
        elif name.endswith("o_proj.weight"):
            w = w * 0.1  # each block adds a modest update to the residual stream
        elif name.endswith("down_proj.weight"):
            w = w * 0.003  # the MLP reads x20-50 outlier inputs: damp its update to the same scale
        out[r0:r1] = rnd.to_bfloat16(w).cpu()
    if name == "lm_heads.0.weight":
        plant_end_of_audio(out, cfg, outliers[:2].cpu())
    return out


# How strongly the text head prefers the gen slot to the delay slot, through the two massive
# channels (a constant in every hidden state, as massive activations are a bias in trained LLMs).
# A random head would end every utterance at its first allowed step; with this margin, on
# held-out prompts the BF16 tiny model ends its audio after tens to hundreds of frames when
# sampled (a hazard that the hidden state moves), and a model whose hidden states drift ends
# it elsewhere. A literal, chosen by hand on tiny: nothing is computed, so the bytes stay portable.
END_OF_AUDIO_MARGIN = 144.0


def plant_end_of_audio(head: torch.Tensor, cfg: dict, massive: torch.Tensor) -> None:
    gen, delay = cfg["audio_assistant_gen_slot_token_id"], cfg["audio_assistant_delay_slot_token_id"]
    head[delay, massive] = rnd.to_bfloat16(head[gen, massive].double() - END_OF_AUDIO_MARGIN)


ROW_BLOCK_ELEMENTS = 1 << 24


def write_fixture(name: str, out: Path, seed: int = 0, layers: int | None = None, device: str = "cpu") -> Path:
    """Write the fixture atomically (temporary folder, then rename). Returns the folder.

    `layers` keeps the full width with fewer blocks (scale runs that cannot afford 36)."""
    if name not in SHAPES:
        raise PipelineError(f"unknown fixture {name!r} (known: {', '.join(SHAPES)})")
    out = Path(out)
    cfg = fixture_config(name)
    if layers:
        cfg["language_config"]["num_hidden_layers"] = layers
    specs = tensor_specs(cfg)
    sizes = {k: math.prod(s) * 2 for k, s in specs.items()}
    plan = shard_plan(sizes, SHAPES[name]["shard"])
    files = shard_names(len(plan)) if len(plan) > 1 else ["model-00001-of-00001.safetensors"]
    weight_map = {}
    with atomic_folder(out) as tmp:
        from .progress import progress

        for fname, keys in progress(list(zip(files, plan)), desc=f"fixture {name}", unit="shard"):
            save_file({k: make_tensor(k, specs[k], cfg, seed, device) for k in keys}, str(tmp / fname), {"format": "pt"})
            weight_map.update({k: fname for k in keys})
        (tmp / INDEX).write_text(canonical_json({"metadata": {"total_size": sum(sizes.values())},
                                                 "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        (tmp / "config.json").write_text(canonical_json(cfg, indent=2))
    return out


def write_any_fixture(name: str, out: Path, seed: int = 0) -> Path:
    """Generator fixtures live here; codec fixtures in `codec_fixtures` (same call shape)."""
    if name in SHAPES:
        return write_fixture(name, out, seed)
    from . import codec_fixtures

    return codec_fixtures.write_codec_fixture(name, out, seed)

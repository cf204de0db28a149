"""Deterministic MOSS-Audio-Tokenizer checkpoints in the upstream layout (FP32 on disk, like the real one).

`codec-tiny` mirrors the real codec's structure at toy width: encoder
[Patch16, T, Patch2, T, Patch2, T] (stacks 1,3,5), decoder [T, Patch2, T, Patch2, T, Patch16]
(stacks 0,2,4), the same conditional input/output projections as the real stages, and the
real quantizer shape: 32 codebooks x 1024 codes of dim 8 (so the shared validation code set
decodes on both). Linear widths are multiples of 16. The attention window is shortened
(0.04 s = 15/30/60 frames per stage) so that validation sequences cross it.
Weights are heavy-tailed (Student-t) with a few large-magnitude input columns per Linear,
which is what per-output-channel FP8 scales have to cope with in trained models.
`codec-full-shape` is the real configuration (used for meta-device shape checks; writing it
takes ~7 GB).
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
from .models.moss_audio_tokenizer import CodecConfig, tensor_specs


def _transformer(i, o, d, heads, layers, ff):
    return {
        "module_type": "Transformer", "input_dimension": i, "output_dimension": o, "d_model": d,
        "num_heads": heads, "num_layers": layers, "dim_feedforward": ff, "causal": True,
        "norm": "layer_norm", "positional_embedding": "rope", "max_period": 10000, "gating": "none",
        "layer_scale": 0.01, "conv_layout": True,
    }


def _patch(p):
    return {"module_type": "PatchedPretransform", "patch_size": p}


def _config(downsample, enc, dec, quant, context, sr=24000) -> dict:
    return {
        "architectures": ["MossAudioTokenizerModel"],
        "model_type": "speech_tokenizer",
        "dtype": "float32",
        "sampling_rate": sr,
        "downsample_rate": downsample,
        "causal_transformer_context_duration": context,
        "encoder_kwargs": enc,
        "decoder_kwargs": dec,
        "quantizer_type": "rlfq",
        "quantizer_kwargs": {**quant, "quantizer_type": "rlfq"},
    }


def fixture_config(name: str) -> dict:
    if name == "codec-tiny":
        t = lambda i, o: _transformer(i, o, 64, 4, 2, 256)  # noqa: E731
        return _config(
            64,
            [_patch(16), t(16, 32), _patch(2), t(64, 32), _patch(2), t(64, 48)],
            [t(48, 64), _patch(2), t(32, 64), _patch(2), t(32, 16), _patch(16)],
            {"input_dim": 48, "rvq_dim": 32, "output_dim": 48, "num_quantizers": 32, "codebook_size": 1024, "codebook_dim": 8},
            context=0.04,
        )
    if name == "codec-full-shape":
        small = lambda i, o: _transformer(i, o, 768, 12, 12, 3072)  # noqa: E731
        big = lambda i, o: _transformer(i, o, 1280, 20, 32, 5120)  # noqa: E731
        return _config(
            1920,
            [_patch(240), small(240, 384), _patch(2), small(768, 384), _patch(2), small(768, 640), _patch(2), big(1280, 768)],
            [big(768, 1280), _patch(2), small(640, 768), _patch(2), small(384, 768), _patch(2), small(384, 240), _patch(240)],
            {"input_dim": 768, "rvq_dim": 512, "output_dim": 768, "num_quantizers": 32, "codebook_size": 1024, "codebook_dim": 8},
            context=10.0,
        )
    raise PipelineError(f"unknown codec fixture {name!r} (known: codec-tiny, codec-full-shape)")


def make_tensor(name: str, shape, seed: int, device: str = "cpu") -> torch.Tensor:
    """One float32 tensor from its own stream (keyed by the seed and its full name): order-independent,
    the same bytes on every machine and device (pipelines/portable_random.py)."""
    key = f"moss-quant/codec-fixture/{seed}/{name}"
    if name.endswith(("norm1.weight", "norm2.weight")):
        x = 1.0 + 0.1 * rnd.normal(key, shape, device)
    elif name.endswith(("norm1.bias", "norm2.bias")):
        x = 0.02 * rnd.normal(key, shape, device)
    elif ".layer_scale_" in name:
        # Trained LayerScales grow far from their 0.01 init; 0.1-0.5 keeps every layer audible.
        x = 0.1 + 0.4 * rnd.uniform(key, shape, device)
    elif name.endswith("original0"):  # weight-norm gain g: the per-channel output norm
        x = 0.5 + rnd.uniform(key, shape, device)
    elif name.endswith(".bias"):  # quantizer conv biases
        x = 0.01 * rnd.normal(key, shape, device)
    elif name.endswith("codebook.weight"):
        x = rnd.normal(key, shape, device)
    else:
        # Linear weights and weight-norm directions v: heavy tails plus a few loud input columns.
        fan_in = shape[1]
        x = rnd.student_t(key, shape, df=4, device=device) / math.sqrt(fan_in)
        if x.dim() == 2 and fan_in >= 16:
            cols = rnd.permutation(key + "/loud-columns", fan_in, device)[: max(1, fan_in // 32)]
            x[:, cols] = x[:, cols] * 4.0
        if name.endswith("output_proj.weight") and name.startswith("decoder."):
            x = x * 0.015  # the waveform head: PCM std ~0.15, peaks inside [-1, 1]
    return rnd.to_float32(x).cpu()


SHARD_BYTES = 2 << 30  # the full-shape codec (7.1 GB) is written shard by shard


def write_codec_fixture(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Write the safetensors file(s) + `config.json` atomically (temp folder, then rename). Returns the folder."""
    from .progress import progress

    cfg = fixture_config(name)
    specs = tensor_specs(CodecConfig.from_dict(cfg))
    out = Path(out_dir)
    with atomic_folder(out) as tmp:
        plan = shard_plan({k: 4 * math.prod(s) for k, s in specs.items()}, SHARD_BYTES)
        files = shard_names(len(plan))
        for fname, keys in progress(list(zip(files, plan)), desc=f"fixture {name}", unit="shard"):
            save_file({k: make_tensor(k, specs[k], seed).contiguous() for k in keys}, str(tmp / fname),
                      {"format": "pt"})
        if len(files) > 1:
            weight_map = {k: f for f, keys in zip(files, plan) for k in keys}
            (tmp / INDEX).write_text(canonical_json({"metadata": {"total_size": sum(4 * math.prod(s) for s in specs.values())},
                                                     "weight_map": dict(sorted(weight_map.items()))}, indent=2))
        (tmp / "config.json").write_text(canonical_json(cfg, indent=2))
    return out

"""FP8 codec artifact: decode-only MOSS-Audio-Tokenizer with FP8 E4M3 decoder Linears.

The encoder and the quantizer's input-side projections are dropped; the decoder's Linear
weights become `weight` (float8_e4m3fn) + `weight_scale` (float32 [out, 1]); LayerNorms,
LayerScales, the quantizer's decode path (codebooks, weight-normed 1x1 convs) and any
Linear named in `keep_bf16` are stored BF16. Weight-only, round-to-nearest: no calibration.
"""
from __future__ import annotations

import torch

from quantizers.errors import QuantizerError
from quantizers.formats import fp8_channel, pack
from quantizers.fp8 import FP8Config, quantize_fp8

from ..errors import PipelineError
from ..models.moss_audio_tokenizer import (CodecConfig, TransformerSpec, decoder_linear_names, extract_decode_only,
                                           read_config, stored_name)
from ..progress import progress
from .weights import Weights

REASONS = {
    "norm": "LayerNorm: tiny, sets every activation's scale, kept BF16",
    "layer_scale": "LayerScale: per-channel residual gain, kept BF16",
    "quantizer": "quantizer decode path (codebooks, weight-normed 1x1 convs): not a Linear, kept BF16",
    "keep": "named in the profile's keep_bf16: first/last projection of the decoder",
}


def resolve_keep(cfg: CodecConfig, keep: tuple[str, ...]) -> list[str]:
    """Role names -> module names; every entry must be an FP8 candidate of this codec."""
    stages = [(i, m) for i, m in enumerate(cfg.decoder) if isinstance(m, TransformerSpec)]
    roles = {"first_input_proj": f"decoder.{stages[0][0]}.input_proj",
             "last_output_proj": f"decoder.{stages[-1][0]}.output_proj"}
    linears = set(decoder_linear_names(cfg))
    out = []
    for name in keep:
        module = roles.get(name, name)
        if module not in linears:
            raise PipelineError(f"quantize.keep_bf16: {name!r} is not a decoder Linear of this codec "
                                f"(roles: {', '.join(roles)}; or a name like decoder.0.transformer.layers.0.linear1)")
        out.append(module)
    return sorted(set(out))


def quantize(ctx, cfg: FP8Config, device: str) -> Weights:
    ckpt = ctx.checkpoint()
    ccfg = read_config(ckpt)
    extraction = extract_decode_only(ckpt, ccfg)
    keep = resolve_keep(ccfg, tuple(cfg.keep_bf16))
    targets = set(decoder_linear_names(ccfg)) - set(keep)
    packed, kept_bf16, reasons, errors = {}, {}, {}, []
    for name in progress(extraction.kept, desc="fp8", unit="tensor"):
        w = ckpt.get(stored_name(ckpt, name))
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in targets:
            try:
                q = quantize_fp8(w.to(device), cfg, name=name)
            except QuantizerError as e:
                raise PipelineError(str(e)) from None
            packed[module] = pack(q, "fp8")
            err = ((q.dequantize(torch.float32).cpu() - w.float()).norm() / w.float().norm().clamp(min=1e-30)).item()
            errors.append((err, name))
        else:
            kept_bf16[name] = w  # read under its stored (possibly legacy weight_g/weight_v) name
            reasons[name] = (REASONS["keep"] if module in keep else REASONS["quantizer"] if name.startswith("quantizer.")
                             else REASONS["layer_scale"] if ".layer_scale_" in name else REASONS["norm"])
    errors.sort(reverse=True)
    details = {
        "decode_only": extraction.manifest(),
        "fp8": {
            "format": "float8_e4m3fn", "scale": "amax/448 per output channel, float32, axis 0", "targets": len(targets),
            "kept_bf16": keep,
            "weight_rel_error_mean": float(f"{sum(e for e, _ in errors) / max(1, len(errors)):.6g}"),
            "weight_rel_error_worst": [{"tensor": n, "rel_error": float(f"{e:.6g}")} for e, n in errors[:5]],
        },
    }
    # The FP32 source's dtype no longer describes the artifact: it loads as BF16.
    dtype_keys = {k: "bfloat16" for k in ("dtype", "torch_dtype") if k in ckpt.config()}
    return Weights(packed, fp8_channel.quantization_config(keep), replaced=kept_bf16, reasons=reasons, details=details,
                   config=dtype_keys, kept={n: list(extraction.shapes[n]) for n in extraction.kept},
                   source_params=extraction.params_before)

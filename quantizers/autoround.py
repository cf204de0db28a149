"""auto-round (SignRound) one decoder block at a time, through its block-level API.

The pipeline's engine owns the loop over blocks; for each one, auto-round's `quantize_block`
(the public entry llm-compressor's AutoRoundModifier uses) gets the block, the quantized stream's
inputs (what the tuned block reads, as with auto-round's `enable_quanted_input`) and the fp
stream's output as its reference. auto-round never sees a model, a tokenizer or a dataset of its
own, and holds only the block; the caller runs the tuned block on the stream itself (in place, so
auto-round's own copy of the outputs is not made). The tuned integers come back as `IntWeight`s
for our GPTQ packing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from .errors import QuantizerError
from .rtn import IntWeight

from .formats.gptq import BITS as FORMAT_BITS, GROUP_SIZES as FORMAT_GROUP_SIZES


@dataclass(frozen=True)
class AutoRoundConfig:
    bits: int = 3
    group_size: int = 128
    sym: bool = True
    # auto-round's own defaults for an LLM (iters/nsamples/seqlen/batch_size); lr None = 1/iters.
    iters: int = 200
    nsamples: int = 128
    seqlen: int = 2048
    batch_size: int = 8
    lr: float | None = None
    enable_deterministic_algorithms: bool = True
    # CUDA only. True: the block's inputs and reference outputs stay on the host, a batch at a time
    # on the GPU (the 8 GiB budget at 128 x 2048: each is 2 GiB); False: both on the GPU.
    low_gpu_mem_usage: bool = True
    # CUDA only (on the CPU inductor would compile C++ for minutes). auto-round's default is on;
    # measured deterministic with enable_deterministic_algorithms (bench/autoround_settings.py).
    enable_torch_compile: bool = False

    def validate(self):
        if self.bits not in FORMAT_BITS:
            raise ValueError(f"bits: {self.bits} is not supported by the auto_round:auto_gptq format "
                             f"(allowed: {list(FORMAT_BITS)})")
        if self.group_size not in FORMAT_GROUP_SIZES:
            raise ValueError(f"group_size: {self.group_size} is not supported by the auto_round:auto_gptq format "
                             f"(allowed: {list(FORMAT_GROUP_SIZES)})")
        for key in ("iters", "nsamples", "seqlen", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"lr: must be > 0 or null, got {self.lr}")


def block_seed(seed: int, index: int) -> int:
    """Each block's own seed (GPTQModel's per-module seeds): a block's tuning does not depend on
    the blocks before it having drawn random numbers, so a resumed run tunes it the same way."""
    return int.from_bytes(hashlib.sha256(f"{seed}/block/{index}".encode()).digest()[:4], "little") & 0x7FFFFFFF


class _OneBlock(nn.Module):
    """A decoder layer as `model.layers[0]`: what auto-round's block discovery walks."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.dtype = dtype
        self.name_or_path = ""
        self.config = layer.self_attn.config  # auto-round reads the model's config (a Qwen3 decoder layer carries it)

    def forward(self, *args, **kwargs):
        return self.model.layers[0](*args, **kwargs)


def compressor(layer: nn.Module, nsamples: int, seqlen: int, cfg: AutoRoundConfig, seed: int, device: str,
               grids: dict[str, tuple[int, int]] | None = None):
    """auto-round for one decoder layer, fed by the caller (never a dataset of its own); `grids`
    gives Linears (by name in the block) their own (bits, group_size), auto-round's layer_config."""
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.config import SignRoundConfig

    plain_logs()
    dtype = next(layer.parameters()).dtype
    return AutoRound(
        # enable_quanted_input off: the inputs given already are the quantized stream, and the
        # caller computes the tuned block's outputs (auto-round would hold a copy of them)
        _OneBlock(layer, dtype), tokenizer="", scheme="W4A16",
        alg_configs=SignRoundConfig(iters=cfg.iters, lr=cfg.lr, enable_quanted_input=False,
                                    bits=cfg.bits, group_size=cfg.group_size, sym=cfg.sym),
        nsamples=nsamples, seqlen=seqlen,
        batch_size=min(cfg.batch_size, nsamples), seed=seed, device_map=device,
        enable_torch_compile=compiled(cfg, device), enable_deterministic_algorithms=cfg.enable_deterministic_algorithms,
        low_gpu_mem_usage=cfg.low_gpu_mem_usage and str(device).startswith("cuda"), to_quant_block_names="model.layers",
        layer_config={f"model.layers.0.{name}": {"bits": b, "group_size": g}
                      for name, (b, g) in (grids or {}).items() if (b, g) != (cfg.bits, cfg.group_size)} or None,
    )


def tune_block(layer: nn.Module, inputs: torch.Tensor, reference: torch.Tensor, position_embeddings,
               cfg: AutoRoundConfig, seed: int, device: str,
               grids: dict[str, tuple[int, int]] | None = None) -> dict[str, IntWeight]:
    """SignRound on one block through auto-round's block-level API (`quantize_block`, the entry
    llm-compressor's AutoRoundModifier uses): the tuned block reads `inputs` (N, S, H), the
    quantized stream (for block 0 the fp stream), and is fitted to `reference`, the source block's
    output on the fp stream, which the caller already has (auto-round's `reference_output`: it
    neither recomputes it nor holds the fp inputs). `layer` is left holding its quantized-
    dequantized weights; returns its Linears' integers, by name within the block (`grids`:
    per-Linear (bits, group_size) other than the config's)."""
    n, s = inputs.shape[:2]
    if s != cfg.seqlen:
        raise QuantizerError(f"block inputs: expected sequences of seqlen={cfg.seqlen}, got {s}")
    if reference.shape != inputs.shape:
        raise QuantizerError(f"block reference: expected shape {list(inputs.shape)}, got {list(reference.shape)}")
    kwargs = {"position_embeddings": position_embeddings, "attention_mask": None}
    if str(device).startswith("cuda") and not cfg.low_gpu_mem_usage:
        inputs, reference = inputs.to(device), reference.to(device)
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    try:  # auto-round switches deterministic algorithms and the cuBLAS workspace on process-wide: give them back
        ar = compressor(layer, n, s, cfg, seed, device, grids)
        with torch.enable_grad(), best_params_in_place():
            ar.quantize_block(layer, [(((inputs[i:i + 1],), kwargs),) for i in range(n)], q_input=None,
                              device=device, auto_offload=False,
                              reference_output=[reference[i:i + 1] for i in range(n)])
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        if was[2] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = was[2]
    tuned = {name: int_weight(mod) for name, mod in layer.named_modules() if isinstance(mod, nn.Linear) and hasattr(mod, "scale")}
    if not tuned:
        raise QuantizerError("auto-round quantized no Linear of the block")
    layer.to(device)  # auto-round hands the block back on the host; the caller runs it next, on the device
    return dict(sorted(tuned.items()))


def compiled(cfg: AutoRoundConfig, device: str) -> bool:
    return cfg.enable_torch_compile and str(device).startswith("cuda")


@contextmanager
def best_params_in_place():
    """auto-round copies every rounding parameter of the block each time the loss improves, into new
    tensors, on the host under low_gpu_mem_usage: at 8B widths 0.8 GB a time, synchronous and to
    freshly allocated pageable memory, half the tuning time (bench/autoround_settings.py). Here one
    copy is kept on the parameters' device and overwritten in place, as auto-round's own diffusion
    tuning cache does: the same values, so the same result."""
    from auto_round.algorithms.quantization.sign_round import quantizer

    kept: dict = {}

    def collect(block, cache_device="cpu"):
        for name, m in block.named_modules():
            if hasattr(m, "orig_layer"):
                best = kept.setdefault(name, {})
                for key, p in m.params.items():
                    if key in best:
                        best[key].copy_(p.data)
                    else:
                        best[key] = p.data.clone()
        return kept

    original = quantizer.collect_best_params
    quantizer.collect_best_params = collect
    try:
        yield
    finally:
        quantizer.collect_best_params = original


def plain_logs() -> None:
    """auto-round colours its log lines with terminal escapes; off a terminal, plain warnings only."""
    import logging
    import sys

    if sys.stderr.isatty():
        return
    log = logging.getLogger("autoround")
    for h in log.handlers:
        h.setFormatter(logging.Formatter("auto-round %(levelname)s: %(message)s"))
    log.setLevel(logging.WARNING)


def int_weight(layer: nn.Module) -> IntWeight:
    """The tuned layer's integers, computed as auto-round's own packer does (round(W / s + zp), clamped)."""
    if not hasattr(layer, "scale") or layer.weight.dim() != 2:
        raise QuantizerError(f"{getattr(layer, 'global_name', layer)}: not a layer auto-round quantized")
    out_f, in_f = layer.weight.shape
    bits, gs = int(layer.bits), int(layer.group_size)
    scales = layer.scale.detach().reshape(out_f, in_f // gs).to(torch.float32)
    zp = layer.zp
    zeros = (zp.detach().reshape(out_f, in_f // gs).to(torch.int32) if isinstance(zp, torch.Tensor)
             else torch.full((out_f, in_f // gs), int(zp), dtype=torch.int32))
    w = layer.weight.detach().reshape(out_f, in_f // gs, gs)
    q = torch.round(w / scales.to(layer.scale.dtype)[..., None] + zeros[..., None]).clamp(0, 2**bits - 1)
    return IntWeight(q.to(torch.int32).reshape(out_f, in_f), scales.cpu(), zeros.cpu(), bits, gs, bool(layer.sym))


def tuning_record(cfg: AutoRoundConfig) -> dict:
    """The tuning parameters auto-round records in its quantization_config."""
    import auto_round

    d = dataclasses.asdict(cfg)
    return {k: d[k] for k in ("iters", "nsamples", "seqlen", "batch_size", "lr")} | {
        "autoround_version": auto_round.__version__, "enable_quanted_input": True, "enable_minmax_tuning": True}


def determinism_record(cfg: AutoRoundConfig, device: str) -> dict:
    """What auto-round ran under (it sets these for its own run; the manifest's environment shows the
    process settings before and after)."""
    return {"deterministic_algorithms": cfg.enable_deterministic_algorithms,
            "cublas_workspace_config": ":4096:8 (auto-round sets it when unset)", "torch_compile": compiled(cfg, device)}

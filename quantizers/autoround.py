"""auto-round (SignRound) on a Qwen3 backbone whose block-0 inputs are given, not looked up.

auto-round drives a causal LM with token ids and catches what reaches the first decoder block.
MOSS's block-0 input is a sum of 1 + n_vq embeddings, not one lookup, so the backbone is put in a
Qwen3ForCausalLM whose embedding table *is* the calibration inputs: row n * S + s holds sample n,
position s, and sample n is fed as the ids n * S .. n * S + S - 1. auto-round then tunes exactly
the MOSS block inputs (Qwen3's own rotary and causal mask), and only `model.layers`.

Data is always an explicit list of id tensors, so auto-round never builds its default
(hub-fetched) dataset. Its tuned weights come back as `IntWeight`s for our GPTQ packing.
"""
from __future__ import annotations

import copy
import dataclasses
import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .errors import QuantizerError
from .rtn import IntWeight

FORMAT_BITS = (2, 3, 4, 8)  # GPTQ-packed widths auto-round's loaders and our packing share
FORMAT_GROUP_SIZES = (32, 64, 128, 256, 512, 1024)  # groups must align with 32-row packing words
BLOCKS = "model.layers"


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
    low_gpu_mem_usage: bool = True  # offload cached block inputs; only used on CUDA

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


def embeds_lm(qwen3_config, get: Callable[[str], torch.Tensor], block_inputs: torch.Tensor):
    """A Qwen3ForCausalLM over `get` (Qwen3Model names) whose ids index `block_inputs` (N, S, H).

    Returns (model, ids): ids[n] = (1, S) tensor that makes block 0 see block_inputs[n].
    """
    from transformers import Qwen3ForCausalLM

    n, s, h = block_inputs.shape
    cfg = copy.deepcopy(qwen3_config)
    cfg.vocab_size = n * s
    cfg.tie_word_embeddings = False
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    dtype = block_inputs.dtype
    # Copies: auto-round writes the tuned weights in place, and a getter may hand out shared memory.
    state = {f"model.{k}": get(k).to(dtype, copy=True)
             for k, _ in model.model.named_parameters() if k != "embed_tokens.weight"}
    state["model.embed_tokens.weight"] = block_inputs.reshape(n * s, h)
    model.load_state_dict(state, assign=True, strict=False)
    # Never called (caching stops after the blocks); a 1-row head keeps the unused vocab free.
    model.lm_head = nn.Linear(h, 1, bias=False, dtype=dtype)
    nn.init.zeros_(model.lm_head.weight)
    with torch.device("cpu"):  # rotary inv_freq is a non-persistent buffer: rebuild it off meta
        model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    model.requires_grad_(False).eval()
    ids = [torch.arange(i * s, (i + 1) * s).unsqueeze(0) for i in range(n)]
    return model, ids


# auto-round refuses a module without a tokenizer even when the data is already ids; it only reads
# pad_token(_id) (absent: padding is inferred, and our ids never repeat) and model_max_length.
def ids_only_tokenizer(seqlen: int):
    return types.SimpleNamespace(pad_token=None, pad_token_id=None, model_max_length=seqlen)


def compressor(model, ids: list[torch.Tensor], cfg: AutoRoundConfig, seed: int, device: str):
    """auto-round's compressor for `model.layers` of `model`, on exactly `ids` (never a hub dataset)."""
    from auto_round import AutoRound
    from auto_round.algorithms.quantization.sign_round.config import SignRoundConfig

    plain_logs()

    if not ids or not all(isinstance(t, torch.Tensor) for t in ids):
        raise QuantizerError("auto-round calibration: expected a non-empty list of id tensors")
    sign_round = SignRoundConfig(iters=cfg.iters, lr=cfg.lr)
    return AutoRound(
        model, ids_only_tokenizer(cfg.seqlen), scheme="W4A16", alg_configs=sign_round,
        bits=cfg.bits, group_size=cfg.group_size, sym=cfg.sym,
        dataset=ids, nsamples=len(ids), seqlen=cfg.seqlen, batch_size=cfg.batch_size,
        seed=seed, device_map=device, enable_torch_compile=False,
        enable_deterministic_algorithms=cfg.enable_deterministic_algorithms,
        low_gpu_mem_usage=cfg.low_gpu_mem_usage and device.startswith("cuda"),
        to_quant_block_names=BLOCKS,
    )


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


def int_weights(model: nn.Module, prefix: str = BLOCKS) -> dict[str, IntWeight]:
    """Every Linear auto-round quantized under `prefix`, by module name relative to the CausalLM's `model.`."""
    out = {}
    for name, mod in model.named_modules():
        if name.startswith(prefix + ".") and isinstance(mod, nn.Linear) and hasattr(mod, "scale"):
            out[name.removeprefix("model.")] = int_weight(mod)
    return dict(sorted(out.items()))


def tune(qwen3_config, get: Callable[[str], torch.Tensor], block_inputs: torch.Tensor, cfg: AutoRoundConfig,
         seed: int, device: str = "cpu") -> dict[str, IntWeight]:
    """SignRound over every decoder block; returns {"layers.i.<linear>": IntWeight}."""
    if block_inputs.shape[1] != cfg.seqlen:
        raise QuantizerError(f"block inputs: expected sequences of seqlen={cfg.seqlen}, got {block_inputs.shape[1]}")
    model, ids = embeds_lm(qwen3_config, get, block_inputs)
    import os

    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:  # auto-round switches deterministic algorithms and the cuBLAS workspace on process-wide: give them back
        ar = compressor(model, ids, cfg, seed, device)
        ar.quantize()
    finally:
        torch.use_deterministic_algorithms(was_deterministic, warn_only=was_warn_only)
        if was_workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = was_workspace
    tuned = int_weights(model)
    if not tuned:
        raise QuantizerError("auto-round quantized no Linear under model.layers")
    return tuned


def tuning_record(cfg: AutoRoundConfig) -> dict:
    """The tuning parameters auto-round records in its quantization_config."""
    import auto_round

    d = dataclasses.asdict(cfg)
    return {k: d[k] for k in ("iters", "nsamples", "seqlen", "batch_size", "lr")} | {
        "autoround_version": auto_round.__version__, "enable_quanted_input": True, "enable_minmax_tuning": True}


def determinism_record(cfg: AutoRoundConfig) -> dict:
    """What auto-round ran under (it sets these for its own run; the manifest's environment shows the
    process settings before and after)."""
    return {"deterministic_algorithms": True, "deterministic_warn_only": not cfg.enable_deterministic_algorithms,
            "cublas_workspace_config": ":4096:8 (auto-round sets it when unset)", "torch_compile": False}

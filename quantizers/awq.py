"""AWQ through autoawq's own per-block search, driven one decoder block at a time.

autoawq's `AwqQuantizer.__init__` wants a whole Hugging Face model and a hub text dataset, so
it is built bare here and only its per-block algorithm is used, unchanged: `_search_best_scale`
(20 ratios of activation/weight magnitude, the lowest output MSE of the inspected module wins),
`apply_scale` (fold 1/s into the preceding norm or Linear), `_search_best_clip` + `apply_clip`
(per-group max shrink, q/k skipped) and `pseudo_quantize_tensor` (the zero-point grid). The
caller supplies the block, every Linear's input activations (what autoawq's `_get_input_feat`
would collect) and the block's input-sharing groups.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from .errors import QuantizerError
from .rtn import IntWeight, quantize_to_grid

N_GRID = 20  # autoawq's scale grid (fixed inside _compute_best_scale); its clip grid is 20 x 0.5 shrink


@dataclass(frozen=True)
class AWQConfig:
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    duo_scaling: bool = True  # autoawq's default: s = x_mean^r / w_mean^(1-r)
    apply_clip: bool = True
    nsamples: int = 128  # calibration sequences of `seqlen` (autoawq's max_calib_samples / max_calib_seq_len)
    seqlen: int = 512
    batch_size: int = 8  # sequences per forward (autoawq's n_parallel_calib_samples)
    # Compute dtype of the search. auto: bfloat16 on CUDA (autoawq's own runs are half precision;
    # FP32 there is several times slower), float32 on the CPU (no fast half matmuls there).
    dtype: str = "auto"

    def validate(self):
        if self.bits != 4:
            raise ValueError(f"bits: AWQ GEMM is 4-bit only, got {self.bits}")
        if self.version != "gemm":
            raise ValueError(f"version: only 'gemm' is written, got {self.version!r}")
        if not self.zero_point:
            raise ValueError("zero_point: the AWQ GEMM layout stores zero points; must be true")
        if self.group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {self.group_size}")
        for key in ("nsamples", "seqlen", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: one of auto, float32, bfloat16, float16, got {self.dtype!r}")

    def torch_dtype(self, device: str) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Group:
    """Linears reading the same input, the module producing it, and the module whose output the
    scale search compares (None: the single Linear itself, as autoawq does for v->o and up->down)."""

    prev: str
    linears: tuple[str, ...]
    inspect: str | None = None


def autoawq_quantizer(cfg: AWQConfig):
    """An AwqQuantizer holding only what its per-block functions read."""
    # autoawq's import sets its own warning filter and warns that it is deprecated (last tested on
    # torch 2.6 / transformers 4.51): record that warning instead of printing it on every build.
    with warnings.catch_warnings(record=True):
        from awq.quantize.quantizer import AwqQuantizer

    q = AwqQuantizer.__new__(AwqQuantizer)
    q.w_bit, q.group_size, q.zero_point, q.version = cfg.bits, cfg.group_size, cfg.zero_point, cfg.version
    q.duo_scaling, q.apply_clip, q.export_compatible = cfg.duo_scaling, cfg.apply_clip, True
    q.n_parallel_calib_samples = cfg.batch_size
    q.max_chunk_memory = 1 << 30
    q.modules_to_not_convert = []
    q.awq_model = SimpleNamespace(model_type="qwen3")  # only consulted for MoE special cases
    return q


class _Snapshotting(nn.Module):
    """Runs `inner` unchanged but gives autoawq a real copy when it snapshots it.

    autoawq 0.2.9's `_compute_best_scale` saves `{k: v.cpu()}` of the inspected module, mutates
    the weights in place per ratio and restores the saved dict. On CUDA `.cpu()` copies; on CPU it
    returns the very same tensors, so the in-place `mul_` writes into the "snapshot" and the block
    keeps the ratio-0 scales in its weights without the matching norm division (the block
    function changes). Cloning here restores the intended semantics without touching its code.
    """

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.forward = inner.forward  # same signature: autoawq filters kwargs by it

    def state_dict(self, *args, **kwargs):
        return {k: v.clone() for k, v in self.inner.state_dict().items()}

    def load_state_dict(self, state, *args, **kwargs):
        return self.inner.load_state_dict(state, *args, **kwargs)


@torch.no_grad()
def awq_block(q, layer: nn.Module, feats: dict[str, torch.Tensor], kwargs: dict, linears: list[str], groups: list[Group]):
    """Search and apply AWQ scales over `groups`, then clipping over `linears`, on one block in place.

    `feats` holds every Linear's inputs on the fp stream (what autoawq's `_get_input_feat` collects;
    the engine captures them in its one pass over the block). Returns ([(prev, linears, scales)],
    [(linear, max_val)]).
    """
    from awq.quantize.scale import apply_clip, apply_scale

    named = {name: layer.get_submodule(name) for name in linears}
    q.module_kwargs = kwargs
    scales = [
        q._search_best_scale(
            layer,
            prev_op=layer.get_submodule(g.prev),
            layers=[named[n] for n in g.linears],
            inp=feats[g.linears[0]],
            module2inspect=_Snapshotting(layer.get_submodule(g.inspect) if g.inspect else named[g.linears[0]]),
            kwargs=dict(kwargs),
        )
        for g in groups
    ]
    apply_scale(layer, scales, input_feat_dict=feats)
    clips = []
    if q.apply_clip:
        clips = q._search_best_clip(layer, named, feats)
        apply_clip(layer, clips)
    return scales, clips


@torch.no_grad()
def int_weight(q, w: torch.Tensor, name: str = "weight") -> IntWeight:
    """autoawq's zero-point grid for one weight, with scales rounded to the stored float16."""
    if w.shape[1] % q.group_size:
        raise QuantizerError(f"{name}: group_size={q.group_size} does not divide the input width {w.shape[1]}")
    w = w.float()
    _, scales, zeros = q.pseudo_quantize_tensor(w)
    scales = scales.to(torch.float16).float()
    zeros = zeros.to(torch.int32)
    qw = quantize_to_grid(w, scales, zeros, q.w_bit, q.group_size)
    return IntWeight(qw, scales, zeros, q.w_bit, q.group_size, sym=False)

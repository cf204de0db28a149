"""AWQ per decoder block: autoawq's objective and grids, searched on the device in large chunks.

The search (`search: ours`, the default) is AWQ's, re-implemented for speed: per input-sharing
group, the 20 ratios of activation/weight magnitude (s = x_mean^r / w_mean^(1-r), normalised),
each scored by the MSE of the inspected module's output (the attention for q/k/v, the MLP for
gate/up, the Linear itself otherwise) over every calibration token; then per Linear (q/k
skipped) the per-group clip shrink over 10 steps of 1/20, scored on 512 sampled tokens exactly as
autoawq samples them, with every group of every output channel scored in one batched matmul per
shrink instead of an elementwise product. What autoawq 0.2.9 does slowly, and this does not:
its module forward runs in batches of `n_parallel_calib_samples` and copies every batch's output
to the host, it snapshots the inspected module to the host and reloads it after every ratio, and
it syncs on every loss chunk. `search: autoawq` runs autoawq's own `_search_best_scale` /
`_search_best_clip` with its `apply_scale` / `apply_clip` (the reference: tests compare the two on
the same inputs); ours folds and clips on the device (`apply_scales`, `apply_clips`).

autoawq's `AwqQuantizer.__init__` wants a whole Hugging Face model and a hub text dataset, so it
is built bare here and only its per-block functions are used.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from inspect import signature
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
    search: str = "ours"  # or "autoawq": its own per-block search functions (the reference)
    chunk_tokens: int = 32768  # calibration tokens per forward of an inspected module in our search

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
        if self.search not in ("ours", "autoawq"):
            raise ValueError(f"search: 'ours' or 'autoawq', got {self.search!r}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: must be >= 1, got {self.chunk_tokens}")
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


def zero_point_grid(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """autoawq's zero-point grid (pseudo_quantize_tensor) for groups along the last dimension, as
    (scales, zeros), one row per group: the same arithmetic without its NaN asserts
    (each a host sync, and this runs 30 times per Linear in the search) and without importing autoawq
    (0.9 s a process) where only its grid is needed."""
    w = w.reshape(-1, group_size)
    hi, lo = w.amax(dim=1, keepdim=True), w.amin(dim=1, keepdim=True)
    max_int = 2 ** bits - 1
    scales = (hi - lo).clamp(min=1e-5) / max_int
    return scales, (-torch.round(lo / scales)).clamp_(0, max_int)


def pseudo_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """`w` rounded to its zero-point grid and back."""
    scales, zeros = zero_point_grid(w, bits, group_size)
    max_int = 2 ** bits - 1
    return ((torch.clamp(torch.round(w.reshape(-1, group_size) / scales) + zeros, 0, max_int) - zeros) * scales).reshape(w.shape)


def _out(y):
    return y[0] if isinstance(y, tuple) else y


@torch.no_grad()
def search_scale(cfg: AWQConfig, linears: list[nn.Linear], inspect, x: torch.Tensor) -> torch.Tensor:
    """The AWQ input scale of one group: the ratio whose quantized weights give the inspected
    module's output (`inspect(x_chunk)`) the lowest MSE against its FP output, as autoawq scores it."""
    gs = cfg.group_size
    w = torch.cat([m.weight for m in linears])
    g = w.reshape(-1, gs).abs()
    w_mean = (g / (g.amax(dim=1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)
    flat = x.reshape(-1, x.shape[-1])  # the mean |x| by chunks: a float32 copy of a down_proj input is 3.2 GB
    x_mean = (sum(c.abs().float().sum(0) for c in flat.split(cfg.chunk_tokens)) / flat.shape[0]).to(x.dtype)
    per = max(1, cfg.chunk_tokens // x.shape[1]) if x.dim() == 3 else cfg.chunk_tokens
    chunks = torch.split(x, per)
    ref = [_out(inspect(c)) for c in chunks]
    numel = sum(r.numel() for r in ref)
    orig = [m.weight.detach().clone() for m in linears]  # a device copy, not a host round trip

    def scales(ratio: float) -> torch.Tensor:
        if cfg.duo_scaling:
            s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(ratio).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s[torch.isinf(s) | torch.isnan(s)] = 1
        return s

    losses = []
    try:
        for r in range(N_GRID):
            view = scales(r / N_GRID).view(1, -1)
            for m, w0 in zip(linears, orig):
                m.weight.copy_(pseudo_quantize(w0 * view, cfg.bits, gs) / view)
            losses.append(sum((_out(inspect(c)) - rc).float().pow(2).sum() for c, rc in zip(chunks, ref)) / numel)
    finally:
        for m, w0 in zip(linears, orig):
            m.weight.copy_(w0)
    best = int(torch.stack(losses).argmin())  # one host sync per group; the first minimum, as autoawq's `<`
    return scales(best / N_GRID)


def apply_scales(layer: nn.Module, scales: list, feats: dict[str, torch.Tensor]) -> None:
    """Fold each group's 1/s into the module before it (a norm's gain, or the rows of the Linear
    feeding it) and s into the group's Linears and their captured inputs (autoawq's apply_scale,
    without its moves of every module to the host and back)."""
    divided = set()  # Linears reading one input may share one tensor in `feats`: scale it once
    for prev, names, s in scales:
        op = layer.get_submodule(prev)
        if isinstance(op, nn.Linear):
            op.weight[-s.numel():].div_(s.view(-1, 1).to(op.weight.dtype))
            if op.bias is not None:
                op.bias.div_(s.to(op.bias.dtype))
        else:  # RMSNorm
            op.weight.div_(s.to(op.weight.dtype))
        for n in names:
            fc = layer.get_submodule(n)
            fc.weight.mul_(s.view(1, -1).to(fc.weight.dtype))
            if id(feats[n]) not in divided:
                feats[n].div_(s.view(1, -1).to(feats[n].dtype))
                divided.add(id(feats[n]))


def apply_clips(layer: nn.Module, clips: list) -> None:
    for name, max_val in clips:
        w = layer.get_submodule(name).weight
        w.copy_(torch.clamp(w.reshape(*max_val.shape[:2], -1), -max_val, max_val).reshape(w.shape))


CLIP_TOKENS = 512  # autoawq's n_sample_token for the clip search


def clip_tokens(x: torch.Tensor, n_tokens: int = CLIP_TOKENS) -> torch.Tensor:
    """The tokens autoawq scores a clip on: every (n/512)-th of the flattened inputs. Sampling again
    what this returns takes every token (the step of a sample's sample is 1)."""
    x = x.reshape(-1, x.shape[-1])
    return x[:: max(1, x.shape[0] // n_tokens)]


@torch.no_grad()
def search_clip(cfg: AWQConfig, w: torch.Tensor, x: torch.Tensor, n_grid: int = 20, max_shrink: float = 0.5,
                n_tokens: int = CLIP_TOKENS, rows: int = 1024) -> torch.Tensor:
    """autoawq's per-group clip (max |w| shrunk by i/20, i < 10, lowest output MSE on `clip_tokens`
    of x), each shrink scored for all groups and rows in one batched matmul. [out, groups, 1]."""
    gs = cfg.group_size
    out_f, in_f = w.shape
    x = clip_tokens(x, n_tokens).to(w.device)
    xg = x.reshape(x.shape[0], -1, gs).transpose(0, 1)  # [groups, tokens, gs]
    best_all = []
    for r0 in range(0, out_f, rows):
        wc = w[r0:r0 + rows].reshape(-1, in_f // gs, gs)  # [rows, groups, gs]
        org_max = wc.abs().amax(dim=-1, keepdim=True)
        org_out = torch.bmm(xg, wc.permute(1, 2, 0))  # [groups, tokens, rows]
        best, min_err = org_max.clone(), None
        for i in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i / n_grid)
            q = pseudo_quantize(torch.clamp(wc, -max_val, max_val), cfg.bits, gs)
            err = (torch.bmm(xg, q.permute(1, 2, 0)) - org_out).float().pow(2).mean(dim=1).t()[..., None]
            if min_err is None:
                min_err = err
                continue  # shrink 0 is the unclipped weight: already the best so far
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best = torch.where(better, max_val, best)
        best_all.append(best)
    return torch.cat(best_all)


def module_input(module: nn.Module, target: nn.Module, x: torch.Tensor, rows: int) -> torch.Tensor:
    """The input of `target` inside `module` run on `x`, `rows` sequences at a time: the engine's
    batches, so the same bits as a capture in its pass over the block."""
    out = []
    hook = target.register_forward_pre_hook(lambda mod, args: out.append(args[0]))
    try:
        for s in range(0, x.shape[0], rows):
            module(x[s:s + rows])
    finally:
        hook.remove()
    return torch.cat(out)


@torch.no_grad()
def awq_block(layer: nn.Module, feats: dict[str, torch.Tensor], kwargs: dict, linears: list[str], groups: list[Group],
              cfg: AWQConfig, derived: dict[str, tuple[str, str]] | None = None, q=None):
    """Search and apply AWQ scales over `groups`, then clipping over `linears`, on one block in place.

    `feats` holds the Linears' inputs on the fp stream (what autoawq's `_get_input_feat` collects;
    the engine captures them in its one pass over the block); a Linear named in `derived`
    (linear -> (module, source Linear)) may be missing there: its input is recomputed by running
    the module on the source's input, on the device, for its group's search (our search only).
    `q`: autoawq's quantizer for `search: autoawq` (default: `autoawq_quantizer(cfg)`).
    Returns ([(prev, linears, scales)], [(linear, max_val)]).
    """
    named = {name: layer.get_submodule(name) for name in linears}
    if cfg.search == "autoawq":
        from awq.quantize.scale import apply_clip, apply_scale

        q = q or autoawq_quantizer(cfg)
        seen = set()  # autoawq's apply_scale divides every name's input: give shared inputs their own copy
        feats = {n: f if id(f) not in seen and not seen.add(id(f)) else f.clone() for n, f in feats.items()}
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
        clips = q._search_best_clip(layer, named, feats) if q.apply_clip else []
        apply_clip(layer, clips)
        return scales, clips
    device = next(layer.parameters()).device
    derived = derived or {}

    def inputs(name: str) -> torch.Tensor:  # on the device; every scale search runs on the source weights
        if name in feats:
            return feats[name].to(device)
        module, source = derived[name]
        return module_input(layer.get_submodule(module), named[name], feats[source].to(device), cfg.batch_size)

    scales, samples, sampled = [], {}, {}  # one clip sample per input tensor, shared as it is (q/k/v, gate/up)
    for g in groups:
        module = layer.get_submodule(g.inspect) if g.inspect else named[g.linears[0]]
        takes = signature(module.forward).parameters  # the block's kwargs the module accepts (autoawq's rule)
        inspect = partial(module, **{k: v for k, v in kwargs.items() if k in takes})
        x = inputs(g.linears[0])
        if g.linears[0] not in feats:  # a recomputed input: its sample now, the tensor then goes
            samples.update({n: clip_tokens(x).clone() for n in g.linears})
        scales.append((g.prev, g.linears, search_scale(cfg, [named[n] for n in g.linears], inspect, x)))
        del x
    for n in linears:
        if n in feats:
            samples.setdefault(n, sampled.setdefault(id(feats[n]), clip_tokens(feats[n]).to(device, copy=True)))
        elif n not in samples:  # recomputed, though in no group
            samples[n] = clip_tokens(inputs(n)).clone()
    apply_scales(layer, scales, samples)  # elementwise: sampling then dividing = dividing then sampling
    # autoawq's rule: no clipping of q/k (through the q.k product the output MSE is a poor guide)
    clips = [(n, search_clip(cfg, named[n].weight, samples[n])) for n in linears
             if cfg.apply_clip and not any(t in n for t in ("q_", "k_"))]
    apply_clips(layer, clips)
    return scales, clips


@torch.no_grad()
def int_weight(cfg: AWQConfig, w: torch.Tensor, name: str = "weight") -> IntWeight:
    """autoawq's zero-point grid for one weight, with scales rounded to the stored float16."""
    if w.shape[1] % cfg.group_size:
        raise QuantizerError(f"{name}: group_size={cfg.group_size} does not divide the input width {w.shape[1]}")
    w = w.float()
    scales, zeros = (t.view(w.shape[0], -1) for t in zero_point_grid(w, cfg.bits, cfg.group_size))
    scales = scales.to(torch.float16).float()
    zeros = zeros.to(torch.int32)
    qw = quantize_to_grid(w, scales, zeros, cfg.bits, cfg.group_size)
    return IntWeight(qw, scales, zeros, cfg.bits, cfg.group_size, sym=False)

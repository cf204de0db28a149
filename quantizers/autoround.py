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
import random
from contextlib import contextmanager, nullcontext
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
    # With enable_torch_compile: one static graph per weight shape and grid (`static_shapes`) instead of
    # dynamo's symbolic ones. On in autoround-q3, where a GPU A/B measured it 6% faster a block with every
    # fidelity figure unchanged (BENCHMARKS.md); the mixed-grid sensitivity profiles are not A/B'd yet.
    compile_static_shapes: bool = False

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
    if not str(device).startswith("cuda"):
        bf16_on_every_cpu()
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


def bf16_on_every_cpu() -> None:
    """auto-round asks the CPU whether it has bf16 instructions (py-cpuinfo in a subprocess, about
    1 s a process) and, on one without (AVX2-only CPUs), casts the block to fp32 and tunes that: another
    computation, so another bundle, on another machine. torch computes bf16 on every x86 CPU (natively
    or by conversion), so the answer is yes everywhere: a bf16 block tunes in bf16 on any CPU, as on a GPU."""
    from auto_round.utils.device_manager import get_ar_device

    get_ar_device("cpu")._bf16_supported = True  # the cache its `supports_bf16` fills from the probe


def tune_block(layer: nn.Module, inputs: torch.Tensor, reference: torch.Tensor, position_embeddings,
               cfg: AutoRoundConfig, seed: int, device: str,
               grids: dict[str, tuple[int, int]] | None = None) -> dict[str, IntWeight]:
    """SignRound on one block through auto-round's block-level API (`quantize_block`, the entry
    llm-compressor's AutoRoundModifier uses): the tuned block reads `inputs` (N, S, H), the
    quantized stream (for block 0 the fp stream), and is fitted to `reference`, the source block's
    output on the fp stream, which the caller already has (auto-round's `reference_output`: it
    neither recomputes it nor holds the fp inputs). `layer` is left holding its quantized-
    dequantized weights; returns its Linears' integers on `device`, by name within the block
    (`grids`: per-Linear (bits, group_size) other than the config's)."""
    n, s = inputs.shape[:2]
    if s != cfg.seqlen:
        raise QuantizerError(f"block inputs: expected sequences of seqlen={cfg.seqlen}, got {s}")
    if reference.shape != inputs.shape:
        raise QuantizerError(f"block reference: expected shape {list(inputs.shape)}, got {list(reference.shape)}")
    kwargs = {"position_embeddings": position_embeddings, "attention_mask": None}
    cuda = str(device).startswith("cuda")
    if cuda and not cfg.low_gpu_mem_usage:
        inputs, reference = inputs.to(device), reference.to(device)
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    try:  # auto-round switches deterministic algorithms and the cuBLAS workspace on process-wide: give them back
        with collections_of_new_objects_only():
            _quantize_block(layer, inputs, reference, kwargs, cfg, seed, device, grids)
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        if was[2] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = was[2]
    # the caller runs the block next, on the device, and the integers are computed there too (on
    # the host, 8B widths: seconds a block, with their packing)
    layer.to(device)
    tuned = {name: int_weight(mod) for name, mod in layer.named_modules() if isinstance(mod, nn.Linear) and hasattr(mod, "scale")}
    if not tuned:
        raise QuantizerError("auto-round quantized no Linear of the block")
    return dict(sorted(tuned.items()))


def _quantize_block(layer, inputs, reference, kwargs, cfg: AutoRoundConfig, seed: int, device: str, grids) -> None:
    """auto-round's block API on `layer`; what it made is garbage once this returns."""
    n, s = inputs.shape[:2]
    ar = compressor(layer, n, s, cfg, seed, device, grids)
    staged = staged_batches(device) if str(device).startswith("cuda") and cfg.low_gpu_mem_usage else nullcontext()
    static = static_shapes() if compiled(cfg, device) and cfg.compile_static_shapes else nullcontext()
    with torch.enable_grad(), best_params_in_place(), block_left_on_device(), staged, static:  # staged: streams on the host
        ar.quantize_block(layer, [(((inputs[i:i + 1],), kwargs),) for i in range(n)], q_input=None,
                          device=device, auto_offload=False, reference_output=[reference[i:i + 1] for i in range(n)])


def compiled(cfg: AutoRoundConfig, device: str) -> bool:
    return cfg.enable_torch_compile and str(device).startswith("cuda")


# A block's Linears have 4 weight shapes; a mixed grid has up to 6 (bits, group_size) pairs.
STATIC_GRAPHS = 64


@contextmanager
def static_shapes():
    """auto-round compiles its weight quantizer (one code object for every Linear) meaning one static
    graph per shape (its cache-limit bump says so), but dynamo's automatic dynamic shapes recompile it
    at the second shape for symbolic shapes, and on a mixed grid for symbolic bits and group size:
    counted on a CPU, 4 shapes x 6 grids give 4-5 graphs, the last symbolic in all of them. Here each
    (shape, grid) gets its own static graph, compiled once and reused by every block."""
    import torch._dynamo.config as dynamo

    with dynamo.patch(automatic_dynamic_shapes=False, recompile_limit=max(dynamo.recompile_limit, STATIC_GRAPHS)):
        yield


@contextmanager
def collections_of_new_objects_only():
    """auto-round frees memory with full `gc.collect()`s, five a block, each walking every object
    the process holds (about 400k with torch, transformers and auto-round loaded: 0.2-0.3 s a
    walk on a 2-core CPU). The objects alive before are set aside (`gc.freeze`) while it runs, so
    its collections walk only the block's own. One more collection, before they are given back,
    frees what the block left in cycles: auto-round's Linear wrappers refer to themselves and hold
    the block's Linears (0.4 GB of GPU a block at 8B widths), and no collection would reach them
    later but a full one. (Reference counting frees set-aside objects as always.)"""
    import gc

    if gc.get_freeze_count():  # someone froze already: theirs to undo
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.collect()
        gc.unfreeze()


@contextmanager
def block_left_on_device():
    """auto-round's block API moves the tuned block to the host when it is done: at 8B widths 0.4 GB
    into fresh pageable memory, which the caller, running the block next on the device, would copy
    straight back. Here the block stays where it was tuned."""
    from auto_round.compressors import orchestrator

    original = orchestrator.mv_module_from_gpu
    orchestrator.mv_module_from_gpu = lambda module: module
    try:
        yield
    finally:
        orchestrator.mv_module_from_gpu = original


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


@contextmanager
def staged_batches(device: str):
    """Under low_gpu_mem_usage auto-round's loop gathers each batch of the block's inputs and reference
    from the host inside the step (a host `torch.cat`, then a synchronous copy), the GPU idle
    meanwhile: 12.9 s of a 23.7 s block at 8B widths (bench/autoround_settings.py). For the length of the tuning, each batch is copied
    one step ahead, on a side stream, into one of two device slots, and the loop's two lists hand
    out views of the slot: the same values, so the same result. The next batch is forecast from
    auto-round's own sampler (as its diffusion tuning cache does); a batch the forecast missed is
    copied when it is drawn. Yields counts of the batches served prefetched and not."""
    from auto_round.algorithms.quantization.sign_round.quantizer import IndexSampler, SignRoundQuantizer

    counts = {"prefetched": 0, "copied_when_drawn": 0}
    tune, draw = SignRoundQuantizer.quantize_block, IndexSampler.next_batch

    def staged_tune(self, block, fp_inputs, input_others, fp_outputs, q_inputs=None, *args, **kwargs):
        if q_inputs is not None or not (isinstance(fp_inputs, list) and isinstance(fp_outputs, list)):
            return tune(self, block, fp_inputs, input_others, fp_outputs, q_inputs, *args, **kwargs)
        slots = _Slots((fp_inputs, fp_outputs), device)

        def staged_draw(sampler):
            batch = draw(sampler)
            slots.take(batch)
            slots.stage(_upcoming(sampler))
            return batch

        IndexSampler.next_batch = staged_draw
        try:
            return tune(self, block, slots.lists[0], input_others, slots.lists[1], q_inputs, *args, **kwargs)
        finally:
            IndexSampler.next_batch = draw
            slots.close()
            for key in counts:
                counts[key] += slots.counts[key]

    SignRoundQuantizer.quantize_block = staged_tune
    try:
        yield counts
    finally:
        SignRoundQuantizer.quantize_block = tune


def _upcoming(sampler) -> list[int]:
    """What auto-round's `IndexSampler.next_batch` returns next, without advancing it or the RNG."""
    if sampler.index + sampler.batch_size > sampler.nsamples:
        rng = random.Random()
        rng.setstate(random.getstate())
        order = list(sampler.indices)
        rng.shuffle(order)
        return order[:sampler.batch_size]
    return sampler.indices[sampler.index:sampler.index + sampler.batch_size]


class _Slots:
    """Two device slots of one batch of each stream (lists of per-sample (1, ...) host tensors)."""

    def __init__(self, streams: tuple[list, list], device: str):
        self.streams, self.device = streams, torch.device(device)
        self.copier = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.slots = [{"batch": None, "rows": {}, "tensors": None, "ready": None} for _ in range(2)]
        self.current = None
        self.counts = {"prefetched": 0, "copied_when_drawn": 0}
        self.lists = [_Served(self, k, s) for k, s in enumerate(streams)]

    def stage(self, batch: list[int]) -> dict:
        slot = self.slots[1] if self.current is self.slots[0] else self.slots[0]
        if slot["tensors"] is None or slot["tensors"][0].shape[0] != len(batch):
            slot["tensors"] = [torch.empty((len(batch), *s[0].shape[1:]), dtype=s[0].dtype, device=self.device)
                               for s in self.streams]
            for t in slot["tensors"] if self.copier is not None else ():
                t.record_stream(self.copier)  # freed, not reused before the copies into it are done
        if self.copier is None:
            self._copy(slot, batch)
        else:  # after everything the step has queued so far: the slot's last batch is read by then
            self.copier.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copier):
                self._copy(slot, batch)
                slot["ready"] = torch.cuda.Event()
                slot["ready"].record(self.copier)
        slot["batch"], slot["rows"] = list(batch), {i: r for r, i in enumerate(batch)}
        return slot

    def _copy(self, slot: dict, batch: list[int]) -> None:
        for src, dest in zip(self.streams, slot["tensors"]):
            for r, i in enumerate(batch):
                dest[r:r + 1].copy_(src[i], non_blocking=True)

    def take(self, batch: list[int]) -> None:
        slot = next((s for s in self.slots if s["batch"] == list(batch)), None)
        self.counts["copied_when_drawn" if slot is None else "prefetched"] += 1
        slot = slot or self.stage(batch)
        if slot["ready"] is not None:
            torch.cuda.current_stream(self.device).wait_event(slot["ready"])
        self.current = slot

    def row(self, k: int, i: int) -> torch.Tensor | None:
        r = self.current["rows"].get(i) if self.current else None
        return None if r is None else self.current["tensors"][k][r:r + 1]

    def close(self) -> None:
        if self.copier is not None:
            self.copier.synchronize()  # the host streams are overwritten next: no copy may still read them
        self.slots, self.current = [], None


class _Served(list):
    """auto-round's list of one stream's samples: a sample of the batch in flight comes from its slot."""

    def __init__(self, slots: _Slots, k: int, samples: list):
        super().__init__(samples)
        self.slots, self.k = slots, k

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list.__getitem__(self, i)
        staged = self.slots.row(self.k, int(i))
        return list.__getitem__(self, int(i)) if staged is None else staged


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
    """The tuned layer's integers, computed as auto-round's own packer does (round(W / s + zp), clamped),
    on the weight's device (the same correctly rounded division and rounding on either device)."""
    if not hasattr(layer, "scale") or layer.weight.dim() != 2:
        raise QuantizerError(f"{getattr(layer, 'global_name', layer)}: not a layer auto-round quantized")
    out_f, in_f = layer.weight.shape
    bits, gs = int(layer.bits), int(layer.group_size)
    w = layer.weight.detach().reshape(out_f, in_f // gs, gs)
    scales = layer.scale.detach().to(w.device).reshape(out_f, in_f // gs).to(torch.float32)
    zp = layer.zp
    zeros = (zp.detach().to(w.device).reshape(out_f, in_f // gs).to(torch.int32) if isinstance(zp, torch.Tensor)
             else torch.full((out_f, in_f // gs), int(zp), dtype=torch.int32, device=w.device))
    q = torch.round(w / scales.to(layer.scale.dtype)[..., None] + zeros[..., None]).clamp(0, 2**bits - 1)
    return IntWeight(q.to(torch.int32).reshape(out_f, in_f), scales, zeros, bits, gs, bool(layer.sym))


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
            "cublas_workspace_config": ":4096:8 (auto-round sets it when unset)", "torch_compile": compiled(cfg, device),
            "torch_compile_static_shapes": compiled(cfg, device) and cfg.compile_static_shapes}

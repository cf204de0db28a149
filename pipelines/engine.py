"""The layer-sequential engine: the one loop over the generator's decoder blocks.

It streams blocks from a tensor getter (the pinned checkpoint read on demand, or a dequantizing
view of a bundle): one block and the batch in flight on the device, the activations of the whole
calibration set and one block on the host, never the whole backbone. Block i runs on block i-1's
output. Two streams can flow side by side:

  fp     the source model's activations (what AWQ, the sensitivity measurement and the reference
         side of an evaluation read),
  quant  the activations of the model quantized so far (auto-round's inputs, the candidate side
         of an evaluation).

A method hooks into the loop (llm-compressor's layer_sequential pattern): the engine runs block i
on the fp stream, capturing the inputs of the Linears the hook asks for (statistics in that one
pass), then calls `hook.on_block(step)`. The hook searches, tunes or measures the block, may
change it in place, and returns what gives the quant stream: the quantized block (the engine runs
it on the stream) or the stream's new value.

Each stream is one host tensor that the blocks overwrite in place, batch by batch, wherever nothing
else reads it: the fp stream when the hook reads only its output, the quant stream always. At
auto-round's 128 x 2048 tokens of an 8B a stream is 2 GiB, and a block then holds two of them,
not three or four.

`output_fisher` runs the other way: forward over every block keeping the input of every sqrt(n)-th
block on the host, then one block at a time backwards (a segment's inputs recomputed from its first,
each block recomputed with gradients: activation checkpointing at block granularity), giving per block
the mean squared gradient of a loss on the model's outputs with respect to the block's output.

Given a `resume` folder (the quantize stage's), the engine checkpoints each finished block there
and a re-run continues at the first unfinished one (pipelines/resume.py); the hook then also
implements `block_state(i)` and `restore_block(i, tensors, meta)`. Only the quant stream is saved:
a resumed run recomputes the fp stream through the source blocks it has already passed (a fraction
of a second a block on a GPU, against writing 2 GiB a block).

With `prefetch`, block i+1's tensors are read on a thread while block i runs: the awq and auto-round
quantize stages turn it on on a GPU, where the search or the tuning hides the read.
"""
from __future__ import annotations

import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from .models.moss_tts_delay import BLOCK_PREFIX, MossTTSDelayConfig
from .progress import host_rss_gib, progress
from .resume import BlockCheckpoint

Getter = Callable[[str], torch.Tensor]
FP, QUANT = "fp", "quant"


def embed(cfg: MossTTSDelayConfig, get: Getter, ids: torch.Tensor, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    """(N, S, 1 + n_vq) ids -> (N, S, H): the text embedding plus the n_vq audio embeddings, the
    block-0 input. The tables are read for this and dropped."""
    ids = ids.to(device)
    x = nn.functional.embedding(ids[..., 0], get("language_model.embed_tokens.weight").to(device, dtype))
    for k in range(cfg.n_vq):
        x = x + nn.functional.embedding(ids[..., k + 1], get(f"emb_ext.{k}.weight").to(device, dtype))
    return x


def load_block(cfg: MossTTSDelayConfig, i: int, get: Getter, dtype=torch.bfloat16, device="cpu",
               read: dict[str, torch.Tensor] | None = None) -> Qwen3DecoderLayer:
    """Block i with `get`'s tensors, or those `read_block` already read."""
    with torch.device("meta"):
        layer = Qwen3DecoderLayer(cfg.qwen3(), layer_idx=i)
    tensors = read or read_block(cfg, i, get)
    layer.load_state_dict({name: tensors[name].to(device, dtype) for name, _ in layer.named_parameters()},
                          assign=True)
    return layer.eval().requires_grad_(False)


def read_block(cfg: MossTTSDelayConfig, i: int, get: Getter) -> dict[str, torch.Tensor]:
    """Block i's tensors as `get` gives them (read and checked, on the host), for `load_block`."""
    with torch.device("meta"):
        names = [name for name, _ in Qwen3DecoderLayer(cfg.qwen3(), layer_idx=i).named_parameters()]
    return {name: get(f"{BLOCK_PREFIX}.{i}.{name}") for name in names}


def rotary(cfg: MossTTSDelayConfig, seqlen: int, dtype=torch.bfloat16, device="cpu"):
    with torch.device(device):
        rope = Qwen3RotaryEmbedding(config=cfg.qwen3())
    return rope(torch.zeros(1, seqlen, 1, dtype=dtype, device=device), torch.arange(seqlen, device=device)[None])


def final_norm(cfg: MossTTSDelayConfig, get: Getter, hidden: torch.Tensor) -> torch.Tensor:
    norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.language_config.get("rms_norm_eps", 1e-6))
    norm.weight = nn.Parameter(get("language_model.norm.weight").to(hidden.device, hidden.dtype), requires_grad=False)
    return norm(hidden)


def release_host_cache() -> None:
    """Page-locked host memory, once freed, stays in CUDA's host cache instead of going back to the
    OS: after a run, the streams (2 GiB each at 128 x 2048 tokens of an 8B) would stay resident
    through the rest of the stage, beside the packed weights being written."""
    empty = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds only; no public name for it yet
    if empty is not None and torch.cuda.is_initialized():
        empty()


class _Clock:
    """A block's wall time by phase, for the block lines (off: `device` None, nothing measured). On
    a GPU each lap first waits for the work queued so far, so a phase is charged its own kernels
    (the block's work is serial: the wait costs nothing measurable)."""

    def __init__(self, device: str | None):
        self.device, self.laps = device, {}
        self.started = self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.device is None:
            return
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.laps[phase], self.last = now - self.last, now

    def line(self) -> str:
        laps = ", ".join(f"{k} {v:.2f}" for k, v in self.laps.items())
        return f"{self.last - self.started:.1f} s ({laps})"


class Capture:
    """One Linear's inputs over the calibration set (on the device), each batch copied into its rows
    of one tensor allocated at the first batch: no per-batch copies to concatenate."""

    def __init__(self, rows: int):
        self.rows, self.tensor, self.filled = rows, None, 0

    def __call__(self, x: torch.Tensor) -> None:
        if self.tensor is None:
            self.tensor = torch.empty((self.rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        self.tensor[self.filled:self.filled + x.shape[0]].copy_(x)
        self.filled += x.shape[0]


@dataclass
class Step:
    """What a hook sees of block `index`."""

    index: int
    layer: nn.Module  # the block with the source weights, on the device (a hook may change it)
    fp_in: torch.Tensor | None  # (N, S, H) fp-stream input (host); None for a hook with reads_fp_in False
    fp_out: torch.Tensor  # the source block's output on fp_in (host; read-only)
    quant_in: torch.Tensor | None  # quant-stream input (host; read-only), when the hook reads that stream
    captured: dict[str, torch.Tensor]  # Linear name -> its inputs on the fp stream (device)
    position_embeddings: tuple
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # the engine's batched forward of a block


class BlockHook(Protocol):
    streams: tuple[str, ...]  # FP, and QUANT if the hook reads the quantized stream
    capture: tuple[str, ...]  # Linear names (relative to the block) whose fp-stream inputs it needs
    # reads_fp_in (optional, default True): False lets the block's fp output overwrite its input
    #   (one stream's worth of host memory: 2 GiB at 128 x 2048 tokens of an 8B)

    def on_block(self, step: Step) -> nn.Module | torch.Tensor | None:
        """The quant stream's next value: the block to run on it (in place), or the output itself."""


class ResumableHook(BlockHook, Protocol):
    """A hook whose results can be checkpointed per block: what `on_block(i)` accumulated, as
    tensors and a JSON-able record, and how to take them back in a later process (blocks in order)."""

    def block_state(self, index: int) -> tuple[dict[str, torch.Tensor], dict]: ...

    def restore_block(self, index: int, tensors: dict[str, torch.Tensor], meta: dict) -> None: ...

    # optional: spill_block(index, tensors): swap block `index`'s tensors for these readers of its saved file


@dataclass
class Engine:
    cfg: MossTTSDelayConfig
    get: Getter  # source tensors
    device: str = "cpu"
    dtype: torch.dtype = torch.bfloat16
    batch_size: int = 8
    desc: str = "blocks"
    last: dict = field(default_factory=dict)  # the final hidden states of each stream after run()
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)
    block_lines: bool = False  # one log line a block (a long run: the bar is silent off a terminal)
    # Read block i+1 on a thread while block i runs, for one more block on the host. Measured at 8B widths
    # on an H100 (BENCHMARKS.md): the load 1 s -> 0.1 s, the tuning beside the read 0.4 s slower.
    prefetch: bool = False

    def host_empty(self, shape, dtype) -> torch.Tensor:
        """A stream's host tensor: page-locked when the blocks run on a GPU, so that its batches move
        by DMA, asynchronously (auto-round's slots are filled a step ahead from it), instead of
        through a synchronous bounce buffer. (CUDA's host allocator rounds a size up to a power of
        two: none lost at the profiles' 2^k samples, up to the rest of that power otherwise.)"""
        return torch.empty(shape, dtype=dtype, pin_memory=torch.device(self.device).type == "cuda")

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        return self.host_empty(x.shape, x.dtype).copy_(x)

    @torch.no_grad()
    def forward(self, layer: nn.Module, hidden: torch.Tensor, pos, observe: dict | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The block on `hidden` (host), `batch_size` sequences at a time on the device; each
        batch's input of a Linear named in `observe` is handed to its callable. The output is
        written batch by batch into one tensor (no per-batch copies to concatenate: those doubled
        the peak and, freed, stayed in the host allocator's heap): `out` when given, which may be
        `hidden` itself (a batch is read before its rows are written)."""
        hooks = []
        for name, fn in (observe or {}).items():
            hooks.append(layer.get_submodule(name).register_forward_pre_hook(lambda mod, args, fn=fn: fn(args[0])))
        try:
            for s in range(0, hidden.shape[0], self.batch_size):
                h = hidden[s:s + self.batch_size].to(self.device, non_blocking=True)
                o = layer(h, attention_mask=None, position_embeddings=pos, position_ids=None)
                o = o[0] if isinstance(o, tuple) else o
                if out is None:
                    out = self.host_empty((hidden.shape[0], *o.shape[1:]), o.dtype) if hidden.device.type == "cpu" \
                        else torch.empty((hidden.shape[0], *o.shape[1:]), dtype=o.dtype, device=hidden.device)
                out[s:s + o.shape[0]].copy_(o)
        finally:
            for h in hooks:
                h.remove()
        return out

    def output_fisher(self, ids: torch.Tensor, output_grad: Callable[[torch.Tensor, slice], torch.Tensor],
                      segment: int | None = None) -> list[torch.Tensor]:
        """Per block i, [H] float64: mean over tokens of (d loss / d output of block i)^2, the
        diagonal Fisher there when the loss is a log-likelihood of labels sampled from the model.
        `output_grad(final_hidden, rows)` returns d loss / d final hidden for the sequences `rows`.
        The forward keeps the input of every `segment`-th block (default ceil(sqrt(n))); the backward
        recomputes a segment's other inputs from it: about 2 sqrt(n) block inputs on the host
        instead of n (4.5 GiB at 36 blocks and 32 x 512 tokens of an 8B), for one more forward."""
        host, n, bs = "cpu", self.cfg.num_layers, self.batch_size
        k = segment or math.isqrt(n - 1) + 1
        x = embed(self.cfg, self.get, ids, self.dtype, self.device).to(host)
        pos = rotary(self.cfg, ids.shape[1], self.dtype, self.device)
        kept = {}  # block -> its input, at each segment's first block
        for i in progress(range(n), desc=f"{self.desc} (forward)", unit="block"):
            if i % k == 0:
                kept[i] = x
            x = self.forward(load_block(self.cfg, i, self.get, self.dtype, self.device), x, pos)
        batches = [slice(s, s + bs) for s in range(0, x.shape[0], bs)]
        grad = torch.cat([output_grad(x[b].to(self.device), b).to(host, self.dtype) for b in batches])
        tokens, out = grad.shape[0] * grad.shape[1], [None] * n
        del x
        bar = progress(None, total=n, desc=f"{self.desc} (backward)", unit="block")
        for start in reversed(range(0, n, k)):
            inputs = [kept.pop(start)]  # the segment's inputs, recomputed as the forward made them
            for i in range(start, min(start + k, n) - 1):
                inputs.append(self.forward(load_block(self.cfg, i, self.get, self.dtype, self.device), inputs[-1], pos))
            for i in reversed(range(start, start + len(inputs))):
                grad = grad.to(self.device)  # once a block: the square-sum and every batch's backward read it
                g = grad.reshape(-1, grad.shape[-1]).double()
                out[i] = ((g * g).sum(0) / tokens).to(host)
                del g
                layer, back = load_block(self.cfg, i, self.get, self.dtype, self.device), []
                for b in batches:
                    h = inputs[i - start][b].to(self.device).requires_grad_()
                    with torch.enable_grad():
                        o = layer(h, attention_mask=None, position_embeddings=pos, position_ids=None)
                        (o[0] if isinstance(o, tuple) else o).backward(grad[b])
                    back.append(h.grad.to(host))
                grad, inputs[i - start] = torch.cat(back), None
                bar.update()
        bar.close()
        return out

    def run(self, hook: BlockHook, ids: torch.Tensor, quant_get: Getter | None = None,
            resume: Path | None = None) -> None:
        """Every block once, in order, through `hook`. The quant stream starts from the same
        embeddings, or from `quant_get`'s when the candidate model has its own. With `resume`,
        each finished block is checkpointed there and the blocks a previous run finished are
        restored instead of run (`hook` is then a ResumableHook)."""
        n = self.cfg.num_layers
        fp = self.to_host(embed(self.cfg, self.get, ids, self.dtype, self.device))
        quant = None
        if QUANT in hook.streams:
            quant = self.to_host(embed(self.cfg, quant_get, ids, self.dtype, self.device)) if quant_get else fp
        pos = rotary(self.cfg, ids.shape[1], self.dtype, self.device)
        start, ckpt = 0, None
        if resume is not None:
            if not (hasattr(hook, "block_state") and hasattr(hook, "restore_block")):
                raise TypeError(f"{type(hook).__name__} cannot be resumed: it lacks block_state/restore_block")
            ckpt = BlockCheckpoint(resume, self.log)
            start, quant = ckpt.restore(hook, n, fp, quant, empty=self.host_empty)
            for i in progress(range(start), desc=f"{self.desc} (fp stream, resuming)", unit="block"):
                fp = self.forward(load_block(self.cfg, i, self.get, self.dtype, self.device), fp, pos,
                                  out=None if fp is quant else fp)
        reads_fp_in = getattr(hook, "reads_fp_in", True)
        run = lambda layer, x: self.forward(layer, x, pos)  # noqa: E731
        with ThreadPoolExecutor(1) if self.prefetch else nullcontext() as reader:
            ahead = None  # block i+1's tensors, being read (`prefetch`)
            for i in progress(range(start, n), desc=self.desc, unit="block", total=n, initial=start):
                clock = _Clock(self.device if self.block_lines else None)
                read = ahead.result() if ahead is not None else None  # a getter's error is raised here, at its block
                ahead = reader.submit(read_block, self.cfg, i + 1, self.get) if reader and i + 1 < n else None
                layer = load_block(self.cfg, i, self.get, self.dtype, self.device, read)
                del read
                clock.lap("load")
                stores = {name: Capture(fp.shape[0]) for name in hook.capture}
                in_place = not reads_fp_in and fp is not quant  # block 0's quant stream is the fp stream's input
                fp_out = self.forward(layer, fp, pos, stores, out=fp if in_place else None)
                captured = {name: store.tensor for name, store in stores.items()}
                step = Step(i, layer, fp if reads_fp_in else None, fp_out, quant, captured, pos, run)
                fp = fp_out
                clock.lap("fp forward")
                out = hook.on_block(step)
                clock.lap("hook")
                del captured, stores, step, layer
                if isinstance(out, nn.Module):
                    if ckpt is not None:  # the quant stream is overwritten: block i-1's copy of it on disk first
                        self._written(hook, ckpt, ckpt.wait())
                        clock.lap("checkpoint wait")
                    out = self.forward(out, quant, pos, out=None if quant is fp else quant)
                    clock.lap("quant forward")
                if quant is not None:
                    quant = out
                if ckpt is not None:
                    self._written(hook, ckpt, ckpt.save(i, hook, quant))
                    clock.lap("checkpoint")
                if self.block_lines:
                    self.log(f"{self.desc} block {i} of {n}: {clock.line()}{self._memory()}")
        if ckpt is not None:
            self._written(hook, ckpt, ckpt.wait())
        self.last = {FP: fp, QUANT: quant}

    def _memory(self) -> str:
        """The host RSS and GPU peak so far: where a 36-block run's memory went."""
        rss, peak = host_rss_gib(), host_rss_gib("VmHWM")
        host = "" if rss is None else f", host RSS {rss:.2f} GiB (peak {peak:.2f})"
        if torch.device(self.device).type != "cuda":
            return host
        return host + f", GPU allocated peak {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f} GiB"

    @staticmethod
    def _written(hook, ckpt: BlockCheckpoint, i: int | None) -> None:
        if i is not None and hasattr(hook, "spill_block"):  # the hook's block-i results, now on disk, leave memory
            hook.spill_block(i, ckpt.lazy(i))

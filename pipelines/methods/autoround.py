"""auto-round (SignRound) on the generator's decoder blocks, calibrated on MOSS inputs.

The engine streams the blocks: block 0 reads the summed text + n_vq audio embeddings of the
multi-channel calibration set; each block is tuned by auto-round's block-level API against the
source block on the fp stream while reading the quantized stream, and its output on that stream
(the engine's, written in place) feeds the next block. Only `language_model.layers` is tuned; embeddings, heads and norms stay
BF16. The tuned integers are packed by our GPTQ packing under upstream MOSS names, in
auto-round's own format.
"""
from __future__ import annotations

from quantizers.autoround import AutoRoundConfig, block_seed, determinism_record, tune_block, tuning_record
from quantizers.errors import QuantizerError
from quantizers.formats import gptq, pack

from ..calibration import CALIB_FILE, load_ids
from ..engine import FP, QUANT, Engine
from ..errors import PipelineError
from ..models.moss_tts_delay import BLOCK_PREFIX, MossTTSDelayConfig, block_linear_names
from .weights import Weights, packed_from_state, packed_state, spill_packed


def calibration_ids(ctx, cfg: AutoRoundConfig):
    """The first `nsamples` calibration sequences cropped to `seqlen`; refuses what auto-round would skip."""
    ids = load_ids(ctx.dirs["calibrate"])
    n, s = ids.shape[:2]
    usable = n if s >= cfg.seqlen else 0
    if usable < cfg.nsamples:
        raise PipelineError(
            f"{CALIB_FILE}: {usable} of {n} calibration sequences are usable (length {s}, quantize.seqlen is "
            f"{cfg.seqlen}); quantize.nsamples needs {cfg.nsamples} (raise calibrate.nsamples/seqlen)")
    return ids[: cfg.nsamples, : cfg.seqlen]


class AutoRoundHook:
    """auto-round on each block; `grids` (full Linear name -> (bits, group_size)) for mixed precision."""

    streams, capture = (FP, QUANT), ()
    reads_fp_in = False  # auto-round fits the block to the fp stream's output, which the engine computed

    def __init__(self, cfg: AutoRoundConfig, seed: int, device: str, grids: dict[str, tuple[int, int]] | None = None):
        self.cfg, self.seed, self.device, self.grids = cfg, seed, device, grids or {}
        self.packed = {}

    def on_block(self, step):
        pre = f"{BLOCK_PREFIX}.{step.index}."
        grids = {n.removeprefix(pre): g for n, g in self.grids.items() if n.startswith(pre)}
        try:
            tuned = tune_block(step.layer, step.quant_in, step.fp_out, step.position_embeddings, self.cfg,
                               block_seed(self.seed, step.index), self.device, grids)
            for name, iw in tuned.items():
                self.packed[f"{BLOCK_PREFIX}.{step.index}.{name}"] = pack(iw, "gptq")
        except QuantizerError as e:
            raise PipelineError(str(e)) from None
        return step.layer  # tuned: the engine runs it on the quant stream

    def block_state(self, i: int):
        pre = f"{BLOCK_PREFIX}.{i}."
        tensors, records = packed_state(self.packed, [name for name in self.packed if name.startswith(pre)])
        return tensors, {"packed": records}

    def spill_block(self, i: int, tensors) -> None:
        spill_packed(self.packed, tensors)

    def restore_block(self, i: int, tensors, meta) -> None:
        self.packed.update(packed_from_state(tensors, meta["packed"]))


def quantize(ctx, cfg: AutoRoundConfig, device: str) -> Weights:
    ckpt = ctx.checkpoint()
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    ids = calibration_ids(ctx, cfg)
    ctx.log(f"auto-round: {cfg.bits}-bit sym={cfg.sym} g{cfg.group_size}, {cfg.iters} iters on "
            f"{ids.shape[0]} x {ids.shape[1]} MOSS block inputs, device {device}")
    hook = AutoRoundHook(cfg, ctx.seed, device)
    Engine(mcfg, ckpt.get, device, desc="auto-round", batch_size=cfg.batch_size, log=ctx.log,
           block_lines=True, prefetch=device.startswith("cuda")).run(
        hook, ids, resume=ctx.partial)
    missing = sorted(set(block_linear_names(mcfg)) - set(hook.packed))
    if missing:
        raise PipelineError(f"auto-round left {len(missing)} decoder Linears unquantized, e.g. {missing[0]}")
    qc = gptq.quantization_config(cfg.bits, cfg.group_size, cfg.sym, BLOCK_PREFIX, **tuning_record(cfg))
    details = {
        "calibration_inputs": f"block-0 inputs: summed text + {mcfg.n_vq} audio embeddings",
        "tuned_blocks": BLOCK_PREFIX,
        "driven_by": "the engine, one block at a time through auto-round's quantize_block",
        "block_seeds": "sha256(profile seed, block index): each block tuned independently of the others' draws",
        "low_gpu_mem_usage": cfg.low_gpu_mem_usage and device.startswith("cuda"),
        "determinism": determinism_record(cfg, device),
    }
    return Weights(hook.packed, qc, details=details)

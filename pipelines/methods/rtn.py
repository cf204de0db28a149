"""Round-to-nearest, group-wise: the baseline every calibrated method must beat.

Streams one tensor at a time from the checkpoint on disk; needs no calibration or activations.
"""
from __future__ import annotations

from quantizers.errors import QuantizerError
from quantizers.formats import gptq, pack
from quantizers.rtn import RTNConfig, quantize_rtn

from ..errors import PipelineError
from ..models.moss_tts_delay import BLOCK_PREFIX, MossTTSDelayConfig, block_linear_names
from ..progress import progress
from .weights import Weights


def quantize(ctx, cfg: RTNConfig, device: str) -> Weights:
    ckpt = ctx.checkpoint()
    packed = {}
    for module in progress(block_linear_names(MossTTSDelayConfig.from_dict(ckpt.config())), desc="rtn", unit="tensor"):
        try:
            packed[module] = pack(quantize_rtn(ckpt.get(module + ".weight").to(device), cfg, name=module + ".weight"), "gptq")
        except QuantizerError as e:
            raise PipelineError(str(e)) from None
    return Weights(packed, gptq.quantization_config(cfg.bits, cfg.group_size, cfg.sym, BLOCK_PREFIX, iters=0))

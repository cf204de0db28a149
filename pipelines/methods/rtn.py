"""Round-to-nearest, group-wise: the baseline every calibrated method must beat.

Streams one tensor at a time from the checkpoint on disk; needs no calibration.
"""
from __future__ import annotations

from quantizers.errors import QuantizerError
from quantizers.packing import pack
from quantizers.rtn import RTNConfig, quantize_rtn

from ..errors import PipelineError
from ..models.moss_tts_delay import MossTTSDelayConfig, block_linear_names
from ..progress import progress
from .gptq_layout import autoround_config, gptq_result

CONFIG = RTNConfig
NEEDS_CALIBRATION = False


def quantize(ctx, cfg: RTNConfig, device: str):
    ckpt = ctx.checkpoint()
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    quantized = {}
    for module in progress(block_linear_names(mcfg), desc="rtn", unit="tensor"):
        w = ckpt.get(module + ".weight").to(device)
        try:
            quantized[module] = pack(quantize_rtn(w, cfg, name=module + ".weight"), "gptq")
        except QuantizerError as e:
            raise PipelineError(str(e)) from None
    qc = autoround_config(cfg.bits, cfg.group_size, cfg.sym, iters=0)
    return gptq_result(ckpt, quantized, qc)

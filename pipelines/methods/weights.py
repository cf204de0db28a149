"""What every quantization method returns: weights only (the quantize stage stores them)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantizers.formats import PackedWeight


@dataclass
class Weights:
    packed: dict[str, PackedWeight]  # Linear module name -> its stored form
    quantization_config: dict
    replaced: dict[str, torch.Tensor] = field(default_factory=dict)  # source tensor -> the value to store (BF16)
    reasons: dict[str, str] = field(default_factory=dict)  # source tensor -> why it stays BF16 (over the definition's)
    details: dict = field(default_factory=dict)  # the manifest's method_details
    files: dict[str, bytes] = field(default_factory=dict)  # extra bundle files (measurement.json)
    config: dict = field(default_factory=dict)  # config.json keys the method changes (the dtype it loads as)
    # The source tensors the artifact holds, with their shapes (None: all of the checkpoint's; the
    # decode-only codec keeps the decode path), and the whole source's parameter count then.
    kept: dict[str, list[int]] | None = None
    source_params: int | None = None

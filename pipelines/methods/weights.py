"""What every quantization method returns: weights only (the quantize stage stores them)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantizers.formats import PackedWeight

from ..checkpoint import Lazy


@dataclass
class Weights:
    packed: dict[str, PackedWeight]  # Linear module name -> its stored form (parts: tensors, or Lazy once checkpointed)
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


def packed_state(packed: dict[str, PackedWeight], modules) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """`modules`' packed Linears as a block checkpoint holds them: their parts by stored name, and
    one JSON record each (in order), which `packed_from_state` turns back into the same PackedWeights."""
    tensors, records = {}, []
    for m in modules:
        pw = packed[m]
        tensors.update({f"{m}.{part}": t for part, t in pw.parts.items()})
        records.append({"module": m, "format": pw.format, "parts": list(pw.parts), "bits": pw.bits,
                        "group_size": pw.group_size, "sym": pw.sym})
    return tensors, records


def packed_from_state(tensors: dict[str, torch.Tensor], records: list[dict]) -> dict[str, PackedWeight]:
    return {r["module"]: PackedWeight(r["format"], {p: tensors[f"{r['module']}.{p}"] for p in r["parts"]},
                                      r["bits"], r["group_size"], r["sym"]) for r in records}


def spill_packed(packed: dict[str, PackedWeight], tensors: dict[str, Lazy]) -> None:
    """Swap the parts of the Linears a block checkpoint holds for readers of its file (the same
    bytes, tests/test_resume.py): from here on a part is a `Lazy` that only the stage's write reads."""
    for module in {name.rsplit(".", 1)[0] for name in tensors} & packed.keys():
        pw = packed[module]
        packed[module] = PackedWeight(pw.format, {p: tensors[f"{module}.{p}"] for p in pw.parts}, pw.bits, pw.group_size, pw.sym)

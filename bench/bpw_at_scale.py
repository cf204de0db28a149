"""What a bundle's recipe stores per weight on the real 8B generator: its backbone-Linear bits per
weight (from the manifest) over the full-shape parameter split, everything else kept BF16.

    python bench/bpw_at_scale.py artifacts/tiny/*/v1-*     # the README's "8B est." column

A computed figure, not a measurement: safetensors headers (under 0.001 bit at 8B) are left out.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def split(model: str = "full-shape") -> tuple[int, int]:
    """(backbone Linear parameters, all parameters) of a fixture's shapes."""
    from pipelines.fixtures import fixture_config, tensor_specs
    from pipelines.models.moss_tts_delay import DEFINITION

    specs = tensor_specs(fixture_config(model))
    total = sum(math.prod(s) for s in specs.values())
    return sum(math.prod(s) for k, s in specs.items() if DEFINITION.component_of(k) == "backbone_linears"), total


def main(argv=None) -> None:
    linear, total = split()
    print(f"full-shape: {linear / 1e9:.3f} B backbone Linear parameters of {total / 1e9:.3f} B "
          f"({linear / total:.1%}); BF16 backbone alone {2 * linear / 2**30:.1f} GiB")
    print("| bundle | profile | quantized_linear bpw | effective bpw at 8B (computed) |\n|---|---|---:|---:|")
    for bundle in argv if argv is not None else sys.argv[1:]:
        m = json.loads((Path(bundle) / "manifest.json").read_text())
        q = m["bits_per_weight"]["quantized_linear"]
        print(f"| {bundle} | {m['profile']} | {q} | {(linear * q + (total - linear) * 16) / total:.2f} |")


if __name__ == "__main__":
    main()

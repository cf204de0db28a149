"""What a bundle's recipe stores per weight on the real 8B generator: its backbone-Linear bits per
weight (from the manifest) over the full-shape parameter split; embedding tables and heads the
bundle stores as ggml blocks at their type's bits (Q8_0 8.5, Q4_0 4.5), everything else BF16.

    .venv/bin/python bench/bpw_at_scale.py artifacts/tiny/*/v1-*   # the README's "8B est." column and GGUF sizes

A computed figure, not a measurement: safetensors headers (under 0.001 bit at 8B) are left out.
"""
from __future__ import annotations

import json
import math
import re
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


GGUF_ROWS = (  # (label, block-Linear type bpw, embeddings + heads type bpw)
    ("awq4 -> Q5_0 (exact), tables BF16", 5.5, 16.0),
    ("awq4 -> Q5_0 (exact), tables Q8_0", 5.5, 8.5),
    ("awq4 -> Q4_1 (near-exact), tables Q8_0", 5.0, 8.5),
    ("autoround-q3 -> Q4_0 (exact), tables Q8_0", 4.5, 8.5),
    ("official MOSS_TTS_Q4_K_M: backbone Q4_K_M (~4.85) + F16 embeddings/heads beside it", 4.85, 16.0),
)


def gguf_sizes() -> None:
    """GGUF file sizes at the real 8B split (computed from the block types' bits, metadata aside)."""
    linear, total = split()
    tables = total - linear  # embeddings, heads (norms: 0.3M, F32, negligible)
    print("\n| GGUF at the 8B split (computed) | bits per weight | GB |\n|---|---:|---:|")
    for label, lin_bpw, tab_bpw in GGUF_ROWS:
        bits = linear * lin_bpw + tables * tab_bpw
        print(f"| {label} | {bits / total:.2f} | {bits / 8 / 1e9:.2f} |")


def at_scale(manifest: dict, model: str = "full-shape") -> float:
    """Effective bits per weight of `manifest`'s recipe on `model`'s shapes."""
    from pipelines.fixtures import fixture_config, tensor_specs
    from pipelines.models.moss_tts_delay import DEFINITION
    from quantizers.formats.ggml import BLOCK, TYPE_BYTES

    q = manifest["bits_per_weight"]["quantized_linear"]
    tables = {}  # the bundle's table keys -> bits per weight of their ggml type
    for key, t in ((manifest.get("method_details") or {}).get("tables") or {}).items():
        tables[key] = 8 * TYPE_BYTES[t["ggml_type"]] / BLOCK
    bits = total = 0
    for name, shape in tensor_specs(fixture_config(model)).items():
        n = math.prod(shape)
        key = next((k for k, p in DEFINITION.tables if re.search(p, name)), None)
        bits += n * (q if DEFINITION.component_of(name) == "backbone_linears" else tables.get(key, 16.0))
        total += n
    return bits / total


def main(argv=None) -> None:
    linear, total = split()
    print(f"full-shape: {linear / 1e9:.3f} B backbone Linear parameters of {total / 1e9:.3f} B "
          f"({linear / total:.1%}); BF16 backbone alone {2 * linear / 2**30:.1f} GiB")
    print("| bundle | profile | quantized_linear bpw | effective bpw at 8B (computed) |\n|---|---|---:|---:|")
    for bundle in argv if argv is not None else sys.argv[1:]:
        m = json.loads((Path(bundle) / "manifest.json").read_text())
        print(f"| {bundle} | {m['profile']} | {m['bits_per_weight']['quantized_linear']} | {at_scale(m):.3f} |")
    gguf_sizes()


if __name__ == "__main__":
    main()

"""What the runtimes people deploy with need to run a bundle's weight format, and where they would
load it wrong. Export asks before it writes: a grid that a runtime would load as placeholder
weights whatever is installed is refused; a package the kernel needs or a slow fallback kernel is a
warning that names the runtime and what is missing.

The CPU facts come from the installed auto-round's own backend table (what transformers'
auto-round integration picks from), so they follow the version that will load the bundle; the
vLLM facts are read from its source (model_executor/layers/quantization/auto_round.py: Marlin
for symmetric 4- and 8-bit GPTQ packing, the plain GPTQ kernel otherwise; fused q/k/v and
gate/up need one width).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

from quantizers.formats import gptq

VLLM_MARLIN_GPTQ = {(4, True), (8, True)}
NO_KERNEL_BACKENDS = ("auto_round:fake",)  # loads the layer with random weights and only a load report
APPLE_ONLY = ("mlx",)  # listed for "cpu", but MLX runs on Apple silicon only
BASE_REQUIREMENTS = {"auto-round", "torch"}  # what loading an auto-round model needs anyway


@dataclass(frozen=True)
class Gap:
    runtime: str
    refuse: bool  # no kernel exists for it: the runtime would load placeholder weights, whatever is installed
    message: str

    def __str__(self) -> str:
        return f"{self.runtime}: {self.message}"


def layer_grids(qc: dict) -> dict[tuple[int, bool], list[str]]:
    """{(bits, sym): modules} of an auto-round config; "*" stands for every layer on the base grid."""
    grids = {(int(qc["bits"]), bool(qc.get("sym", False))): ["*"]}
    for module in sorted(qc.get("extra_config") or {}):
        bits, _, sym = gptq.layer_grid(qc, module)
        if bits < 16:  # 16: left unquantized, a plain Linear everywhere
            grids.setdefault((bits, sym), []).append(module)
    return grids


def _package(requirement: str) -> str:
    return re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].strip().lower()


def _cpu_backends(bits: int, sym: bool) -> list[tuple[str, list[str]]]:
    """auto-round's real CPU kernels for GPTQ-packed layers of this grid: (backend, requirements)."""
    from auto_round.inference.backend import BackendInfos

    usable = lambda name: name not in NO_KERNEL_BACKENDS and (sys.platform == "darwin" or name not in APPLE_ONLY)  # noqa: E731
    return [(name, list(b.requirements or [])) for name, b in sorted(BackendInfos.items())
            if usable(name) and "cpu" in b.device and gptq.PACKING in b.packing_format and bits in b.bits and sym in b.sym]


def _grid_name(bits: int, sym: bool) -> str:
    return f"{'symmetric' if sym else 'asymmetric'} {bits}-bit"


def auto_round_gaps(qc: dict) -> list[Gap]:
    gaps = []
    for (bits, sym), modules in layer_grids(qc).items():
        named = [m for m in modules if m != "*"]
        where = ("the base grid" if "*" in modules else "") + (" and " if "*" in modules and named else "") + (
            f"{len(named)} layers, e.g. {named[0]}" if named else "")
        backends = _cpu_backends(bits, sym)
        if not backends:
            gaps.append(Gap("transformers (CPU)", True,
                            f"{_grid_name(bits, sym)} ({where}): auto-round has no CPU kernel for it; transformers "
                            "would load placeholder weights (auto_round:fake) with only a load report"))
        elif all(any(_package(r) not in BASE_REQUIREMENTS for r in reqs) for _, reqs in backends):
            # said whatever this machine has installed: the bundle is loaded elsewhere
            need = sorted({r for _, reqs in backends for r in reqs if _package(r) not in BASE_REQUIREMENTS})
            gaps.append(Gap("transformers (CPU)", False,
                            f"{_grid_name(bits, sym)} ({where}): its CPU kernels ({', '.join(n for n, _ in backends)}) "
                            f"need {', '.join(need)}; without it transformers loads placeholder weights "
                            "(auto_round:fake)"))
        if (bits, sym) not in VLLM_MARLIN_GPTQ:
            fallback = "reported to produce gibberish at 3 bits" if bits == 3 else "slower"
            gaps.append(Gap("vLLM", False, f"{_grid_name(bits, sym)} ({where}): no Marlin kernel (symmetric 4/8-bit "
                                           f"only); it falls back to the plain GPTQ kernel ({fallback})"))
    return gaps


def awq_gaps(qc: dict) -> list[Gap]:
    return [Gap("transformers", False, "loads AWQ only through gptqmodel (not autoawq) and refuses without it, "
                                       "with an error (gptqmodel 7.7 needs torch >= 2.14.1)"),
            Gap("vLLM", False, "AWQ 4-bit: AWQ-Marlin on GPUs with compute capability >= 8.0, the plain AWQ kernel below")]


GAPS = {"auto-round": auto_round_gaps, "awq": awq_gaps}
BACKBONE_TABLES = ("language_model.embed_tokens", "lm_heads.0")  # the tables a Qwen3ForCausalLM folder holds


def table_gaps(tables: list[str]) -> list[Gap]:
    """Embedding tables / heads stored as ggml blocks: only llama.cpp (the GGUF export) and this project's
    loader read them. MOSS's vLLM-Omni and SGLang-Omni models load `emb_ext.*` / `lm_heads.*` as plain
    `.weight` tensors (a missing weight: a load error there, not placeholders), and transformers has no
    quantized embedding: a backbone folder holding one is refused."""
    if not tables:
        return []
    out = [Gap("vLLM-Omni / SGLang-Omni", False, f"{len(tables)} embedding tables or heads are ggml blocks (e.g. "
                                                 f"{tables[0]}); they read plain .weight tensors only: serve it "
                                                 "through the GGUF export (llama.cpp)")]
    inside = [t for t in tables if t in BACKBONE_TABLES]
    if inside:
        out.append(Gap("transformers", True, f"{inside[0]} is stored as ggml blocks; a Qwen3ForCausalLM folder "
                                             "holds it only as a plain weight"))
    return out


def gaps(quantization_config: dict | None) -> list[Gap]:
    """What a runtime lacks for this config (compressed-tensors FP8: none known; unquantized: none)."""
    if not quantization_config:
        return []
    fn = GAPS.get(quantization_config.get("quant_method"))
    return fn(quantization_config) if fn else []


def warn(gaps_: list[Gap], what: str) -> None:
    """One line per gap on stderr (export's voice: the bundle is written, the user is told)."""
    for g in gaps_:
        print(f"warning: {what}: {g}", file=sys.stderr)

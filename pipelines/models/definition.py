"""One data-only definition per architecture (GPTQModel's models/definitions pattern): what is
quantized, which Linears share an input, which a runtime fuses, the components that bits per
weight are broken down by, and what stays BF16 and why."""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    name: str
    pattern: str  # regex over stored tensor names (source names and their packed parts alike)
    reason: str  # why it stays BF16 where it is not quantized


@dataclass(frozen=True)
class Definition:
    name: str
    model_types: tuple[str, ...]
    components: tuple[Component, ...]  # the first match names a tensor's component
    block_prefix: str | None = None  # the repeated decoder blocks the engine streams
    block_linears: tuple[str, ...] = ()  # quantized Linears, relative to `<block_prefix>.<i>.`
    # (module whose output feeds them, Linears reading that same input): where AWQ scales fold
    input_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Linear -> (module, Linear): its input is made inside `module` from the other Linear's input
    # (down_proj's, act(gate) * up, inside the MLP from gate_proj's): recomputed where it is needed
    # instead of kept (at 128 x 512 tokens it is 1.5 GiB, half of what AWQ would keep per block)
    derived_inputs: tuple[tuple[str, tuple[str, str]], ...] = ()
    # Linears a serving runtime fuses into one matmul (vLLM's qkv_proj, gate_up_proj): one width
    fused_groups: tuple[tuple[str, ...], ...] = ()
    # Embedding tables and heads a profile may store quantized: (key named in `quantize.tables`, regex
    # over source tensor names)
    tables: tuple[tuple[str, str], ...] = ()
    linear_component: str = "backbone_linears"  # the component whose bits per weight is `quantized_linear`
    split_by_format: bool = False  # count that component per stored format (`<component>_fp8`, `_bf16`)

    def component_of(self, tensor_name: str, fmt: str | None = None) -> str:
        """The component of a stored tensor; with `split_by_format`, the quantized-Linear component
        is split by the tensor's stored format (fp8 / bf16 ...)."""
        for c in self.components:
            if re.search(c.pattern, tensor_name):
                if self.split_by_format and c.name == self.linear_component and fmt:
                    return f"{c.name}_{fmt}"
                return c.name
        return "other"

    def reason(self, tensor_name: str) -> str:
        name = self.component_of(tensor_name)
        return next((c.reason for c in self.components if c.name == name), "not a quantization target, kept BF16")

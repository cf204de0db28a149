"""Stored (packed) tensors back as source-named weights, and bundles as runnable modules.

Works from the `quantization_config` alone, as ecosystem loaders do: the format module it names
(quantizers/formats) reads each Linear's parts and grid back and dequantizes it.
"""
from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import torch

from quantizers.errors import QuantizerError
from quantizers.formats import for_config, ggml, stored, table

from . import manifest
from .checkpoint import Checkpoint
from .errors import PipelineError
from .models import moss_audio_tokenizer as codec_model
from .models.moss_tts_delay import MossTTSDelay, MossTTSDelayConfig, build_empty, load_state


INTEGER_FORMATS = ("awq", "gptq")


class DequantizingView:
    """A getter over stored tensors that returns source-named weights, dequantized (float32)."""

    def __init__(self, get, keys, quantization_config: dict | None, where: str = "bundle", device: str = "cpu"):
        # device: where integer Linears are unpacked and dequantized (integer ops and one rounding
        # per element: the same values on any device); what is read stays on the host
        self._get, self.where, self.device = get, where, device
        self.qc = quantization_config or {}
        try:
            self.fmt = for_config(self.qc)
        except QuantizerError as e:
            raise PipelineError(f"{where}: {e}") from None
        keys = set(keys)
        marker = f".{self.fmt.MARKER}" if self.fmt else None
        self.packed = {k[: -len(marker)] for k in keys if k.endswith(marker)} if marker else set()
        parts = {f"{m}.{p}" for m in self.packed for p in self.fmt.PARTS} if self.fmt else set()
        # tables stored as ggml blocks, in any bundle: the part's name says the type
        self.tables = {k.rsplit(".", 1)[0]: k.rsplit(".", 1)[1] for k in keys if k.rsplit(".", 1)[-1] in ggml.PARTS}
        self.packed |= set(self.tables)
        self.plain = keys - parts - {f"{m}.{p}" for m, p in self.tables.items()}

    def names(self) -> list[str]:
        return sorted(self.plain | {m + ".weight" for m in self.packed})

    def packed_weight(self, module: str):
        try:
            if module in self.tables:
                return table(module, self.tables[module], self._get)
            pw = stored(self.fmt, module, self._get, self.qc)
            if self.device != "cpu" and pw.format in INTEGER_FORMATS:
                pw = dataclasses.replace(pw, parts={k: v.to(self.device) for k, v in pw.parts.items()})
            return pw
        except (QuantizerError, KeyError) as e:
            raise PipelineError(f"{self.where}: tensor {module}: {e}") from None

    def __call__(self, name: str) -> torch.Tensor:
        module = name.removesuffix(".weight")
        if module in self.packed:
            try:
                return self.packed_weight(module).dequantize(torch.float32)
            except QuantizerError as e:
                raise PipelineError(f"{self.where}: {e}") from None
        if name not in self.plain:
            raise PipelineError(f"{self.where}: tensor {name} missing")
        t = self._get(name)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # codes without their scale are not a weight
            raise PipelineError(f"{self.where}: tensor {name} is float8 but {name}_scale is missing")
        return t

    def codes(self, name: str) -> torch.Tensor | None:
        """The stored integer codes of a quantized weight (FP8: its bit patterns); None if unquantized."""
        module = name.removesuffix(".weight")
        return self.packed_weight(module).codes() if module in self.packed else None


def bundle_view(path: Path) -> tuple[DequantizingView, dict]:
    ckpt = Checkpoint(Path(path))
    config = ckpt.config()
    return (DequantizingView(ckpt.get, ckpt.keys(), config.get("quantization_config"),
                             str(path)), config)


def stage_view(folder: Path, device: str = "cpu") -> DequantizingView:
    """The quantize stage's output (pipelines/quantize.py) as a view."""
    from .quantize import load

    stored, meta = load(folder)
    return DequantizingView(partial(stored.get, check_finite=False), stored.keys(), meta["quantization_config"],
                            "quantize stage", device)


def codec_decoder(cfg, view: DequantizingView, dtype=torch.bfloat16, where: str = "bundle"):
    """The decode-only codec from a view: refuses tensors that are not part of it."""
    model = codec_model.build_empty(cfg, decode_only=True)
    extra = sorted(set(view.names()) - {n for n, _ in model.named_parameters()})
    if extra:
        raise PipelineError(f"{where}: unexpected tensor {extra[0]} (not part of the decode-only codec)")
    return codec_model.load_state(model, view, dtype=dtype, where=where)


def load_bundle(path: Path, dtype=torch.bfloat16, device="cpu", verify: bool = True):
    """A bundle folder -> a runnable module: the generator (dequantized), or the decode-only codec."""
    path = Path(path)
    if verify:
        manifest.verify(path)
    view, config = bundle_view(path)
    if config.get("model_type") != "moss_tts_delay":
        if view.fmt is not None and view.fmt.NAME != "fp8":
            raise PipelineError(f"{path / 'config.json'}: quantization_config.quant_method is "
                                f"{view.qc.get('quant_method')!r}, expected 'compressed-tensors'")
        cfg = codec_model.CodecConfig.from_dict(config, where=str(path / "config.json"))
        return codec_decoder(cfg, view, dtype=dtype, where=str(path))
    cfg = MossTTSDelayConfig.from_dict({k: v for k, v in config.items() if k != "quantization_config"},
                                       where=str(path / "config.json"))
    try:
        return load_state(build_empty(cfg), view, dtype=dtype, device=device)
    except ValueError as e:
        raise PipelineError(f"{path}: {e}") from None


def load_source(path: Path, dtype=torch.bfloat16, device="cpu") -> MossTTSDelay:
    ckpt = Checkpoint(path)
    cfg = MossTTSDelayConfig.from_dict(ckpt.config(), where=str(Path(path) / "config.json"))
    return load_state(build_empty(cfg), ckpt.get, dtype=dtype, device=device)

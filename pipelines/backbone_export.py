"""The ecosystem path: a generator bundle's Qwen3 backbone as a plain Qwen3ForCausalLM folder.

`language_model.*` -> `model.*`, the text head `lm_heads.0` -> `lm_head`; the audio embeddings
and heads are left out (MOSS-specific). config.json is the backbone's Qwen3 config with the
bundle's quantization_config, `block_name_to_quantize` and per-layer keys renamed to match, so
transformers' own auto-round integration loads it. The MOSS input (summed 1 + n_vq embeddings)
goes in as `inputs_embeds`.
"""
from __future__ import annotations

from pathlib import Path

from quantizers.formats import ggml

from . import serving
from .atomic import atomic_folder
from .checkpoint import Checkpoint, canonical_json, write_sharded
from .errors import PipelineError

RENAMES = (("language_model.", "model."), ("lm_heads.0.", "lm_head."))


def backbone_name(name: str) -> str | None:
    for old, new in RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return None  # audio embeddings / heads: not part of the backbone


def _module_name(name: str) -> str | None:
    """A module name or prefix of the bundle as it is in the backbone ('lm_heads' -> 'lm_head')."""
    if name == "lm_heads":  # the prefix of every head; only the text head is in the backbone
        return "lm_head"
    new = backbone_name(name + ".")
    return new.rstrip(".") if new else None


def export_backbone(bundle: Path, dest: Path, shard_size_mb: int = 2048) -> Path:
    """Write `dest` (temporary folder, then renamed); refuses to overwrite."""
    bundle, dest = Path(bundle), Path(dest)
    if dest.exists():
        raise PipelineError(f"{dest}: already exists; choose a new folder")
    ckpt = Checkpoint(bundle)
    config = ckpt.config()
    if config.get("model_type") != "moss_tts_delay":
        raise PipelineError(f"{bundle / 'config.json'}: model_type {config.get('model_type')!r}, expected 'moss_tts_delay'")
    qc = config.get("quantization_config")
    tables = sorted(k.rsplit(".", 1)[0] for k in ckpt.keys() if k.rsplit(".", 1)[-1] in ggml.PARTS)
    gaps = serving.gaps(qc) + serving.table_gaps(tables)  # before any tensor is read: a refusal costs nothing
    refused = [g for g in gaps if g.refuse]
    if refused:  # this folder exists to be loaded by transformers/vLLM: never hand them placeholders
        raise PipelineError(f"{bundle}: {refused[0]}; rebuild with a format it loads (sym: true grids, no "
                            "quantize.tables), nothing written")
    serving.warn(gaps, str(dest))
    tensors = {new: ckpt.get(n, check_finite=False) for n in ckpt.keys() if (new := backbone_name(n))}
    qwen3 = {k: v for k, v in config["language_config"].items() if k not in ("transformers_version", "torch_dtype")}
    qwen3.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=False,
                 dtype=config.get("dtype", "bfloat16"))
    if qc:  # every module name in it as the backbone names the module
        qc = dict(qc)
        if "modules_to_not_convert" in qc:
            qc["modules_to_not_convert"] = sorted({_module_name(m) for m in qc["modules_to_not_convert"]} - {None})
        if "block_name_to_quantize" in qc:
            qc["block_name_to_quantize"] = _module_name(qc["block_name_to_quantize"])
        if qc.get("extra_config"):
            qc["extra_config"] = {_module_name(k): v for k, v in sorted(qc["extra_config"].items())}
        qwen3["quantization_config"] = qc
    with atomic_folder(dest, replace=False) as tmp:  # an existing dest makes the rename fail: never overwritten
        write_sharded(tmp, tensors, shard_size_mb << 20)
        (tmp / "config.json").write_text(canonical_json(qwen3, indent=2))
    return dest

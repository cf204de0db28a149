"""The export stage: a versioned bundle, safetensors + config.json + recipe.yaml + manifest.json.

`artifacts/<model>/<profile>/<version>/`, written to a temporary folder, synced and renamed,
never overwritten. The version id hashes every stage key, so the same inputs give the same id.
Bits per weight count every stored bit (packed weights, scales, zeros, protected tensors and the
safetensors headers) over the source's logical parameter count, and must agree with the bytes
on disk.
"""
from __future__ import annotations

import hashlib
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import manifest, serving
from .atomic import publish, temporary_sibling
from .checkpoint import canonical_json, safetensors_header, sha256_file, write_sharded
from .errors import PipelineError
from .quantize import load as load_quantized
from .source import ARTIFACTS

DTYPE_BITS = {"BF16": 16, "F16": 16, "F32": 32, "I32": 32, "I64": 64, "F8_E4M3": 8, "I8": 8, "U8": 8, "BOOL": 8}


@dataclass
class ExportParams:
    shard_size_mb: int = 2048

    def validate(self):
        if self.shard_size_mb < 1:
            raise ValueError(f"shard_size_mb: must be >= 1, got {self.shard_size_mb}")


def safetensors_layout(path: Path) -> tuple[int, dict]:
    """(header bytes including the 8-byte length, {name: {dtype, shape}}) read from the file itself."""
    header, data_start = safetensors_header(path)
    return data_start, {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in header.items()}


def bits_per_weight(folder: Path, files: list[str], layout: dict, source_shapes: dict[str, list[int]],
                    definition, full_source_params: int | None = None) -> dict:
    """Effective bpw from the files on disk, with a per-component breakdown (the definition's)."""
    stored_to_source = {s: src for src, entry in layout.items() for s in entry["stored"]}
    component = lambda src: definition.component_of(src, layout.get(src, {}).get("format"))  # noqa: E731
    comp_bits: dict[str, int] = {}
    header_bits = 0
    for fname in files:
        if not fname.endswith(".safetensors"):
            continue
        hbytes, tensors = safetensors_layout(folder / fname)
        header_bits += 8 * hbytes
        for name, info in tensors.items():
            c = component(stored_to_source.get(name, name))
            comp_bits[c] = comp_bits.get(c, 0) + DTYPE_BITS[info["dtype"]] * math.prod(info["shape"])
    comp_params: dict[str, int] = {}
    for name, shape in source_shapes.items():
        comp_params[component(name)] = comp_params.get(component(name), 0) + math.prod(shape)
    total_params = sum(comp_params.values())
    total_bits = sum(comp_bits.values()) + header_bits
    disk_bits = 8 * sum((folder / f).stat().st_size for f in files if f.endswith(".safetensors"))
    if total_bits != disk_bits:
        raise PipelineError(f"{folder}: bit count {total_bits} disagrees with safetensors bytes on disk {disk_bits}")
    components = {
        c: {"params": comp_params.get(c, 0), "bits": comp_bits.get(c, 0),
            "bpw": round(comp_bits.get(c, 0) / comp_params[c], 6) if comp_params.get(c) else None}
        for c in sorted(set(comp_params) | set(comp_bits))
    }
    linear = definition.linear_component + ("_fp8" if definition.split_by_format else "")
    out = {
        "effective": round(total_bits / total_params, 6),
        "quantized_linear": components.get(linear, {}).get("bpw"),
        "source_params": total_params,
        "stored_bits": total_bits,
        "header_bits": header_bits,
        "components": components,
        "definition": "every safetensors bit (weights, scales, zeros, protected tensors, headers) / source parameters",
    }
    if full_source_params is not None:  # a decode-only artifact: also against the whole source
        out.update(full_source_params=full_source_params,
                   effective_vs_full_source=round(total_bits / full_source_params, 6),
                   definition=out["definition"] + "; source = the decode path (encoder and quantizer input side "
                                                  "dropped); effective_vs_full_source counts against the whole codec")
    return out


def version_id(stage_keys: dict[str, str]) -> str:
    return "v1-" + hashlib.sha256(canonical_json(stage_keys).encode()).hexdigest()[:12]


def write_bundle(dest: Path, build) -> Path:
    """Call build(tmp_folder) to fill a temporary folder, then rename it to dest atomically.

    A version that exists already is kept when its payload files are the same; other content is
    refused."""
    dest = Path(dest)
    tmp = temporary_sibling(dest)
    try:
        build(tmp)
        if dest.exists():
            if same_payload(dest, tmp):
                return dest  # already built, identical: nothing to do
            raise PipelineError(f"{dest}: version exists with different content; versions are never overwritten "
                                f"(`mossquant rebuild {dest}` says what differs)")
        publish(tmp, dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def same_payload(a: Path, b: Path) -> bool:
    """Same files with the same hashes (the manifest's figures may differ in the last digits when
    the environment differs: another thread count, say)."""
    import json

    fa, fb = (json.loads((p / manifest.FILE).read_text()).get("files") for p in (a, b))
    return fa is not None and fa == fb


def run(ctx, params: ExportParams, out: Path) -> dict:
    from .stages import code_version

    stored, meta = load_quantized(ctx.dirs["quantize"])
    ckpt = ctx.checkpoint()
    stage_keys = {k: v for k, v in ctx.keys.items() if k != "export"}
    version = version_id(stage_keys)
    folder = ctx.bundle_root or ARTIFACTS / ctx.spec.name / ctx.profile.name
    gate = ctx.results.get("gate", {"status": "unchecked", "checks": []})
    kept = meta.get("kept")
    source_shapes = kept if kept is not None else {k: ckpt.shape(k) for k in ckpt.keys()}
    environment = ctx.environments["quantize"]  # where the weights were made

    def build(tmp: Path):
        write_sharded(tmp, {k: stored.lazy(k) for k in stored.keys()}, params.shard_size_mb << 20)
        config = dict(ckpt.config())
        config.update(meta["config"], quantization_config=meta["quantization_config"])
        (tmp / "config.json").write_text(canonical_json(config, indent=2))
        (tmp / "recipe.yaml").write_text(yaml.safe_dump(ctx.profile.resolved(), sort_keys=False))  # stage order matters
        for name in meta["files"]:
            shutil.copyfile(ctx.dirs["quantize"] / name, tmp / name)
        for folder_ in ctx.dirs.values():  # report/ folders (decoded WAVs) and a GGUF from earlier stages
            if (folder_ / "report").is_dir():
                shutil.copytree(folder_ / "report", tmp / "report", dirs_exist_ok=True)
            for gguf_file in folder_.glob("*.gguf"):
                shutil.copyfile(gguf_file, tmp / gguf_file.name)
        files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        bpw = bits_per_weight(tmp, files, meta["layout"], source_shapes, ctx.definition, meta.get("source_params"))
        if "gguf" in ctx.results:  # the GGUF counted the same way: every bit of the file over the source
            g = ctx.results["gguf"]
            bpw["gguf"] = {"file": g["file"], "effective": round(8 * (tmp / g["file"]).stat().st_size / bpw["source_params"], 6),
                           "types": g["types"], "inexact_tensors": len(g["inexact"])}
        m = {
            "schema": manifest.SCHEMA,
            "model": ctx.spec.name,
            "kind": ctx.spec.kind,
            "profile": ctx.profile.name,
            "version": version,
            "status": gate["status"],
            "gate": gate,
            "source": ctx.spec.pins(),
            "calibration": ctx.results.get("calibrate"),
            "evaluation": ctx.results.get("evaluate"),
            "free_running": ctx.results.get("freerun"),
            "stages": ctx.profile.resolved()["stages"],
            "stage_keys": stage_keys,
            "seed": ctx.seed,
            "method": meta["method"],
            "method_details": meta["extra"],
            "environment": environment,
            "environment_by_stage": {k: v for k, v in ctx.environments.items() if v != environment},
            "code_version": code_version(),
            "files": {f: {"sha256": sha256_file(tmp / f), "size": (tmp / f).stat().st_size} for f in files},
            "tensors": meta["layout"],
            "protected": sorted(k for k, v in meta["layout"].items() if v["format"] == "bf16"),
            "bits_per_weight": bpw,
        }
        if "gguf" in ctx.results:
            m["gguf"] = ctx.results["gguf"]
        (tmp / manifest.FILE).write_text(canonical_json(m, indent=2))

    path = write_bundle(folder / version, build)
    manifest.record(folder, version)
    tables = sorted(k.removesuffix(".weight") for k, v in meta["layout"].items() if v["format"] == "ggml")
    serving.warn(serving.gaps(meta["quantization_config"]) + serving.table_gaps(tables),
                 f"{ctx.spec.name}/{ctx.profile.name} {version}")
    ctx.bundle = path
    return {"bundle": str(path.name), "status": gate["status"]}

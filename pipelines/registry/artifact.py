"""A bundle folder as a CNCF ModelPack OCI artifact, and the checks a pulled one must pass.

The manifest is canonical JSON built only from the bundle's own bytes and manifest.json (no clock,
host or path), so the same bundle always has the same manifest digest wherever it is pushed.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .. import manifest as bundle_manifest
from ..checkpoint import canonical_json, sha256_file
from ..errors import PipelineError

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.cncf.model.manifest.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.cncf.model.config.v1+json"
# Only the layer types the ModelPack spec defines (docs/spec.md), so ModelPack clients pull a bundle.
WEIGHT = "application/vnd.cncf.model.weight.v1.raw"
WEIGHT_CONFIG = "application/vnd.cncf.model.weight.config.v1.raw"
DOC = "application/vnd.cncf.model.doc.v1.raw"
# A bundle's GGUF is also tagged as a Docker model artifact (same blob, no second upload): the
# manifest shape and types llama.cpp's `-dr` and Docker Model Runner pick a GGUF by (docker/model-runner).
GGUF = "application/vnd.docker.ai.gguf.v3"
DOCKER_MODEL_CONFIG = "application/vnd.docker.ai.model.config.v0.1+json"
GGUF_NAME = "model.gguf"
GGUF_TAG_SUFFIX = "-gguf"

FILEPATH = "org.cncf.model.filepath"
TITLE = "org.opencontainers.image.title"
VENDOR = "org.moss-quant."
BUNDLE_MANIFEST_NAME = "manifest.json"
TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
DIGEST_RE = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Blob:
    digest: str  # "sha256:<hex>"
    size: int
    path: Path | None = None  # a bundle file, streamed from disk
    data: bytes | None = None  # a small generated blob (the ModelPack config)

    def open(self):
        return open(self.path, "rb") if self.path is not None else io.BytesIO(self.data)


@dataclass(frozen=True)
class Artifact:
    manifest: bytes  # exactly the bytes that are pushed; digest = sha256(manifest)
    digest: str
    blobs: list[Blob]  # config first, then layers in manifest order
    version_tag: str  # immutable
    moving_tags: list[str]  # re-pointed on every push of this model/profile


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(digest: str) -> str:
    if not DIGEST_RE.fullmatch(digest or ""):
        raise PipelineError(f"{digest!r}: not a sha256 digest (expected sha256:<64 hex>)")
    return digest


def check_tag(tag: str, what: str) -> str:
    if not TAG_RE.fullmatch(tag or ""):
        raise PipelineError(f"{what} {tag!r}: not a valid OCI tag ([A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})")
    return tag


# Files that describe the weights (how they are laid out and were made): ModelPack's weight config.
_WEIGHT_CONFIG_NAMES = {"config.json", BUNDLE_MANIFEST_NAME, "recipe.yaml", "measurement.json",
                        "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def media_type(rel: str) -> str:
    name = PurePosixPath(rel).name
    if name.endswith((".safetensors", ".gguf")):
        return WEIGHT
    if rel in _WEIGHT_CONFIG_NAMES or name.endswith(".safetensors.index.json"):
        return WEIGHT_CONFIG
    return DOC  # the report's listening samples and anything else a person reads


def _bundle_files(bundle: Path) -> list[str]:
    out = []
    for p in sorted(bundle.rglob("*")):
        if p.is_symlink():
            raise PipelineError(f"{p}: symlink in a bundle; bundles hold plain files only")
        if p.is_file():
            out.append(p.relative_to(bundle).as_posix())
    return out


def _hex(value) -> str:
    return str(value).removeprefix("sha256:")


def build_artifact(bundle: Path, force: bool = False) -> Artifact:
    """Hash every bundle file against manifest.json and describe the bundle as a ModelPack artifact."""
    bundle = Path(bundle)
    files = _bundle_files(bundle)  # refuses symlinks
    info = bundle_manifest.verify(bundle)  # every file hashed against manifest.json, no stray or missing file
    mpath = bundle / BUNDLE_MANIFEST_NAME
    if info["status"] != "accepted" and not force:
        raise PipelineError(f"{mpath}: status is {info['status']!r}, not 'accepted'; "
                            "refusing to push (use --force to push it anyway)")
    version = check_tag(str(info["version"]), f"{mpath}: version")
    model, profile = str(info["model"]), str(info["profile"])
    moving = check_tag(f"{model}-{profile}", f"{mpath}: model-profile tag")

    layers, blobs = [], []
    # Weights first (ModelPack readers look there), then everything else; both sorted by path.
    for rel in sorted(files, key=lambda r: (media_type(r) != WEIGHT, r)):
        path = bundle / rel
        # verify() just hashed every listed file: use its digests instead of hashing 16 GB twice
        sha = sha256_file(path) if rel == BUNDLE_MANIFEST_NAME else _hex(info["files"][rel]["sha256"])
        digest, size = "sha256:" + sha, path.stat().st_size
        blobs.append(Blob(digest, size, path=path))
        layers.append({"mediaType": media_type(rel), "digest": digest, "size": size,
                       "annotations": {FILEPATH: rel, TITLE: rel}})

    source = info.get("source") if isinstance(info.get("source"), dict) else {}
    qcfg = _quantization_config(bundle)
    descriptor = {"name": model, "version": version, "title": f"{model} {profile}"}
    if source.get("revision"):
        descriptor["revision"] = str(source["revision"])
    if source.get("repo"):
        descriptor["sourceURL"] = str(source["repo"])
    mconfig = {"format": "safetensors"}
    if qcfg.get("quant_method"):
        mconfig["quantization"] = str(qcfg["quant_method"])
    if qcfg.get("bits"):
        mconfig["precision"] = f"int{qcfg['bits']}"
    config = canonical_json({"descriptor": descriptor, "config": mconfig,
                             "modelfs": {"type": "layers", "diffIds": [layer["digest"] for layer in layers]}}).encode()
    config_blob = Blob(digest_of(config), len(config), data=config)

    annotations = {
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.title": f"{model} {profile} {version}",
        VENDOR + "model": model,
        VENDOR + "profile": profile,
        VENDOR + "status": str(info["status"]),
    }
    if source.get("revision"):
        annotations["org.opencontainers.image.revision"] = str(source["revision"])
    if source.get("repo"):
        annotations["org.opencontainers.image.source"] = str(source["repo"])
    bpw = info.get("bits_per_weight")
    if isinstance(bpw, dict) and bpw.get("effective") is not None:
        annotations[VENDOR + "bits-per-weight"] = str(bpw["effective"])
    manifest = canonical_json({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": config_blob.digest, "size": config_blob.size},
        "layers": layers,
        "annotations": annotations,
    }).encode()
    # A rejected bundle pushed with force keeps its version tag but never moves the profile tag.
    accepted = info["status"] == "accepted"
    return Artifact(manifest, digest_of(manifest), [config_blob, *blobs], version, [moving] if accepted else [])


def gguf_artifact(art: Artifact) -> Artifact | None:
    """The bundle's GGUF as a Docker model artifact (tags `<version>-gguf`, `<model>-<profile>-gguf`).

    Its one layer is the blob the ModelPack manifest already lists, so pushing it uploads only a config.
    """
    main = json.loads(art.manifest)
    layer = next((x for x in main["layers"] if x["annotations"][FILEPATH] == GGUF_NAME), None)
    if layer is None:
        return None
    ann = main["annotations"]
    config = canonical_json({
        "config": {"format": "gguf", "architecture": "moss-tts-delay", "size": str(layer["size"]),
                   "quantization": ann.get(VENDOR + "profile", "")},
        "descriptor": {},
        "rootfs": {"type": "layers", "diff_ids": [layer["digest"]]},
    }).encode()
    config_blob = Blob(digest_of(config), len(config), data=config)
    manifest = canonical_json({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": DOCKER_MODEL_CONFIG, "digest": config_blob.digest, "size": config_blob.size},
        "layers": [{**layer, "mediaType": GGUF}],
        "annotations": {k: v for k, v in ann.items() if k.startswith("org.opencontainers.")},
    }).encode()
    gguf_blob = next(b for b in art.blobs if b.digest == layer["digest"])
    return Artifact(manifest, digest_of(manifest), [config_blob, gguf_blob], art.version_tag + GGUF_TAG_SUFFIX,
                    [t + GGUF_TAG_SUFFIX for t in art.moving_tags])


def _quantization_config(bundle: Path) -> dict:
    try:
        q = json.loads((bundle / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return {}
    return q if isinstance(q, dict) else {}


@dataclass(frozen=True)
class Layer:
    path: str  # relative file path inside the bundle
    digest: str
    size: int


def parse_manifest(data: bytes, where: str) -> list[Layer]:
    """The files a pulled manifest describes; paths checked so nothing lands outside the destination."""
    try:
        m = json.loads(data)
        if m.get("artifactType") != ARTIFACT_TYPE:
            raise PipelineError(f"{where}: artifactType is {m.get('artifactType')!r}, expected {ARTIFACT_TYPE!r}")
        layers = [Layer(x["annotations"][FILEPATH], check_digest(x["digest"]), int(x["size"])) for x in m["layers"]]
    except PipelineError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PipelineError(f"{where}: not a moss-quant bundle manifest ({type(e).__name__}: {e})") from None
    seen = set()
    for layer in layers:
        p = PurePosixPath(layer.path)
        if not layer.path or p.is_absolute() or ".." in p.parts or layer.path != p.as_posix() or layer.path in seen:
            raise PipelineError(f"{where}: layer path {layer.path!r} is unsafe or repeated")
        seen.add(layer.path)
    if BUNDLE_MANIFEST_NAME not in seen:
        raise PipelineError(f"{where}: no {BUNDLE_MANIFEST_NAME} layer; not a moss-quant bundle")
    return layers


def check_pulled(folder: Path, layers: list[Layer], where: str) -> None:
    """Every pulled file is the one the bundle's own manifest.json lists (blob digests are checked already)."""
    info = bundle_manifest.read(folder)
    got = {layer.path: layer for layer in layers if layer.path != BUNDLE_MANIFEST_NAME}
    if set(got) != set(info["files"]):
        missing = sorted(set(info["files"]) ^ set(got))
        raise PipelineError(f"{where}: layers and {BUNDLE_MANIFEST_NAME} 'files' disagree on {missing[0]}")
    for rel, layer in got.items():
        want = info["files"][rel]
        if _hex(want.get("sha256")) != layer.digest[7:] or want.get("size") != layer.size:
            raise PipelineError(f"{where}: {rel} differs from its {BUNDLE_MANIFEST_NAME} entry")


CHUNK = 8 << 20  # read/upload granularity: memory stays at one chunk whatever the file size


def read_chunks(f, chunk: int = CHUNK):
    while block := f.read(chunk):
        yield block


def write_verified(chunks, dest: Path, digest: str, size: int, what: str) -> None:
    """Stream chunks into dest, hashing; raise (dest left for the caller to discard) unless digest and size match."""
    h, n = hashlib.sha256(), 0
    with open(dest, "wb") as f:
        for block in chunks:
            n += len(block)
            if n > size:
                raise PipelineError(f"{what}: blob {digest} is longer than its {size} bytes (tampered)")
            h.update(block)
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    if n != size:
        raise PipelineError(f"{what}: blob {digest} has {n} of its {size} bytes (truncated)")
    if "sha256:" + h.hexdigest() != digest:
        raise PipelineError(f"{what}: blob content hashes to sha256:{h.hexdigest()}, not {digest} (tampered)")

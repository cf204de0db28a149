"""Push and pull bundles as OCI artifacts: a local OCI image layout by default, or an OCI registry.

URLs: `oci-layout:PATH` (default `artifacts/registry`) or `oci://HOST:PORT/REPO` (plain HTTP on
loopback, HTTPS elsewhere). A reference adds `:TAG` or `@sha256:...`; a bare tag means the default
layout. Each bundle gets its version id as an immutable tag and `<model>-<profile>` as a moving tag.
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..atomic import publish, temporary_sibling
from ..errors import PipelineError
from ..progress import progress
from .artifact import (DIGEST_RE, TAG_RE, Artifact, Blob, build_artifact, check_pulled, check_tag, gguf_artifact,
                       parse_manifest)

DEFAULT_URL = "oci-layout:artifacts/registry"


class Registry(Protocol):
    url: str

    # "absent", "intact" or "corrupt": the stored bytes hashed, never judged by size alone
    def check_blob(self, digest: str, size: int) -> str: ...
    def put_blob(self, blob: Blob) -> None: ...
    def discard_blob(self, digest: str) -> None: ...  # before a corrupt blob is uploaded again
    def fetch_blob(self, digest: str, size: int, dest: Path, what: str) -> None: ...  # verifies or raises
    def resolve(self, ref: str) -> str | None: ...
    def get_manifest(self, ref: str) -> tuple[bytes, str] | None: ...  # (exact bytes, their digest)
    def put_manifest(self, data: bytes, digest: str, tag: str, immutable: bool) -> None: ...
    def tags(self) -> list[str]: ...


def open_registry(url: str = DEFAULT_URL) -> Registry:
    if url.startswith("oci-layout:"):
        from .layout import LayoutRegistry

        return LayoutRegistry(Path(url[len("oci-layout:"):] or "."))
    m = re.fullmatch(r"oci://([^/@]+)/([a-z0-9]+(?:[._/-][a-z0-9]+)*)", url)
    if m:
        if "@" in url.split("/")[2]:
            raise PipelineError("registry URL: credentials in the URL are not accepted; use the environment")
        from .remote import RemoteRegistry

        return RemoteRegistry(m.group(1), m.group(2))
    if url.startswith("oci://") and "@" in url.split("/")[2]:
        raise PipelineError("registry URL: credentials in the URL are not accepted; use the environment")
    raise PipelineError(f"registry URL {url!r}: expected oci-layout:PATH or oci://HOST:PORT/REPO (lowercase repo)")


def split_ref(ref: str) -> tuple[str, str]:
    """'URL:TAG', 'URL@sha256:..' or a bare 'TAG' -> (registry URL, tag or digest)."""
    scheme = next((s for s in ("oci://", "oci-layout:") if ref.startswith(s)), "")
    if not scheme and TAG_RE.fullmatch(ref):
        return DEFAULT_URL, ref
    rest = ref[len(scheme):]
    head, _, last = rest.rpartition("/")
    if "@" in last:
        last, _, digest = last.partition("@")
        if not DIGEST_RE.fullmatch(digest):
            raise PipelineError(f"reference {ref!r}: {digest!r} is not a sha256 digest (sha256:<64 hex>)")
        name, target = last, digest
    elif ":" in last:
        name, _, target = last.rpartition(":")
        check_tag(target, f"reference {ref!r}: tag")
    else:
        raise PipelineError(f"reference {ref!r}: expected oci-layout:PATH:TAG, oci://HOST:PORT/REPO:TAG, "
                            "URL@sha256:DIGEST or a bare TAG")
    if not scheme:
        if head or name:
            raise PipelineError(f"reference {ref!r}: a registry URL starts with oci-layout: or oci://")
        return DEFAULT_URL, target
    return scheme + (f"{head}/{name}" if head else name), target


@dataclass
class PushResult:
    digest: str
    tags: list[str]
    uploaded: list[str] = field(default_factory=list)  # blob digests sent
    skipped: list[str] = field(default_factory=list)  # already in the registry, bytes checked
    repaired: list[str] = field(default_factory=list)  # held corrupt by the registry, sent again


def push(registry: Registry, bundle: Path, force: bool = False) -> PushResult:
    """Upload missing or corrupt blobs, then the manifest under the version tag, then the moving tag.

    The manifest goes last, so an interrupted push leaves no tag pointing at missing blobs and a
    re-run only sends what is still missing. A bundle with a GGUF also gets its Docker model tags.
    """
    art: Artifact = build_artifact(Path(bundle), force=force)
    extra = gguf_artifact(art)
    arts = [art] + ([extra] if extra else [])
    for a in arts:
        old = registry.resolve(a.version_tag)
        if old not in (None, a.digest):
            raise PipelineError(f"{registry.url}:{a.version_tag}: already holds {old}, not this bundle's "
                                f"{a.digest}; a version id never changes content")
    result = PushResult(art.digest, [t for a in arts for t in (a.version_tag, *a.moving_tags)])
    blobs = list({b.digest: b for a in arts for b in a.blobs}.values())
    for blob in progress(blobs, desc="push", unit="blob"):
        state = registry.check_blob(blob.digest, blob.size)
        if state == "intact":
            result.skipped.append(blob.digest)
            continue
        if state == "corrupt":
            registry.discard_blob(blob.digest)
            result.repaired.append(blob.digest)
        registry.put_blob(blob)
        if state == "corrupt" and registry.check_blob(blob.digest, blob.size) != "intact":
            raise PipelineError(f"{registry.url}: blob {blob.digest} is stored corrupt and the registry kept its bytes "
                                "after delete and re-upload (CNCF Distribution never replaces stored blob data); "
                                "remove it from the registry's storage and push again; no tag was written")
        result.uploaded.append(blob.digest)
    for a in arts:
        registry.put_manifest(a.manifest, a.digest, a.version_tag, immutable=True)
        for tag in a.moving_tags:
            registry.put_manifest(a.manifest, a.digest, tag, immutable=False)
    return result


def pull(registry: Registry, ref: str, dest: Path) -> str:
    """Fetch and verify every blob into a temp folder beside dest, then move it into place.

    dest must not exist (or be an empty folder); on any failure nothing is left there. Returns the digest.
    """
    dest = Path(dest)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise PipelineError(f"{dest}: exists and is not an empty folder; pull into a new one")
    got = registry.get_manifest(ref)
    if got is None:
        raise PipelineError(f"{registry.url}: nothing tagged {ref!r} (see `mossquant ls {registry.url}`)")
    data, digest = got
    where = f"{registry.url}@{digest}"
    layers = parse_manifest(data, where)
    tmp = temporary_sibling(dest)
    try:
        for layer in progress(layers, desc="pull", unit="file"):
            (tmp / layer.path).parent.mkdir(parents=True, exist_ok=True)
            registry.fetch_blob(layer.digest, layer.size, tmp / layer.path, layer.path)
        check_pulled(tmp, layers, where)
        publish(tmp, dest)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, PipelineError):
            raise PipelineError(f"{e}; nothing was written to {dest}") from None
        raise
    return digest


def list_tags(registry: Registry) -> dict[str, str | None]:
    """tag -> manifest digest."""
    return {tag: registry.resolve(tag) for tag in registry.tags()}

"""The embedded registry: an OCI image layout folder (readable by oras --oci-layout, skopeo oci:, crane).

Blobs are content-addressed files that are written once (temp file, fsync, hard link: never
overwritten) and hashed on every read; tags live in index.json as org.opencontainers.image.ref.name,
updated under an flock and replaced atomically.
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..checkpoint import canonical_json, sha256_file
from ..errors import PipelineError
from .artifact import (DIGEST_RE, MANIFEST_MEDIA_TYPE, Blob, check_digest, digest_of, read_chunks,
                       write_verified)

REF_NAME = "org.opencontainers.image.ref.name"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
MAX_MANIFEST = 4 << 20


class LayoutRegistry:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.url = f"oci-layout:{self.root}"

    # -- blobs -------------------------------------------------------------------------------
    def _blob(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / check_digest(digest)[7:]

    def check_blob(self, digest: str, size: int) -> str:
        p = self._blob(digest)
        if not p.is_file():
            return "absent"
        return "intact" if p.stat().st_size == size and "sha256:" + sha256_file(p) == digest else "corrupt"

    def discard_blob(self, digest: str) -> None:
        self._quarantine(self._blob(digest))

    def put_blob(self, blob: Blob) -> None:
        self._init()
        final = self._blob(blob.digest)
        fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".upload-")
        os.close(fd)
        try:
            with blob.open() as f:
                write_verified(read_chunks(f), Path(tmp), blob.digest, blob.size, f"{self.url}: push")
            try:
                os.link(tmp, final)  # atomic and never replaces: a present blob already has these bytes
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)

    def fetch_blob(self, digest: str, size: int, dest: Path, what: str) -> None:
        p = self._blob(digest)
        try:
            f = open(p, "rb")
        except FileNotFoundError:
            raise PipelineError(f"{self.url}: {what}: blob {digest} missing") from None
        with f:
            try:
                write_verified(read_chunks(f), dest, digest, size, f"{self.url}: {what}")
            except PipelineError as e:
                self._quarantine(p)
                raise PipelineError(f"{e}; moved to {self.root / 'quarantine'}, push the bundle again to repair") from None

    def _quarantine(self, p: Path) -> None:
        # A bad blob would otherwise make every later push skip it as already present.
        (self.root / "quarantine").mkdir(exist_ok=True)
        os.replace(p, self.root / "quarantine" / p.name)

    # -- manifests and tags ------------------------------------------------------------------
    def _init(self) -> None:
        if (self.root / "oci-layout").is_file():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked():
            if (self.root / "oci-layout").is_file():
                return
            foreign = sorted(p.name for p in self.root.iterdir() if p.name not in {".index.lock", "blobs", "index.json"})
            if foreign:
                raise PipelineError(f"{self.root}: holds {foreign[0]} and is not an OCI image layout")
            (self.root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
            if not (self.root / "index.json").exists():
                self._write_index([])
            _atomic_write(self.root / "oci-layout", canonical_json({"imageLayoutVersion": "1.0.0"}).encode())

    @contextmanager
    def _locked(self):
        with open(self.root / ".index.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _entries(self) -> list[dict]:
        path = self.root / "index.json"
        try:
            index = json.loads(path.read_text())
            return [m for m in index["manifests"] if isinstance(m, dict)]
        except FileNotFoundError:
            if not (self.root / "oci-layout").exists():  # not created yet (index.json is written first)
                return []
            if path.exists():  # another process initialised the layout between our two looks
                return self._entries()
            raise PipelineError(f"{self.root}: not an OCI image layout (no index.json)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise PipelineError(f"{path}: not an OCI image index ({type(e).__name__})") from None

    def _write_index(self, entries: list[dict]) -> None:
        entries = sorted(entries, key=lambda m: (m.get("annotations", {}).get(REF_NAME, ""), m["digest"]))
        index = {"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "manifests": entries}
        _atomic_write(self.root / "index.json", canonical_json(index).encode())

    def resolve(self, ref: str) -> str | None:
        if DIGEST_RE.fullmatch(ref):
            return ref if self._blob(ref).is_file() else None
        for m in self._entries():
            if m.get("annotations", {}).get(REF_NAME) == ref:
                return m["digest"]
        return None

    def get_manifest(self, ref: str) -> tuple[bytes, str] | None:
        digest = self.resolve(ref)
        if digest is None:
            return None
        p = self._blob(digest)
        if p.stat().st_size > MAX_MANIFEST:
            raise PipelineError(f"{self.url}:{ref}: manifest {digest} is larger than {MAX_MANIFEST} bytes")
        data = p.read_bytes()
        got = digest_of(data)
        if got != digest:
            self._quarantine(p)
            raise PipelineError(f"{self.url}:{ref}: manifest blob hashes to {got}, not {digest} (tampered)")
        return data, digest

    def put_manifest(self, data: bytes, digest: str, tag: str, immutable: bool) -> None:
        self.put_blob(Blob(digest, len(data), data=data))
        with self._locked():
            entries = self._entries()
            old = [m for m in entries if m.get("annotations", {}).get(REF_NAME) == tag]
            if immutable and old and old[0]["digest"] != digest:
                raise PipelineError(f"{self.url}:{tag}: already holds {old[0]['digest']}, not {digest}; "
                                    "a version id never changes content")
            entries = [m for m in entries if m not in old]
            entry = {"mediaType": MANIFEST_MEDIA_TYPE, "digest": digest, "size": len(data), "annotations": {REF_NAME: tag}}
            kind = json.loads(data).get("artifactType")  # the index mirrors the manifest's own (OCI image-spec)
            entries.append({**entry, "artifactType": kind} if kind else entry)
            self._write_index(entries)

    def tags(self) -> list[str]:
        if not (self.root / "oci-layout").is_file():
            raise PipelineError(f"{self.root}: not an OCI image layout (no oci-layout file)")
        return sorted({m["annotations"][REF_NAME] for m in self._entries() if REF_NAME in m.get("annotations", {})})


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

"""An OCI distribution registry over HTTP, through the oras client (URLs, session, tag paging).

What oras 0.2.43 leaves out is done here: uploads are PATCHed one chunk at a time (never a whole
file in memory), manifests are PUT as our exact bytes and the returned Docker-Content-Digest checked,
and downloads are hashed and sized. Requests are tried once (oras retries with sleeps of up to
minutes); a failed push is simply run again and skips the blobs already there (their bytes read back).
Credentials go only into the Authorization header: never into URLs, messages or logs.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from pathlib import Path

import oras.provider
import requests

from ..errors import PipelineError
from .artifact import (CHUNK, DIGEST_RE, MANIFEST_MEDIA_TYPE, Blob, check_digest, digest_of, read_chunks,
                       write_verified)

LOOPBACK = ("127.0.0.1", "localhost", "[::1]")
USER_ENV, PASSWORD_ENV = "MOSSQUANT_REGISTRY_USER", "MOSSQUANT_REGISTRY_PASSWORD"
MAX_MANIFEST = 4 << 20
TIMEOUT = (10, 300)  # connect, read


def credentials(host: str) -> str | None:
    """base64(user:password) from the environment, else from the docker config's `auths`."""
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    if user or password:
        if not (user and password):
            raise PipelineError(f"{USER_ENV}/{PASSWORD_ENV}: set both or neither")
        return base64.b64encode(f"{user}:{password}".encode()).decode()
    config = Path(os.environ.get("DOCKER_CONFIG") or Path.home() / ".docker") / "config.json"
    try:
        auths = json.loads(config.read_text()).get("auths", {})
    except FileNotFoundError:
        return None
    except (ValueError, AttributeError):
        raise PipelineError(f"{config}: not valid docker config JSON") from None
    for key, entry in auths.items():
        name = key.split("://", 1)[-1].split("/", 1)[0]
        if name == host and isinstance(entry, dict) and entry.get("auth"):
            return entry["auth"]
    return None


class _Client(oras.provider.Registry):
    """oras' registry client with one-shot requests, timeouts and our Authorization header."""

    def __init__(self, host: str, auth: str | None):
        super().__init__(hostname=host, insecure=re.sub(r":\d+$", "", host) in LOOPBACK, auth_backend="basic")
        self._auth = {"Authorization": f"Basic {auth}"} if auth else {}
        self._where = f"oci://{host}"

    def do_request(self, url, method="GET", data=None, headers=None, json=None, stream=False):
        try:
            r = self.session.request(method, url, data=data, json=json, headers={**(headers or {}), **self._auth},
                                     stream=stream, timeout=TIMEOUT, allow_redirects=True)
        except requests.RequestException as e:
            raise PipelineError(f"{self._where}: {method} failed ({type(e).__name__}); is the registry running?") from None
        if r.status_code in (401, 403):
            hint = "credentials refused" if self._auth else f"credentials needed: set {USER_ENV}/{PASSWORD_ENV} or docker login"
            raise PipelineError(f"{self._where}: {r.status_code} on {method}: {hint}")
        return r


def _error(r: requests.Response) -> str:
    try:
        errs = r.json().get("errors") or []
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errs if isinstance(e, dict)) or r.reason
    except ValueError:
        return r.reason


class RemoteRegistry:
    def __init__(self, host: str, repo: str, chunk_size: int = CHUNK):
        self.url = f"oci://{host}/{repo}"
        self.client = _Client(host, credentials(host))
        self.container = self.client.get_container(f"{host}/{repo}")
        self.chunk_size = chunk_size
        self.base = f"{self.client.prefix}://{host}/v2/{self.container.api_prefix}"

    def _fail(self, what: str, r: requests.Response):
        raise PipelineError(f"{self.url}: {what}: HTTP {r.status_code} {_error(r)}")

    # -- blobs -------------------------------------------------------------------------------
    def check_blob(self, digest: str, size: int) -> str:
        """HEAD, then the stored bytes read back and hashed: Distribution's HEAD reports the digest it was
        asked for and the size on disk, so a blob corrupted in its storage passes a HEAD of the same size."""
        url = f"{self.base}/blobs/{check_digest(digest)}"
        r = self.client.do_request(url, "HEAD")
        if r.status_code == 404:
            return "absent"
        if r.status_code != 200:
            self._fail(f"check blob {digest}", r)
        if r.headers.get("Content-Length") != str(size):
            return "corrupt"
        h, n = hashlib.sha256(), 0
        with self.client.do_request(url, "GET", stream=True) as r:
            if r.status_code != 200:
                self._fail(f"read back blob {digest}", r)
            for block in r.iter_content(1 << 20):
                h.update(block)
                n += len(block)
        return "intact" if n == size and "sha256:" + h.hexdigest() == digest else "corrupt"

    def discard_blob(self, digest: str) -> None:
        r = self.client.do_request(f"{self.base}/blobs/{check_digest(digest)}", "DELETE")
        if r.status_code not in (202, 404):
            self._fail(f"delete corrupt blob {digest} (the registry must allow deletes to repair it)", r)

    def put_blob(self, blob: Blob) -> None:
        """POST a session, PATCH chunk by chunk, PUT ?digest= to close it."""
        r = self.client.do_request(f"{self.base}/blobs/uploads/", "POST", headers={"Content-Length": "0"})
        if r.status_code != 202:
            self._fail(f"start upload of {blob.digest}", r)
        location, start, h = self.client._get_location(r, self.container), 0, hashlib.sha256()
        with blob.open() as f:
            for chunk in read_chunks(f, self.chunk_size):
                h.update(chunk)
                headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(chunk)),
                           "Content-Range": f"{start}-{start + len(chunk) - 1}"}
                r = self.client.do_request(location, "PATCH", data=chunk, headers=headers)
                if r.status_code != 202:
                    self._fail(f"upload of {blob.digest}", r)
                location, start = self.client._get_location(r, self.container), start + len(chunk)
        if "sha256:" + h.hexdigest() != blob.digest or start != blob.size:
            raise PipelineError(f"{blob.path}: changed while being pushed (now sha256:{h.hexdigest()}, {start} bytes)")
        sep = "&" if "?" in location else "?"
        r = self.client.do_request(f"{location}{sep}digest={blob.digest}", "PUT", headers={"Content-Length": "0"})
        if r.status_code != 201:
            self._fail(f"finish upload of {blob.digest}", r)

    def fetch_blob(self, digest: str, size: int, dest: Path, what: str) -> None:
        with self.client.do_request(f"{self.base}/blobs/{check_digest(digest)}", "GET", stream=True) as r:
            if r.status_code != 200:
                self._fail(f"{what}: get blob {digest}", r)
            write_verified(r.iter_content(1 << 20), dest, digest, size, f"{self.url}: {what}")

    # -- manifests and tags ------------------------------------------------------------------
    def resolve(self, ref: str) -> str | None:
        r = self.client.do_request(f"{self.base}/manifests/{ref}", "HEAD", headers={"Accept": MANIFEST_MEDIA_TYPE})
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            self._fail(f"resolve {ref}", r)
        return r.headers.get("Docker-Content-Digest")

    def get_manifest(self, ref: str) -> tuple[bytes, str] | None:
        r = self.client.do_request(f"{self.base}/manifests/{ref}", "GET", headers={"Accept": MANIFEST_MEDIA_TYPE})
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            self._fail(f"get manifest {ref}", r)
        data = r.content[: MAX_MANIFEST + 1]
        digest = digest_of(data)
        claimed = r.headers.get("Docker-Content-Digest", digest)
        if len(data) > MAX_MANIFEST or claimed != digest or (DIGEST_RE.fullmatch(ref) and ref != digest):
            raise PipelineError(f"{self.url}:{ref}: manifest hashes to {digest}, registry says {claimed} (tampered)")
        return data, digest

    def put_manifest(self, data: bytes, digest: str, tag: str, immutable: bool) -> None:
        if immutable and (old := self.resolve(tag)) not in (None, digest):
            raise PipelineError(f"{self.url}:{tag}: already holds {old}, not {digest}; a version id never changes content")
        r = self.client.do_request(f"{self.base}/manifests/{tag}", "PUT", data=data,
                                   headers={"Content-Type": MANIFEST_MEDIA_TYPE})
        if r.status_code != 201:
            self._fail(f"put manifest {tag}", r)
        if r.headers.get("Docker-Content-Digest") != digest:
            raise PipelineError(f"{self.url}:{tag}: registry stored {r.headers.get('Docker-Content-Digest')}, "
                                f"not our {digest} (it rewrote the manifest)")

    def tags(self) -> list[str]:
        r = self.client.do_request(f"{self.base}/tags/list", "GET")
        if r.status_code == 404:
            return []
        if r.status_code != 200:
            self._fail("list tags", r)
        return sorted(self.client.get_tags(self.container))

"""A real OCI registry (Debian's docker-registry, CNCF Distribution) for tests, on 127.0.0.1 at a free port.

The binary comes from REGISTRY_BIN or .tools/docker-registry (scripts/install-registry.sh). Missing,
the registry tests skip locally and fail under CI=true. Every request is in the access log, which
the tests read to count uploads the server actually received.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
INSTALLED = ROOT / ".tools" / "docker-registry" / "usr" / "bin" / "docker-registry"


def registry_bin() -> Path:
    path = Path(os.environ.get("REGISTRY_BIN") or INSTALLED)
    if not os.access(path, os.X_OK):
        msg = f"docker-registry not found at {path}; run scripts/install-registry.sh or set REGISTRY_BIN"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RegistryServer:
    def __init__(self, root: Path, users: dict[str, str] | None = None):
        self.root, self.users = Path(root), users
        self.port = _free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.storage = self.root / "storage"
        self.log = self.root / "registry.log"
        self.proc: subprocess.Popen | None = None

    def _config(self) -> str:
        auth = ""
        if self.users:
            import bcrypt  # cost 4: the server checks the hash on every request

            lines = [f"{u}:{bcrypt.hashpw(p.encode(), bcrypt.gensalt(rounds=4)).decode()}" for u, p in self.users.items()]
            (self.root / "htpasswd").write_text("\n".join(lines) + "\n")
            auth = f"auth:\n  htpasswd:\n    realm: test\n    path: {self.root / 'htpasswd'}\n"
        return (
            "version: 0.1\n"
            "log: {level: info, accesslog: {disabled: false}}\n"
            "storage:\n"
            f"  filesystem: {{rootdirectory: {self.storage}}}\n"
            "  delete: {enabled: true}\n"
            "  maintenance: {uploadpurging: {enabled: false}}\n"
            f"http: {{addr: '{self.host}', secret: test-secret}}\n"
            "health: {storagedriver: {enabled: false}}\n" + auth
        )

    def start(self) -> "RegistryServer":
        binary = registry_bin()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "config.yml").write_text(self._config())
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([str(binary), "serve", str(self.root / "config.yml")],
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            try:
                if requests.get(f"http://{self.host}/v2/", timeout=1).status_code in (200, 401):
                    return self
            except requests.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"docker-registry did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def requests_seen(self, method: str, path_part: str) -> int:
        """Access-log lines for `METHOD /v2/...path_part...` (the server's own count)."""
        return sum(1 for line in self.log.read_text().splitlines() if f'"{method} /v2/' in line and path_part in line)

    def blob_data(self, digest: str) -> Path:
        hexd = digest.removeprefix("sha256:")
        return self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexd[:2] / hexd / "data"


@pytest.fixture(scope="module")
def registry_server(tmp_path_factory):
    server = RegistryServer(tmp_path_factory.mktemp("registry")).start()
    yield server
    server.stop()


AUTH_USER, AUTH_PASSWORD = "mossuser", "s3cret-Pa55-word-for-tests"


@pytest.fixture(scope="module")
def auth_registry_server(tmp_path_factory):
    server = RegistryServer(tmp_path_factory.mktemp("registry-auth"), users={AUTH_USER: AUTH_PASSWORD}).start()
    yield server
    server.stop()

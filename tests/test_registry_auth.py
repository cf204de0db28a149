"""Basic auth against a real registry (htpasswd): credentials from the environment or the docker config,
and never in manifests, pulled files, logs or error messages."""
from __future__ import annotations

import base64
import json
import logging
import socket

import pytest

from pipelines.errors import PipelineError
from pipelines.registry.client import open_registry, pull, push
from registry_server import AUTH_PASSWORD, AUTH_USER, auth_registry_server  # noqa: F401  (pytest fixture)
from test_registry import make_bundle, tree


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    monkeypatch.delenv("MOSSQUANT_REGISTRY_USER", raising=False)
    monkeypatch.delenv("MOSSQUANT_REGISTRY_PASSWORD", raising=False)
    caplog.set_level(logging.DEBUG)  # requests/urllib3/oras logs are checked for the password


def assert_secret_absent(*texts):
    b64 = base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode()
    for text in texts:
        assert AUTH_PASSWORD not in text and b64 not in text


def test_without_credentials_a_clear_error(auth_registry_server, tmp_path):
    reg = open_registry(f"oci://{auth_registry_server.host}/moss/noauth")
    with pytest.raises(PipelineError, match="401.*credentials needed: set MOSSQUANT_REGISTRY_USER"):
        push(reg, make_bundle(tmp_path / "bundle"))


def test_wrong_password_refused_without_echoing_it(auth_registry_server, tmp_path, monkeypatch, caplog, capsys):
    monkeypatch.setenv("MOSSQUANT_REGISTRY_USER", AUTH_USER)
    monkeypatch.setenv("MOSSQUANT_REGISTRY_PASSWORD", AUTH_PASSWORD + "-wrong")
    reg = open_registry(f"oci://{auth_registry_server.host}/moss/wrong")
    with pytest.raises(PipelineError, match="credentials refused") as e:
        push(reg, make_bundle(tmp_path / "bundle"))
    out = capsys.readouterr()
    assert AUTH_PASSWORD not in str(e.value) + caplog.text + out.out + out.err


@pytest.mark.parametrize("source", ["env", "docker-config"])
def test_round_trip_with_credentials(auth_registry_server, tmp_path, monkeypatch, caplog, capsys, source):
    host = auth_registry_server.host
    if source == "env":
        monkeypatch.setenv("MOSSQUANT_REGISTRY_USER", AUTH_USER)
        monkeypatch.setenv("MOSSQUANT_REGISTRY_PASSWORD", AUTH_PASSWORD)
    else:
        (tmp_path / "docker").mkdir()
        auth = base64.b64encode(f"{AUTH_USER}:{AUTH_PASSWORD}".encode()).decode()
        (tmp_path / "docker" / "config.json").write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    reg = open_registry(f"oci://{host}/moss/auth-{source}")
    bundle = make_bundle(tmp_path / "bundle")
    result = push(reg, bundle)
    pull(reg, "tiny-rtn4", tmp_path / "pulled")
    assert tree(tmp_path / "pulled") == tree(bundle)

    manifest, _ = reg.get_manifest(result.digest)
    m = json.loads(manifest)
    config = tmp_path / "modelpack-config.json"
    reg.fetch_blob(m["config"]["digest"], m["config"]["size"], config, "config")
    pulled_text = "".join(p.read_bytes().decode("latin-1") for p in (tmp_path / "pulled").iterdir())
    out = capsys.readouterr()
    assert_secret_absent(manifest.decode(), config.read_text(), pulled_text, caplog.text, out.out, out.err, repr(reg))


def test_unreachable_registry_fails_fast_and_clearly(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    reg = open_registry(f"oci://127.0.0.1:{port}/moss/none")
    with pytest.raises(PipelineError, match="is the registry running"):
        push(reg, make_bundle(tmp_path / "bundle"))

"""A real rtn4 bundle of the tiny fixture through the registry and the CLI: pushed, pulled, loaded."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from pipelines.cli import main
from pipelines.loader import load_bundle
from pipelines.registry.client import open_registry, pull, push
from registry_server import registry_server  # noqa: F401  (pytest fixture)
from test_registry import tree


@pytest.fixture(scope="module")
def bundle(rtn4_build):
    return rtn4_build.bundle  # the suite's one rtn4 build of the tiny fixture (tests/conftest.py)


@pytest.fixture(autouse=True)
def no_ambient_credentials(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
    monkeypatch.delenv("MOSSQUANT_REGISTRY_USER", raising=False)
    monkeypatch.delenv("MOSSQUANT_REGISTRY_PASSWORD", raising=False)


def forward(model) -> torch.Tensor:
    ids = torch.arange(4 * (1 + model.config.n_vq)).reshape(1, 4, -1) % 64
    with torch.no_grad():
        return torch.cat([o.float().flatten() for o in model(ids)])


@pytest.mark.parametrize("kind", ["layout", "remote"])
def test_real_bundle_round_trip_loads(bundle, tmp_path, request, kind):
    if kind == "layout":
        reg = open_registry(f"oci-layout:{tmp_path / 'registry'}")
    else:
        reg = open_registry(f"oci://{request.getfixturevalue('registry_server').host}/moss/tiny-rtn4")
    info = json.loads((bundle / "manifest.json").read_text())
    force = info["status"] != "accepted"  # tiny's 4-bit RTN may fail the gate; then only --force pushes it
    result = push(reg, bundle, force=force)
    assert result.tags[0] == info["version"] and ("tiny-rtn4" in result.tags) == (not force)
    assert push(reg, bundle, force=force).uploaded == []

    pull(reg, info["version"], tmp_path / "pulled")
    assert tree(tmp_path / "pulled") == tree(bundle)
    assert torch.equal(forward(load_bundle(tmp_path / "pulled")), forward(load_bundle(bundle)))


def test_cli_push_ls_pull(bundle, tmp_path, capsys):
    url = f"oci-layout:{tmp_path / 'registry'}"
    info = json.loads((bundle / "manifest.json").read_text())
    if info["status"] != "accepted":
        with pytest.raises(SystemExit) as e:
            main(["push", str(bundle), url])
        assert e.value.code == 2 and "--force" in capsys.readouterr().err
    main(["push", str(bundle), url, "--force"])
    assert info["version"] in capsys.readouterr().out

    main(["ls", url])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith(info["version"] + "\tsha256:") for line in lines)

    main(["pull", f"{url}:{info['version']}", str(tmp_path / "pulled")])
    assert tree(tmp_path / "pulled") == tree(bundle)
    with pytest.raises(SystemExit) as e:
        main(["pull", f"{url}:no-such-tag", str(tmp_path / "other")])
    assert e.value.code == 2 and "nothing tagged 'no-such-tag'" in capsys.readouterr().err


def test_cli_push_newest_bundle_of_a_profile(bundle, tmp_path, capsys, monkeypatch):
    import pipelines.api
    from pipelines import manifest

    # The newest by the recorded build order (index.json), not by mtime: an older version built
    # afterwards is recorded later, so it is "newest" only when its record says so.
    art = tmp_path / "art"
    shutil.copytree(bundle, art / "tiny" / "rtn4" / bundle.name)
    older = art / "tiny" / "rtn4" / "v1-000000000000"
    shutil.copytree(bundle, older)
    manifest.record(art / "tiny" / "rtn4", bundle.name)
    manifest.record(art / "tiny" / "rtn4", older.name)
    manifest.record(art / "tiny" / "rtn4", bundle.name)  # rebuilt last: it moves to the end
    monkeypatch.setattr(pipelines.api, "ARTIFACTS", art)
    bundle = art / "tiny" / "rtn4" / bundle.name
    url = f"oci-layout:{tmp_path / 'registry'}"
    main(["push", "--newest", "tiny/rtn4", url, "--force"])
    assert f"pushed {bundle} to {url}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["push", "--newest", "tiny/awq4", url])
    assert e.value.code == 2 and "tiny/awq4: no bundle under artifacts/tiny/awq4/" in capsys.readouterr().err

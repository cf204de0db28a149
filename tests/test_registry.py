"""Bundles as OCI artifacts: the same round trip and failure cases on the local layout and a real registry."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipelines.checkpoint import canonical_json, sha256_file
from pipelines.errors import PipelineError
from pipelines.registry.client import list_tags, open_registry, pull, push, split_ref
from pipelines.registry.artifact import ARTIFACT_TYPE, Blob, CONFIG_MEDIA_TYPE, FILEPATH, WEIGHT, WEIGHT_CONFIG
from registry_server import auth_registry_server, registry_server  # noqa: F401  (pytest fixtures)

from modelpack_client import ModelPackClient
from modelpack_client.constants import MODEL_LAYER_MEDIA_TYPES
from modelpack_client.schema import CONFIG_SCHEMA  # the CNCF schema, as the ModelPack client ships it


@pytest.fixture(autouse=True)
def no_ambient_credentials(monkeypatch, tmp_path):
    # Never pick up the developer's docker login or registry env.
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))
    monkeypatch.delenv("MOSSQUANT_REGISTRY_USER", raising=False)
    monkeypatch.delenv("MOSSQUANT_REGISTRY_PASSWORD", raising=False)


def make_bundle(folder: Path, seed: int = 0, status: str = "accepted", version: str | None = None,
                model: str = "tiny", profile: str = "rtn4") -> Path:
    """A synthetic bundle per the contract: two shards + index, config.json, recipe.yaml, manifest.json."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    shards = {"model-00001-of-00002.safetensors": {"a.qweight": torch.randint(-2**31, 2**31 - 1, (256, 160), generator=g,
                                                                               dtype=torch.int32)},
              "model-00002-of-00002.safetensors": {"a.scales": torch.randn(64, 256, generator=g).half()}}
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
    weight_map = {k: name for name, ts in shards.items() for k in ts}
    (folder / "model.safetensors.index.json").write_text(canonical_json({"weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(canonical_json(
        {"model_type": "moss_tts_delay", "quantization_config": {"quant_method": "rtn", "bits": 4}}, indent=2))
    (folder / "recipe.yaml").write_text(f"name: {profile}\nbits: 4\n")
    files = {p.name: {"sha256": sha256_file(p), "size": p.stat().st_size} for p in sorted(folder.iterdir())}
    content = hashlib.sha256(canonical_json(files).encode()).hexdigest()[:12]
    manifest = {"schema": "moss-quant/manifest/v1", "model": model, "profile": profile,
                "version": version or f"v1-{content}", "status": status, "gate": {"checks": []},
                "source": {"repo": "OpenMOSS-Team/MOSS-TTSD-v1.0", "revision": "0" * 40, "files": {}},
                "files": files, "bits_per_weight": {"effective": 4.25}}
    (folder / "manifest.json").write_text(canonical_json(manifest, indent=2))
    return folder


def tree(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def repo_name(request) -> str:
    return "moss/" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")


@pytest.fixture(params=["layout", "remote"])
def backend(request, tmp_path):
    """(registry, server or None): the embedded layout and a real docker-registry, same tests."""
    if request.param == "layout":
        return open_registry(f"oci-layout:{tmp_path / 'registry'}"), None
    server = request.getfixturevalue("registry_server")
    reg = open_registry(f"oci://{server.host}/{repo_name(request)}")
    reg.chunk_size = 64 << 10  # several PATCHes per shard
    return reg, server


def corrupt_blob(backend, digest: str, how: str) -> None:
    reg, server = backend
    path = server.blob_data(digest) if server else reg.root / "blobs" / "sha256" / digest[7:]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncate" else data[:100] + bytes([data[100] ^ 1]) + data[101:])


def test_round_trip(backend, tmp_path):
    reg, server = backend
    bundle = make_bundle(tmp_path / "bundle")
    version = json.loads((bundle / "manifest.json").read_text())["version"]

    first = push(reg, bundle)
    assert first.tags == [version, "tiny-rtn4"]
    assert len(first.uploaded) == 7 and not first.skipped  # config + 6 files
    assert list_tags(reg) == {version: first.digest, "tiny-rtn4": first.digest}

    pull(reg, version, tmp_path / "pulled")
    assert tree(tmp_path / "pulled") == tree(bundle)
    pull(reg, first.digest, tmp_path / "by-digest")
    assert tree(tmp_path / "by-digest") == tree(bundle)

    posts = server.requests_seen("POST", "/blobs/uploads/") if server else None
    again = push(reg, bundle)
    assert again.digest == first.digest and again.uploaded == [] and len(again.skipped) == 7
    if server:
        assert server.requests_seen("POST", "/blobs/uploads/") == posts == 7  # the server saw each blob once
        assert server.requests_seen("PATCH", "/blobs/uploads/") > 7  # chunked, not one body per file


def test_manifest_is_deterministic_modelpack(backend, tmp_path):
    reg, _ = backend
    bundle = make_bundle(tmp_path / "a" / "bundle")
    moved = shutil.copytree(bundle, tmp_path / "elsewhere" / "other-name")  # path must not matter
    digest = push(reg, bundle).digest
    assert push(reg, moved).digest == digest
    assert push(open_registry(f"oci-layout:{tmp_path / 'second'}"), moved).digest == digest

    data, got = reg.get_manifest("tiny-rtn4")
    assert got == digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert data == canonical_json(json.loads(data)).encode()  # sent as our canonical bytes
    m = json.loads(data)
    assert m["artifactType"] == ARTIFACT_TYPE and m["config"]["mediaType"] == CONFIG_MEDIA_TYPE
    by_path = {layer["annotations"][FILEPATH]: layer for layer in m["layers"]}
    assert set(by_path) == set(tree(bundle))
    for rel, layer in by_path.items():
        assert layer["digest"] == "sha256:" + sha256_file(bundle / rel)  # raw layers: blob = the file
    assert {by_path[r]["mediaType"] for r in by_path if r.endswith(".safetensors")} == {WEIGHT}
    assert {by_path[r]["mediaType"] for r in ("config.json", "manifest.json", "recipe.yaml",
                                              "model.safetensors.index.json")} == {WEIGHT_CONFIG}
    assert {x["mediaType"] for x in m["layers"]} <= MODEL_LAYER_MEDIA_TYPES  # ModelPack's own types only
    ann = m["annotations"]
    assert ann["org.opencontainers.image.version"] == json.loads((bundle / "manifest.json").read_text())["version"]
    assert ann["org.opencontainers.image.revision"] == "0" * 40
    assert "created" not in data.decode() and str(tmp_path) not in data.decode()

    config_path = tmp_path / "config.json"
    reg.fetch_blob(m["config"]["digest"], m["config"]["size"], config_path, "config")
    config = json.loads(config_path.read_text())
    assert config["modelfs"] == {"type": "layers", "diffIds": [layer["digest"] for layer in m["layers"]]}
    assert config["config"] == {"format": "safetensors", "quantization": "rtn", "precision": "int4"}


def test_modelpack_config_validates_against_the_cncf_schema(tmp_path):
    import jsonschema

    from pipelines.registry.artifact import build_artifact

    art = build_artifact(make_bundle(tmp_path / "bundle"))
    config = json.loads(art.blobs[0].data)
    jsonschema.Draft202012Validator(CONFIG_SCHEMA).validate(config)
    config["modelfs"]["diff_ids"] = config["modelfs"].pop("diffIds")  # what moss-quant wrote before
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(CONFIG_SCHEMA).validate(config)


def test_modelpack_client_pulls_what_push_wrote(registry_server, tmp_path, request):
    """The ModelPack client (PyPI modelpack-client) checks the manifest's layer types, the config against
    the schema, each layer's digest and diffId, and writes files at their org.cncf.model.filepath."""
    bundle = make_bundle(tmp_path / "bundle")
    (bundle / "report").mkdir()
    (bundle / "report" / "sample.wav").write_bytes(b"RIFF" + bytes(60))  # a doc layer in a subfolder
    info = json.loads((bundle / "manifest.json").read_text())
    info["files"]["report/sample.wav"] = {"sha256": sha256_file(bundle / "report" / "sample.wav"), "size": 64}
    (bundle / "manifest.json").write_text(canonical_json(info, indent=2))
    repo = repo_name(request)
    pushed = push(open_registry(f"oci://{registry_server.host}/{repo}"), bundle)
    got = ModelPackClient(insecure=True).pull(f"{registry_server.host}/{repo}:tiny-rtn4", tmp_path / "pulled")
    assert got.manifest["config"]["digest"] == json.loads(
        open_registry(f"oci://{registry_server.host}/{repo}").get_manifest(pushed.digest)[0])["config"]["digest"]
    assert tree(tmp_path / "pulled") == tree(bundle)


def test_repush_repairs_a_corrupt_blob_in_the_layout(tmp_path):
    reg = open_registry(f"oci-layout:{tmp_path / 'registry'}")
    bundle = make_bundle(tmp_path / "bundle")
    push(reg, bundle)
    shard = "sha256:" + sha256_file(bundle / "model-00001-of-00002.safetensors")
    corrupt_blob((reg, None), shard, "flip")  # same size: a size check would skip it
    again = push(reg, bundle)
    assert again.repaired == [shard] and shard in again.uploaded and len(again.skipped) == 6
    pull(reg, "tiny-rtn4", tmp_path / "pulled")
    assert tree(tmp_path / "pulled") == tree(bundle)


def test_repush_names_a_corrupt_blob_distribution_will_not_replace(registry_server, tmp_path, request):
    """CNCF Distribution keeps a stored blob's bytes after DELETE and re-upload (content-addressed data is
    never overwritten), so the push must not tag a manifest over it: one clear line, no tag moved."""
    reg = open_registry(f"oci://{registry_server.host}/{repo_name(request)}")
    bundle = make_bundle(tmp_path / "bundle", seed=103)
    first = push(reg, bundle)
    shard = "sha256:" + sha256_file(bundle / "model-00001-of-00002.safetensors")
    corrupt_blob((reg, registry_server), shard, "flip")
    newer = make_bundle(tmp_path / "newer", seed=103, version="v2-newer")  # same shard, new version
    with pytest.raises(PipelineError, match=f"blob {shard} is stored corrupt.*no tag was written"):
        push(reg, newer)
    assert reg.resolve("v2-newer") is None and reg.resolve("tiny-rtn4") == first.digest
    assert registry_server.requests_seen("DELETE", "/blobs/") >= 1


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_tampered_blob_detected_and_nothing_written(backend, tmp_path, how):
    reg, _ = backend
    # Own content: the server keeps one copy of a blob for all repos, and this test breaks it.
    bundle = make_bundle(tmp_path / "bundle", seed={"flip": 101, "truncate": 102}[how])
    push(reg, bundle)
    corrupt_blob(backend, "sha256:" + sha256_file(bundle / "model-00001-of-00002.safetensors"), how)
    with pytest.raises(PipelineError, match="(tampered|truncated).*nothing was written") as e:
        pull(reg, "tiny-rtn4", tmp_path / "out" / "dest")
    assert "model-00001-of-00002.safetensors" in str(e.value)
    assert list((tmp_path / "out").iterdir()) == []  # no dest, no temp folder


class DropsHalfway(Blob):
    """A blob whose source dies (like a dropped connection) after half its bytes were sent."""

    def open(self):
        blob, f = self, super().open()

        class Reader:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def read(self, n):
                if f.tell() >= blob.size // 2:
                    raise ConnectionResetError("simulated network drop")
                return f.read(min(n, 16 << 10))

        return Reader()


def test_interrupted_push_completes_on_rerun(backend, tmp_path, monkeypatch):
    reg, server = backend
    bundle = make_bundle(tmp_path / "bundle")
    real_put, sent = reg.put_blob, []

    def put_dies_in_third_blob(blob):
        if len(sent) == 2:
            real_put(DropsHalfway(**vars(blob)))
        real_put(blob)
        sent.append(blob.digest)

    monkeypatch.setattr(reg, "put_blob", put_dies_in_third_blob)
    with pytest.raises(ConnectionResetError):
        push(reg, bundle)
    monkeypatch.undo()
    assert reg.resolve("tiny-rtn4") is None  # no tag points at a half-pushed bundle
    if server is None:
        assert not list((reg.root / "blobs" / "sha256").glob(".upload-*"))  # no partial blob left
    else:
        assert server.requests_seen("PATCH", "/blobs/uploads/") > 0

    result = push(reg, bundle)
    assert sorted(result.skipped) == sorted(sent) and len(result.uploaded) == 7 - len(sent)
    pull(reg, "tiny-rtn4", tmp_path / "pulled")
    assert tree(tmp_path / "pulled") == tree(bundle)


def test_rejected_bundle_needs_force_and_never_moves_profile_tag(backend, tmp_path):
    reg, _ = backend
    bundle = make_bundle(tmp_path / "bundle", status="rejected")
    with pytest.raises(PipelineError, match="status is 'rejected'.*--force"):
        push(reg, bundle)
    assert reg.resolve("tiny-rtn4") is None
    result = push(reg, bundle, force=True)
    assert result.tags == [json.loads((bundle / "manifest.json").read_text())["version"]]
    assert list_tags(reg) == {result.tags[0]: result.digest}


def test_existing_version_with_other_content_refused(backend, tmp_path):
    reg, _ = backend
    first = push(reg, make_bundle(tmp_path / "a", seed=0, version="v1-000000000000"))
    with pytest.raises(PipelineError, match="v1-000000000000: already holds .*never changes content"):
        push(reg, make_bundle(tmp_path / "b", seed=1, version="v1-000000000000"))
    assert list_tags(reg) == {"v1-000000000000": first.digest, "tiny-rtn4": first.digest}


def test_bundle_changed_after_writing_refused(backend, tmp_path):
    reg, _ = backend
    bundle = make_bundle(tmp_path / "bundle")
    (bundle / "recipe.yaml").write_text("name: rtn4\nbits: 3\n")
    with pytest.raises(PipelineError, match=r"recipe.yaml: content does not match manifest.json"):
        push(reg, bundle)
    (bundle / "extra.txt").write_text("x")
    with pytest.raises(PipelineError, match="extra.txt: not listed"):
        push(reg, bundle)


def test_pull_refuses_nonempty_destination_and_unknown_tag(tmp_path):
    reg = open_registry(f"oci-layout:{tmp_path / 'registry'}")
    push(reg, make_bundle(tmp_path / "bundle"))
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "keep.txt").write_text("mine")
    with pytest.raises(PipelineError, match="not an empty folder"):
        pull(reg, "tiny-rtn4", tmp_path / "dest")
    with pytest.raises(PipelineError, match="nothing tagged 'tiny-awq4'"):
        pull(reg, "tiny-awq4", tmp_path / "new")
    assert (tmp_path / "dest" / "keep.txt").read_text() == "mine" and not (tmp_path / "new").exists()


def test_pull_refuses_paths_escaping_destination(tmp_path):
    reg = open_registry(f"oci-layout:{tmp_path / 'registry'}")
    push(reg, make_bundle(tmp_path / "bundle"))
    m = json.loads(reg.get_manifest("tiny-rtn4")[0])
    m["layers"][0]["annotations"][FILEPATH] = "../escaped.safetensors"
    data = canonical_json(m).encode()
    reg.put_manifest(data, "sha256:" + hashlib.sha256(data).hexdigest(), "evil", immutable=False)
    with pytest.raises(PipelineError, match="unsafe"):
        pull(reg, "evil", tmp_path / "out" / "dest")
    assert not (tmp_path / "out" / "escaped.safetensors").exists()


def test_layout_is_a_standard_oci_image_layout(tmp_path):
    root = tmp_path / "registry"
    reg = open_registry(f"oci-layout:{root}")
    result = push(reg, make_bundle(tmp_path / "bundle"))
    assert json.loads((root / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((root / "index.json").read_text())
    refs = {m["annotations"]["org.opencontainers.image.ref.name"]: m["digest"] for m in index["manifests"]}
    assert set(refs.values()) == {result.digest} and "tiny-rtn4" in refs
    for blob in (root / "blobs" / "sha256").iterdir():
        assert blob.name == sha256_file(blob)  # every file is addressed by its content
    from oras.layout.layout import NewLayout  # an independent reader validates the layout

    assert len(NewLayout(str(root)).get_ordered_blobs("tiny-rtn4")) == 8  # manifest, config, 6 files


def test_refs():
    assert split_ref("oci-layout:artifacts/registry:tiny-rtn4") == ("oci-layout:artifacts/registry", "tiny-rtn4")
    assert split_ref("oci://127.0.0.1:5000/moss/q:v1-abc") == ("oci://127.0.0.1:5000/moss/q", "v1-abc")
    assert split_ref("oci://h:5/r@sha256:" + "a" * 64) == ("oci://h:5/r", "sha256:" + "a" * 64)
    assert split_ref("tiny-rtn4") == ("oci-layout:artifacts/registry", "tiny-rtn4")
    for bad in ["oci://h:5/r", "foo/bar:x", "oci://h:5/r@sha256:xyz", "oci://h:5/r:bad/tag:"]:
        with pytest.raises(PipelineError):
            split_ref(bad)
    with pytest.raises(PipelineError, match="credentials in the URL") as e:
        open_registry("oci://user:hunter2@127.0.0.1:5000/repo")
    assert "hunter2" not in str(e.value)


def test_layout_concurrent_pushes_keep_every_tag(tmp_path):
    """index.json is read-modified-written under an flock: parallel pushes lose no tag."""
    from concurrent.futures import ThreadPoolExecutor

    bundles = [make_bundle(tmp_path / f"b{i}", seed=i, model=f"m{i}") for i in range(8)]

    def push_one(b):
        return push(open_registry(f"oci-layout:{tmp_path / 'registry'}"), b)  # own handle, like another process

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(push_one, bundles))
    tags = list_tags(open_registry(f"oci-layout:{tmp_path / 'registry'}"))
    assert tags == {t: r.digest for r in results for t in r.tags}
    assert len(tags) == 16

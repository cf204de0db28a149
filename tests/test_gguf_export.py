"""Bundles as first-class moss-tts-delay GGUFs (issue 20): every tensor read back by the gguf
package equals our own dequantization, bit for bit where the mapping is exact."""
import json
import subprocess
import sys

import pytest
import torch

from pipelines.source import ROOT

gguf = pytest.importorskip("gguf")


def export(bundle, dest, *flags):
    r = subprocess.run([sys.executable, "-m", "pipelines", "export-gguf", str(bundle), str(dest), "--model", "tiny", *flags],
                       capture_output=True, text=True, cwd=ROOT)
    return r


def check_round_trip(bundle, gguf_path, want_linear_type):
    """What llama.cpp would compute from the file is what our loader computes from the bundle."""
    from pipelines.gguf_export import ARCH, gguf_name
    from pipelines.loader import bundle_view

    view, config = bundle_view(bundle)
    reader = gguf.GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    names = {gguf_name(n): n for n in view.names()}
    assert set(tensors) == set(names)  # no extra tensor: the fork's loader refuses one
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert fields["general.architecture"] == ARCH and fields[f"{ARCH}.n_vq"] == 32
    assert fields[f"{ARCH}.block_count"] == config["language_config"]["num_hidden_layers"]
    assert fields[f"{ARCH}.audio_pad_code"] == config["audio_pad_code"]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config["language_config"]["vocab_size"]
    for gname, t in tensors.items():
        name = names[gname]
        got = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        ours = view(name).float()
        assert tuple(got.shape) == tuple(ours.shape), gname
        assert torch.equal(got, ours), f"{gname} ({t.tensor_type.name}) differs from our dequantization"
        if name.removesuffix(".weight") in view.packed:
            assert t.tensor_type.name == want_linear_type, gname
        elif ours.dim() == 1:
            assert t.tensor_type.name == "F32"
    return reader


def test_rtn4_exports_as_q5_0_bit_exact(rtn4_build, tmp_path):
    r = export(rtn4_build.bundle, tmp_path / "rtn4.gguf")
    assert r.returncode == 0, r.stderr
    assert "not bit-exact" not in r.stdout
    check_round_trip(rtn4_build.bundle, tmp_path / "rtn4.gguf", "Q5_0")


def test_symmetric_3bit_exports_as_q4_0(tmp_path):
    from pipelines.api import build

    ctx = build("rtn4", "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "bundles",
                overrides={"quantize": {"bits": 3, "sym": True}})
    assert export(ctx.bundle, tmp_path / "q3.gguf").returncode == 0
    check_round_trip(ctx.bundle, tmp_path / "q3.gguf", "Q4_0")


def test_q4_1_and_q8_0_tables_are_labelled_inexact(rtn4_build, tmp_path):
    r = export(rtn4_build.bundle, tmp_path / "x.gguf", "--linear", "Q4_1", "--embeddings", "Q8_0")
    assert r.returncode == 0, r.stderr
    assert "not bit-exact" in r.stdout and "bits per weight" in r.stdout


def test_bad_input_is_one_line_and_writes_nothing(rtn4_build, tmp_path):
    from pipelines.api import build

    r = export(rtn4_build.bundle, tmp_path / "y.gguf", "--linear", "Q4_0")  # 4-bit asymmetric does not fit Q4_0
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "Q4_0 cannot hold this 4-bit grid exactly" in r.stderr and not (tmp_path / "y.gguf").exists()
    assert not list(tmp_path.glob(".y.gguf.tmp-*"))
    codec = build("codec-fp8", "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "codec")
    r = export(codec.bundle, tmp_path / "c.gguf")
    assert r.returncode == 2 and "a moss-tts-delay GGUF is made from a generator bundle" in r.stderr
    assert not (tmp_path / "c.gguf").exists()


def test_a_profile_can_list_the_gguf_stage(tmp_path):
    import yaml

    from pipelines.api import build
    from pipelines.profile import profile_path

    data = yaml.safe_load(profile_path("rtn4").read_text())
    stages = dict(data["stages"])
    export_stage = stages.pop("export")
    data["stages"] = {**stages, "gguf": {"linear": "exact", "heads": "Q8_0"}, "export": export_stage}
    (tmp_path / "rtn4-gguf.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    ctx = build(str(tmp_path / "rtn4-gguf.yaml"), "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "b")
    m = json.loads((ctx.bundle / "manifest.json").read_text())
    assert "model.gguf" in m["files"] and m["bits_per_weight"]["gguf"]["types"]["Q5_0"] == 28
    assert m["bits_per_weight"]["gguf"]["effective"] == pytest.approx(
        8 * (ctx.bundle / "model.gguf").stat().st_size / m["bits_per_weight"]["source_params"], abs=1e-6)
    assert m["gguf"]["inexact"] and all(n.startswith("output") for n in m["gguf"]["inexact"])  # the Q8_0 heads


def test_the_gguf_pushes_as_a_docker_model_and_a_modelpack_weight(tmp_path):
    """One blob, two manifests: a ModelPack weight layer, and a Docker model artifact (`<version>-gguf`)
    whose config and layer types are the ones llama.cpp's -dr and Docker Model Runner pick."""
    import hashlib

    import yaml

    from pipelines.api import build
    from pipelines.profile import profile_path
    from pipelines.registry.artifact import DOCKER_MODEL_CONFIG, GGUF, WEIGHT
    from pipelines.registry.client import open_registry, pull, push

    data = yaml.safe_load(profile_path("rtn4").read_text())
    stages = dict(data["stages"])
    # rtn4 without its free-running checks (which reject it on tiny): a bundle whose verdict lets it move its tags
    stages.pop("freerun")
    stages["gate"] = {b: {k: v for k, v in stages["gate"][b].items() if not k.startswith("free.")} for b in ("max", "min")}
    data["models"]["tiny"].pop("freerun")
    data["stages"] = {**{k: v for k, v in stages.items() if k != "export"}, "gguf": {}, "export": stages["export"]}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    ctx = build(str(tmp_path / "p.yaml"), "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "b")
    reg = open_registry(f"oci-layout:{tmp_path / 'reg'}")
    result = push(reg, ctx.bundle)
    version = json.loads((ctx.bundle / "manifest.json").read_text())["version"]
    assert result.tags == [version, "tiny-rtn4", f"{version}-gguf", "tiny-rtn4-gguf"]
    want = "sha256:" + hashlib.sha256((ctx.bundle / "model.gguf").read_bytes()).hexdigest()

    raw, _ = reg.get_manifest(result.digest)
    (layer,) = [x for x in json.loads(raw)["layers"] if x["annotations"]["org.cncf.model.filepath"] == "model.gguf"]
    assert layer["mediaType"] == WEIGHT and layer["digest"] == want
    docker, _ = reg.get_manifest("tiny-rtn4-gguf")
    docker = json.loads(docker)
    assert docker["config"]["mediaType"] == DOCKER_MODEL_CONFIG and "artifactType" not in docker
    assert [(x["mediaType"], x["digest"]) for x in docker["layers"]] == [(GGUF, want)]
    cfg_path = tmp_path / "docker-config.json"
    reg.fetch_blob(docker["config"]["digest"], docker["config"]["size"], cfg_path, "config")
    cfg = json.loads(cfg_path.read_text())
    assert cfg["config"]["format"] == "gguf" and cfg["rootfs"] == {"type": "layers", "diff_ids": [want]}
    assert push(reg, ctx.bundle).uploaded == []  # the second manifest costs no second upload

    pull(reg, result.digest, tmp_path / "pulled")
    assert (tmp_path / "pulled" / "model.gguf").read_bytes() == (ctx.bundle / "model.gguf").read_bytes()

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pipelines.manifest import verify as verify_bundle
from pipelines.checkpoint import Checkpoint
from pipelines.api import build
from pipelines.errors import PipelineError
from pipelines.loader import load_bundle, load_source


def _manifest(ctx):
    return json.loads((ctx.bundle / "manifest.json").read_text())


def test_rtn4_bundle_layout_and_manifest(rtn4_build):
    b = rtn4_build.bundle
    m = _manifest(rtn4_build)
    assert {"config.json", "recipe.yaml", "model.safetensors"} <= set(m["files"])
    for key in ("profile", "version", "source", "stages", "environment", "seed", "files", "tensors",
                "bits_per_weight", "protected", "status"):
        assert key in m
    assert m["version"] == b.name and m["profile"] == "rtn4"
    checks = m["gate"]["checks"]
    assert m["status"] == ("accepted" if all(c["passed"] for c in checks) else "rejected")
    assert all(c["passed"] for c in checks if not c["metric"].startswith("free."))  # teacher-forced: a 4-bit pass
    assert m["source"]["files"]["config.json"] and m["source"]["revision"] == "fixture-v2"
    qc = json.loads((b / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "auto-round" and qc["packing_format"] == "auto_round:auto_gptq"
    assert (qc["bits"], qc["group_size"], qc["sym"]) == (4, 128, False)
    with safe_open(b / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    q = "language_model.layers.0.self_attn.q_proj"
    assert {q + ".qweight", q + ".qzeros", q + ".scales"} <= keys and q + ".weight" not in keys
    assert "lm_heads.0.weight" in keys and "emb_ext.3.weight" in keys
    assert "lm_heads.0.weight" in m["protected"] and m["tensors"][q + ".weight"]["bits"] == 4
    assert len(m["protected"]) == 111 - 28  # every non-Linear tensor of the 4-layer fixture
    verify_bundle(b)


def test_effective_bits_per_weight_equals_a_recount_from_disk(rtn4_build, tiny_path):
    b = rtn4_build.bundle
    bpw = _manifest(rtn4_build)["bits_per_weight"]
    params = Checkpoint(tiny_path).num_params()
    disk_bits = 8 * sum(p.stat().st_size for p in b.glob("*.safetensors"))
    assert bpw["source_params"] == params
    assert bpw["effective"] == round(disk_bits / params, 6)
    # backbone linears at 4-bit g128 with fp16 scales and packed 4-bit zeros: 4 + (16 + 4) / 128
    assert bpw["quantized_linear"] == pytest.approx(4 + 20 / 128)
    comps = bpw["components"]
    assert comps["embeddings"]["bpw"] == comps["heads"]["bpw"] == comps["norms"]["bpw"] == 16
    assert sum(c["bits"] for c in comps.values()) + bpw["header_bits"] == disk_bits


def test_bundle_loads_back_close_to_the_bf16_source(rtn4_build, tiny_path):
    src = load_source(tiny_path, dtype=torch.float32)
    q = load_bundle(rtn4_build.bundle, dtype=torch.float32)
    ids = torch.randint(0, 60, (2, 16, 33))
    ref, got = src(ids), q(ids)
    for r, g in zip(ref, got):
        assert torch.equal(torch.isinf(r), torch.isinf(g))  # the audio pad code stays masked
        r, g = r.masked_fill(torch.isinf(r), 0), g.masked_fill(torch.isinf(g), 0)
        rel = ((g - r).norm() / r.norm()).item()
        assert 0 < rel < 0.25  # quantized, but the same model
    # the packed weights dequantize to a 16-level grid per group
    w = q.language_model.layers[1].mlp.up_proj.weight[0, :128]
    assert len(torch.unique(w)) <= 16


def test_second_run_reuses_the_stage_cache_and_the_version(rtn4_build, capsys):
    root = rtn4_build.cache_root
    again = build("rtn4", "tiny", cache_root=root, bundle_root=rtn4_build.bundle.parent)
    err = capsys.readouterr().err
    assert "stage quantize: cached" in err and "stage evaluate: cached" in err
    assert again.bundle == rtn4_build.bundle
    verify_bundle(again.bundle)


def test_version_ids_follow_the_recipe(tmp_path, rtn4_build, monkeypatch):
    import pipelines.profile as profile

    src = profile.profile_path("rtn4").read_text().replace("group_size: 128", "group_size: 64")
    (tmp_path / "rtn4g64.yaml").write_text(src)
    ctx = build(str(tmp_path / "rtn4g64.yaml"), "tiny", cache_root=rtn4_build.cache_root,
                bundle_root=tmp_path / "bundles")
    assert ctx.bundle.name != rtn4_build.bundle.name
    assert _manifest(ctx)["bits_per_weight"]["quantized_linear"] == pytest.approx(4 + 20 / 64)


def _bad_snapshot(tiny_path, tmp_path, monkeypatch, mutate):
    snap = tmp_path / "snap"
    shutil.copytree(tiny_path, snap)
    mutate(snap)
    # a user-pinned copy: pin the mutated snapshot so only the content check can refuse it
    import pipelines.source as source

    configs = tmp_path / "configs"
    shutil.copytree(source.CONFIGS, configs)
    monkeypatch.setattr(source, "CONFIGS", configs)
    source.pin("tiny", snap)
    return snap


def test_nan_weight_is_named_and_nothing_partial_is_left(tiny_path, tmp_path, monkeypatch):
    name = "language_model.layers.2.mlp.down_proj.weight"

    def poison(snap):
        shard = json.loads((snap / "model.safetensors.index.json").read_text())["weight_map"][name]
        tensors = load_file(snap / shard)
        tensors[name][3, 7] = float("nan")
        save_file(tensors, snap / shard, {"format": "pt"})

    snap = _bad_snapshot(tiny_path, tmp_path, monkeypatch, poison)
    with pytest.raises(PipelineError, match=rf"tensor {name} contains NaN or Inf"):
        build("rtn4", "tiny", model_path=snap, cache_root=tmp_path / "cache", bundle_root=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").rglob("*.tmp-*"))


def test_truncated_shard_is_named(tiny_path, tmp_path, monkeypatch):
    def truncate(snap):
        shard = sorted(snap.glob("model-*.safetensors"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    snap = _bad_snapshot(tiny_path, tmp_path, monkeypatch, truncate)
    with pytest.raises(PipelineError, match=r"model-00001-of-00003.safetensors: unreadable safetensors shard"):
        build("rtn4", "tiny", model_path=snap, cache_root=tmp_path / "cache", bundle_root=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_interrupted_run_resumes_at_the_unfinished_stage(tmp_path, monkeypatch, capsys):
    import dataclasses

    from pipelines.pipeline import STAGES

    def boom(*a, **k):
        raise KeyboardInterrupt

    real = STAGES["evaluate"]
    monkeypatch.setitem(STAGES, "evaluate", dataclasses.replace(real, run={"generator": boom}))
    with pytest.raises(KeyboardInterrupt):
        build("rtn4", "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").rglob("*.tmp-*"))
    monkeypatch.setitem(STAGES, "evaluate", real)
    capsys.readouterr()
    ctx = build("rtn4", "tiny", cache_root=tmp_path / "cache", bundle_root=tmp_path / "out")
    err = capsys.readouterr().err
    assert "stage quantize: cached" in err and "stage evaluate: running" in err
    verify_bundle(ctx.bundle)


def test_versions_are_never_overwritten(rtn4_build, tmp_path):
    from pipelines.export import write_bundle

    def other(tmp):
        (tmp / "manifest.json").write_text("{}")

    with pytest.raises(PipelineError, match="versions are never overwritten"):
        write_bundle(rtn4_build.bundle, other)
    verify_bundle(rtn4_build.bundle)

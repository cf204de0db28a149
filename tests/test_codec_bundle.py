"""codec-fp8 end to end on the tiny codec: decode-only FP8 bundle, loader, validation, gate, bad input."""
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors import safe_open

from pipelines.export import safetensors_layout
from pipelines.checkpoint import Checkpoint
from pipelines.api import build
from pipelines.codec_eval import load_validation_set, parity_metrics, read_wav
from pipelines.loader import load_bundle as load_codec_bundle
from pipelines.models.moss_audio_tokenizer import read_config, source_decoder
from pipelines.codec_fixtures import write_codec_fixture
from pipelines.errors import PipelineError
from pipelines.loader import load_bundle
from pipelines.models.moss_audio_tokenizer import decoder_linear_names
from pipelines.profile import profile_path

GATE = yaml.safe_load(profile_path("codec-fp8").read_text())["stages"]["gate"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_codec_fixture("codec-tiny", tmp_path_factory.mktemp("src") / "codec-tiny")


@pytest.fixture(scope="module")
def built(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    ctx = build("codec-fp8", "codec-tiny", model_path=tiny, cache_root=root / "cache", bundle_root=root / "bundles")
    return ctx.bundle, root


def manifest(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def stored(bundle):
    out = {}
    with safe_open(bundle / "model.safetensors", "pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out


def test_bundle_is_decode_only_fp8(built, tiny):
    bundle, _ = built
    m = manifest(bundle)
    assert m["status"] == "accepted" and all(c["passed"] for c in m["gate"]["checks"])
    t = stored(bundle)
    assert not any(k.startswith("encoder.") or ".in_proj." in k or k.startswith("quantizer.input_proj") for k in t)
    src = Checkpoint(tiny)
    dropped = m["method_details"]["decode_only"]
    assert dropped["params_before"] == src.num_params()
    assert set(dropped["dropped_tensors"]) == {k for k in src.keys() if k.startswith("encoder.") or ".in_proj." in k
                                              or k.startswith("quantizer.input_proj")}
    kept = {"decoder.0.input_proj", "decoder.4.output_proj"}  # the profile's first/last roles on this codec
    linears = decoder_linear_names(read_config(src))
    assert len(linears) == 3 * 2 * 4 + 4  # 3 stages x 2 layers x (qkv, out, linear1, linear2) + 3 input_proj + 1 output_proj
    for module in linears:
        if module in kept:
            assert t[module + ".weight"].dtype == torch.bfloat16 and module + ".weight_scale" not in t
        else:
            assert t[module + ".weight"].dtype == torch.float8_e4m3fn
            assert t[module + ".weight_scale"].dtype == torch.float32
            assert t[module + ".weight_scale"].shape == (t[module + ".weight"].shape[0], 1)
    others = [k for k in t if not k.endswith(("weight_scale",)) and t[k].dtype != torch.float8_e4m3fn]
    assert all(t[k].dtype == torch.bfloat16 for k in others)
    assert any(".norm1." in k for k in others) and any(".layer_scale_1." in k for k in others)
    assert any(k.endswith("codebook.weight") for k in others)
    config = json.loads((bundle / "config.json").read_text())
    assert config["dtype"] == "bfloat16"  # what it loads as, not the FP32 source's dtype
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert sorted(qc["ignore"]) == sorted(kept) == sorted(m["method_details"]["fp8"]["kept_bf16"])


def test_loaded_bundle_reproduces_fp32_decode_within_the_gate(built, tiny):
    bundle, _ = built
    model = load_codec_bundle(bundle)
    assert model.decoder_dtype == torch.bfloat16
    assert type(load_bundle(bundle)) is type(model)  # the generic loader dispatches to the codec
    vset = load_validation_set()
    ref = source_decoder(Checkpoint(tiny))
    for name, codes in zip(vset.names, vset.codes):
        a, b = ref.decode(codes), model.decode(codes)
        m = parity_metrics(a, b, 24000)
        assert m["sample_parity"] and b.shape == (1, 1, codes.shape[1] * 64)
        assert m["snr_db"] >= GATE["min"]["min_sequence_snr_db"]
        assert m["rel_mean_abs_diff"] <= GATE["max"]["rel_mean_abs_diff"]
        assert m["max_abs_diff"] / float(a.abs().max()) <= GATE["max"]["peak_error_ratio"] * 1.5  # per-sequence peak
        assert 0 < m["mean_abs_diff"]  # it really is the quantized model
    # The report's FP8 WAV is this loader's decode of the first sequence, the FP32 one the source's.
    wav8, sr = read_wav(bundle / "report" / "codec-validation-v1-long-fp8.wav")
    wav32, _ = read_wav(bundle / "report" / "codec-validation-v1-long-fp32.wav")
    assert sr == 24000 and wav8.numel() == wav32.numel() == 150 * 64
    torch.testing.assert_close(wav8, model.decode(vset.codes[0]).flatten().clamp(-1, 1), atol=1 / 32767, rtol=0)
    torch.testing.assert_close(wav32, ref.decode(vset.codes[0]).flatten().clamp(-1, 1), atol=1 / 32767, rtol=0)


def test_manifest_records_validation_and_bits_per_weight(built, tiny):
    bundle, _ = built
    m = manifest(bundle)
    v = m["evaluation"]
    assert v["dataset"]["sha256"] == load_validation_set().sha256
    assert v["metrics"]["sample_count_mismatches"] == 0
    for key in ("mean_abs_diff", "max_abs_diff", "snr_db", "log_mel_distance_db"):
        assert isinstance(v["metrics"][key], float)
    # The unquantized BF16 baseline is closer to FP32 than the FP8 artifact.
    assert v["unquantized_baseline"]["metrics"]["snr_db"] > v["metrics"]["snr_db"]
    assert sorted(v["wav"]) == sorted(f for f in m["files"] if f.startswith("report/"))
    bpw = m["bits_per_weight"]
    header_bytes, tensors = safetensors_layout(bundle / "model.safetensors")
    assert bpw["stored_bits"] == 8 * (bundle / "model.safetensors").stat().st_size
    decode_params = m["method_details"]["decode_only"]["params_after"]
    assert bpw["source_params"] == decode_params
    assert bpw["effective"] == pytest.approx(bpw["stored_bits"] / decode_params, abs=1e-6)
    assert bpw["effective_vs_full_source"] == pytest.approx(bpw["stored_bits"] / Checkpoint(tiny).num_params(), abs=1e-6)
    comps = bpw["components"]
    assert set(comps) == {"decoder_linears_fp8", "decoder_linears_bf16", "decoder_norms_layerscale", "quantizer_decode_path"}
    assert 8 < comps["decoder_linears_fp8"]["bpw"] < 9  # fp8 + one fp32 scale per row
    assert comps["decoder_linears_bf16"]["bpw"] == 16 and bpw["quantized_linear"] == comps["decoder_linears_fp8"]["bpw"]


def test_rebuild_is_identical(built, tiny):
    bundle, root = built
    again = build("codec-fp8", "codec-tiny", model_path=tiny, cache_root=root / "cache2", bundle_root=root / "bundles")
    assert again.bundle == bundle  # same version id, identical manifest (else write_bundle refuses)


def test_bad_codes_on_the_loaded_decoder(built):
    model = load_codec_bundle(built[0])
    with pytest.raises(PipelineError, match="codebook 3 .* has code 5000, expected 0..1023"):
        model.decode(torch.full((32, 4), 0).index_fill_(0, torch.tensor([3]), 5000))
    with pytest.raises(PipelineError, match="33 codebooks, the codec has 32"):
        model.decode(torch.zeros(33, 4, dtype=torch.long))


def test_tampered_bundle_is_refused(built, tmp_path):
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(built[0], copy)
    (copy / "report" / "codec-validation-v1-long-fp8.wav").write_bytes(b"RIFF")
    with pytest.raises(PipelineError, match="does not match manifest.json"):
        load_codec_bundle(copy)


def test_decoder_shape_mismatch_fails_cleanly(tiny, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    t = load_file(tiny / "model.safetensors")
    t["decoder.2.transformer.layers.0.self_attn.in_projs.0.weight"] = torch.zeros(96, 64)
    save_file(t, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((tiny / "config.json").read_text())
    import pipelines.api

    monkeypatch.setattr(pipelines.api, "verify", lambda spec, path: {})  # a user who pinned a broken snapshot
    with pytest.raises(PipelineError) as e:
        build("codec-fp8", "codec-tiny", model_path=bad, cache_root=tmp_path / "cache", bundle_root=tmp_path / "bundles")
    msg = str(e.value)
    assert "\n" not in msg and "decoder.2.transformer.layers.0.self_attn.in_projs.0.weight has shape [96, 64]" in msg
    assert "[192, 64]" in msg
    assert not (tmp_path / "bundles").exists() or not any((tmp_path / "bundles").rglob("*"))
    assert not any(p.name.count(".tmp-") for p in (tmp_path / "cache").rglob("*"))


def test_cli_builds_codec_maps_model_tiny_and_refuses_kind_mismatch(tmp_path, tiny):
    from pathlib import Path

    env = {**os.environ, "MOSSQUANT_ARTIFACTS": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "pipelines", *a], capture_output=True, text=True, env=env)  # noqa: E731
    r = run("quantize", "codec-fp8", "--model", "codec-tiny", "--model-path", str(tiny))
    assert r.returncode == 0, r.stderr
    bundle = Path(r.stdout.strip().splitlines()[-1].removeprefix("bundle: "))
    assert bundle.parent == tmp_path / "codec-tiny" / "codec-fp8" and (bundle / "manifest.json").is_file()
    # The issue's `MODEL=tiny` with a codec profile means tiny's codec companion, codec-tiny: same bundle.
    r = run("quantize", "codec-fp8", "--model", "tiny")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip().splitlines()[-1].removeprefix("bundle: ")) == bundle
    # ... and so does `make rebuild PROFILE=codec-fp8 MODEL=tiny`: it finds that bundle and rebuilds it.
    r = run("rebuild", "--profile", "codec-fp8", "--model", "tiny")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "identical", r.stderr[-500:]
    # A generator profile on the codec: one clear line, non-zero exit.
    r = run("quantize", "rtn4", "--model", "codec-tiny", "--model-path", str(tiny))
    err = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and "generator" in err[0] and "codec-tiny" in err[0]


def test_mossquant_load_decodes_a_codec_bundle(built, capsys):
    from pipelines.cli import main

    bundle, _ = built
    main(["load", str(bundle)])
    out = capsys.readouterr().out
    cfg = read_config(Checkpoint(bundle))
    assert f"decode ok: 4 frames -> {4 * cfg.downsample_rate} samples" in out and "torch.bfloat16" in out


def test_compressed_tensors_reads_the_codec_bundle_as_we_do(built):
    """The ecosystem's own reader: compressed-tensors parses the config (pydantic, strict) and its
    float-quantized decompressor gives every FP8 Linear exactly our dequantization."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus
    from safetensors import safe_open

    from quantizers.formats.fp8_channel import dequantize

    bundle, _ = built
    cfg = QuantizationConfig.model_validate(json.loads((bundle / "config.json").read_text())["quantization_config"])
    assert cfg.format == "float-quantized" and cfg.quantization_status == QuantizationStatus.COMPRESSED
    (scheme,) = cfg.config_groups.values()
    n = 0
    with safe_open(bundle / "model.safetensors", "pt") as f:
        for key in sorted(k for k in f.keys() if k.endswith(".weight_scale")):
            module = key[: -len(".weight_scale")]
            assert module not in cfg.ignore
            w, s = f.get_tensor(module + ".weight"), f.get_tensor(key)
            theirs = FloatQuantizationCompressor.decompress({"weight": w, "weight_scale": s}, scheme)["weight"]
            assert torch.equal(theirs, dequantize(w, s, dtype=theirs.dtype)), (module, ct.__version__)
            n += 1
    layout = json.loads((bundle / "manifest.json").read_text())["tensors"]
    assert n > 0 and n == sum(1 for t in layout.values() if t["format"] == "fp8")


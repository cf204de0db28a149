"""MOSS-Audio-Tokenizer module tree: upstream names/shapes, decode semantics, bad input."""
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipelines.checkpoint import Checkpoint
from pipelines.codec_fixtures import fixture_config, write_codec_fixture
from pipelines.errors import PipelineError
from pipelines.models.moss_audio_tokenizer import extract_decode_only, read_config, source_decoder
from pipelines.models.moss_audio_tokenizer import (
    CodecConfig, Patch, WeightNormConv1x1, decoder_linear_names, rope, tensor_specs,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_codec_fixture("codec-tiny", tmp_path_factory.mktemp("codec") / "codec-tiny")


@pytest.fixture(scope="module")
def model(tiny):
    return source_decoder(Checkpoint(tiny))


def test_real_config_matches_upstream_inventory():
    # Counts from a meta-device build of upstream (shared/notes/moss-architecture.md §2.2).
    cfg = CodecConfig.from_dict(fixture_config("codec-full-shape"))
    specs = tensor_specs(cfg)
    count = lambda pre: sum(math.prod(s) for n, s in specs.items() if n.startswith(pre))  # noqa: E731
    assert count("") == 1_774_566_400
    assert count("decoder.") == 886_609_920
    assert count("quantizer.") == 1_346_560
    assert len([n for n in specs if n.startswith("decoder.")]) == 685
    assert len(decoder_linear_names(cfg)) == 277
    assert specs["decoder.0.input_proj.weight"] == (1280, 768)
    assert specs["decoder.6.output_proj.weight"] == (240, 768)
    assert specs["decoder.2.input_proj.weight"] == (768, 640)
    assert "decoder.2.output_proj.weight" not in specs and "encoder.3.input_proj.weight" not in specs
    assert specs["decoder.0.transformer.layers.31.self_attn.in_projs.0.weight"] == (3840, 1280)
    assert specs["quantizer.quantizers.31.codebook.weight"] == (1024, 8)
    assert specs["quantizer.quantizers.0.out_proj.parametrizations.weight.original0"] == (512, 1, 1)
    assert specs["quantizer.quantizers.0.out_proj.parametrizations.weight.original1"] == (512, 8, 1)
    assert specs["quantizer.output_proj.bias"] == (768,)
    assert cfg.stage_contexts() == {0: 125, 2: 250, 4: 500, 6: 1000}  # 10 s at 12.5/25/50/100 Hz
    assert cfg.downsample_rate == 1920 and cfg.sampling_rate == 24000


def test_weight_norm_conv_matches_torch_parametrization():
    torch.manual_seed(0)
    ref = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(8, 32, kernel_size=1))
    mine = WeightNormConv1x1(8, 32)
    missing = mine.load_state_dict(ref.state_dict(), strict=True)  # same names, same shapes
    assert not missing.missing_keys
    x = torch.randn(2, 8, 5)
    torch.testing.assert_close(mine(x.transpose(1, 2)), ref(x).transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_patch_matches_channel_first_formula():
    x = torch.randn(2, 3 * 4, 5)  # upstream (B, C*p, T) layout
    b, dh, length = x.shape
    upstream = x.reshape(b, 3, 4, length).permute(0, 1, 3, 2).reshape(b, 3, length * 4)
    assert torch.equal(Patch(4)(x.transpose(1, 2)).transpose(1, 2), upstream)


def test_rope_rotates_pairs_and_is_relative():
    torch.manual_seed(0)
    q = torch.randn(1, 1, 12, 16)
    r = rope(q, 1e4)
    torch.testing.assert_close(r.norm(dim=-1), q.norm(dim=-1))  # a rotation
    assert torch.equal(r[:, :, 0], q[:, :, 0])  # position 0 is unrotated
    # <rope(a)_i, rope(b)_j> depends only on i - j.
    a, b = torch.randn(16), torch.randn(16)
    ra, rb = rope(a.expand(1, 1, 12, 16).clone(), 1e4), rope(b.expand(1, 1, 12, 16).clone(), 1e4)
    d1, d2 = (ra[0, 0, 7] @ rb[0, 0, 3]), (ra[0, 0, 9] @ rb[0, 0, 5])
    torch.testing.assert_close(d1, d2, rtol=1e-5, atol=1e-5)


def test_decode_shapes_batch_and_prefix(model):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 1024, (32, 2, 9), generator=g)
    y = model.decode(codes)
    assert y.shape == (2, 1, 9 * 64) and y.dtype == torch.float32 and torch.isfinite(y).all()
    torch.testing.assert_close(model.decode(codes[:, 1]), y[1:2])  # (n_q, T) == batch of one
    assert model.decode(codes[:8]).shape == (2, 1, 9 * 64)  # any codebook prefix decodes
    assert not torch.allclose(model.decode(codes[:8]), y)


def test_decode_is_causal_with_a_sliding_window(model):
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 1024, (32, 1, 120), generator=g)
    y = model.decode(codes)
    torch.testing.assert_close(model.decode(codes[:, :, :50]), y[..., : 50 * 64], rtol=1e-4, atol=1e-5)
    # Change frame 0 only. Windows of 15/30/60 steps at 1x/2x/4x the frame rate, 2 layers
    # each, bound the receptive field to 28 + 29 + 29.5 < 90 frames: later output must be
    # bit-identical (full causal attention would leak everywhere), earlier output must change.
    changed = codes.clone()
    changed[:, :, 0] = (changed[:, :, 0] + 1) % 1024
    y2 = model.decode(changed)
    assert not torch.allclose(y2[..., : 10 * 64], y[..., : 10 * 64])
    assert torch.equal(y2[..., 90 * 64 :], y[..., 90 * 64 :])


def test_decode_rejects_bad_codes(model):
    ok = torch.zeros(32, 1, 4, dtype=torch.long)
    bad = ok.clone()
    bad[5, 0, 2] = 1024
    with pytest.raises(PipelineError, match=r"codebook 5 \(batch 0, frame 2\) has code 1024, expected 0..1023"):
        model.decode(bad)
    with pytest.raises(PipelineError, match="has code -1"):
        model.decode(ok - 1)
    with pytest.raises(PipelineError, match="33 codebooks, the codec has 32"):
        model.decode(torch.zeros(33, 1, 4, dtype=torch.long))
    with pytest.raises(PipelineError, match="integer tensor"):
        model.decode(ok.float())
    with pytest.raises(PipelineError, match="expected shape"):
        model.decode(torch.zeros(32, 1, 1, 4, dtype=torch.long))


def test_extraction_drops_encoder_and_input_side(tiny):
    ck = Checkpoint(tiny)
    ex = extract_decode_only(ck, read_config(ck))
    assert ex.params_before == ck.num_params()
    assert not any(n.startswith("encoder.") or ".in_proj." in n or n.startswith("quantizer.input_proj") for n in ex.kept)
    assert {n for n in ex.dropped if n.startswith("encoder.")} == {n for n in ck.keys() if n.startswith("encoder.")}
    assert sum(".in_proj." in n for n in ex.dropped) == 32 * 3
    assert ex.params_after == sum(math.prod(ck.shape(n)) for n in ex.kept)
    m = ex.manifest()
    assert m["params_dropped"] == ex.params_before - ex.params_after > 0
    assert m["dropped_groups"]["quantizer.quantizers.*.in_proj"] == 96


def _rewrite(src, dst, edit):
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text((src / "config.json").read_text())
    return Checkpoint(dst)


def test_shape_mismatch_and_unexpected_tensors_are_named(tiny, tmp_path):
    name = "decoder.2.transformer.layers.1.linear1.weight"
    ck = _rewrite(tiny, tmp_path / "a", lambda t: t.__setitem__(name, torch.zeros(128, 64)))
    with pytest.raises(PipelineError, match=rf"tensor {name} has shape \[128, 64\], config.json implies \[256, 64\]"):
        extract_decode_only(ck, read_config(ck))
    ck = _rewrite(tiny, tmp_path / "b", lambda t: t.pop("decoder.4.output_proj.weight"))
    with pytest.raises(PipelineError, match="tensor decoder.4.output_proj.weight missing"):
        extract_decode_only(ck, read_config(ck))
    ck = _rewrite(tiny, tmp_path / "c", lambda t: t.__setitem__("decoder.9.extra", torch.zeros(2)))
    with pytest.raises(PipelineError, match="unexpected tensor decoder.9.extra"):
        extract_decode_only(ck, read_config(ck))


def test_legacy_weight_norm_names_load(tiny, tmp_path):
    def rename(t):
        for k in [k for k in t if k.endswith("parametrizations.weight.original0")]:
            base = k[: -len(".parametrizations.weight.original0")]
            t[base + ".weight_g"] = t.pop(k)
            t[base + ".weight_v"] = t.pop(base + ".parametrizations.weight.original1")

    ck = _rewrite(tiny, tmp_path / "legacy", rename)
    codes = torch.randint(0, 1024, (32, 3), generator=torch.Generator().manual_seed(3))
    assert torch.equal(source_decoder(ck).decode(codes), source_decoder(Checkpoint(tiny)).decode(codes))


def test_config_chain_errors_name_the_key():
    cfg = fixture_config("codec-tiny")
    cfg["decoder_kwargs"][2]["input_dimension"] = 48
    with pytest.raises(PipelineError, match=r"decoder_kwargs\[2\].input_dimension is 48, expected 32"):
        CodecConfig.from_dict(cfg)
    cfg = fixture_config("codec-tiny")
    cfg["downsample_rate"] = 32
    with pytest.raises(PipelineError, match="patch sizes multiply to 64, downsample_rate is 32"):
        CodecConfig.from_dict(cfg)
    cfg = fixture_config("codec-tiny")
    cfg["decoder_kwargs"][0]["positional_embedding"] = "sin"
    with pytest.raises(PipelineError, match=r"decoder_kwargs\[0\].positional_embedding is 'sin'"):
        CodecConfig.from_dict(cfg)


def test_fixture_is_deterministic(tiny, tmp_path):
    again = write_codec_fixture("codec-tiny", tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert (again / "config.json").read_text() == (tiny / "config.json").read_text()
    assert all(Checkpoint(tiny).get(n).dtype == torch.float32 for n in Checkpoint(tiny).keys())

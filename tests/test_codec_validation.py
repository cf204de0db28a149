"""Codec validation: the versioned code set, parity metrics, log-mel distance, WAV output."""
import math
import wave

import pytest
import torch
import yaml

from pipelines import codec_eval as codec
from pipelines.codec_eval import (
    check_set_matches, codes_digest, generate_codes, load_validation_set, log_mel_distance_db, parity_metrics,
    read_wav, wav_bytes,
)
from pipelines.codec_fixtures import fixture_config
from pipelines.errors import PipelineError
from pipelines.models.moss_audio_tokenizer import CodecConfig


def test_validation_set_is_pinned_and_covers_all_codebooks():
    v = load_validation_set()
    spec = yaml.safe_load((codec.CONFIGS / "calibration" / "codec-validation-v1.yaml").read_text())
    assert v.sha256 == spec["codes_sha256"] == codes_digest(generate_codes(spec))
    assert [tuple(c.shape) for c in v.codes] == [(32, 150), (32, 40), (32, 25)]
    assert all(c.dtype == torch.long and 0 <= int(c.min()) and int(c.max()) < 1024 for c in v.codes)
    # 150 frames at 12.5 Hz is 12 s: past the real decoder's 10 s window.
    assert v.codes[0].shape[1] / 12.5 > 10
    # Coarse codebooks persist more than fine ones (the RVQ-like process), the held one is constant.
    changes = (v.codes[0][:, 1:] != v.codes[0][:, :-1]).float().mean(1)
    assert changes[:4].mean() < changes[-4:].mean()
    assert (v.codes[2] == v.codes[2][:, :1]).all()
    check_set_matches(v, CodecConfig.from_dict(fixture_config("codec-full-shape")))  # the real codec


def test_changed_spec_or_wrong_codebook_count_is_refused(tmp_path, monkeypatch):
    spec = yaml.safe_load((codec.CONFIGS / "calibration" / "codec-validation-v1.yaml").read_text())
    spec["seed"] += 1
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "codec-validation-v1.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(codec, "CONFIGS", tmp_path)
    with pytest.raises(PipelineError, match="codec-validation-v1.yaml: generated codes hash to .* codes_sha256 pins"):
        load_validation_set()
    monkeypatch.undo()
    cfg = fixture_config("codec-tiny")
    cfg["quantizer_kwargs"]["num_quantizers"] = 16
    with pytest.raises(PipelineError, match="sequence 'long' has 32 codebooks, the codec has 16"):
        check_set_matches(load_validation_set(), CodecConfig.from_dict(cfg))
    with pytest.raises(PipelineError, match="unknown codec validation set 'nope'"):
        load_validation_set("nope")


def test_parity_metrics_on_known_errors():
    g = torch.Generator().manual_seed(0)
    ref = 0.3 * torch.randn(1, 1, 4800, generator=g)
    same = parity_metrics(ref, ref.clone(), 24000)
    assert same["sample_parity"] and same["mean_abs_diff"] == 0 and same["snr_db"] == codec.SNR_CAP_DB
    assert same["log_mel_distance_db"] == 0
    test = ref * 1.1  # error = 0.1 * signal: SNR exactly 20 dB
    m = parity_metrics(ref, test, 24000)
    assert math.isclose(m["snr_db"], 20.0, abs_tol=1e-4)  # float32 rounding of 1.1 * ref
    assert math.isclose(m["rel_mean_abs_diff"], 0.1, rel_tol=1e-5)
    assert math.isclose(m["max_abs_diff"], 0.1 * float(ref.abs().max()), rel_tol=1e-6)
    # A 10% gain change is ~0.83 dB at every mel bin above the floor.
    assert 0.8 < m["log_mel_distance_db"] < 0.85
    short = parity_metrics(ref, test[..., :-64], 24000)
    assert short["sample_parity"] is False and short["samples_test"] == 4736 and "snr_db" not in short


def test_log_mel_distance_sees_spectral_change_not_phase_noise_floor():
    t = torch.arange(24000) / 24000
    tone = torch.sin(2 * math.pi * 440 * t)
    assert log_mel_distance_db(tone, tone, 24000) == 0
    shifted = torch.sin(2 * math.pi * 880 * t)
    assert log_mel_distance_db(tone, shifted, 24000) > 10 * log_mel_distance_db(tone, 1.1 * tone, 24000)


def test_wav_is_16bit_pcm_mono_and_deterministic(tmp_path):
    x = torch.tensor([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0])
    data = wav_bytes(x, 24000)
    assert data == wav_bytes(x.clone(), 24000)
    (tmp_path / "a.wav").write_bytes(data)
    with wave.open(str(tmp_path / "a.wav"), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24000, 7)
    back, sr = read_wav(tmp_path / "a.wav")
    assert sr == 24000
    torch.testing.assert_close(back, x.clamp(-1, 1), atol=1 / 32767, rtol=0)  # clipped, 16-bit steps

"""The evaluate stage for the codec: the seed's golden protocol, automated.

A fixed, versioned set of code sequences (all 32 codebooks) is decoded by the FP32 source decoder
and by the artifact (FP8 weights dequantized to BF16, BF16 compute); the waveforms are compared:
sample-count parity, PCM mean/max absolute difference, SNR and a log-mel spectral distance. A few
decodes are written as WAVs so a person can listen.
"""
from __future__ import annotations

import hashlib
import io
import math
import wave
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from . import portable_random as rnd
from .checkpoint import canonical_json
from .errors import PipelineError
from .models.moss_audio_tokenizer import CodecConfig, MossAudioTokenizer, read_config, source_decoder
from .source import CONFIGS

VALIDATION_SET = "codec-validation-v1"
SNR_CAP_DB = 300.0  # identical signals: a finite stand-in for +inf (JSON has no inf)


# --------------------------------------------------------------------------- validation code set


@dataclass
class ValidationSet:
    name: str
    names: list[str]
    codes: list[torch.Tensor]  # each (n_q, T) int64
    sha256: str
    spec: dict


def _uniforms(seed: int, *key) -> list[float]:
    """Four uniforms in [0, 1) from one SHA-256 block: stable across Python/torch versions."""
    d = hashlib.sha256(("/".join(map(str, (seed, *key)))).encode()).digest()
    return [int.from_bytes(d[i : i + 8], "big") / 2**64 for i in range(0, 32, 8)]


def generate_codes(spec: dict) -> list[torch.Tensor]:
    seed, nq, size = int(spec["seed"]), int(spec["num_codebooks"]), int(spec["codebook_size"])
    p = spec.get("process", {})
    out = []
    for s, seq in enumerate(spec["sequences"]):
        frames, kind = int(seq["frames"]), seq["kind"]
        codes = torch.empty(nq, frames, dtype=torch.long)
        for k in range(nq):
            stay = float(p.get("stay0", 0.6)) * rnd.power(float(p.get("decay", 0.93)), k)  # no libm pow
            for t in range(frames):
                u = _uniforms(seed, s, k, t)
                if t == 0:
                    c = int(u[0] * size)
                elif kind == "repeat":
                    c = int(codes[k, 0])
                elif kind == "process":
                    prev = int(codes[k, t - 1])
                    if u[0] < stay:
                        c = prev
                    elif u[1] < float(p.get("local", 0.7)):
                        step = int(p.get("step", 24))
                        c = (prev + int(u[2] * (2 * step + 1)) - step) % size
                    else:
                        c = int(u[3] * size)
                else:
                    raise PipelineError(f"validation set sequence {seq.get('name')!r}: unknown kind {kind!r} (process, repeat)")
                codes[k, t] = c
        out.append(codes)
    return out


def codes_digest(codes: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for c in codes:
        h.update(canonical_json(list(c.shape)).encode())
        h.update(c.to(torch.int32).numpy().tobytes())
    return h.hexdigest()


def load_validation_set(name: str = VALIDATION_SET, check_pin: bool = True) -> ValidationSet:
    path = CONFIGS / "calibration" / f"{name}.yaml"
    if not path.exists():
        raise PipelineError(f"unknown codec validation set {name!r}: no {path.name} in configs/calibration")
    spec = yaml.safe_load(path.read_text())
    for key in ("seed", "num_codebooks", "codebook_size", "sequences"):
        if key not in spec:
            raise PipelineError(f"{path.name}: key {key!r} missing")
    codes = generate_codes(spec)
    digest = codes_digest(codes)
    if check_pin and spec.get("codes_sha256") != digest:
        raise PipelineError(f"{path.name}: generated codes hash to {digest[:12]}…, codes_sha256 pins {str(spec.get('codes_sha256'))[:12]}…")
    return ValidationSet(spec.get("name", name), [s["name"] for s in spec["sequences"]], codes, digest, spec)


def check_set_matches(vset: ValidationSet, cfg: CodecConfig) -> None:
    """Every sequence must carry all of the codec's codebooks, with codes in range."""
    q = cfg.quantizer
    for name, c in zip(vset.names, vset.codes):
        if c.shape[0] != q.num_quantizers:
            raise PipelineError(f"{vset.name}: sequence {name!r} has {c.shape[0]} codebooks, the codec has {q.num_quantizers}")
        if int(c.max()) >= q.codebook_size:
            raise PipelineError(f"{vset.name}: sequence {name!r} has code {int(c.max())}, codebook size is {q.codebook_size}")


# --------------------------------------------------------------------------- metrics


def _mel_filterbank(sr: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """HTK-scale triangular filters, (n_mels, n_fft // 2 + 1)."""
    hz = torch.linspace(0, sr / 2, n_fft // 2 + 1, dtype=torch.float64)
    mel = lambda f: 2595.0 * torch.log10(1.0 + f / 700.0)  # noqa: E731
    pts = 700.0 * (10 ** (torch.linspace(0, float(mel(torch.tensor(sr / 2.0))), n_mels + 2, dtype=torch.float64) / 2595.0) - 1)
    lo, mid, hi = pts[:-2, None], pts[1:-1, None], pts[2:, None]
    fb = torch.minimum((hz - lo) / (mid - lo), (hi - hz) / (hi - mid)).clamp(min=0)
    return fb.float()


def log_mel(x: torch.Tensor, sr: int, n_mels: int = 80) -> torch.Tensor:
    """Power mel spectrogram in dB of a 1-D signal: ~43 ms windows, 1/4 overlap hop."""
    n_fft = 1 << max(6, round(math.log2(sr * 0.043)))  # 1024 at 24 kHz
    spec = torch.stft(x.float(), n_fft, hop_length=n_fft // 4, window=torch.hann_window(n_fft), return_complex=True)
    mel = _mel_filterbank(sr, n_fft, n_mels) @ spec.abs().pow(2)
    return 10 * torch.log10(mel.clamp(min=1e-12))


def log_mel_distance_db(ref: torch.Tensor, test: torch.Tensor, sr: int, floor_db: float = 80.0) -> float:
    """Mean |log-mel(ref) - log-mel(test)| in dB, both floored 80 dB below the reference peak
    (so inaudible bins cannot dominate)."""
    a, b = log_mel(ref, sr), log_mel(test, sr)
    floor = a.max() - floor_db
    return float((a.clamp(min=floor) - b.clamp(min=floor)).abs().mean())


def parity_metrics(ref: torch.Tensor, test: torch.Tensor, sr: int) -> dict:
    """Waveform comparison of two decodes (B, 1, N)."""
    out = {"samples_ref": int(ref.shape[-1]), "samples_test": int(test.shape[-1])}
    out["sample_parity"] = ref.shape == test.shape
    if not out["sample_parity"]:
        return out
    r, t = ref.double().flatten(), test.double().flatten()
    err = r - t
    noise, signal = float(err.pow(2).sum()), float(r.pow(2).sum())
    out.update(
        ref_mean_abs=float(r.abs().mean()),
        mean_abs_diff=float(err.abs().mean()),
        max_abs_diff=float(err.abs().max()),
        snr_db=SNR_CAP_DB if noise == 0 else min(SNR_CAP_DB, 10 * math.log10(signal / noise)) if signal > 0 else 0.0,
        log_mel_distance_db=sum(log_mel_distance_db(a[0], b[0], sr) for a, b in zip(ref, test)) / ref.shape[0],
    )
    out["rel_mean_abs_diff"] = out["mean_abs_diff"] / out["ref_mean_abs"] if out["ref_mean_abs"] > 0 else 0.0
    return out


def aggregate(per_seq: dict[str, dict], refs: dict, tests: dict, sr: int) -> dict:
    """Pooled over every sample of every sequence (SNR = total signal / total error power)."""
    parity = all(m["sample_parity"] for m in per_seq.values())
    out = {"sample_parity": parity, "sequences": len(per_seq),
           "samples": sum(m["samples_ref"] for m in per_seq.values())}
    if not parity:
        return out
    r = torch.cat([refs[k].double().flatten() for k in per_seq])
    t = torch.cat([tests[k].double().flatten() for k in per_seq])
    pooled = parity_metrics(r[None, None], t[None, None], sr)
    out["ref_peak"] = float(r.abs().max())
    out.update({k: pooled[k] for k in ("ref_mean_abs", "mean_abs_diff", "max_abs_diff", "snr_db", "rel_mean_abs_diff")})
    out["log_mel_distance_db"] = max(m["log_mel_distance_db"] for m in per_seq.values())  # worst sequence
    out["min_sequence_snr_db"] = min(m["snr_db"] for m in per_seq.values())
    return out


def decode_set(model: MossAudioTokenizer, vset: ValidationSet) -> dict[str, torch.Tensor]:
    from .progress import progress

    return {n: model.decode(c) for n, c in progress(list(zip(vset.names, vset.codes)), desc="decode", unit="seq")}


def compare(refs: dict, tests: dict, sr: int) -> dict:
    per = {k: parity_metrics(refs[k], tests[k], sr) for k in refs}
    return {"overall": aggregate(per, refs, tests, sr), "per_sequence": per}


# --------------------------------------------------------------------------- WAV


def wav_bytes(x: torch.Tensor, sr: int) -> bytes:
    """Mono 16-bit PCM WAV (stdlib `wave`; no timestamps, so the bytes are deterministic).
    Samples outside [-1, 1] are clipped."""
    pcm = (x.detach().float().flatten().clamp(-1, 1) * 32767).round().to(torch.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sr))
        w.writeframes(pcm.numpy().astype("<i2").tobytes())
    return buf.getvalue()


def read_wav(path: Path) -> tuple[torch.Tensor, int]:
    with wave.open(str(path), "rb") as w:
        sr, n = w.getframerate(), w.getnframes()
        data = w.readframes(n)
    import numpy as np

    return torch.from_numpy(np.frombuffer(data, dtype="<i2").astype("float32") / 32767), sr


# --------------------------------------------------------------------------- the stage


@dataclass
class CodecEvaluateParams:
    dataset: str = VALIDATION_SET
    dtype: str = "bfloat16"  # what the artifact dequantizes to at load (and computes in)
    bf16_baseline: bool = True  # also score the unquantized source in `dtype`: splits FP8 error from compute error
    wav_sequences: int = 1  # how many sequences (in set order) get FP32/FP8 WAVs in report/

    def validate(self):
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype: {self.dtype!r} (allowed: bfloat16, float16, float32)")
        if self.wav_sequences < 0:
            raise ValueError(f"wav_sequences: must be >= 0, got {self.wav_sequences}")


def _rounded(d):
    if isinstance(d, dict):
        return {k: _rounded(v) for k, v in d.items()}
    return float(f"{d:.6g}") if isinstance(d, float) else d


def gate_metrics(overall: dict) -> dict:
    """The flat numbers the gate reads (see configs/profiles/codec-fp8.yaml)."""
    m = {"sample_count_mismatches": 0 if overall["sample_parity"] else 1}
    if overall["sample_parity"]:
        m.update({k: overall[k] for k in ("mean_abs_diff", "rel_mean_abs_diff", "max_abs_diff", "snr_db",
                                          "min_sequence_snr_db", "log_mel_distance_db", "ref_mean_abs")})
        m["peak_error_ratio"] = overall["max_abs_diff"] / overall["ref_peak"] if overall["ref_peak"] > 0 else 0.0
    return _rounded(m)


def run(ctx, params: CodecEvaluateParams, out: Path) -> dict:
    """Decode the validation set with the FP32 source and the quantize stage's tensors."""
    from .loader import codec_decoder, stage_view

    ckpt = ctx.checkpoint()
    cfg = read_config(ckpt)
    vset = load_validation_set(params.dataset)
    check_set_matches(vset, cfg)
    dtype = getattr(torch, params.dtype)
    refs = decode_set(source_decoder(ckpt, torch.float32), vset)
    tests = decode_set(codec_decoder(cfg, stage_view(ctx.dirs["quantize"]), dtype=dtype, where="quantize stage"), vset)
    result = compare(refs, tests, cfg.sampling_rate)
    report = {
        "dataset": {"name": vset.name, "sha256": vset.sha256, "sequences": dict(zip(vset.names, (list(c.shape) for c in vset.codes)))},
        "reference": "source decoder, float32 weights and compute",
        "artifact": f"FP8 weights dequantized to {params.dtype}, {params.dtype} compute (quantizer path float32)",
        "metrics": gate_metrics(result["overall"]),
        "per_sequence": _rounded(result["per_sequence"]),
    }
    if params.bf16_baseline:
        base = compare(refs, decode_set(source_decoder(ckpt, dtype), vset), cfg.sampling_rate)
        report["unquantized_baseline"] = {"what": f"source weights cast to {params.dtype}, no FP8",
                                          "metrics": gate_metrics(base["overall"])}
    (out / "report").mkdir()
    wavs = []
    for name in vset.names[: params.wav_sequences]:
        for tag, wave_ in (("fp32", refs[name]), ("fp8", tests[name])):
            fname = f"report/{vset.name}-{name}-{tag}.wav"
            (out / fname).write_bytes(wav_bytes(wave_[0], cfg.sampling_rate))
            wavs.append(fname)
    report["wav"] = wavs
    return report

"""Multi-channel calibration sequences that look like MOSS inputs.

Each sequence is (seqlen, 1 + n_vq) ids: a chat-style text prompt with every audio channel at
the pad code, then an audio segment in the delay pattern (codebook k lags codebook k-1 by one
step; the text channel holds the assistant gen-slot / delay-slot tokens), closed by audio_end.
Text is tokenized with the snapshot's own `tokenizer.json` when it has one; fixtures without a
tokenizer use UTF-8 bytes (recorded as `tokenizer: bytes`). Codes come from a seeded per-codebook
process described in the dataset YAML. Everything is deterministic.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from . import portable_random as rnd
from .errors import PipelineError
from .models.moss_tts_delay import SPECIAL_IDS
from .source import CONFIGS



@dataclass
class CalibrationSet:
    name: str
    ids: torch.Tensor  # (N, seqlen, 1 + n_vq) int64
    tokenizer: str  # "tokenizer.json" or "bytes"
    spec_sha256: str

    @property
    def sha256(self) -> str:
        h = hashlib.sha256(self.spec_sha256.encode())
        h.update(self.ids.to(torch.int32).numpy().astype("<i4").tobytes())
        return h.hexdigest()


def load_dataset_spec(name: str) -> tuple[dict, bytes]:
    path = CONFIGS / "calibration" / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise PipelineError(f"unknown calibration set {name!r}: no {path.name} (known: {known})")
    raw = path.read_bytes()
    return yaml.safe_load(raw), raw


def _tokenizer(snapshot: Path | None, vocab: int):
    tok_file = snapshot / "tokenizer.json" if snapshot else None
    if tok_file and tok_file.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(tok_file))
        return (lambda s: tok.encode(s, add_special_tokens=False).ids), "tokenizer.json"
    if vocab < 256 + 8:
        raise PipelineError(f"vocab_size {vocab} is too small for byte-level fallback tokenization")
    return (lambda s: list(s.encode("utf-8"))), "bytes"


def code_process(stream: str, samples: range, frames: int, n_vq: int, size: int, p: dict) -> torch.Tensor:
    """(len(samples), frames, n_vq) codes from one of two processes (`kind` in the set's YAML).

    persistence (the default): codebook k repeats its previous code with probability
    stay0 * decay^k, else moves by a step in [-step, step] (probability `local`, clamped) or jumps
    uniformly; every codebook on its own.
    segments: phone-like segments whose boundaries every codebook shares (a boundary at each frame
    with probability 1 / `segment`): at a boundary every codebook jumps uniformly; inside a
    segment codebook k holds with probability hold0 * decay^k, else moves by a step in
    [-step, step]. Other statistics than `persistence`: correlated across codebooks, no
    independent jumps, longer holds.

    Draws come from `stream` (pipelines/portable_random.py) at counters that depend only on
    (sample, frame, codebook), so sample i is the same whatever else is drawn."""
    if frames >= 1 << 16:
        raise PipelineError(f"calibration {stream}: {frames} frames per sequence, at most {(1 << 16) - 1}")
    st = rnd.Stream(stream)
    i = torch.tensor(list(samples), dtype=torch.int64)[:, None, None]
    t = torch.arange(frames, dtype=torch.int64)[None, :, None]
    k = torch.arange(n_vq, dtype=torch.int64)[None, None, :]
    c = (((i << 16) + t) * n_vq + k) * 4
    kind = p.get("kind", "persistence")
    if kind == "segments":
        return _segments(st, c, frames, n_vq, size, p)
    if kind != "persistence":
        raise PipelineError(f"calibration {stream}: codes.kind {kind!r} (allowed: persistence, segments)")
    stay_u = st.uniform(c)
    local = st.uniform(c + 1) < float(p["local"])
    step = st.integers(c + 2, 2 * int(p["step"]) + 1) - int(p["step"])
    jump = st.integers(c + 3, size)
    stay = torch.tensor([float(p["stay0"]) * rnd.power(float(p["decay"]), q) for q in range(n_vq)], dtype=torch.float64)
    stays = stay_u < stay
    codes = torch.empty(len(samples), frames, n_vq, dtype=torch.int64)
    codes[:, 0] = jump[:, 0]
    for f in range(1, frames):
        prev = codes[:, f - 1]
        moved = torch.where(local[:, f], (prev + step[:, f]).clamp(0, size - 1), jump[:, f])
        codes[:, f] = torch.where(stays[:, f], prev, moved)
    return codes


def _segments(st, c: torch.Tensor, frames: int, n_vq: int, size: int, p: dict) -> torch.Tensor:
    boundary = st.uniform(c[..., :1]) < 1.0 / float(p["segment"])  # codebook 0's counter: shared by all
    hold_u = st.uniform(c + 1)
    step = st.integers(c + 2, 2 * int(p["step"]) + 1) - int(p["step"])
    jump = st.integers(c + 3, size)
    hold = torch.tensor([float(p["hold0"]) * rnd.power(float(p["decay"]), q) for q in range(n_vq)], dtype=torch.float64)
    holds = hold_u < hold
    codes = torch.empty(c.shape, dtype=torch.int64)
    codes[:, 0] = jump[:, 0]
    for f in range(1, frames):
        prev = codes[:, f - 1]
        inside = torch.where(holds[:, f], prev, (prev + step[:, f]).clamp(0, size - 1))
        codes[:, f] = torch.where(boundary[:, f], jump[:, f], inside)
    return codes


def codes_digest(codes: torch.Tensor) -> str:
    return hashlib.sha256(codes.to(torch.int32).numpy().astype("<i4").tobytes()).hexdigest()


def check_codes_pin(name: str, spec: dict) -> None:
    """Regenerate the set's pinned reference codes: a machine whose arithmetic gives other bytes
    is refused before anything is built on them."""
    pin = spec.get("codes_pin")
    if not isinstance(pin, dict) or not {"sequences", "frames", "n_vq", "codebook_size", "sha256"} <= set(pin):
        raise PipelineError(f"{name}.yaml: codes_pin must map sequences, frames, n_vq, codebook_size, sha256")
    codes = code_process(stream_name(spec), range(int(pin["sequences"])), int(pin["frames"]), int(pin["n_vq"]),
                         int(pin["codebook_size"]), spec["codes"])
    got = codes_digest(codes)
    if got != pin["sha256"]:
        raise PipelineError(f"{name}.yaml: its code process gives sha256 {got[:12]}… on this machine, "
                            f"codes_pin.sha256 is {str(pin['sha256'])[:12]}…")


def stream_name(spec: dict) -> str:
    return f"moss-quant/calibration/{spec['name']}/{int(spec['seed'])}"


def delay_pattern(codes: torch.Tensor, pad: int) -> torch.Tensor:
    """(T, n_vq) codes -> (T + n_vq - 1, n_vq): codebook k shifted down by k steps, pad elsewhere."""
    frames, n_vq = codes.shape
    out = torch.full((frames + n_vq - 1, n_vq), pad, dtype=torch.int64)
    for k in range(n_vq):
        out[k:k + frames, k] = codes[:, k]
    return out


def build(name: str, model_config: dict, nsamples: int, seqlen: int, snapshot: Path | None = None) -> CalibrationSet:
    spec, raw = load_dataset_spec(name)
    lc = model_config["language_config"]
    vocab, n_vq = lc["vocab_size"], model_config["n_vq"]
    size, pad = model_config["audio_vocab_size"], model_config.get("audio_pad_code", model_config["audio_vocab_size"])
    ids_of = {k: model_config.get(k, v) for k, v in SPECIAL_IDS.items()}
    if any(v >= vocab for v in ids_of.values()):
        raise PipelineError(f"config.json: special token ids {ids_of} exceed vocab_size {vocab}")
    encode, tok_kind = _tokenizer(snapshot, vocab)
    texts = spec["texts"]
    if nsamples < 1 or seqlen < n_vq + 8:
        raise PipelineError(f"calibration {name}: need nsamples >= 1 and seqlen >= {n_vq + 8}, got {nsamples}, {seqlen}")
    check_codes_pin(name, spec)
    texts = [[t for t in encode(texts[i % len(texts)]) if t < vocab][: seqlen // 3] for i in range(nsamples)]
    codes = code_process(stream_name(spec), range(nsamples), seqlen, n_vq, size, spec["codes"])
    rows = []
    for i, text in enumerate(texts):
        prompt = [ids_of["im_start_token_id"], *text, ids_of["im_end_token_id"], ids_of["audio_start_token_id"]]
        frames = seqlen - len(prompt)  # enough frames to fill the sequence; the tail is cropped
        audio = delay_pattern(codes[i, :frames], pad)
        slot = torch.full((audio.shape[0],), ids_of["audio_assistant_delay_slot_token_id"])
        slot[:frames] = ids_of["audio_assistant_gen_slot_token_id"]
        head = torch.full((len(prompt), 1 + n_vq), pad, dtype=torch.int64)
        head[:, 0] = torch.tensor(prompt)
        body = torch.cat([slot[:, None], audio], dim=1)
        rows.append(torch.cat([head, body])[:seqlen])
    ids = torch.stack(rows)
    return CalibrationSet(name, ids, tok_kind, hashlib.sha256(raw).hexdigest())


@dataclass
class CalibrateParams:
    dataset: str = "moss-calib-v1"
    nsamples: int = 32
    seqlen: int = 256

    def validate(self):
        if self.nsamples < 1:
            raise ValueError(f"nsamples: must be >= 1, got {self.nsamples}")
        if self.seqlen < 40:
            raise ValueError(f"seqlen: must be >= 40 (the delay pattern alone spans n_vq steps), got {self.seqlen}")


CALIB_FILE = "calibration.safetensors"


def run_calibrate(ctx, params: CalibrateParams, out: Path) -> dict:
    from safetensors.torch import save_file

    cal = build(params.dataset, ctx.checkpoint().config(), params.nsamples, params.seqlen, ctx.snapshot)
    save_file({"input_ids": cal.ids.to(torch.int32).contiguous()}, str(out / CALIB_FILE))
    return {"name": cal.name, "sha256": cal.sha256, "tokenizer": cal.tokenizer,
            "nsamples": params.nsamples, "seqlen": params.seqlen}


def load_ids(folder: Path) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(folder / CALIB_FILE))["input_ids"].long()

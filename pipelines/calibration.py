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

from .errors import PipelineError
from .source import CONFIGS

UPSTREAM_IDS = {
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "audio_start_token_id": 151652,
    "audio_end_token_id": 151653,
    "audio_assistant_gen_slot_token_id": 151656,
    "audio_assistant_delay_slot_token_id": 151662,
}


@dataclass
class CalibrationSet:
    name: str
    ids: torch.Tensor  # (N, seqlen, 1 + n_vq) int64
    tokenizer: str  # "tokenizer.json" or "bytes"
    spec_sha256: str

    @property
    def sha256(self) -> str:
        h = hashlib.sha256(self.spec_sha256.encode())
        h.update(self.ids.to(torch.int32).numpy().tobytes())
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


def _codes(gen: torch.Generator, frames: int, n_vq: int, size: int, p: dict) -> torch.Tensor:
    codes = torch.empty(frames, n_vq, dtype=torch.int64)
    codes[0] = torch.randint(0, size, (n_vq,), generator=gen)
    stay = torch.tensor([p["stay0"] * p["decay"] ** k for k in range(n_vq)])
    for t in range(1, frames):
        u = torch.rand(n_vq, generator=gen)
        step = torch.randint(-p["step"], p["step"] + 1, (n_vq,), generator=gen)
        jump = torch.randint(0, size, (n_vq,), generator=gen)
        local = torch.rand(n_vq, generator=gen) < p["local"]
        moved = torch.where(local, (codes[t - 1] + step).clamp(0, size - 1), jump)
        codes[t] = torch.where(u < stay, codes[t - 1], moved)
    return codes


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
    ids_of = {k: model_config.get(k, v) for k, v in UPSTREAM_IDS.items()}
    if any(v >= vocab for v in ids_of.values()):
        raise PipelineError(f"config.json: special token ids {ids_of} exceed vocab_size {vocab}")
    encode, tok_kind = _tokenizer(snapshot, vocab)
    texts = spec["texts"]
    if nsamples < 1 or seqlen < n_vq + 8:
        raise PipelineError(f"calibration {name}: need nsamples >= 1 and seqlen >= {n_vq + 8}, got {nsamples}, {seqlen}")
    gen = torch.Generator().manual_seed(int(spec["seed"]))
    rows = []
    for i in range(nsamples):
        text = [t for t in encode(texts[i % len(texts)]) if t < vocab][: seqlen // 3]
        prompt = [ids_of["im_start_token_id"], *text, ids_of["im_end_token_id"], ids_of["audio_start_token_id"]]
        frames = seqlen - len(prompt)  # enough frames to fill the sequence; the tail is cropped
        audio = delay_pattern(_codes(gen, frames, n_vq, size, spec["codes"]), pad)
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

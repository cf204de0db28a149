"""Free-running MOSS-TTS generation in the delay pattern, greedy: the decoding rules of MOSS's own
runtime (llama.cpp fork, tools/tts/moss-tts.cpp `moss_delay_step`) over our model, so a GGUF run in
`llama-moss-tts` and the bundle run here can be compared code for code.

Each step emits one row: a text token and n_vq audio codes. Text: outside audio, anything but the
slot/end/pad tokens; inside audio, the gen slot or the delay slot (the delay slot not on the first
step); once the delay slot is chosen, n_vq more delay slots then audio_end. Audio: codebook k is
predicted only while the audio segment is at least k + 1 frames long (the delay pattern's lag) and
until the delay countdown passes it; the pad code is never predicted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .models.moss_tts_delay import SPECIAL_IDS

NEG_INF = float("-inf")


@dataclass
class DelayState:
    n_vq: int
    ids: dict
    pad_code: int
    audio_length: int = 0
    delayed_length: int | None = None  # None: not counting down (the C++ INT64_MAX)
    is_audio: bool = False
    is_stopping: bool = False
    time_step: int = 0
    text: list = field(default_factory=list)

    @classmethod
    def from_prompt(cls, prompt: torch.Tensor, ids: dict, pad_code: int) -> "DelayState":
        s = cls(prompt.shape[1] - 1, ids, pad_code, text=prompt[:, 0].tolist())
        if s.text and s.text[-1] in (ids["audio_start_token_id"], ids["audio_assistant_gen_slot_token_id"]):
            start = max(i for i, t in enumerate(s.text) if t == ids["audio_start_token_id"]) \
                if ids["audio_start_token_id"] in s.text else None
            if start is not None:
                s.audio_length, s.is_audio = len(s.text) - start, True
        return s

    def step(self, text_logits: torch.Tensor, audio_logits: torch.Tensor) -> list[int]:
        """One greedy row from the last position's logits: text (V,), audio (n_vq, A)."""
        ids, n_vq = self.ids, self.n_vq
        vocab = text_logits.shape[0]
        if self.delayed_length is not None and self.delayed_length < n_vq:
            nxt = ids["audio_assistant_delay_slot_token_id"]
        elif self.delayed_length == n_vq:
            nxt = ids["audio_end_token_id"]
            self.is_audio = False
        else:
            scaled = text_logits.float().clone()
            if not self.is_audio:
                for k in ("pad_token_id", "audio_assistant_gen_slot_token_id", "audio_assistant_delay_slot_token_id",
                          "audio_end_token_id"):
                    if 0 <= ids[k] < vocab:
                        scaled[ids[k]] = NEG_INF
            else:
                keep = [ids[k] for k in ("audio_assistant_gen_slot_token_id", "audio_assistant_delay_slot_token_id")
                        if ids[k] < vocab]
                masked = torch.full_like(scaled, NEG_INF)
                masked[keep] = scaled[keep]
                scaled = masked
            if self.time_step == 0 and ids["audio_assistant_delay_slot_token_id"] < vocab:
                scaled[ids["audio_assistant_delay_slot_token_id"]] = NEG_INF
            if self.time_step <= n_vq and ids["im_end_token_id"] < vocab:
                scaled[ids["im_end_token_id"]] = NEG_INF
            nxt = int(scaled.argmax())
        if nxt == ids["audio_start_token_id"]:
            self.is_audio = True
        if nxt == ids["im_end_token_id"]:
            self.is_stopping = True
        audio = [self.pad_code] * n_vq
        lagged = [c for c in range(n_vq) if c < max(self.audio_length, 0)
                  and (self.delayed_length is None or c > self.delayed_length - 1)]
        if lagged:
            scaled = audio_logits.float().clone()
            scaled[:, self.pad_code] = NEG_INF
            for c in lagged:
                audio[c] = int(scaled[c].argmax())
        if nxt in (ids["audio_start_token_id"], ids["audio_assistant_gen_slot_token_id"],
                   ids["audio_assistant_delay_slot_token_id"]):
            self.audio_length += 1
        if nxt == ids["audio_end_token_id"]:
            self.audio_length = 0
        if self.delayed_length is None and nxt == ids["audio_assistant_delay_slot_token_id"]:
            self.delayed_length = 0
        if self.delayed_length is not None:
            self.delayed_length += 1
            if self.delayed_length > n_vq:
                self.delayed_length = None
        self.time_step += 1
        self.text.append(nxt)
        return [nxt, *audio]


def special_ids(config: dict) -> dict:
    return {k: int(config.get(k, v)) for k, v in SPECIAL_IDS.items()}


@torch.no_grad()
def generate(model, prompt: torch.Tensor, steps: int, ids: dict) -> torch.Tensor:
    """Greedy rows after `prompt` (S, 1 + n_vq), with the KV cache; stops at im_end."""
    from transformers import DynamicCache

    state = DelayState.from_prompt(prompt, ids, model.config.audio_pad_code)
    cache = DynamicCache()
    x, rows = prompt[None], []
    for _ in range(steps):
        h = model.language_model(inputs_embeds=model.embed(x), past_key_values=cache, use_cache=True).last_hidden_state
        logits = model.heads(h[:, -1:])
        row = state.step(logits[0][0, 0], torch.stack([lg[0, 0] for lg in logits[1:]]))
        rows.append(row)
        if state.is_stopping:
            break
        x = torch.tensor([[row]], dtype=torch.long)
    return torch.tensor(rows, dtype=torch.long).reshape(-1, prompt.shape[1])


def de_delay(rows: torch.Tensor, n_vq: int) -> torch.Tensor:
    """Delayed audio rows (T, n_vq) -> codes (T - n_vq + 1, n_vq): codebook k read k rows later."""
    frames = rows.shape[0] - n_vq + 1
    if frames <= 0:
        return torch.empty(0, n_vq, dtype=torch.long)
    return torch.stack([rows[k:k + frames, k] for k in range(n_vq)], dim=1)


def raw_codes(rows: torch.Tensor, n_vq: int, pad_code: int) -> torch.Tensor:
    """The generated audio as frames of codes, as llama-moss-tts dumps them: de-delayed, frames that
    are all pad dropped (the segments joined)."""
    codes = de_delay(rows[:, 1:], n_vq)
    return codes[(codes != pad_code).any(dim=1)]

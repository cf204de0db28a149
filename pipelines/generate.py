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
    overrides: int = 0
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
        """One row from the last position's scores: text (V,), audio (n_vq, A). Greedy on logits;
        sampling hands in logits / temperature + Gumbel noise (argmax of that is a sample).
        `overrides` counts the choices the pattern's rules had to overrule: the free argmax was
        a token or code that the delay pattern does not allow there."""
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
            self.overrides += int(text_logits.argmax()) != nxt
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
            self.overrides += int((audio_logits[lagged].argmax(-1) == self.pad_code).sum())
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
    return generate_batch(model, [prompt], steps, ids, stop="im_end")[0].rows


@dataclass
class Run:
    rows: torch.Tensor  # (T, 1 + n_vq) generated rows, the stop token's row included
    ended: bool  # the stop token came within the step budget
    overrides: int  # DelayState.overrides: choices the pattern's rules overruled


@torch.no_grad()
def generate_batch(model, prompts: list[torch.Tensor], steps: int, ids: dict, noise=None, temperature: float = 1.0,
                   stop: str = "audio_end", device="cpu") -> list[Run]:
    """Every prompt (S_b, 1 + n_vq) continued for up to `steps` rows, batched with the KV cache
    (prompts left-padded and masked). Greedy unless `noise(step) -> (text (B, V), audio (B, n_vq, A))`
    gives Gumbel noise: then each row is a sample at `temperature`, and two models handed the same
    noise draw coupled samples (equal whenever their distributions are close). A sequence stops at
    `stop` ("audio_end" or "im_end")."""
    from transformers import DynamicCache

    from .progress import progress

    stop_id = ids[f"{stop}_token_id"]
    pad_code = model.config.audio_pad_code
    states = [DelayState.from_prompt(p, ids, pad_code) for p in prompts]
    width, longest = prompts[0].shape[1], max(p.shape[0] for p in prompts)
    x = torch.full((len(prompts), longest, width), pad_code, dtype=torch.long)
    x[:, :, 0] = ids["pad_token_id"]
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for b, p in enumerate(prompts):
        x[b, longest - p.shape[0]:], mask[b, longest - p.shape[0]:] = p, 1
    x, mask = x.to(device), mask.to(device)
    cache, rows, done = DynamicCache(), [[] for _ in prompts], [False] * len(prompts)
    for t in progress(range(steps), desc=f"generate {len(prompts)}", unit="row"):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -x.shape[1]:]
        h = model.language_model(inputs_embeds=model.embed(x), attention_mask=mask, position_ids=pos,
                                 past_key_values=cache, use_cache=True).last_hidden_state
        logits = model.heads(h[:, -1])
        text, audio = logits[0].float(), torch.stack(logits[1:], dim=1).float()
        if noise is not None:
            g_text, g_audio = noise(t)
            text, audio = text / temperature + g_text.to(text), audio / temperature + g_audio.to(audio)
        nxt = []
        for b, state in enumerate(states):
            if done[b]:  # finished sequences ride along; their rows are not kept
                nxt.append(rows[b][-1])
                continue
            row = state.step(text[b], audio[b])
            rows[b].append(row)
            done[b] = row[0] == stop_id
            nxt.append(row)
        if all(done):
            break
        x = torch.tensor(nxt, dtype=torch.long, device=device)[:, None]
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
    return [Run(torch.tensor(r, dtype=torch.long).reshape(-1, width), d, s.overrides)
            for r, d, s in zip(rows, done, states)]


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

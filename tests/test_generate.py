"""MOSS's delay-pattern decoding rules (pipelines/generate.py, ported from the llama.cpp runtime)."""
import torch

from pipelines.generate import DelayState, de_delay, generate, raw_codes

IDS = {"pad_token_id": 0, "im_start_token_id": 1, "im_end_token_id": 2, "audio_start_token_id": 3,
       "audio_end_token_id": 4, "audio_assistant_gen_slot_token_id": 5, "audio_assistant_delay_slot_token_id": 6}
N_VQ, PAD = 4, 16


def _prompt():
    rows = torch.full((3, 1 + N_VQ), PAD)
    rows[:, 0] = torch.tensor([1, 9, 3])  # im_start, a text token, audio_start
    return rows


def _logits(prefer: int, audio_pick: int = 7):
    text = torch.zeros(10)
    text[prefer] = 5.0
    audio = torch.zeros(N_VQ, PAD + 1)
    audio[:, audio_pick] = 3.0
    audio[:, PAD] = 100.0  # the pad code is never predicted, however likely
    return text, audio


def test_delay_rules_lag_codebooks_then_count_down_to_audio_end():
    s = DelayState.from_prompt(_prompt(), IDS, PAD)
    assert s.is_audio and s.audio_length == 1
    rows = [s.step(*_logits(prefer=6))]  # step 0: the delay slot is not allowed, the gen slot is taken
    assert rows[0][0] == 5 and rows[0][1:] == [7, PAD, PAD, PAD]  # only codebook 0 once the segment has 1 frame
    rows.append(s.step(*_logits(prefer=5)))
    assert rows[1][1:] == [7, 7, PAD, PAD]  # codebook k starts k frames later
    rows.append(s.step(*_logits(prefer=6)))  # the delay slot: the countdown starts
    assert rows[2][0] == 6
    texts = [s.step(*_logits(prefer=5))[0] for _ in range(N_VQ)]
    assert texts == [6] * (N_VQ - 1) + [4]  # n_vq delay slots in all, then audio_end
    assert not s.is_audio


def test_text_outside_audio_never_picks_slots_and_im_end_waits():
    prompt = _prompt()
    prompt[-1, 0] = 9  # no audio_start at the end: text mode
    s = DelayState.from_prompt(prompt, IDS, PAD)
    assert not s.is_audio
    for _ in range(N_VQ + 1):  # im_end is masked for the first n_vq + 1 steps
        row = s.step(*_logits(prefer=2))
        assert row[0] not in (0, 2, 4, 5, 6) and row[1:] == [PAD] * N_VQ
    assert s.step(*_logits(prefer=2))[0] == 2 and s.is_stopping


def test_de_delay_and_raw_codes():
    codes = torch.arange(5 * N_VQ).reshape(5, N_VQ)
    delayed = torch.full((5 + N_VQ - 1, N_VQ), PAD)
    for k in range(N_VQ):
        delayed[k:k + 5, k] = codes[:, k]
    assert torch.equal(de_delay(delayed, N_VQ), codes)
    rows = torch.cat([torch.zeros(len(delayed), 1, dtype=torch.long), delayed], dim=1)
    pad_frame = torch.full((N_VQ, N_VQ + 1), PAD)
    assert torch.equal(raw_codes(torch.cat([rows, pad_frame]), N_VQ, PAD), codes)


def test_cached_generation_equals_recomputing_every_step(tiny_path):
    from pipelines.generate import special_ids
    from pipelines.loader import load_source

    model = load_source(tiny_path, dtype=torch.float32)
    cfg = model.config.raw
    ids = special_ids(cfg)
    prompt = torch.full((6, 33), model.config.audio_pad_code)
    prompt[:, 0] = torch.tensor([ids["im_start_token_id"], 72, 105, 33, ids["im_end_token_id"], ids["audio_start_token_id"]])
    rows = generate(model, prompt, 12, ids)
    state, x = DelayState.from_prompt(prompt, ids, model.config.audio_pad_code), prompt
    with torch.no_grad():
        for t in range(len(rows)):
            logits = model(x[None])
            row = state.step(logits[0][0, -1], torch.stack([lg[0, -1] for lg in logits[1:]]))
            assert row == rows[t].tolist(), t
            x = torch.cat([x, torch.tensor([row])])

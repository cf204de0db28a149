"""The free-running evaluation (issue 18): what a listener would hear, not what teacher forcing sees.

From held-out prompts (text, then a few frames of reference audio: the voice), the BF16 source and
the quantized candidate each generate on their own in the delay pattern (pipelines/generate.py,
the rules of MOSS's runtime), greedy and sampled, up to `max_frames` rows or the audio's end.
Sampling is coupled: both models get the same Gumbel noise (drawn from pipelines/portable_random.py
by set, prompt, step and channel), so two close models draw the same codes and a divergence is the
models', not the dice's. A second BF16 run under other noise is the yardstick: how far BF16 is
from itself when only the dice change. The code streams are decoded by the source codec (FP32)
and compared as waveforms.

Per set and mode it records the first divergent row, per-codebook code agreement, the agreement
curve over rows, audio end and length ratio, runaways (no end) and loops, the rule overrides, and
the decoded log-mel distance, SNR and sample counts, per set (`sets`); `metrics` holds the
figures the gate reads, pooled over the sets.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import portable_random as rnd
from .calibration import build
from .errors import PipelineError
from .generate import Run, generate_batch, raw_codes, special_ids

CURVE_BINS = 20
UNBOUNDED = 1e6  # a ratio over a zero yardstick (JSON has no infinity)
LOOP_PERIODS = 8  # a cycle of up to this many frames ...
LOOP_FRAMES = 25  # ... repeating exactly for 2 s of audio (12.5 frames/s) is a loop: speech never does that


@dataclass
class FreeRunParams:
    sets: list[str] = field(default_factory=lambda: ["moss-heldout-v1", "moss-heldout-v2", "moss-stress-long-v1"])
    prompts: int = 8  # per set
    voice_frames: int = 25  # reference audio frames in the prompt (2 s at 12.5 Hz): the voice to continue
    max_frames: int = 1000
    temperature: float = 1.0
    wavs: int = 1  # prompts per set whose decoded audio (BF16 and quantized, sampled) goes into report/
    scorers: list[str] = field(default_factory=list)  # "module:Class" on the decoded audio (pipelines/scorers.py)

    def validate(self):
        if not self.sets:
            raise ValueError("sets: at least one evaluation set")
        for key in ("prompts", "max_frames"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.voice_frames < 0 or self.wavs < 0:
            raise ValueError("voice_frames and wavs: must be >= 0")
        if not self.temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {self.temperature}")
        from .scorers import check_entry

        for entry in self.scorers:
            check_entry(entry)


def prompts_of(name: str, config: dict, n: int, voice_frames: int, snapshot: Path | None) -> tuple[list, str]:
    """The set's first n sequences cut after audio_start + `voice_frames` rows; and the set's hash."""
    ids = special_ids(config)
    held = build(name, config, n, 1024 + voice_frames, snapshot)
    out = []
    for row in held.ids:
        start = int((row[:, 0] == ids["audio_start_token_id"]).nonzero()[0, 0])
        out.append(row[: start + 1 + voice_frames])
    return out, held.sha256


def gumbel(stream: str, batch: int, text_vocab: int, n_vq: int, audio_vocab: int):
    """noise(step) for generate_batch: Gumbel(0, 1) from a counter-based stream, the same on every machine."""
    st = rnd.Stream(stream)
    per_row = text_vocab + n_vq * audio_vocab

    def noise(step: int):
        c = (torch.arange(batch, dtype=torch.int64)[:, None] * (1 << 20) + step) * per_row \
            + torch.arange(per_row, dtype=torch.int64)[None]
        g = -torch.log(-torch.log(st.uniform(c)))
        return g[:, :text_vocab], g[:, text_vocab:].reshape(batch, n_vq, audio_vocab)

    return noise


def loops(codes: torch.Tensor) -> bool:
    """Does the stream end in an exact cycle of <= LOOP_PERIODS frames held for LOOP_FRAMES frames?"""
    if codes.shape[0] < LOOP_FRAMES + LOOP_PERIODS:
        return False
    tail = codes[-(LOOP_FRAMES + LOOP_PERIODS):]
    return any(torch.equal(tail[p:], tail[:-p]) for p in range(1, LOOP_PERIODS + 1))


def compare_runs(ref: Run, cand: Run, n_vq: int, pad: int) -> dict:
    """One prompt: BF16's rows against the candidate's."""
    n = min(len(ref.rows), len(cand.rows))
    same = ref.rows[:n] == cand.rows[:n]
    differ = (~same.all(dim=1)).nonzero()
    due = ref.rows[:n, 1:] != pad  # codes the reference emitted (lagged codebooks start later)
    agree = (same[:, 1:] & due).sum(0).double() / due.sum(0).clamp(min=1)
    r_codes, c_codes = raw_codes(ref.rows, n_vq, pad), raw_codes(cand.rows, n_vq, pad)
    return {
        "first_divergence": int(differ[0, 0]) if len(differ) else n,
        "agreement": agree.tolist(),
        # per row: the share of its due codes equal to BF16's (a row with none due: its text token)
        "row_agreement": torch.where(due.sum(1) > 0, (same[:, 1:] & due).sum(1) / due.sum(1).clamp(min=1),
                                     same[:, 0].double()).tolist(),
        "length_ratio": len(cand.rows) / len(ref.rows),
        "runaway": (not cand.ended or loops(c_codes)) and ref.ended and not loops(r_codes),
        "ended": [ref.ended, cand.ended],
        "loops": [loops(r_codes), loops(c_codes)],
        "overrides_per_row": [ref.overrides / len(ref.rows), cand.overrides / len(cand.rows)],
    }


def curve(per_prompt: list[dict], max_frames: int) -> list[float]:
    """Code agreement over the run, in CURVE_BINS bins of the row index (mean over prompts still running)."""
    width = math.ceil(max_frames / CURVE_BINS)
    out = []
    for b in range(CURVE_BINS):
        vals = [v for p in per_prompt for v in p["row_agreement"][b * width:(b + 1) * width]]
        out.append(round(sum(vals) / len(vals), 4) if vals else None)
    return out


def decoded_distance(codec, ref: Run, cand: Run, n_vq: int, pad: int, sr: int) -> dict:
    """Both generated continuations decoded by the source codec (de-delayed, the generated rows hold
    whole frames from the first), compared over their common length."""
    from .codec_eval import SNR_CAP_DB, log_mel_distance_db

    waves = []
    for run in (ref, cand):
        codes = raw_codes(run.rows, n_vq, pad)
        waves.append(codec.decode(codes.t().contiguous()[:, None])[0, 0] if len(codes) else torch.zeros(0))
    per_frame = codec.config.downsample_rate
    a, b = waves
    n = min(len(a), len(b))
    out = {"samples": [len(waves[0]), len(waves[1])]}
    if n < max(4 * per_frame, 1024):  # under one STFT window: one of the two ended at once
        out.update(log_mel_db=None, snr_db=None)
        return out, waves
    a, b = a[:n].double(), b[:n].double()
    noise, signal = float((a - b).pow(2).sum()), float(a.pow(2).sum())
    out["snr_db"] = SNR_CAP_DB if noise == 0 else (10 * math.log10(signal / noise) if signal > 0 else 0.0)
    out["log_mel_db"] = log_mel_distance_db(a.float(), b.float(), sr)
    return out, waves


def summarise(pairs: list[dict], dist: list[dict], n_vq: int, max_frames: int) -> dict:
    agree = [sum(p["agreement"][k] for p in pairs) / len(pairs) for k in range(n_vq)]
    mel = [d["log_mel_db"] for d in dist if d["log_mel_db"] is not None]
    snr = [d["snr_db"] for d in dist if d["snr_db"] is not None]
    return {
        "prompts": len(pairs),
        "first_divergence": sorted(p["first_divergence"] for p in pairs),
        "code_agreement": sum(agree) / n_vq,
        "code_agreement_min": min(agree),
        "code_agreement_per_codebook": agree,
        "agreement_curve": curve(pairs, max_frames),
        "length_ratio_gmean": math.exp(sum(math.log(p["length_ratio"]) for p in pairs) / len(pairs)),
        "length_ratios": [p["length_ratio"] for p in pairs],
        "ended": [sum(p["ended"][i] for p in pairs) for i in (0, 1)],
        "loops": [sum(p["loops"][i] for p in pairs) for i in (0, 1)],
        "overrides_per_row": [sum(p["overrides_per_row"][i] for p in pairs) / len(pairs) for i in (0, 1)],
        "log_mel_db": sum(mel) / len(mel) if mel else None,
        "log_mel_per_prompt": [d["log_mel_db"] for d in dist],
        "runaways": sum(p["runaway"] for p in pairs),
        "snr_db": sum(snr) / len(snr) if snr else None,
        "samples": [sum(d["samples"][i] for d in dist) for i in (0, 1)],
    }


def gated(sets: dict) -> dict:
    """The gate's figures, pooled over every prompt of every set (a random fixture's free runs are
    chaotic: pooling is what makes them statistics). Sampled figures are ratios to the yardstick,
    BF16 against itself under other noise: 1.0 = as far from BF16 as a reroll of the dice.

    free.runaway_excess: share of prompts that the candidate fails to end (or ends in a loop) where
        BF16 ends cleanly; greedy (no dice: every one counts) plus sampled beyond the yardstick's own.
    free.code_disagreement_ratio: code disagreement with BF16 under coupled sampling (codebooks averaged).
    free.log_mel_ratio: decoded log-mel distance to BF16 after the voice prompt, frame by frame, over
        the prompts long enough to compare in both.
    free.length_ratio: geometric-mean utterance length (sampled), candidate over BF16.
    free.length_shift: |ln length_ratio| beyond two standard errors of sampling noise (the reroll's
        per-prompt spread over sqrt(prompts); conservative, as the coupled pairs vary less): the part
        of a tempo change that the dice cannot explain.
    free.length_dev_ratio: mean |ln(length / BF16's)| per prompt, over the yardstick's (recorded)."""
    def ratio(a, b):  # BF16 never varies under other noise: any deviation of the candidate is unbounded
        return a / b if b else (0.0 if not a else UNBOUNDED)

    every = lambda mode, key: [x for s in sets.values() for x in s[mode][key]]  # noqa: E731
    total = lambda mode, key: sum(s[mode][key] for s in sets.values())  # noqa: E731
    prompts = total("sampled", "prompts")
    agree = lambda mode: sum(s[mode]["code_agreement"] * s[mode]["prompts"] for s in sets.values()) / prompts  # noqa: E731
    def paired(key):  # the prompts long enough to compare in both the candidate's run and the yardstick's
        return [(a, b) for a, b in zip(every("sampled", key), every("resample", key)) if a is not None and b is not None]

    mel = paired("log_mel_per_prompt")
    dev = lambda mode: sum(abs(math.log(r)) for r in every(mode, "length_ratios"))  # noqa: E731
    shift = sum(math.log(r) for r in every("sampled", "length_ratios")) / prompts
    # a prompt's ln length ratio under a reroll: its spread is the noise in one prompt's figure
    noise = math.sqrt(sum(math.log(r) ** 2 for r in every("resample", "length_ratios")) / prompts)
    figures = {
        "free.runaway_excess": (total("greedy", "runaways") + max(0, total("sampled", "runaways") - total("resample", "runaways"))) / prompts,
        "free.code_disagreement_ratio": ratio(1 - agree("sampled"), 1 - agree("resample")),
        "free.log_mel_ratio": ratio(sum(a for a, _ in mel), sum(b for _, b in mel)) if mel else 0.0,
        "free.length_ratio": math.exp(shift),
        "free.length_shift": max(0.0, abs(shift) - 2 * noise / math.sqrt(prompts)),
        "free.length_dev_ratio": ratio(dev("sampled"), dev("resample")),
        "free.prompts": prompts,
    }
    for key in sorted({k for s in sets.values() for k in s.get("scorers", {})}):  # the user's scorers, averaged
        figures[f"free.{key}"] = sum(s["scorers"][key] for s in sets.values()) / len(sets)
    return {k: round(v, 6) for k, v in figures.items()}


def reference_cache(ctx, params: FreeRunParams, device: str):
    """BF16's runs depend on the source, the sets, these params, the seed, the device kind and this
    code, never on the profile or the run: made once, kept content-addressed in artifacts/.cache/
    whatever the run's own cache root (the key covers all they depend on), written atomically, read
    by every profile after."""
    import hashlib
    import json

    from safetensors.torch import load_file, save_file

    from .atomic import atomic_folder
    from .checkpoint import canonical_json
    from .source import ARTIFACTS, pins_digest
    from .stages import stage_code

    def get(shas: dict, make):
        payload = {"sets": shas, "source": pins_digest(ctx.spec), "seed": ctx.seed, "device": device,
                   "params": {k: v for k, v in dataclasses.asdict(params).items() if k not in ("sets", "wavs", "scorers")},
                   "code": stage_code(__name__)}
        folder = ARTIFACTS / ".cache" / "freerun-bf16" / hashlib.sha256(canonical_json(payload).encode()).hexdigest()
        if not (folder / "runs.json").exists():
            runs = make()
            with atomic_folder(folder) as tmp:
                save_file({f"{mode}/{name}/{i}": r.rows.contiguous() for (mode, name), rs in runs.items()
                           for i, r in enumerate(rs)}, str(tmp / "runs.safetensors"))
                (tmp / "runs.json").write_text(canonical_json(
                    {f"{mode}/{name}": [[r.ended, r.overrides] for r in rs] for (mode, name), rs in runs.items()}))
            return runs
        rows, meta = load_file(str(folder / "runs.safetensors")), json.loads((folder / "runs.json").read_text())
        return {tuple(key.split("/", 1)): [Run(rows[f"{key}/{i}"], ended, overrides) for i, (ended, overrides) in enumerate(rs)]
                for key, rs in meta.items()}

    return get


def run(ctx, params: FreeRunParams, out: Path) -> dict:
    from .checkpoint import Checkpoint
    from .loader import stage_view
    from .models.moss_audio_tokenizer import source_decoder
    from .models.moss_tts_delay import MossTTSDelayConfig, build_empty, load_state
    from .source import load_model_spec, resolve_path, verify
    from .stages import resolve_device

    from .scorers import load_scorers

    scorers = load_scorers(params.scorers, f"{ctx.profile.path}: stages.freerun.scorers")  # fail before the long part
    if not ctx.spec.codec:
        raise PipelineError(f"configs/models/{ctx.spec.name}.yaml: no `codec:` to decode the generated audio with")
    config = ctx.checkpoint().config()
    cfg = MossTTSDelayConfig.from_dict(config)
    device = resolve_device("auto")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32  # BF16 weights either way
    models = {"ref": load_state(build_empty(cfg), ctx.checkpoint().get, dtype=dtype, device=device),
              "cand": load_state(build_empty(cfg), stage_view(ctx.dirs["quantize"]), dtype=dtype, device=device)}
    codec_spec = load_model_spec(ctx.spec.codec)
    codec_path = resolve_path(codec_spec)
    verify(codec_spec, codec_path)
    codec = source_decoder(Checkpoint(codec_path))
    sets, wavs = free_run(models, codec, config, params, ctx.seed, ctx.snapshot, out, device,
                          reference_cache(ctx, params, device), scorers)
    return {"device": device, "params": {"max_frames": params.max_frames, "temperature": params.temperature},
            "sets": sets, "metrics": gated(sets), "wav": wavs}


NOISE = {"greedy": None, "sampled": "coupled", "resample": "other"}  # mode -> noise stream (greedy: none)


def free_run(models: dict, codec, config: dict, params: FreeRunParams, seed: int, snapshot, out: Path | None,
             device="cpu", reference_cache=None, scorers=()) -> tuple[dict, list]:
    """BF16 (`models["ref"]`) and the candidate (`models["cand"]`) on every set: per-set figures,
    and the WAVs written under out/report/ (none when out is None). `reference_cache(key, make)`,
    when given, returns BF16's runs, made by `make()` only the first time.

    Every set's prompts in every mode go through one batched generation per model (the step count,
    not the batch, is what costs); BF16 and the candidate see the same batch composition for the
    modes they share, so a candidate equal to BF16 draws exactly BF16's rows."""
    from .codec_eval import wav_bytes
    from .models.moss_tts_delay import MossTTSDelayConfig

    cfg = MossTTSDelayConfig.from_dict(config)
    ids, pad, n_vq = special_ids(config), cfg.audio_pad_code, cfg.n_vq
    vocab, audio_vocab = cfg.language_config["vocab_size"], pad + 1
    prompts, shas = {}, {}
    for name in params.sets:
        prompts[name], shas[name] = prompts_of(name, config, params.prompts, params.voice_frames, snapshot)

    def gen(who: str, modes: tuple) -> dict:
        groups = [(mode, name) for mode in modes for name in params.sets]
        noises = [gumbel(f"moss-quant/freerun/{name}/{seed}/{NOISE[mode]}", len(prompts[name]), vocab, n_vq, audio_vocab)
                  if NOISE[mode] else None for mode, name in groups]

        def noise(t):
            parts = [nz(t) if nz else (torch.zeros(len(prompts[n]), vocab, dtype=torch.float64),
                                       torch.zeros(len(prompts[n]), n_vq, audio_vocab, dtype=torch.float64))
                     for nz, (_, n) in zip(noises, groups)]
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])

        runs = generate_batch(models[who], [p for _, n in groups for p in prompts[n]], params.max_frames, ids,
                              noise=noise if any(noises) else None, temperature=params.temperature, device=device)
        out, at = {}, 0
        for mode, name in groups:
            out[mode, name], at = runs[at:at + len(prompts[name])], at + len(prompts[name])
        return out

    def bf16_runs():
        return {**gen("ref", ("greedy", "sampled")), **gen("ref", ("resample",))}

    ref = bf16_runs() if reference_cache is None else reference_cache(shas, bf16_runs)
    cand = gen("cand", ("greedy", "sampled"))
    if out is not None:
        (out / "report").mkdir(exist_ok=True)
    sets, wavs = {}, []
    for name in params.sets:
        entry = {"sha256": shas[name], "prompts": len(prompts[name]), "voice_frames": params.voice_frames}
        runs = {"greedy": (ref["greedy", name], cand["greedy", name]),
                "sampled": (ref["sampled", name], cand["sampled", name]),
                "resample": (ref["sampled", name], ref["resample", name])}
        for mode, (refs, cands) in runs.items():
            pairs = [compare_runs(r, c, n_vq, pad) for r, c in zip(refs, cands)]
            dist, continuations = [], []
            for i, (r, c) in enumerate(zip(refs, cands)):
                d, waves = decoded_distance(codec, r, c, n_vq, pad, codec.config.sampling_rate)
                dist.append(d)
                continuations.append(waves)
                if out is not None and mode == "sampled" and i < params.wavs:
                    for tag, w in zip(("bf16", "quant"), waves):
                        fname = f"report/{name}-{i}-{tag}.wav"
                        (out / fname).write_bytes(wav_bytes(w, codec.config.sampling_rate))
                        wavs.append(fname)
            entry[mode] = summarise(pairs, dist, n_vq, params.max_frames)
            if scorers and mode == "sampled":
                from .scorers import run_scorers

                entry["scorers"] = run_scorers(scorers, [w[0] for w in continuations], [w[1] for w in continuations],
                                               {"modality": "decoded-audio", "sampling_rate": codec.config.sampling_rate,
                                                "set": name})
        sets[name] = entry
    return sets, wavs

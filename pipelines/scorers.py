"""Optional scorers: the user's own speech metrics (ASR character error, speaker-embedding
cosine, a MOS predictor) plugged into the `evaluate` stage.

Nothing here is needed offline and nothing is loaded unless a profile names it:

    stages:
      evaluate:
        scorers: ["my_package.asr:CharErrorScorer"]   # "module:Class", constructed with no arguments

A scorer is any class with

    name: str                                    # short, no spaces: prefixes its metrics
    def score(self, reference, candidate, context: dict) -> dict[str, float]

and is called once per evaluation with the reference (BF16 source) and candidate (bundle)
outputs of the same inputs. In the generator's `evaluate` stage these are the teacher-forced
greedy tokens, int64 (N, S, 1 + n_vq): channel 0 the text head's choice, channels 1.. the 32
audio codebooks' (under the delay pattern). `context` carries `modality` ("generator-tokens"),
`ids` (the held-out input, same shape), `audio_mask` (N, S: positions scored for audio),
`config` (the source config.json) and `codec_model` (the companion codec's model name, or
None): a scorer that needs audio decodes the tokens with a codec it has. Scorers loading their
own models must find them locally (the pipeline runs with HF_HUB_OFFLINE=1).

The returned figures go into the manifest's `evaluation.metrics` as `<name>.<key>` (finite
floats, 6 significant digits), where the report shows them and `gate` can threshold them.

In the `freerun` stage (`stages.freerun.scorers`) a scorer gets decoded audio instead: reference
and candidate are lists of 1-D float waveforms (BF16's and the bundle's continuation of the same
prompt under the same sampling noise, after the voice prompt); `context` carries `modality`
("decoded-audio"), `sampling_rate` and `set`. Its figures land per set in `free_running.sets` and,
averaged over the sets, as `free.<name>.<key>` in `free_running.metrics` (gate-able).

Built in: `pipelines.scorers:PocketSphinxCER`, ASR consistency with pocketsphinx's own en-US model
(shipped inside its wheel: nothing is downloaded; `pip install '.[speech]'`).
"""
from __future__ import annotations

import importlib
import math
import re
from typing import Protocol, runtime_checkable

import torch

from .errors import PipelineError

ENTRY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
NAME = re.compile(r"^[A-Za-z_][\w-]*$")


@runtime_checkable
class Scorer(Protocol):
    name: str

    def score(self, reference, candidate, context: dict) -> dict[str, float]: ...


class ExactMatch:
    """The trivial scorer (a worked example): the fraction of positions where the candidate
    emits exactly the reference's token (or sample)."""

    name = "exact"

    def score(self, reference, candidate, context: dict) -> dict[str, float]:
        return {"match": float((torch.as_tensor(reference) == torch.as_tensor(candidate)).float().mean())}


def check_entry(entry: str) -> None:
    if not isinstance(entry, str) or not ENTRY.match(entry):
        raise ValueError(f"scorers: {entry!r} is not 'package.module:ClassName'")


def load_scorers(entries: list[str], where: str = "scorers") -> list[Scorer]:
    """Import and construct each configured scorer; one-line PipelineError on any failure."""
    out, names = [], set()
    for entry in entries:
        try:
            check_entry(entry)
        except ValueError as e:
            raise PipelineError(f"{where}: {e}") from None
        mod, cls = entry.split(":")
        try:
            scorer = getattr(importlib.import_module(mod), cls)()
        except ImportError as e:
            raise PipelineError(f"{where}: cannot import {mod!r} for scorer {entry!r} ({e})") from None
        except AttributeError:
            raise PipelineError(f"{where}: module {mod!r} has no class {cls!r}") from None
        except Exception as e:  # the user's constructor: report it in one line
            raise PipelineError(f"{where}: constructing {entry!r} failed ({type(e).__name__}: {e})") from None
        name = getattr(scorer, "name", None)
        if not isinstance(scorer, Scorer) or not isinstance(name, str) or not NAME.match(name):
            raise PipelineError(f"{where}: {entry!r} needs a `name` (letters, digits, _ or -) and a `score(reference, candidate, context)` method")
        if name in names:
            raise PipelineError(f"{where}: two scorers are named {name!r}")
        names.add(name)
        out.append(scorer)
    return out


def run_scorers(scorers: list[Scorer], reference, candidate, context: dict) -> dict[str, float]:
    """Every scorer's figures, flat as `<name>.<key>`; a non-finite or non-numeric figure is refused."""
    out = {}
    for s in scorers:
        figures = s.score(reference, candidate, context)
        if not isinstance(figures, dict):
            raise PipelineError(f"scorer {s.name!r}: score() returned {type(figures).__name__}, expected dict[str, float]")
        for key, value in sorted(figures.items()):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise PipelineError(f"scorer {s.name!r}: figure {key!r} is {value!r}, expected a finite number")
            out[f"{s.name}.{key}"] = float(f"{float(value):.6g}")
    return out


def edit_distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


class PocketSphinxCER:
    """Character error rate of the candidate's transcript against the reference's: does the
    quantized model say what BF16 says (the seeds' "identical transcripts")? pocketsphinx's bundled
    en-US acoustic model and language model; audio resampled to 16 kHz. A dither 40 dB below the
    signal goes in first: pocketsphinx's front end transcribes clean synthetic speech (espeak-ng)
    worse than the same speech with a little noise, and seeded noise keeps the transcript a function
    of the audio."""

    name = "asr"
    DITHER_DB = 40.0

    def __init__(self):
        from pocketsphinx import Decoder

        self.decoder = Decoder(samprate=16000, logfn="/dev/null")

    def transcribe(self, wave: torch.Tensor, sr: int, key: str) -> str:
        from . import portable_random as rnd

        x = torch.as_tensor(wave).double().flatten()
        if x.numel() < sr // 10:  # under 0.1 s: nothing to transcribe
            return ""
        rms = float(x.pow(2).mean().sqrt())
        x = x + rnd.normal(f"moss-quant/asr-dither/{key}", (x.numel(),)).double() * rms * 10 ** (-self.DITHER_DB / 20)
        y = torch.nn.functional.interpolate(x.float()[None, None], size=x.numel() * 16000 // sr, mode="linear",
                                            align_corners=False)[0, 0]
        pcm = (y.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().astype("<i2").tobytes()
        self.decoder.start_utt()
        self.decoder.process_raw(pcm, full_utt=True)
        self.decoder.end_utt()
        hyp = self.decoder.hyp()
        return hyp.hypstr if hyp else ""

    def score(self, reference, candidate, context: dict) -> dict[str, float]:
        sr, cers, chars = context["sampling_rate"], [], 0
        for i, (r, c) in enumerate(zip(reference, candidate)):
            key = f"{context.get('set', '')}/{i}"
            tr, tc = self.transcribe(r, sr, key), self.transcribe(c, sr, key)
            cers.append(edit_distance(tr, tc) / max(1, len(tr)) if tr or tc else 0.0)
            chars += len(tr)
        return {"cer": sum(cers) / max(1, len(cers)), "reference_chars": chars / max(1, len(cers))}


class GreedyTokens:
    """Collects both models' teacher-forced argmax tokens from `evaluate.compare`'s logits hook."""

    def __init__(self, ids: torch.Tensor):
        self.reference = torch.zeros_like(ids)
        self.candidate = torch.zeros_like(ids)

    def __call__(self, head: int, start: int, ref_logits: torch.Tensor, quant_logits: torch.Tensor) -> None:
        n = ref_logits.shape[0]
        self.reference[start:start + n, :, head] = ref_logits.argmax(-1).cpu()
        self.candidate[start:start + n, :, head] = quant_logits.argmax(-1).cpu()

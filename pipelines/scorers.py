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


class GreedyTokens:
    """Collects both models' teacher-forced argmax tokens from `evaluate.compare`'s logits hook."""

    def __init__(self, ids: torch.Tensor):
        self.reference = torch.zeros_like(ids)
        self.candidate = torch.zeros_like(ids)

    def __call__(self, head: int, start: int, ref_logits: torch.Tensor, quant_logits: torch.Tensor) -> None:
        n = ref_logits.shape[0]
        self.reference[start:start + n, :, head] = ref_logits.argmax(-1).cpu()
        self.candidate[start:start + n, :, head] = quant_logits.argmax(-1).cpu()

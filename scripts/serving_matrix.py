"""The README's measured serving cells: each generator profile's newest tiny bundle, its exported
backbone loaded by transformers at float32/float16/bfloat16, logits against the project's loader.

    .venv/bin/python scripts/serving_matrix.py [PROFILE ...]    # after `make demo`

Prints one Markdown row per profile: relative logit error per dtype, top-1 agreement range, and
the auto-round backend transformers picked (or why it did not load).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DTYPES = ("float32", "float16", "bfloat16")


def row(profile: str, work: Path) -> str:
    from transformers import AutoModelForCausalLM

    from pipelines import calibration
    from pipelines.api import newest
    from pipelines.backbone_export import export_backbone
    from pipelines.checkpoint import Checkpoint
    from pipelines.errors import PipelineError
    from pipelines.loader import load_bundle

    bundle = newest("tiny", profile)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            dest = export_backbone(bundle, work / profile)
    except PipelineError as e:
        return f"| {profile} | refused by export: {e} |"
    ours = load_bundle(bundle, dtype=torch.float32)
    ids = calibration.build("moss-heldout-v1", Checkpoint(bundle).config(), 2, 64).ids
    with torch.no_grad():
        x = ours.embed(ids)
        ref = ours.lm_heads[0](ours.language_model(inputs_embeds=x, use_cache=False).last_hidden_state)
    cells, top1s, backend = [], [], ""
    for dtype in DTYPES:
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                hf, info = AutoModelForCausalLM.from_pretrained(dest, dtype=getattr(torch, dtype), device_map="cpu",
                                                                output_loading_info=True)
        except Exception as e:  # a refusal is a cell, not a crash
            cells.append(f"refused: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        if info["missing_keys"]:
            cells.append(f"placeholder weights ({len(info['missing_keys'])} missing)")
            continue
        layer = hf.model.layers[0].mlp.down_proj
        backend = f"{type(layer).__module__.split('.')[0]}.{type(layer).__name__}"
        with torch.no_grad():
            got = hf(inputs_embeds=x.to(hf.dtype), use_cache=False).logits.float()
        cells.append(f"{((got - ref).norm() / ref.norm()).item():.2g}")
        top1s.append((got.argmax(-1) == ref.argmax(-1)).float().mean().item())
    top1 = f"{min(top1s):.3f}–{max(top1s):.3f}" if top1s else "—"
    return f"| {profile} | {' | '.join(cells)} | {top1} | `{backend}` |"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profiles", nargs="*", default=["rtn4", "autoround-q3", "sens-q3", "sens-q2", "awq4"])
    args = p.parse_args(argv)
    print(f"| bundle | {' | '.join(DTYPES)} | top-1 agreement | transformers' layer |")
    print("|---|" + "---:|" * len(DTYPES) + "---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for profile in args.profiles:
            print(row(profile, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()

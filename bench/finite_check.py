"""What the NaN/Inf check of a block's weights costs on this machine's CPU: the check
`Checkpoint.get` runs on every tensor it reads (pipelines/checkpoint.py all_finite), against the
isfinite-on-float-copies check it replaced.

    .venv/bin/python bench/finite_check.py [--runs 3]

One MOSS-TTS (Qwen3-8B) decoder block's 193 M bf16 weights, as one tensor.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipelines.checkpoint import all_finite  # noqa: E402

BLOCK_WEIGHTS = 193_000_000


def isfinite_on_float_copies(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    return all(bool(torch.isfinite(c.float()).all()) for c in t.reshape(-1).split(chunk))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    t = torch.randn(BLOCK_WEIGHTS, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    for name, check in (("isfinite on float copies (before)", isfinite_on_float_copies), ("aminmax (all_finite)", all_finite)):
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            assert check(t)
            times.append(time.perf_counter() - start)
        print(f"{name}: " + ", ".join(f"{s:.3f}" for s in times) + " s")


if __name__ == "__main__":
    main()

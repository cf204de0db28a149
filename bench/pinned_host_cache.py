"""Page-locked host memory freed stays resident until CUDA's host cache is emptied (what
`pipelines.engine.release_host_cache` does after the quantize stage's engine run).

    python bench/pinned_host_cache.py     # a CUDA machine

Prints the process's RSS after allocating two 2 GiB page-locked streams (the engine's, at 128 x 2048
tokens of an 8B), after freeing them, after `release_host_cache()`, and for a pageable 2 GiB tensor.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pipelines.engine import release_host_cache  # noqa: E402

SHAPE = (128, 2048, 4096)


def rss_gib() -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 2**20


def main() -> None:
    torch.cuda.init()
    print(f"start: {rss_gib():.2f} GiB")
    streams = [torch.empty(SHAPE, dtype=torch.bfloat16, pin_memory=True).fill_(1) for _ in range(2)]
    print(f"two page-locked 2 GiB streams: {rss_gib():.2f} GiB")
    del streams
    print(f"freed: {rss_gib():.2f} GiB")
    release_host_cache()
    print(f"after release_host_cache(): {rss_gib():.2f} GiB")
    pageable = torch.empty(SHAPE, dtype=torch.bfloat16).fill_(1)
    print(f"a pageable 2 GiB tensor: {rss_gib():.2f} GiB")
    del pageable
    print(f"freed: {rss_gib():.2f} GiB")


if __name__ == "__main__":
    main()

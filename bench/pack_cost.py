"""What computing and packing one tuned block's integers costs at the real widths, on this machine.

    .venv/bin/python bench/pack_cost.py [--device cuda] [--threads 16]

On a device other than the CPU it also computes them on the host and says whether every integer,
scale, zero and packed byte is the same.

autoround-q3 computed them on the host, where auto-round leaves the tuned block; they are now
computed on the device the block runs on next (quantizers/autoround.py tune_block). Synthetic weights and scales (the arithmetic does not depend on the values): the seven
Linears of a MOSS-TTS (Qwen3-8B) block at 3 bits, groups of 128, GPTQ packing.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from quantizers.autoround import int_weight  # noqa: E402
from quantizers.formats import pack  # noqa: E402

SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "v_proj": (1024, 4096), "o_proj": (4096, 4096),
          "gate_proj": (12288, 4096), "up_proj": (12288, 4096), "down_proj": (4096, 12288)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    layers = []
    for out_f, in_f in SHAPES.values():
        layer = nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16).to(args.device)
        layer.scale = (torch.rand(out_f, in_f // 128, generator=gen) * 0.01 + 1e-3).to(torch.bfloat16)  # on the host, as auto-round leaves it
        layer.zp, layer.bits, layer.group_size, layer.sym = 4, 3, 128, True
        layers.append(layer)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for run in range(args.runs):
        sync()
        t0 = time.perf_counter()
        ints = [int_weight(layer) for layer in layers]
        sync()
        t1 = time.perf_counter()
        for iw in ints:
            pack(iw, "gptq")
        sync()
        t2 = time.perf_counter()
        print(f"run {run + 1}: device {args.device}, {torch.get_num_threads()} threads: integers {t1 - t0:.2f} s, "
              f"packing {t2 - t1:.2f} s, a block {t2 - t0:.2f} s", flush=True)
    if args.device != "cpu":
        differ = []
        for name, layer, iw in zip(SHAPES, layers, ints):
            host = int_weight(layer.to("cpu"))
            parts, host_parts = pack(iw, "gptq").parts, pack(host, "gptq").parts  # stored on the host
            if not all(torch.equal(getattr(iw, k).cpu(), getattr(host, k)) for k in ("q", "scales", "zeros")) or \
                    parts.keys() != host_parts.keys() or not all(torch.equal(parts[k], host_parts[k]) for k in parts):
                differ.append(name)
        print(f"integers, scales, zeros and packed parts on {args.device} against the host's: "
              + (f"differ in {', '.join(differ)}" if differ else "identical in all seven Linears"), flush=True)


if __name__ == "__main__":
    main()

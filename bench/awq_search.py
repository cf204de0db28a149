"""AWQ's block search, ours against autoawq's own, on the same block and the same inputs.

    python bench/awq_search.py --blocks 2 --out bench/results/awq-search-h200.json     # GPU, full width
    python bench/awq_search.py --model tiny --blocks 2 --nsamples 8 --seqlen 64        # CPU smoke

Writes the full-shape fixture with --blocks decoder blocks once (under --work, on the device), runs
the engine's fp pass over each block capturing every Linear's inputs, then per block runs both
searches on copies of the same block and inputs: autoawq's `_search_best_scale` and
`_search_best_clip` at its own defaults (`n_parallel_calib_samples` unset: every sample at once)
and ours (quantizers.awq.search_scale / search_clip). Prints and writes, per block and search:
wall seconds (device synchronised), peak GPU memory allocated, and the quantized block's output
MSE against the FP block on the calibration inputs.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    from pipelines import engine as blocks
    from pipelines.calibration import build
    from pipelines.checkpoint import Checkpoint
    from pipelines.methods.awq import plan_groups
    from pipelines.models.moss_tts_delay import BLOCK_LINEARS, MossTTSDelayConfig
    from bench.run import block_fixture
    from quantizers.awq import AWQConfig, autoawq_quantizer, awq_block, int_weight

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="full-shape")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--nsamples", type=int, default=128)  # autoawq's defaults: 128 x 512
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--work", default="/tmp/moss-awq-bench")
    p.add_argument("--out")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    path = block_fixture(args.model, Path(args.work), args.blocks, device)
    ck = Checkpoint(path)
    mcfg = MossTTSDelayConfig.from_dict(ck.config())
    plan, _ = plan_groups(ck, mcfg, AWQConfig())
    ids = build("moss-calib-v1", ck.config(), args.nsamples, args.seqlen, path).ids
    engine = blocks.Engine(mcfg, ck.get, device, dtype, 8)
    x = blocks.embed(mcfg, ck.get, ids, dtype, device).to("cpu")
    pos = blocks.rotary(mcfg, args.seqlen, dtype, device)
    kwargs = {"position_embeddings": pos, "attention_mask": None}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    for i in range(min(args.blocks, mcfg.num_layers)):
        layer = blocks.load_block(mcfg, i, ck.get, dtype, device)
        stores = {n: [] for n in BLOCK_LINEARS}
        ref = engine.forward(layer, x, pos, {n: s.append for n, s in stores.items()})
        feats = {n: torch.cat(v) for n, v in stores.items()}
        del stores
        for search in ("autoawq", "ours"):
            cfg = AWQConfig(search=search)
            q = autoawq_quantizer(cfg)
            q.n_parallel_calib_samples = None  # autoawq's own default (every sample in one forward)
            block, f = copy.deepcopy(layer), {n: v.clone() for n, v in feats.items()}
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            sync()
            t = time.perf_counter()
            awq_block(block, f, kwargs, list(BLOCK_LINEARS), plan[i], cfg, q=q)
            sync()
            wall = time.perf_counter() - t
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            del f
            block.to(device)  # autoawq's apply_* leave modules on the host
            with torch.no_grad():
                for n in BLOCK_LINEARS:
                    m = block.get_submodule(n)
                    m.weight.copy_(int_weight(cfg, m.weight).dequantize(m.weight.dtype))
            mse = (engine.forward(block, x, pos).float() - ref.float()).pow(2).mean().item()
            row = {"block": i, "search": search, "wall_s": round(wall, 2), "peak_gpu_allocated_gib": peak and round(peak, 2),
                   "block_output_mse": mse}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del block
        x = ref
        del feats, layer
    env = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "model": args.model, "nsamples": args.nsamples, "seqlen": args.seqlen}
    print("| block | search | wall s | peak GPU GiB | block output MSE |\n|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['block']} | {r['search']} | {r['wall_s']} | {r['peak_gpu_allocated_gib']} | {r['block_output_mse']:.4g} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

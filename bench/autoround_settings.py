"""What auto-round's settings cost on one block: deterministic algorithms, torch.compile, the offload.

    python bench/autoround_settings.py --out bench/results/autoround-settings-h200.json    # GPU, full width
    python bench/autoround_settings.py --model tiny --nsamples 8 --seqlen 64 --iters 4     # CPU smoke
    python bench/autoround_settings.py --settings 0,4 --profile 20                          # where the time goes

Writes the full-shape fixture with one decoder block once (under --work, on the device), runs the
engine's fp pass over block 0 on the calibration set (auto-round's defaults: 128 x 2048 tokens),
then tunes copies of that block with `quantizers.autoround.tune_block` (what autoround-q3 runs) under
each setting, twice in a row: the first run pays the compile, the second shows the steady state,
and the two runs' integers compared say whether the setting repeats itself bit for bit. Prints and
writes per run: wall seconds (device synchronised), peak GPU allocated, the tuned block's output MSE
against the FP block, and whether its integers equal the setting's first run's and the first
setting's (does the setting change the result, or only its speed?). A setting that fails to run
(torch.compile without a compiler, say) is a row with its error.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (name, deterministic algorithms, torch.compile, low_gpu_mem_usage: the block inputs and reference
# outputs on the host, a batch at a time on the GPU[, option]). Every setting keeps auto-round's
# best-so-far parameters in place on the device (`best_params_in_place`); until commit 9de7398 they
# were auto-round's own host copies, and "ours" took 37.7 s where it now takes what row 0 says. On
# the host, the batches are staged a step ahead (`staged_batches`) unless the option says "gathered".
SETTINGS = (("deterministic, on the host", True, False, True),
            ("deterministic + compile, on the host", True, True, True),
            ("not deterministic, on the host", False, False, True),
            ("not deterministic + compile, on the host", False, True, True),
            ("deterministic, on the GPU", True, False, False),
            ("deterministic + compile, on the GPU", True, True, False),
            ("not deterministic + compile, on the GPU (auto-round's defaults)", False, True, False),
            ("deterministic + compile, inputs on the GPU, reference on the host", True, True, True, "inputs"),
            ("deterministic + compile, on the host, gathered by auto-round's loop (not staged)", True, True, True,
             "gathered"))


def main(argv=None) -> None:
    from pipelines import engine as blocks
    from pipelines.calibration import build
    from pipelines.checkpoint import Checkpoint
    from pipelines.models.moss_tts_delay import MossTTSDelayConfig
    from bench.run import block_fixture
    from contextlib import nullcontext

    from quantizers import autoround
    from quantizers.autoround import AutoRoundConfig, tune_block

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="full-shape")
    p.add_argument("--nsamples", type=int, default=128)  # auto-round's defaults: 128 x 2048, 200 iters, batch 8
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--settings", help="comma-separated indices into SETTINGS (default all)")
    p.add_argument("--runs", type=int, default=2, help="runs per setting (the first pays the compile)")
    p.add_argument("--profile", type=int, metavar="ITERS",
                   help="instead: one run per setting of ITERS iterations under torch.profiler, its top kernels and ops")
    p.add_argument("--work", default="/tmp/moss-ar-bench")
    p.add_argument("--out")
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    path = block_fixture(args.model, Path(args.work), 1, device)
    ck = Checkpoint(path)
    mcfg = MossTTSDelayConfig.from_dict(ck.config())
    ids = build("moss-calib-v1", ck.config(), args.nsamples, args.seqlen, path).ids
    engine = blocks.Engine(mcfg, ck.get, device, torch.bfloat16, 8)
    x = engine.to_host(blocks.embed(mcfg, ck.get, ids, torch.bfloat16, device))  # page-locked on a GPU, as the engine's streams
    pos = blocks.rotary(mcfg, args.seqlen, torch.bfloat16, device)
    layer = blocks.load_block(mcfg, 0, ck.get, torch.bfloat16, device)
    ref = engine.forward(layer, x, pos)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    chosen = [SETTINGS[int(i)] for i in args.settings.split(",")] if args.settings else SETTINGS
    env = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "model": args.model, "nsamples": args.nsamples, "seqlen": args.seqlen, "iters": args.iters}
    rows, baseline = [], None
    staged = autoround.staged_batches
    for name, det, comp, low, *option in chosen:
        placed = option == ["inputs"]
        autoround.staged_batches = (lambda device: nullcontext()) if option == ["gathered"] else staged
        cfg = AutoRoundConfig(nsamples=args.nsamples, seqlen=args.seqlen, iters=args.profile or args.iters,
                              enable_deterministic_algorithms=det, enable_torch_compile=comp, low_gpu_mem_usage=low)
        first = None
        for run in range(1, 2 if args.profile else args.runs + 1):
            row = {"setting": name, "run": run, **{k: v for k, v in dataclasses.asdict(cfg).items() if k in (
                "enable_deterministic_algorithms", "enable_torch_compile", "low_gpu_mem_usage")}}
            block = copy.deepcopy(layer)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            sync()
            t = time.perf_counter()
            try:  # `placed`: the inputs moved to the device here (inside the timing and the peak), the reference not
                xin = x.to(device) if placed else x
                if args.profile:
                    ints = profiled(lambda: tune_block(block, xin, ref, pos, cfg, seed=0, device=device), name, cuda)
                else:
                    ints = tune_block(block, xin, ref, pos, cfg, seed=0, device=device)
            except Exception as e:  # a setting that cannot run here (no compiler for torch.compile, say) is a row too
                rows.append(row | {"error": f"{type(e).__name__}: {e}"[:500]})
                print(json.dumps(rows[-1]), flush=True)
                break
            sync()
            wall = time.perf_counter() - t
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            out = engine.forward(block, x, pos)
            sq = sum((out[s:s + 8].to(device).float() - ref[s:s + 8].to(device).float()).pow(2).sum().item()
                     for s in range(0, out.shape[0], 8))
            codes = {n: iw.q.cpu() for n, iw in ints.items()}  # kept across settings: not in the next peak
            same = None if first is None else all(torch.equal(codes[n], first[n]) for n in codes)
            first, baseline = first or codes, baseline or codes
            rows.append(row | {"wall_s": round(wall, 2), "peak_gpu_allocated_gib": peak and round(peak, 2),
                               "block_output_mse": sq / out.numel(), "codes_equal_run_1": same,
                               "codes_equal_first_setting": all(torch.equal(codes[n], baseline[n]) for n in codes)})
            print(json.dumps(rows[-1]), flush=True)
            if args.out:  # after every row: a run cut off by a time limit keeps what it measured
                Path(args.out).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
            del block, out, ints, xin
    print("| setting | run | wall s | peak GPU GiB | block output MSE | codes equal run 1 | codes equal first setting's |\n"
          "|---|---:|---:|---:|---:|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['setting']} | {r['run']} | {r['error']} | | | | |")
            continue
        print(f"| {r['setting']} | {r['run']} | {r['wall_s']} | {r['peak_gpu_allocated_gib']} "
              f"| {r['block_output_mse']:.4g} | {r['codes_equal_run_1']} | {r['codes_equal_first_setting']} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))


def profiled(fn, name: str, cuda: bool):
    """`fn` under torch.profiler: the ops and kernels that take the time, by total device and host time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        out = fn()
    table = prof.key_averages()
    for key in (("cuda_time_total", "self_cpu_time_total") if cuda else ("self_cpu_time_total",)):
        print(f"## {name}: top by {key}\n" + table.table(sort_by=key, row_limit=25, max_name_column_width=60), flush=True)
    return out


if __name__ == "__main__":
    main()

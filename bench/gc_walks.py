"""What auto-round's garbage collections cost each tuned block, with and without `tune_block`'s freeze.

    .venv/bin/python bench/gc_walks.py [--blocks 3]

auto-round frees memory with full `gc.collect()` calls while it tunes a block. A full collection
walks every object the collector tracks, and with torch, transformers and auto-round loaded that
is hundreds of thousands. `tune_block` sets the objects alive before aside while auto-round runs
(`collections_of_new_objects_only`). This tunes blocks of the tiny fixture as autoround-q3 does
(2 iterations: the collections, not the tuning, are what is timed), first as `tune_block` runs,
then with the freeze left out, and prints per block the collections made, their summed time and
the objects the collector tracked when the block started. The block's work does not depend on the
model's width, so the same collections happen per block at 8B widths.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=3, help="blocks tuned per setting (the first pays warm-up)")
    args = p.parse_args(argv)

    from pipelines import calibration
    from pipelines.checkpoint import Checkpoint
    from pipelines.engine import Engine, embed, load_block, rotary
    from pipelines.models.moss_tts_delay import MossTTSDelayConfig
    from pipelines.source import load_model_spec, resolve_path
    from quantizers import autoround
    from quantizers.autoround import AutoRoundConfig, tune_block

    ckpt = Checkpoint(resolve_path(load_model_spec("tiny")))
    mcfg = MossTTSDelayConfig.from_dict(ckpt.config())
    ids = calibration.build("moss-calib-v1", ckpt.config(), 4, 64).ids
    x, pos = embed(mcfg, ckpt.get, ids), rotary(mcfg, 64)
    reference = Engine(mcfg, ckpt.get).forward(load_block(mcfg, 0, ckpt.get), x, pos)
    cfg = AutoRoundConfig(iters=2, nsamples=4, seqlen=64, batch_size=4)

    walls: list[float] = []
    collect = gc.collect

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return collect(*a, **k)
        finally:
            walls.append(time.perf_counter() - t)

    frozen = autoround.collections_of_new_objects_only
    gc.collect = timed  # auto-round calls gc.collect by its module attribute
    try:
        for setting, scope in (("as tune_block runs (objects alive before set aside)", frozen),
                               ("without the freeze", contextlib.nullcontext)):
            autoround.collections_of_new_objects_only = scope
            for b in range(args.blocks):
                tracked = len(gc.get_objects())
                walls.clear()
                t = time.perf_counter()
                tune_block(load_block(mcfg, 0, ckpt.get), x, reference, pos, cfg, seed=0, device="cpu")
                wall = time.perf_counter() - t
                print(f"{setting}, block {b + 1}: {len(walls)} collections, {sum(walls):.3f} s of {wall:.3f} s "
                      f"(each {min(walls, default=0):.3f}-{max(walls, default=0):.3f} s), {tracked} objects tracked",
                      flush=True)
    finally:
        gc.collect, autoround.collections_of_new_objects_only = collect, frozen


if __name__ == "__main__":
    main()

"""Run a bundle's GGUF in MOSS's own llama.cpp runtime and compare its greedy codes with ours.

    .venv/bin/python scripts/llama_moss_parity.py --llama-cpp PATH [--profile rtn4] [--steps 64] [--work DIR]

PATH is a local checkout of a llama.cpp fork with the `moss-tts-delay` architecture (the one
OpenMOSS's parity script clones: expectqwq/llama.cpp). The script builds its `llama-moss-tts`
target (CPU, cmake + ninja, once), builds the profile on the `tiny-vocab` fixture (tiny, with MOSS's
real 155648-token text vocabulary, so the upstream special token ids the runtime assumes are
real), exports the GGUF, writes a prompt (a held-out text, then audio_start) as the runtime's
generation input, runs it greedily (temperatures 0, no repetition penalty) with --dump-raw-codes,
generates greedily from the same prompt with the project's own loader and MOSS's delay rules
(pipelines/generate.py), and prints the agreement. Nothing third-party is copied into the repo.
"""
from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GEN_MAGIC, CODES_MAGIC = 0x4652474D, 0x53444F43  # "MGRF", "CODS" (tools/tts/moss-tts.cpp)
SMALL = {"calibrate": {"nsamples": 8, "seqlen": 128},
         "quantize": {"nsamples": 8, "seqlen": 128, "iters": 10, "batch_size": 4},
         "evaluate": {"nsamples": 2, "seqlen": 128}}


def build_runtime(llama: Path) -> Path:
    for built in (llama / "build" / "bin" / "llama-moss-tts", llama / "build-moss" / "bin" / "llama-moss-tts"):
        if built.exists():  # an earlier build of the checkout (its own or this script's)
            return built
    binary = llama / "build-moss" / "bin" / "llama-moss-tts"
    if not binary.exists():
        subprocess.run(["cmake", "-S", str(llama), "-B", str(llama / "build-moss"), "-G", "Ninja",
                        "-DCMAKE_BUILD_TYPE=Release", "-DGGML_CUDA=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                        "-DLLAMA_OPENSSL=OFF"], check=True)
        subprocess.run(["ninja", "-C", str(llama / "build-moss"), "llama-moss-tts"], check=True)
    return binary


def bundle_for(profile: str, work: Path) -> Path:
    from bench.run import pinned
    from pipelines.api import build_from, plan
    from pipelines.fixtures import write_fixture
    from pipelines.source import ModelSpec

    fixture = work / "tiny-vocab"
    if not fixture.exists():
        write_fixture("tiny-vocab", fixture)
    spec = pinned(ModelSpec(name="tiny-vocab", kind="generator", repo="moss-quant/fixture-tiny-vocab",
                            revision="fixture-v1", fixture="tiny-vocab"), fixture)
    prof = plan(profile)
    overrides = {st: {k: v for k, v in SMALL.get(st, {}).items() if k in _fields(p)} for st, p in prof.stages.items()}
    ctx = build_from(profile, spec, model_path=fixture, cache_root=work / "cache", bundle_root=work / "bundles",
                     overrides={k: v for k, v in overrides.items() if v})
    return ctx.bundle


def _fields(params) -> set[str]:
    import dataclasses

    return {f.name for f in dataclasses.fields(getattr(params, "config", params))}


def prompt_rows(config: dict, text: str) -> torch.Tensor:
    from pipelines.generate import special_ids

    ids, n_vq, pad = special_ids(config), config["n_vq"], config["audio_pad_code"]
    tokens = [ids["im_start_token_id"], *text.encode("utf-8"), ids["im_end_token_id"], ids["audio_start_token_id"]]
    rows = torch.full((len(tokens), 1 + n_vq), pad, dtype=torch.long)
    rows[:, 0] = torch.tensor(tokens)
    return rows


def write_generation_input(rows: torch.Tensor, path: Path, pad: int) -> None:
    n, stride = rows.shape
    with open(path, "wb") as f:
        f.write(struct.pack("<IIIIIII", GEN_MAGIC, 1, n, stride - 1, pad, n, 0))
        f.write(rows.to(torch.int32).numpy().astype("<i4").tobytes())


def read_codes(path: Path) -> torch.Tensor:
    data = path.read_bytes()
    magic, version, frames, n_vq = struct.unpack("<IIII", data[:16])
    if magic != CODES_MAGIC or version != 1:
        raise SystemExit(f"{path}: not a llama-moss-tts codes file")
    return torch.from_numpy(np.frombuffer(data[16:], dtype="<i4").reshape(frames, n_vq).astype(np.int64))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, type=Path, help="checkout of the fork with moss-tts-delay")
    ap.add_argument("--profile", default="rtn4")
    ap.add_argument("--steps", type=int, default=64, help="generation steps (rows) on both sides")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moss-llama-parity"))
    args = ap.parse_args(argv)

    from pipelines.calibration import load_dataset_spec
    from pipelines.generate import generate, raw_codes, special_ids
    from pipelines.gguf_export import GGUFParams, write_gguf
    from pipelines.loader import bundle_view, load_bundle

    binary = build_runtime(args.llama_cpp)
    args.work.mkdir(parents=True, exist_ok=True)
    bundle = bundle_for(args.profile, args.work)
    view, config = bundle_view(bundle)
    gguf_path = args.work / f"{args.profile}.gguf"
    gguf_path.unlink(missing_ok=True)
    record = write_gguf(view, config, args.work / "tiny-vocab", True, GGUFParams(), gguf_path, {"bundle": bundle.name})
    text = load_dataset_spec("moss-heldout-v1")[0]["texts"][2]
    rows = prompt_rows(config, text)
    write_generation_input(rows, args.work / "prompt.bin", config["audio_pad_code"])
    codes_file = args.work / "codes.bin"
    codes_file.unlink(missing_ok=True)
    run = subprocess.run([str(binary), "-m", str(gguf_path), "--generation-input", str(args.work / "prompt.bin"),
                          "--max-new-tokens", str(args.steps), "--text-temperature", "0", "--audio-temperature", "0",
                          "--audio-repetition-penalty", "1.0", "--dump-raw-codes", str(codes_file)],
                         capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stderr[-2000:], file=sys.stderr)
        return 1
    theirs = read_codes(codes_file)
    model = load_bundle(bundle, dtype=torch.float32)
    ours_rows = generate(model, rows, args.steps, special_ids(config))
    ours = raw_codes(ours_rows, config["n_vq"], config["audio_pad_code"])
    n = min(len(ours), len(theirs))
    same = (ours[:n] == theirs[:n])
    first = next((t for t in range(n) if not bool(same[t].all())), None)
    out = {"profile": args.profile, "bundle": bundle.name, "gguf_bpw": record["effective_bpw"],
           "gguf_types": sorted({v["type"] for v in record["tensors"].values()}), "steps": args.steps,
           "frames": {"ours": len(ours), "llama_cpp": len(theirs)},
           "frames_identical": int(bool(same.all(dim=1).all()) and len(ours) == len(theirs)),
           "first_differing_frame": first, "code_agreement": round(float(same.float().mean()), 4) if n else None,
           "frame0_agreement": round(float(same[0].float().mean()), 4) if n else None}
    print(json.dumps(out, indent=2))
    shutil.copyfile(codes_file, args.work / f"codes-{args.profile}.bin")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

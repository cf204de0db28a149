"""Are GPU builds bit-identical run to run, and what does determinism cost?

For each profile, builds the tiny model twice in fresh folders (no stage cache) in each mode and
compares every bundle file byte for byte:
  default        torch's defaults (cuDNN/cuBLAS heuristics, TF32 off for matmul as torch ships)
  deterministic  torch.use_deterministic_algorithms(True) + CUBLAS_WORKSPACE_CONFIG=:4096:8
Each build runs in a fresh subprocess so the mode applies from process start.

    python bench/determinism.py --profiles rtn4,awq4,autoround-q3,sens-q3,codec-fp8 --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import os, sys, json, time, torch
if sys.argv[4] == "deterministic":
    torch.use_deterministic_algorithms(True)
from pipelines.cli import build
t = time.perf_counter()
from pathlib import Path
ctx = build(sys.argv[1], sys.argv[2], use_cache=False, cache_root=Path(sys.argv[3]) / "cache", bundle_root=Path(sys.argv[3]) / "bundles")
print(json.dumps({"bundle": str(ctx.bundle), "wall_s": time.perf_counter() - t,
                  "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}))
"""


def one_build(profile: str, model: str, folder: Path, mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if mode == "deterministic":
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    r = subprocess.run([sys.executable, "-c", CHILD, profile, model, str(folder), mode], env=env,
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def differing_files(a: Path, b: Path) -> list[str]:
    fa = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    fb = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    return sorted(str(f) for f in fa | fb if f not in fa or f not in fb or (a / f).read_bytes() != (b / f).read_bytes())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--profiles", default="rtn4,awq4,autoround-q3,sens-q3,codec-fp8")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--modes", default="default,deterministic")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    for profile in args.profiles.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                runs = [one_build(profile, args.model, Path(tmp) / f"run{i}", mode) for i in (1, 2)]
                if any("error" in r for r in runs):
                    rows.append({"profile": profile, "mode": mode, "error": next(r["error"] for r in runs if "error" in r)})
                    continue
                diff = differing_files(Path(runs[0]["bundle"]), Path(runs[1]["bundle"]))
                rows.append({"profile": profile, "mode": mode, "identical": not diff, "differing": diff,
                             "wall_s": [round(r["wall_s"], 2) for r in runs], "device": runs[0]["device"]})
            print(json.dumps(rows[-1]), flush=True)
    lines = ["| profile | mode | run-to-run identical | wall s (run 1, run 2) | differing files |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['profile']} | {r['mode']} | error: {r['error']} | | |")
        else:
            lines.append(f"| {r['profile']} | {r['mode']} | {'yes' if r['identical'] else 'NO'} | "
                         f"{r['wall_s'][0]}, {r['wall_s'][1]} | {', '.join(r['differing']) or '-'} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "determinism.json").write_text(json.dumps(rows, indent=2))
        (Path(args.out) / "determinism.md").write_text(table + "\n")


if __name__ == "__main__":
    main()

"""The determinism matrix: per profile, what a rebuild proves in four situations.

Each cell builds the profile on the tiny fixtures in a fresh process (environment A), then runs
`rebuild` on that bundle in another fresh process (environment B) and records its verdict
(identical / equivalent / differs / nondeterministic) with the measured figures behind it:

  rerun       A = B = this machine as it is
  cpu-kernel  A: ATEN_CPU_CAPABILITY=default, B: the CPU's own best kernel (AVX2 or AVX512)
  cpu-gpu     A: CPU only (CUDA hidden), B: the GPU
  gpu-rerun   A = B = the GPU

    .venv/bin/python bench/determinism.py --cells rerun,cpu-kernel --out bench/results/determinism-cpu.json
    python bench/determinism.py --cells cpu-gpu,gpu-rerun --out bench/results/determinism-gpu.json   # on a GPU machine
    .venv/bin/python bench/determinism.py --table bench/results/determinism-*.json                    # the README's matrix
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROFILES = "rtn4,awq4,autoround-q3,sens-q3,sens-q2,codec-fp8"
CELLS = ("rerun", "cpu-kernel", "cpu-gpu", "gpu-rerun")

BUILD = r"""
import json, sys
from pathlib import Path
from pipelines.api import build
ctx = build(sys.argv[1], sys.argv[2], use_cache=False, cache_root=Path(sys.argv[3]) / "cache", bundle_root=Path(sys.argv[3]) / "bundles")
print(json.dumps({"bundle": str(ctx.bundle), "environment": ctx.environments["quantize"]}))
"""

REBUILD = r"""
import json, math, sys
from pathlib import Path
from pipelines.api import rebuild
v, _ = rebuild(Path(sys.argv[1]), scratch=Path(sys.argv[2]), log=lambda m: None)
codes = [t.mismatch for t in v.tensors if t.kind == "codes"]
figs = [abs(y - x) / abs(x) if x else 0.0 for x, y, _ in v.judged.values()]  # the gated figures rebuild judges
print(json.dumps({"verdict": v.verdict, "environment": v.environment,
                  "tensors_differing": len(v.tensors), "max_code_mismatch": max(codes, default=0.0),
                  "max_figure_rel_delta": max(figs, default=0.0), "lines": v.lines[-1:]}))
"""


def environments(cell: str) -> tuple[dict, dict]:
    if cell == "rerun":
        return {}, {}
    if cell == "cpu-kernel":
        return {"ATEN_CPU_CAPABILITY": "default", "CUDA_VISIBLE_DEVICES": ""}, {"CUDA_VISIBLE_DEVICES": ""}
    if cell == "cpu-gpu":
        return {"CUDA_VISIBLE_DEVICES": ""}, {}
    if cell == "gpu-rerun":
        return {}, {}
    raise SystemExit(f"unknown cell {cell!r} (known: {', '.join(CELLS)})")


def _run(code: str, args: list[str], extra_env: dict) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra_env)
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def cell(profile: str, model: str, name: str) -> dict:
    env_a, env_b = environments(name)
    if name in ("cpu-gpu", "gpu-rerun"):
        import torch

        if not torch.cuda.is_available():
            return {"profile": profile, "cell": name, "skipped": "no GPU on this machine"}
    import time

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        built = _run(BUILD, [profile, model, str(Path(tmp) / "a")], env_a)
        if "error" in built:
            return {"profile": profile, "cell": name, "error": built["error"]}
        t1 = time.perf_counter()
        out = _run(REBUILD, [built["bundle"], str(Path(tmp) / "b")], env_b)
    a = built["environment"]
    return {"profile": profile, "cell": name, "built_on": _where(a), **out,
            "wall_s": {"build": round(t1 - t0, 1), "rebuild": round(time.perf_counter() - t1, 1)}}


def _where(env: dict) -> str:
    gpu = env.get("gpu")
    return gpu["name"] if gpu else f"CPU {env['cpu']['vendor']} family {env['cpu']['family']} ({env['cpu']['torch_capability']})"


def table(rows: list[dict]) -> str:
    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    by = {(r["profile"], r["cell"]): r for r in rows}
    head = "| profile | " + " | ".join(CELLS) + " |"
    lines = [head, "|---" * (len(CELLS) + 1) + "|"]
    for p in profiles:
        cells = []
        for c in CELLS:
            r = by.get((p, c))
            if r is None or "skipped" in r:
                cells.append("not measured")
            elif "error" in r:
                cells.append(f"error: {r['error']}")
            elif r["verdict"] == "identical":
                cells.append("identical")
            else:
                figs = (f", gated figures ≤ {100 * r['max_figure_rel_delta']:.2f}%" if "max_figure_rel_delta" in r else "")
                cells.append(f"{r['verdict']} (codes ≤ {100 * r['max_code_mismatch']:.2f}%{figs})")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    where = sorted({f"{r['cell']}: built on {r['built_on']}" for r in rows if "built_on" in r})
    return "\n".join(lines) + "\n\n" + "; ".join(where)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profiles", default=PROFILES)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--cells", default="rerun,cpu-kernel")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--jobs", type=int, default=1, help="cells run side by side (each in its own processes)")
    ap.add_argument("--table", nargs="*", help="print the markdown matrix from these JSON files and exit")
    args = ap.parse_args(argv)
    if args.table is not None:
        rows = [r for f in args.table for r in json.loads(Path(f).read_text())]
        print(table(rows))
        return
    from concurrent.futures import ThreadPoolExecutor, as_completed

    # Side-by-side cells share the cores: each process gets its share of threads (oversubscribed
    # CPU builds crawl). Rows are written as they finish, so a run cut short keeps what it measured.
    threads = str(max(1, (os.cpu_count() or 1) // args.jobs))
    os.environ.setdefault("OMP_NUM_THREADS", threads)
    jobs = [(p, c) for p in args.profiles.split(",") for c in args.cells.split(",")]
    rows = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for fut in as_completed([pool.submit(cell, p, args.model, c) for p, c in jobs]):
            rows.append(fut.result())
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    order = {j: i for i, j in enumerate(jobs)}
    rows.sort(key=lambda r: order[(r["profile"], r["cell"])])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()

"""Behaviour preserved? Compare every profile's bundle built by two versions of the code.

    .venv/bin/python scripts/compare_builds.py BEFORE_ARTIFACTS AFTER_ARTIFACTS

For each profile's newest bundle under both roots: every safetensors tensor (name, dtype, shape,
bytes), config.json, and the manifest with what is expected to move taken out: stage keys and
version ids (they hash the code), the environment, the recipe file's hash (the recipe's schema
changed) and fields that moved on purpose, compared at their new place (an RTN baseline recorded
by a method is now the evaluate stage's `evaluation.baseline`; the codec's `validation` is now its
`evaluation`). Prints one line per profile and exits 1 if anything else differs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open

PROFILES = {"tiny": ("rtn4", "awq4", "autoround-q3", "sens-q3", "sens-q2"), "codec-tiny": ("codec-fp8",)}
# Profiles whose algorithm is driven differently on purpose: judged by their gated figures, within
# the tolerances their recipe declares for a rebuild elsewhere (`rebuild:`), not byte for byte.
CHANGED_ON_PURPOSE = {"autoround-q3": "auto-round driven one block at a time through quantize_block, per-block seeds"}
DROPPED = ("stage_keys", "version", "code_version", "environment", "environment_by_stage", "stages")
# method_details entries that were evaluation figures (now the evaluate stage's), by method
MOVED_DETAILS = {"awq": ("awq", "baseline_rtn", "heldout"), "autoround": ("autoround_metrics", "baseline_rtn", "fidelity_dataset")}


def newest(folder: Path) -> Path:
    index = folder / "index.json"
    if index.exists():
        return folder / json.loads(index.read_text())["versions"][-1]
    return max((p for p in folder.glob("v1-*") if (p / "manifest.json").exists()), key=lambda p: p.stat().st_mtime)


def tensors(bundle: Path) -> dict[str, tuple]:
    out = {}
    for f in sorted(bundle.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                out[k] = (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


def normalised(m: dict) -> tuple[dict, dict | None]:
    """(the manifest without what moves on purpose, the RTN baseline figures wherever recorded)."""
    m = json.loads(json.dumps(m))
    for k in DROPPED:
        m.pop(k, None)
    m.get("files", {}).pop("recipe.yaml", None)
    baseline = None
    details = m.get("method_details") or {}
    b = details.get("baseline_rtn")
    if b is not None:  # awq wrote the figures inline beside a "quantizer" label, autoround under "metrics"
        baseline = {k: v for k, v in b.get("metrics", b).items() if k != "quantizer"}
    for k in MOVED_DETAILS.get(m.get("method"), ()):
        details.pop(k, None)
    if m.get("validation") is not None:  # the codec's figures: now under evaluation
        m["evaluation"] = m.pop("validation")
    m.pop("validation", None)
    ev = m.get("evaluation") or {}
    if "baseline" in ev:
        baseline = ev.pop("baseline")["metrics"]
    return m, baseline


def diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in diff(a.get(k), b.get(k), f"{path}.{k}" if path else k)]
    return [] if a == b else [f"{path}: {json.dumps(a)[:80]} -> {json.dumps(b)[:80]}"]


def compare(before: Path, after: Path) -> list[str]:
    problems = []
    ta, tb = tensors(before), tensors(after)
    changed = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
    if changed:
        problems.append(f"{len(changed)} of {len(ta)} tensors differ, e.g. {changed[0]}")
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (before, after))
    problems += [f"config.json {d}" for d in diff(ca, cb)]
    (ma, ba), (mb, bb) = (normalised(json.loads((p / "manifest.json").read_text())) for p in (before, after))
    problems += [f"manifest {d}" for d in diff(ma, mb)]
    if ba != bb:
        problems.append(f"RTN baseline figures {json.dumps(ba)[:80]} -> {json.dumps(bb)[:80]}")
    return problems


def _gated(before: Path, after: Path):
    import yaml

    ma, mb = (json.loads((p / "manifest.json").read_text()) for p in (before, after))
    tol = yaml.safe_load((after / "recipe.yaml").read_text())["rebuild"]
    for check in ma["gate"]["checks"]:
        x, y = ma["evaluation"]["metrics"][check["metric"]], mb["evaluation"]["metrics"][check["metric"]]
        yield check["metric"], x, y, tol["max_metric_rel_delta"] * abs(x) + tol["gate_margin"] * abs(check["threshold"])


def equivalent(before: Path, after: Path) -> list[str]:
    out = [f"{k}: {x:.6g} -> {y:.6g} (tolerance {t:.4g})" for k, x, y, t in _gated(before, after) if abs(y - x) > t]
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (before, after))
    out += [f"config.json {d}" for d in diff({k: v for k, v in ca.items() if k != "quantization_config"},
                                             {k: v for k, v in cb.items() if k != "quantization_config"})]
    return out


def figures(before: Path, after: Path) -> str:
    return ", ".join(f"{k} {x:.4g} -> {y:.4g}" for k, x, y, _ in _gated(before, after))


def main(argv=None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    roots = [Path(a) for a in args]
    bad = 0
    for model, profiles in PROFILES.items():
        for profile in profiles:
            a, b = (newest(r / model / profile) for r in roots)
            if profile in CHANGED_ON_PURPOSE:
                problems = equivalent(a, b)
                bad += bool(problems)
                print(f"{profile} ({CHANGED_ON_PURPOSE[profile]}): " + ("; ".join(problems) or "equivalent: " + figures(a, b)))
                continue
            problems = compare(a, b)
            bad += bool(problems)
            print(f"{profile}: " + ("same tensors, config.json and manifest content" if not problems else
                                    "; ".join(problems[:6]) + (f" (+{len(problems) - 6} more)" if len(problems) > 6 else "")))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

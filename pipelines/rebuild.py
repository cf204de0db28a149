"""What a rebuild proves: the comparison of a bundle with its rebuild (`api.rebuild` makes the
rebuild in a scratch folder with no stage cache; this module judges it). One of four verdicts:

- `identical` (exit 0): every payload file (what a runtime loads: weights, config.json,
  recipe.yaml, measurement.json) has the recorded bytes. Evaluation outputs (`report/`: decoded
  WAVs) made in another environment may differ, and are named.
- bytes differ, environment fingerprints the same: a determinism bug (exit 6) — nothing the
  manifest records explains the difference.
- bytes differ, fingerprints differ (another CPU kernel, GPU, library): a measured comparison,
  per quantized tensor the fraction of integer codes that differ and the max |dequantized
  difference|, and the rebuilt bundle's evaluation figures against the original's, judged by
  the tolerances in the recipe's `rebuild:` section: `equivalent` (exit 5) or `differs` (exit 4).

"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from . import manifest

IDENTICAL, EQUIVALENT, DIFFERS, NONDETERMINISTIC = "identical", "equivalent", "differs", "nondeterministic"
EXIT = {IDENTICAL: 0, DIFFERS: 4, EQUIVALENT: 5, NONDETERMINISTIC: 6}


@dataclass
class TensorDiff:
    name: str
    kind: str  # "codes" (quantized) or "values" (stored as is)
    mismatch: float  # fraction of codes (or values) that differ
    max_abs_diff: float  # of the dequantized weights


@dataclass
class Verdict:
    verdict: str
    lines: list[str] = field(default_factory=list)
    environment: list[str] = field(default_factory=list)  # fingerprint differences
    tensors: list[TensorDiff] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # figure -> (original, rebuilt, relative delta)
    judged: dict = field(default_factory=dict)  # the gated figures -> (original, rebuilt, allowed |delta|)

    @property
    def exit_code(self) -> int:
        return EXIT[self.verdict]


# Free-running figures come from sampled generations that can fork at a changed rounding (the
# same prompts under another CPU kernel draw other rows): a rebuild reports how they moved but does
# not judge them; the weights and the teacher-forced figures carry the equivalence.
FREE_RUNNING = "free_running"
EVALUATION_OUTPUTS = "report/"  # decoded WAVs etc.: products of the evaluation, judged like its figures


def payload_diffs(a: dict, b: dict) -> tuple[list[str], list[str]]:
    """(payload files, evaluation outputs) that are missing on one side or hash differently. The
    payload is what a runtime loads: weights, config.json, recipe.yaml, measurement.json."""
    fa, fb = a["files"], b["files"]
    payload, outputs = [], []
    for name in sorted(set(fa) | set(fb)):
        if name not in fa or name not in fb:
            line = f"{name}: only in {'the bundle' if name in fa else 'the rebuild'}"
        elif fa[name]["sha256"] != fb[name]["sha256"]:
            line = f"{name}: differs"
        else:
            continue
        (outputs if name.startswith(EVALUATION_OUTPUTS) else payload).append(line)
    return payload, outputs


def tensor_diffs(original: Path, rebuilt: Path) -> list[TensorDiff]:
    """Every source tensor whose stored form differs: code mismatch and dequantized difference."""
    from .loader import bundle_view

    va, _ = bundle_view(original)
    vb, _ = bundle_view(rebuilt)
    names_a, names_b = set(va.names()), set(vb.names())
    out = []
    for name in sorted(names_a | names_b):
        if name not in names_a or name not in names_b:
            out.append(TensorDiff(name, "missing", 1.0, math.inf))
            continue
        ca, cb = va.codes(name), vb.codes(name)
        if (ca is None) != (cb is None):
            out.append(TensorDiff(name, "format", 1.0, math.inf))
            continue
        if ca is None:
            ca, cb, kind = va(name), vb(name), "values"
        else:
            kind = "codes"
        if ca.shape != cb.shape or ca.dtype != cb.dtype:
            out.append(TensorDiff(name, f"{ca.dtype}{list(ca.shape)} vs {cb.dtype}{list(cb.shape)}", 1.0, math.inf))
            continue
        mismatch = float((ca != cb).double().mean())
        diff = float((va(name).double() - vb(name).double()).abs().max())
        if mismatch or diff:
            out.append(TensorDiff(name, kind, mismatch, diff))
    return out


def _figures(manifest: dict) -> dict[str, float]:
    """Every numeric evaluation figure (lists flattened as name[i])."""
    out = {}
    for section in ("evaluation", FREE_RUNNING, "validation"):
        metrics = (manifest.get(section) or {}).get("metrics") or {}
        for k, v in sorted(metrics.items()):
            if isinstance(v, bool):
                continue
            if isinstance(v, (int, float)):
                out[f"{section}.{k}"] = float(v)
            elif isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
                out.update({f"{section}.{k}[{i}]": float(x) for i, x in enumerate(v)})
    return out


def metric_deltas(a: dict, b: dict) -> dict[str, tuple[float, float, float]]:
    fa, fb = _figures(a), _figures(b)
    out = {}
    for k in sorted(set(fa) | set(fb)):
        x, y = fa.get(k, math.nan), fb.get(k, math.nan)
        out[k] = (x, y, abs(y - x) / abs(x) if x else (0.0 if y == x else math.inf))
    return out


def judge(original: Path, rebuilt: Path) -> Verdict:
    from .environment import differences
    from .profile import RebuildTolerance, build_params

    a, b = manifest.read(original), manifest.read(rebuilt)
    files, outputs = payload_diffs(a, b)
    env = differences(a.get("environment") or {}, b.get("environment") or {})
    if a.get("code_version") != b.get("code_version"):
        env.insert(0, f"code_version: built with {str(a.get('code_version'))[:12]}, now {str(b.get('code_version'))[:12]} "
                      f"(the project's own code changed)")
    if not files:
        notes = [f"(evaluation output {line}: decoded in another environment)" for line in outputs] if env else outputs
        if outputs and not env:
            return Verdict(NONDETERMINISTIC, [*outputs, "determinism bug: the evaluation outputs differ although "
                                              "the environment fingerprint is the same"], env)
        return Verdict(IDENTICAL, [*notes, "identical"], env)
    tensors = tensor_diffs(original, rebuilt)
    lines = [*files, *outputs, *(f"  {t.name}: {t.kind}" for t in tensors if t.kind not in ("codes", "values"))]
    same_device = (a.get("environment") or {}).get("device") == (b.get("environment") or {}).get("device")
    if a["version"] != b["version"] and same_device and a.get("code_version") == b.get("code_version"):
        lines.append(f"differs: rebuilt as {b['version']}, not {a['version']}: with the same code on the same device, "
                     f"the recipe or the pins are not what made this bundle")
        return Verdict(DIFFERS, lines, env, tensors)
    if not env:
        lines.append("determinism bug: the bytes differ although the environment fingerprint (CPU kernel, GPU, "
                     "driver, libraries, threads, determinism settings) is the same")
        lines += [_tensor_line(t) for t in tensors[:10]]
        return Verdict(NONDETERMINISTIC, lines, env, tensors)
    tol = build_params(RebuildTolerance, _recipe_tolerance(original), f"{original / 'recipe.yaml'}: rebuild")
    deltas = metric_deltas(a, b)
    lines.append(f"{'tensor':<56} {'kind':>6} {'differing':>10} {'max |deq diff|':>15}")
    lines += [_tensor_line(t) for t in sorted(tensors, key=lambda t: (-t.mismatch, t.name))[:20]]
    if len(tensors) > 20:
        lines.append(f"... {len(tensors) - 20} more tensors differ")
    worst = max(deltas.items(), key=lambda kv: kv[1][2] if not math.isnan(kv[1][2]) else math.inf, default=None)
    for k in ("evaluation.kl_audio_mean", "evaluation.kl_text", "evaluation.top1_audio_mean", "validation.snr_db",
              "validation.log_mel_distance_db"):
        if k in deltas:
            x, y, r = deltas[k]
            lines.append(f"{k}: {x:.6g} -> {y:.6g} ({100 * r:.2f}%)")
    if worst:
        lines.append(f"largest figure change: {worst[0]} {worst[1][0]:.6g} -> {worst[1][1]:.6g} ({100 * worst[1][2]:.2f}%)")
    failed = []
    structural = [t for t in tensors if t.kind not in ("codes", "values")]
    if structural:
        failed.append(f"{structural[0].name}: {structural[0].kind}")
    over = [t for t in tensors if t.kind == "codes" and t.mismatch > tol.max_code_mismatch]
    if over:
        failed.append(f"{over[0].name}: {100 * over[0].mismatch:.3f}% of codes differ (tolerance "
                      f"{100 * tol.max_code_mismatch:.3f}%)")
    # Judged: the figures the gate checks (the rest is reported above, not judged).
    judged = {}
    for check in (a.get("gate") or {}).get("checks", []):
        key = next((k for k in deltas if k.endswith("." + check["metric"])), None)
        if key is None or key.startswith(FREE_RUNNING + "."):  # reported, not judged: see FREE_RUNNING
            continue
        x, y, _ = deltas[key]
        allowed = tol.max_metric_rel_delta * abs(x) + tol.gate_margin * abs(check["threshold"])
        judged[key] = (x, y, allowed)
        if math.isnan(x) or math.isnan(y) or abs(y - x) > allowed:
            failed.append(f"{key}: {x:.6g} -> {y:.6g} (tolerance {allowed:.4g}: {tol.max_metric_rel_delta:g} of it "
                          f"+ {tol.gate_margin:g} of the gate's bound {check['threshold']})")
    if a.get("status") != b.get("status"):
        # A verdict moved by free-running checks alone forked with the generations (see FREE_RUNNING):
        # said, not judged; one moved by a judged figure (even within its tolerance, at the edge) differs.
        passed = lambda m: {c["metric"]: c["passed"] for c in (m.get("gate") or {}).get("checks", [])}  # noqa: E731
        pa, pb = passed(a), passed(b)
        flipped = sorted(k for k in set(pa) | set(pb) if pa.get(k) != pb.get(k))
        line = f"gate status: {a.get('status')} -> {b.get('status')} (checks that moved: {', '.join(flipped) or 'none'})"
        if flipped and all(k.startswith("free.") for k in flipped):
            lines.append(line + ": free-running only, reported and not judged")
        else:
            failed.append(line)
    verdict = DIFFERS if failed else EQUIVALENT
    lines.append(f"{verdict}: " + ("; ".join(failed) if failed else
                 f"every tensor within {100 * tol.max_code_mismatch:g}% differing codes and every gated figure within "
                 f"{100 * tol.max_metric_rel_delta:g}% of the original's + {100 * tol.gate_margin:g}% of the gate's bound "
                 f"(the recipe's rebuild tolerances)"))
    return Verdict(verdict, lines, env, tensors, deltas, judged)


def _recipe_tolerance(bundle: Path) -> dict:
    import yaml

    recipe = yaml.safe_load((bundle / "recipe.yaml").read_text()) or {}
    return recipe.get("rebuild") or {}


def _tensor_line(t: TensorDiff) -> str:
    return f"{t.name:<56} {t.kind:>6} {100 * t.mismatch:>9.3f}% {t.max_abs_diff:>15.6g}"
